"""`MXFP8Linear`: an inference Linear in MXFP8 for B200s (sm_100a's block-scaled MMA).

    layer = gemmgen.nn.MXFP8Linear.from_linear(linear, activation="silu")   # quantizes W
    layer = gemmgen.nn.MXFP8Linear.from_quantized(w_fp8, w_scales)           # a checkpoint's
    y = layer(x)                                                            # x: bf16 (..., in) on a B200

The weight is e4m3 with one UE8M0 exponent per 32 input features of each output row (the OCP MX
format); each call quantizes its input the same way per token (`gg.quantize_mx`, torch ops) and
runs one microscaled kernel (`Recipe(block_scale=gg.MXFP8)`), the MMA applying the scales, with the
bias and activation in its epilogue. No gradients: the fp8 values are not differentiated. Only
sm_100a builds it: on an H100 the call is refused, naming the arch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..dsl import Recipe, RowVector
from ..errors import InvalidArgument
from ..integrations.ops import caller
from ..ir.microscaling import scale_columns
from ..runtime.quantize import quantize_mx, to_blocked_scales
from ..types import MXFP8, DType, as_dtype
from .base import activation_fn
from .block_scaled import QuantizedLinear, check_in_features, check_input, check_output_dtype


@functools.cache
def mxfp8_linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype) -> Recipe:
    """x @ W^T (+ bias), then the activation, from e4m3 x and W microscaled per 32 values of K
    (MXFP8); the output (and the bias) in `dtype`."""
    act = activation_fn(activation)
    d = as_dtype(dtype, "dtype")
    name = f"mxfp8_linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}"
    kw: dict[str, Any] = {"a": DType.E4M3, "b": DType.E4M3, "d": d, "block_scale": MXFP8}
    if bias:
        return Recipe(name, lambda acc, bias: act(acc + bias), operands={"bias": RowVector(d)}, **kw)
    return Recipe(name, lambda acc: act(acc), **kw)


def _scales(scale: Any, out_features: int, in_features: int) -> torch.Tensor:
    """A checkpoint's exponents (out, ceil(in / 32)) in row order, UE8M0 (or their uint8 bytes), in
    the MMA's blocked order."""
    shape = (out_features, scale_columns(in_features, MXFP8))
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.uint8:
        scale = scale.view(DType.UE8M0.torch)
    if not isinstance(scale, torch.Tensor) or scale.dtype != DType.UE8M0.torch or tuple(scale.shape) != shape:
        raise InvalidArgument(f"weight_scale: expected a torch.float8_e8m0fnu (or uint8) tensor of shape {shape} "
                              f"(one exponent per 32 input features of each output row, row order), got "
                              f"{scale!r:.80}")
    return to_blocked_scales(scale)


class MXFP8Linear(QuantizedLinear):
    """A Linear layer for inference in MXFP8: an e4m3 weight with a UE8M0 exponent per 32 input
    features of each row, inputs quantized the same way on each call; bias and activation fused.

    Buffers: `weight` (out, in) e4m3, `weight_scale` its exponents in the MMA's blocked order
    (round_up(out, 128), round_up(ceil(in / 32), 4)) (`gg.to_blocked_scales`), `bias` (out,) in
    `dtype`. Only sm_100a builds its kernel: `launches(..., arch="sm_100a")` ahead of time."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, dtype: torch.dtype = torch.bfloat16) -> MXFP8Linear:
        """A layer from a checkpoint's e4m3 weight (out, in) and its UE8M0 exponents (out, ceil(in /
        32)) in row order: the weight's values are `weight * 2^(weight_scale - 127)`, 32 by 32."""
        return cls._of(weight, weight_scale, bias, activation, dtype)

    def _take(self, weight: Any, scale: Any, bias: torch.Tensor | None, activation: str | None,
              dtype: torch.dtype) -> None:
        check_output_dtype(dtype)
        activation_fn(activation)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise InvalidArgument(f"weight: expected a 2-D (out_features, in_features) tensor, got {weight!r:.60}")
        out_features, in_features = weight.shape
        check_in_features(in_features)
        if scale is None:
            weight, blocked = quantize_mx(weight)
        elif weight.dtype != torch.float8_e4m3fn:
            raise InvalidArgument(f"weight: expected torch.float8_e4m3fn, got {weight.dtype}; pass the unquantized "
                                  "weights to from_linear instead")
        else:
            blocked = _scales(scale, out_features, in_features)
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise InvalidArgument(f"bias: expected shape ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features, self.activation, self.dtype = in_features, out_features, activation, dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", blocked.contiguous())
        self.register_buffer("bias", bias.to(dtype).contiguous() if bias is not None else None)
        self._set_recipes()

    def _set_recipes(self) -> None:
        self.recipe = mxfp8_linear_recipe(self.activation, self.bias is not None, self.dtype)
        self._op = caller(self.recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.in_features, f"a tensor of shape (..., {self.in_features})")
        lead = x.shape[:-1]
        q, scale_a = quantize_mx(x.reshape(-1, self.in_features))
        args = (q, self.weight.t(), scale_a, self.weight_scale)
        y = self._op(*args) if self.bias is None else self._op(*args, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}, dtype={self.dtype}, weight=MXFP8 (e4m3, a UE8M0 exponent per 32)")


__all__ = ["MXFP8Linear", "mxfp8_linear_recipe"]

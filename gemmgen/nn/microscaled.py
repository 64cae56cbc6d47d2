"""Microscaled inference Linears for B200s (sm_100a's block-scaled MMA): `MXFP8Linear` and
`NVFP4Linear`.

    layer = gemmgen.nn.MXFP8Linear.from_linear(linear, activation="silu")   # quantizes W
    layer = gemmgen.nn.MXFP8Linear.from_quantized(w_fp8, w_scales)           # a checkpoint's
    layer = gemmgen.nn.NVFP4Linear.from_linear(linear)                       # packed fp4 W
    y = layer(x)                                                            # x: bf16 (..., in) on a B200

MXFP8: the weight is e4m3 with one UE8M0 exponent per 32 input features of each output row (the OCP
MX format); each call quantizes its input the same way per token (`gg.quantize_mx`, torch ops).
NVFP4: the weight is packed fp4 with one e4m3 scale per 16 input features and an fp32 scale for
the whole weight; each call quantizes its input per 16 features with an fp32 scale per token.
Either runs one microscaled kernel, the MMA applying the block scales, with the fp32 scales, the
bias and the activation in its epilogue. No gradients: the quantized values are not
differentiated. Only sm_100a builds them: on an H100 the call is refused, naming the arch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..dsl import ColVector, Recipe, RowVector
from ..errors import InvalidArgument
from ..integrations.ops import caller
from ..ir.microscaling import scale_columns
from ..runtime.quantize import nvfp4_tensor_scale, quantize_mx, to_blocked_scales
from ..types import MXFP8, NVFP4, DType, as_dtype
from .base import activation_fn, dense_output
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


def _check_layer(weight: Any, activation: str | None, dtype: torch.dtype) -> None:
    """What either microscaled layer refuses before quantizing: the output dtype, the activation,
    a weight that is not 2-D."""
    check_output_dtype(dtype)
    activation_fn(activation)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InvalidArgument(f"weight: expected a 2-D (out_features, in_features) tensor, got {weight!r:.60}")


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
        _check_layer(weight, activation, dtype)
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
        return dense_output(y, (*lead, self.out_features), self.output_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}, dtype={self.dtype}, weight=MXFP8 (e4m3, a UE8M0 exponent per 32)")


@functools.cache
def nvfp4_linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype) -> Recipe:
    """x @ W^T times an fp32 scale per row (the input's tensor scale per token times the weight's)
    (+ bias), then the activation, from packed fp4 x and W scaled per 16 values of K (NVFP4); the
    output (and the bias) in `dtype`."""
    act = activation_fn(activation)
    d = as_dtype(dtype, "dtype")
    name = f"nvfp4_linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}"
    kw: dict[str, Any] = {"a": DType.E2M1, "b": DType.E2M1, "d": d, "block_scale": NVFP4}
    if bias:
        return Recipe(name, lambda acc, scale, bias: act(acc * scale + bias),
                      operands={"scale": ColVector(DType.F32), "bias": RowVector(d)}, **kw)
    return Recipe(name, lambda acc, scale: act(acc * scale), operands={"scale": ColVector(DType.F32)}, **kw)


class NVFP4Linear(QuantizedLinear):
    """A Linear layer for inference in NVFP4: a packed fp4 weight with an e4m3 scale per 16 input
    features of each row and an fp32 scale for the whole weight; inputs quantized per 16 features
    on each call, with an fp32 scale per token (so that no token's block scales underflow e4m3);
    the product of the two fp32 scales (a column vector), the bias and the activation in the
    kernel's epilogue.

    Buffers: `weight` (out, in / 2) torch.float4_e2m1fn_x2, `weight_scale` its e4m3 scales in the
    MMA's blocked order (round_up(out, 128), round_up(in / 16, 4)), `weight_tensor_scale` fp32
    (0-dim), `bias` (out,) in `dtype`. Only sm_100a builds its kernel."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_tensor_scale: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor,
                       weight_tensor_scale: float | torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, dtype: torch.dtype = torch.bfloat16) -> NVFP4Linear:
        """A layer from a checkpoint's packed fp4 weight (out, in / 2), its e4m3 scales (out, in /
        16) in row order and its fp32 tensor scale: the weight's values are `weight * weight_scale *
        weight_tensor_scale`, 16 by 16 (ModelOpt's weight, weight_scale and weight_scale_2)."""
        return cls._of(weight, (weight_scale, weight_tensor_scale), bias, activation, dtype)

    def _take(self, weight: Any, scale: Any, bias: torch.Tensor | None, activation: str | None,
              dtype: torch.dtype) -> None:
        _check_layer(weight, activation, dtype)
        out_features = weight.shape[0]
        if scale is None:
            in_features = weight.shape[1]
            tensor_scale = nvfp4_tensor_scale(weight)
            weight, blocked = quantize_mx(weight, NVFP4, tensor_scale=tensor_scale)
        elif weight.dtype != DType.E2M1.torch:
            raise InvalidArgument(f"weight: expected {DType.E2M1.torch} (packed pairs of fp4 values), got "
                                  f"{weight.dtype}; pass the unquantized weights to from_linear instead")
        else:
            in_features = 2 * weight.shape[1]
            blocked, tensor_scale = _nvfp4_scales(scale, out_features, in_features, weight.device)
        if in_features % 32:
            raise InvalidArgument(f"in_features {in_features} is not a multiple of 32 (TMA reads the packed fp4 "
                                  "input and weight in 16-byte rows); keep the layer unquantized")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise InvalidArgument(f"bias: expected shape ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features, self.activation, self.dtype = in_features, out_features, activation, dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", blocked.contiguous())
        self.register_buffer("weight_tensor_scale", tensor_scale.float().reshape(()))
        self.register_buffer("bias", bias.to(dtype).contiguous() if bias is not None else None)
        self._set_recipes()

    def _set_recipes(self) -> None:
        self.recipe = nvfp4_linear_recipe(self.activation, self.bias is not None, self.dtype)
        self._op = caller(self.recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.in_features, f"a tensor of shape (..., {self.in_features})")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        x_scale = nvfp4_tensor_scale(rows, per_row=True)
        q, scale_a = quantize_mx(rows, NVFP4, tensor_scale=x_scale)
        args = (q, self.weight.t(), scale_a, self.weight_scale, x_scale.reshape(-1) * self.weight_tensor_scale)
        y = self._op(*args) if self.bias is None else self._op(*args, self.bias)
        return dense_output(y, (*lead, self.out_features), self.output_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}, dtype={self.dtype}, weight=NVFP4 (packed fp4, an e4m3 scale per "
                "16, a tensor scale)")


def _nvfp4_scales(scales: Any, out_features: int, in_features: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's (e4m3 scales (out, in / 16) in row order, fp32 tensor scale): the scales in
    the MMA's blocked order, the tensor scale a 0-dim tensor on the weight's device."""
    scale, tensor_scale = scales
    shape = (out_features, scale_columns(in_features, NVFP4))
    if not isinstance(scale, torch.Tensor) or scale.dtype != DType.UE4M3.torch or tuple(scale.shape) != shape:
        raise InvalidArgument(f"weight_scale: expected a torch.float8_e4m3fn tensor of shape {shape} (one scale per "
                              f"16 input features of each output row, row order), got {scale!r:.80}")
    if isinstance(tensor_scale, torch.Tensor) and tensor_scale.numel() == 1 and tensor_scale.is_floating_point():
        return to_blocked_scales(scale), tensor_scale.to(device)
    if isinstance(tensor_scale, float | int) and not isinstance(tensor_scale, bool) and tensor_scale > 0:
        return to_blocked_scales(scale), torch.tensor(float(tensor_scale), device=device)
    raise InvalidArgument(f"weight_tensor_scale: expected a positive float or a one-element float tensor "
                          f"(ModelOpt's weight_scale_2), got {tensor_scale!r:.60}")


__all__ = ["MXFP8Linear", "NVFP4Linear", "mxfp8_linear_recipe", "nvfp4_linear_recipe"]

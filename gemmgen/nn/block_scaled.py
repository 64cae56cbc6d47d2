"""`BlockScaledLinear`: an inference Linear in fp8 with DeepSeek-V3's block scales.

    layer = gemmgen.nn.BlockScaledLinear.from_linear(linear, activation="silu")   # quantizes W
    layer = gemmgen.nn.BlockScaledLinear.from_quantized(w_fp8, w_scale_inv)       # a checkpoint's
    y = layer(x)                                                                 # x: bf16 (..., in)

The weight is e4m3 with one fp32 scale per 128 x 128 block (`weight_scale`, (ceil(out/128),
ceil(in/128)), a checkpoint's `weight_scale_inv`); each call quantizes its input per token and 128
features (`gg.quantize_blockwise`, torch ops), then runs one block-scaled gemmgen kernel with the
bias and activation in its epilogue. No gradients: the fp8 values are not differentiated.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .. import dsl
from ..config import KernelConfig
from ..dsl import DEEPSEEK_BLOCK_SCALE, Recipe
from ..errors import InvalidArgument
from ..integrations.ops import caller
from ..quantize import quantize_blockwise
from ..types import DType, Layout, as_dtype
from .linear import COMPUTE_DTYPES, RecipeModule, activation_fn

_BLOCK = DEEPSEEK_BLOCK_SCALE[1]  # the weight's blocks are square: 128 x 128


@functools.cache
def block_scaled_linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype) -> Recipe:
    """x @ W^T (+ bias), then the activation, from e4m3 x and W with DeepSeek-V3's block scales;
    the output (and the bias) in `dtype`."""
    act = activation_fn(activation)
    d = as_dtype(dtype, "dtype")
    name = f"fp8_block_linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}"
    kw: dict[str, Any] = {"a": DType.E4M3, "b": DType.E4M3, "d": d, "block_scale": DEEPSEEK_BLOCK_SCALE}
    if bias:
        return Recipe(name, lambda acc, bias: act(acc + bias), operands={"bias": dsl.RowVector(d)}, **kw)
    return Recipe(name, lambda acc: act(acc), **kw)


class BlockScaledLinear(RecipeModule):
    """A Linear layer for inference with an e4m3 weight in 128 x 128 blocks and inputs quantized per
    token and 128 features on each call (DeepSeek-V3's fp8 linear); bias and activation fused.

    Buffers: `weight` (out, in) e4m3, `weight_scale` (ceil(out/128), ceil(in/128)) fp32, kept with
    its rows contiguous in memory (as the kernel reads its transpose), and `bias` (out,) in `dtype`."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        """An nn.Linear's initialisation, quantized (use `from_linear` or `from_quantized` for trained
        weights)."""
        super().__init__()
        linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self._take(linear.weight.detach(), None, linear.bias.detach() if bias else None, activation, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str | None = None,
                    dtype: torch.dtype | None = None) -> BlockScaledLinear:
        """`linear`'s weight quantized to e4m3 in 128 x 128 blocks (copies); output in `dtype`
        (default: the weight's, if bf16 or f16, else bf16)."""
        if not isinstance(linear, nn.Linear):
            raise InvalidArgument(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        out = dtype or (w.dtype if w.dtype in COMPUTE_DTYPES else torch.bfloat16)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(w, None, linear.bias.detach() if linear.bias is not None else None, activation, out)
        return layer

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, dtype: torch.dtype = torch.bfloat16) -> BlockScaledLinear:
        """A layer from a checkpoint's e4m3 weight (out, in) and its fp32 scales per 128 x 128 block
        (ceil(out/128), ceil(in/128)): the weight's values are `weight * weight_scale`, block by block."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(weight, weight_scale, bias, activation, dtype)
        return layer

    def _take(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
              activation: str | None, dtype: torch.dtype) -> None:
        if dtype not in COMPUTE_DTYPES:
            raise InvalidArgument(f"dtype: expected torch.bfloat16 or torch.float16 (the output's), got {dtype!r}")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise InvalidArgument(f"weight: expected a 2-D (out_features, in_features) tensor, got {weight!r:.60}")
        out_features, in_features = weight.shape
        if in_features % 16:
            raise InvalidArgument(f"in_features {in_features} is not a multiple of 16 (TMA reads the fp8 input and "
                                  "weight in 16-byte rows); keep nn.Linear for this layer")
        blocks = (-(-out_features // _BLOCK), -(-in_features // _BLOCK))
        if scale is None:
            weight, scale = quantize_blockwise(weight, (_BLOCK, _BLOCK), scale_layout=Layout.COL)
        elif weight.dtype != torch.float8_e4m3fn:
            raise InvalidArgument(f"weight: expected torch.float8_e4m3fn, got {weight.dtype}; pass an unquantized "
                                  "weight to from_linear instead")
        elif not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
            raise InvalidArgument(f"weight_scale: expected an fp32 tensor of shape {blocks} (one scale per 128 x 128 "
                                  f"block of the weight), got {scale!r:.80}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise InvalidArgument(f"bias: expected shape ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features, self.activation, self.dtype = in_features, out_features, activation, dtype
        self.register_buffer("weight", weight.contiguous())
        # stored with rows contiguous: its transpose, the kernel's scale_b (K blocks x N blocks), is N-contiguous
        self.register_buffer("weight_scale", scale.t().contiguous().t())
        self.register_buffer("bias", bias.to(dtype).contiguous() if bias is not None else None)
        self._set_recipes()

    def _set_recipes(self) -> None:
        self.recipe = block_scaled_linear_recipe(self.activation, self.bias is not None, self.dtype)
        self._op = caller(self.recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise InvalidArgument(f"input: expected a tensor of shape (..., {self.in_features}) (in_features), "
                                  f"got {getattr(x, 'shape', type(x).__name__)}")
        if not x.is_floating_point() or x.dtype.itemsize == 1:
            raise InvalidArgument(f"input: expected a bf16, f16 or f32 tensor (quantized per call), got {x.dtype}")
        lead = x.shape[:-1]
        q, scale_a = quantize_blockwise(x.reshape(-1, self.in_features), (1, _BLOCK), scale_layout=Layout.COL)
        args = (q, self.weight.t(), scale_a, self.weight_scale.t())
        y = self._op(*args) if self.bias is None else self._op(*args, self.bias)
        return y.reshape(*lead, self.out_features)

    def launches(self, tokens: int, training: bool = False, sm_count: int = 132) -> tuple[Recipe, KernelConfig]:
        """(recipe, config) of the kernel forward launches for an input of `tokens` rows when no
        autotune table applies (the heuristic's choice): what to build ahead of time. `training`
        is accepted for model_launches and changes nothing (the layer has no gradients)."""
        from ..select import choose

        return self.recipe, choose(self.recipe.ir, tokens, self.out_features, self.in_features, 1, sm_count).config

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}, dtype={self.dtype}, weight=e4m3 in 128 x 128 blocks")

"""`BlockScaledLinear` and `BlockScaledGroupedLinear`: inference Linears (and MoE experts) in fp8
with DeepSeek-V3's block scales.

    layer = gemmgen.nn.BlockScaledLinear.from_linear(linear, activation="silu")   # quantizes W
    layer = gemmgen.nn.BlockScaledLinear.from_quantized(w_fp8, w_scale_inv)       # a checkpoint's
    y = layer(x)                                                                 # x: bf16 (..., in)
    experts = gemmgen.nn.BlockScaledGroupedLinear.from_quantized(w_fp8, w_scale_inv)  # (E, out, in)
    y = experts(x, offsets)                              # x: (tokens, in) sorted by expert

The weight is e4m3 with one fp32 scale per 128 x 128 block (`weight_scale`, (ceil(out/128),
ceil(in/128)), a checkpoint's `weight_scale_inv`; per expert for the grouped layer); each call
quantizes its input per token and 128 features (`gg.quantize_blockwise`, torch ops), then runs one
block-scaled gemmgen kernel with the bias and activation in its epilogue. No gradients: the fp8
values are not differentiated.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .. import tuning
from ..config import Arch, KernelConfig
from ..dsl import DEEPSEEK_BLOCK_SCALE, Recipe, RowVector
from ..errors import InvalidArgument
from ..integrations.ops import caller, op
from ..runtime.quantize import quantize_blockwise
from ..types import DType, Layout, as_dtype
from .base import COMPUTE_DTYPES, RecipeModule, activation_fn, dense_output, launch_arch
from .grouped import GroupedLaunches, GroupedLinear

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
        return Recipe(name, lambda acc, bias: act(acc + bias), operands={"bias": RowVector(d)}, **kw)
    return Recipe(name, lambda acc: act(acc), **kw)


@functools.cache
def block_scaled_grouped_recipe(activation: str | None, bias: bool, dtype: torch.dtype) -> Recipe:
    """Each expert's x_e @ W_e^T (+ b_e), then the activation, from e4m3 tokens and weights with
    DeepSeek-V3's block scales, as one grouped kernel; the output (and the bias) in `dtype`."""
    act = activation_fn(activation)
    d = as_dtype(dtype, "dtype")
    name = f"fp8_block_grouped_{activation or 'none'}{'_bias' if bias else ''}_{d.value}"
    kw: dict[str, Any] = {"a": DType.E4M3, "b": DType.E4M3, "d": d, "grouped": True,
                          "block_scale": DEEPSEEK_BLOCK_SCALE}
    if bias:
        return Recipe(name, lambda acc, bias: act(acc + bias), operands={"bias": RowVector(d)}, **kw)
    return Recipe(name, lambda acc: act(acc), **kw)


def check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise InvalidArgument(f"dtype: expected torch.bfloat16 or torch.float16 (the output's), got {dtype!r}")


def check_in_features(in_features: int) -> None:
    if in_features % 16:
        raise InvalidArgument(f"in_features {in_features} is not a multiple of 16 (TMA reads the fp8 input and "
                              "weight in 16-byte rows); keep the layer unquantized")


def _block_quantized(weight: Any, scale: Any, dims: str, unquantized: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 weight (..., out, in) and its scales per 128 x 128 block (..., ceil(out/128),
    ceil(in/128)): `weight` quantized here when `scale` is None, else both checked. `dims` names the
    weight's dimensions, `unquantized` the constructor that quantizes."""
    rank = dims.count(",") + 1
    if not isinstance(weight, torch.Tensor) or weight.dim() != rank:
        raise InvalidArgument(f"weight: expected a {rank}-D {dims} tensor, got {weight!r:.60}")
    *lead, out_features, in_features = weight.shape
    check_in_features(in_features)
    if scale is None:
        return quantize_blockwise(weight, (_BLOCK, _BLOCK), compact=True)
    blocks = (*lead, -(-out_features // _BLOCK), -(-in_features // _BLOCK))
    if weight.dtype != torch.float8_e4m3fn:
        raise InvalidArgument(f"weight: expected torch.float8_e4m3fn, got {weight.dtype}; pass the unquantized "
                              f"weights to {unquantized} instead")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
        raise InvalidArgument(f"weight_scale: expected an fp32 tensor of shape {blocks} (one scale per 128 x 128 "
                              f"block of the weight), got {scale!r:.80}")
    return weight, scale


def check_input(x: Any, in_features: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != in_features:
        raise InvalidArgument(f"input: expected {what} (in_features = {in_features}), got "
                              f"{getattr(x, 'shape', type(x).__name__)}")
    if not x.is_floating_point() or x.dtype.itemsize == 1:
        raise InvalidArgument(f"input: expected a bf16, f16 or f32 tensor (quantized per call), got {x.dtype}")


class QuantizedModule(RecipeModule):
    """What the quantized inference layers share: built from weights (quantized or not) by `_take`;
    `in_features`, `out_features`, `activation`, `dtype` (and `num_experts`) read-only; `.to()`,
    `.half()` and the like move the quantized buffers but keep their formats (`_apply`)."""

    _options = ("num_experts", "in_features", "out_features", "activation", "dtype")
    #: the buffers in the layer's quantized format (the weight and its scales), which a cast would undo
    _quantized = ("weight", "weight_scale", "weight_tensor_scale")
    dtype: torch.dtype

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """`.to()`, `.cuda()`, `.half()`, `.float()` and the like, as they act on an nn.Linear: the
        layer moves with them, but its quantized buffers keep their dtypes (a cast would undo the
        quantization), and what it returns follows a conversion: its kernels write bf16 or f16
        (`dtype`, and the bias, become that); for another dtype (fp32, fp64) they keep writing
        `dtype` and the output is cast (`output_dtype`)."""
        order = list(self._buffers)
        kept: dict[str, torch.Tensor] = {}
        for name in self._quantized:
            t = self._buffers.pop(name, None)
            if t is not None:
                kept[name] = t
        probe = fn(torch.zeros((), dtype=self.output_dtype, device=kept["weight"].device))
        try:
            out = super()._apply(fn, recurse)  # the bias, and the recipes
        finally:
            for name, t in kept.items():  # moved, never cast
                moved = t.to(probe.device)
                self._buffers[name] = moved.share_memory_() if probe.is_shared() and not moved.is_shared() else moved
            self._buffers.update([(name, self._buffers.pop(name)) for name in order])  # in their order
        if probe.dtype in COMPUTE_DTYPES:
            self.__dict__["dtype"] = probe.dtype
        self.__dict__["_output_dtype"] = probe.dtype
        bias = self._buffers.get("bias")
        if bias is not None and bias.dtype != self.dtype:
            self._buffers["bias"] = bias.to(self.dtype)
        self._set_recipes()
        return out

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype forward returns: `dtype`, or where a conversion asked for a dtype the kernels
        do not write (`.float()`), that one."""
        return self.__dict__.get("_output_dtype") or self.dtype

    def _take(self, weight: torch.Tensor, scale: Any, bias: torch.Tensor | None,
              activation: str | None, dtype: torch.dtype) -> None:
        raise NotImplementedError

    @classmethod
    def _of(cls, weight: torch.Tensor, scale: Any, bias: torch.Tensor | None,
            activation: str | None, dtype: torch.dtype) -> Any:
        """A layer holding `weight` (quantized here when `scale` is None, else with the format's
        scales), without __init__'s random initialisation."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(weight, scale, bias, activation, dtype)
        return layer


class QuantizedLinear(QuantizedModule):
    """What the quantized inference Linears share (BlockScaledLinear, MXFP8Linear): an nn.Linear's
    initialisation or weights, quantized in the layer's format, and the kernel a forward launches."""

    in_features: int
    out_features: int
    recipe: Recipe

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        """An nn.Linear's initialisation, quantized (use `from_linear` or `from_quantized` for trained
        weights)."""
        super().__init__()
        linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self._take(linear.weight.detach(), None, linear.bias.detach() if bias else None, activation, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str | None = None, dtype: torch.dtype | None = None) -> Any:
        """`linear`'s weight quantized in the layer's format (copies); output in `dtype` (default:
        the weight's, if bf16 or f16, else bf16)."""
        if not isinstance(linear, nn.Linear):
            raise InvalidArgument(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        out = dtype or (w.dtype if w.dtype in COMPUTE_DTYPES else torch.bfloat16)
        return cls._of(w, None, linear.bias.detach() if linear.bias is not None else None, activation, out)

    def launches(self, tokens: int, training: bool = False, sm_count: int | None = None,
                 device: tuning.Device | None = None, arch: Arch | str | None = None) -> tuple[Recipe, KernelConfig]:
        """(recipe, config) of the kernel forward launches for an input of `tokens` rows, as
        FusedLinear.launches: what to build ahead of time. `training` is accepted for
        model_launches and changes nothing (the layer has no gradients)."""
        return self.recipe, tuning.config_for(self.recipe, tokens, self.out_features, self.in_features, 1,
                                              device=device, sm_count=sm_count, arch=launch_arch(arch))


class BlockScaledLinear(QuantizedLinear):
    """A Linear layer for inference with an e4m3 weight in 128 x 128 blocks and inputs quantized per
    token and 128 features on each call (DeepSeek-V3's fp8 linear); bias and activation fused.

    Buffers: `weight` (out, in) e4m3, `weight_scale` (ceil(out/128), ceil(in/128)) fp32, kept with
    its rows contiguous in memory (as the kernel reads its transpose), and `bias` (out,) in `dtype`."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, dtype: torch.dtype = torch.bfloat16) -> BlockScaledLinear:
        """A layer from a checkpoint's e4m3 weight (out, in) and its fp32 scales per 128 x 128 block
        (ceil(out/128), ceil(in/128)): the weight's values are `weight * weight_scale`, block by block."""
        return cls._of(weight, weight_scale, bias, activation, dtype)

    def _take(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
              activation: str | None, dtype: torch.dtype) -> None:
        check_output_dtype(dtype)
        weight, scale = _block_quantized(weight, scale, "(out_features, in_features)", "from_linear")
        out_features, in_features = weight.shape
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
        check_input(x, self.in_features, f"a tensor of shape (..., {self.in_features})")
        lead = x.shape[:-1]
        q, scale_a = quantize_blockwise(x.reshape(-1, self.in_features), (1, _BLOCK), scale_layout=Layout.COL)
        args = (q, self.weight.t(), scale_a, self.weight_scale.t())
        y = self._op(*args) if self.bias is None else self._op(*args, self.bias)
        return dense_output(y, (*lead, self.out_features), self.output_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}, dtype={self.dtype}, weight=e4m3 in 128 x 128 blocks")


class BlockScaledGroupedLinear(GroupedLaunches, QuantizedModule):
    """A mixture-of-experts layer's expert Linears for inference in fp8 with DeepSeek-V3's block
    scales, as one grouped kernel: each expert's e4m3 weight in 128 x 128 blocks, the tokens (sorted
    by expert) quantized per token and 128 features on each call; bias and activation fused.

    Buffers: `weight` (num_experts, out, in) e4m3, `weight_scale` (num_experts, ceil(out/128),
    ceil(in/128)) fp32 (the experts' `weight_scale_inv`, contiguous: the kernel reads each expert's
    transpose, K-major), and `bias` (num_experts, out) in `dtype`."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_linears(cls, linears: Any, activation: str | None = None,
                     dtype: torch.dtype | None = None) -> BlockScaledGroupedLinear:
        """The experts' weights quantized to e4m3 in 128 x 128 blocks (copies): a sequence of
        nn.Linear or a GroupedLinear (whose activation is kept unless another is given); output in
        `dtype` (default: the weights', if bf16 or f16, else bf16)."""
        if isinstance(linears, GroupedLinear):
            w, b = linears.weight.detach(), linears.bias
            bias = b.detach() if b is not None else None
            activation = activation if activation is not None else linears.activation
        else:
            if not linears or not all(isinstance(m, nn.Linear) for m in linears):
                raise InvalidArgument("linears: expected a GroupedLinear or a non-empty sequence of torch.nn.Linear")
            shapes = {(m.in_features, m.out_features, m.bias is not None) for m in linears}
            if len(shapes) != 1:
                raise InvalidArgument(f"linears: the experts differ in (in_features, out_features, bias): "
                                      f"{sorted(shapes)}; a grouped kernel needs them alike")
            w = torch.stack([m.weight.detach() for m in linears])
            bias = torch.stack([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        out = dtype or (w.dtype if w.dtype in COMPUTE_DTYPES else torch.bfloat16)
        return cls._of(w, None, bias, activation, out)

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, dtype: torch.dtype = torch.bfloat16
                       ) -> BlockScaledGroupedLinear:
        """Experts from a checkpoint's e4m3 weights (num_experts, out, in) and their fp32 scales per
        128 x 128 block (num_experts, ceil(out/128), ceil(in/128)), stacked."""
        return cls._of(weight, weight_scale, bias, activation, dtype)

    def _take(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
              activation: str | None, dtype: torch.dtype) -> None:
        check_output_dtype(dtype)
        activation_fn(activation)
        weight, scale = _block_quantized(weight, scale, "(num_experts, out_features, in_features)", "from_linears")
        experts, out_features, in_features = weight.shape
        if out_features % 8:
            raise InvalidArgument(f"out_features {out_features} is not a multiple of 8 (each expert's bias and "
                                  "output rows are read and written in 16-byte vectors)")
        if bias is not None and tuple(bias.shape) != (experts, out_features):
            raise InvalidArgument(f"bias: expected shape ({experts}, {out_features}), got {tuple(bias.shape)}")
        self.num_experts, self.in_features, self.out_features = experts, in_features, out_features
        self.activation, self.dtype = activation, dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("bias", bias.to(dtype).contiguous() if bias is not None else None)
        self._set_recipes()

    def _set_recipes(self) -> None:
        self.recipe = block_scaled_grouped_recipe(self.activation, self.bias is not None, self.dtype)
        self._op = op(self.recipe).default

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        check_input(x, self.in_features, f"(tokens, {self.in_features}) rows sorted by expert")
        if x.dim() != 2:
            raise InvalidArgument(f"input: expected (tokens, {self.in_features}) rows sorted by expert, got shape "
                                  f"{tuple(x.shape)}")
        q, scale_a = quantize_blockwise(x, (1, _BLOCK), compact=True)
        args = (q, self.weight.mT, offsets, scale_a, self.weight_scale.mT)
        y = self._op(*args) if self.bias is None else self._op(*args, self.bias)
        return dense_output(y, y.shape, self.output_dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, activation={self.activation!r}, "
                f"dtype={self.dtype}, weight=e4m3 in 128 x 128 blocks")

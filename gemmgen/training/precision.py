"""Low-precision training recipes as objects: what each GEMM of a layer's training step reads, in
which dtype and at which granularity, and the quantizers that make it.

    precision = gg.training.Float8Blockwise()
    layer = gg.nn.FusedLinear(4096, 14336, activation="gelu", precision=precision)
    mlp = gg.nn.FusedMLP(4096, 14336, 4096, activation="gelu", precision=precision)

A Linear layer's step runs three GEMMs, and each reads its operands block-scaled along *its own* K:

| GEMM | A (M x K) | B (K x N) | K is |
|---|---|---|---|
| fprop, Y = X W^T | X | W^T | in_features |
| dgrad, dX = dY W | dY | W | out_features |
| wgrad, dW = dY^T X | dY^T | X | the tokens |

So X and dY are quantized twice (along features, and along tokens for the weight gradient), and W
twice (along in and along out features). On Hopper fp8 WGMMA reads both operands K-major only, so
each second copy is physically transposed (`Operand.data` is always in the memory order its GEMM
reads). A precision object holds one recipe's every choice: the GEMMs' recipes (`recipe`), their
operands' quantizers (`operand`, `weight`), and whether backward keeps quantized copies or the
original input (`save_original_input`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..dsl import DEEPSEEK_BLOCK_SCALE, Backward, Recipe
from ..dsl.backward import declarations, replay
from ..errors import InvalidArgument
from ..ir import microscaling
from ..ir.ops import quantize_blocks, round_to
from ..runtime.checks import copy_in_layout
from ..types import DType, Layout, Microscaling


class Gemm(enum.Enum):
    """The three GEMMs of a Linear layer's training step."""

    FPROP = "fprop"  # Y = X W^T: A = X, B = W^T (K = in_features)
    DGRAD = "dgrad"  # dX = dY W: A = dY, B = W (K = out_features)
    WGRAD = "wgrad"  # dW = dY^T X: A = dY^T, B = X (K = the tokens)


@dataclass(frozen=True)
class Operand:
    """One quantized operand of one GEMM, as the kernel takes it: `data` is A (M x K, K-major) or
    B (K x N, K-major: a column-major view), `scale` the fp32 scale_a or scale_b in the kernel's
    layout (`GemmSpec.scale_layouts`)."""

    data: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight W (out x in) quantized for both GEMMs that read it: `rows` is fprop's B (W^T,
    along in_features), `columns` dgrad's B (W, along out_features, physically transposed).
    `version` says which values of W it holds (`Precision.weight_version`)."""

    version: tuple[Any, ...]
    rows: Operand
    columns: Operand


@dataclass(frozen=True, repr=False)
class Precision:
    """What every low-precision recipe shares: the choice of what backward keeps. With
    `save_original_input=False` (the default, Transformer Engine's) the forward also quantizes its
    input along the tokens and keeps that copy for the weight gradient (1 byte per value, plus
    scales); with True it keeps the bf16 input (2 bytes per value) and quantizes it again in the
    backward (torchao's). The gradients are the same bits either way: the quantizers are
    deterministic."""

    save_original_input: bool = False

    #: whether its kernels take an epilogue over column pairs (a gated MLP's fc1)
    column_pairs: ClassVar[bool] = True
    #: what its kernels' names end in before the GEMM's
    suffix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not isinstance(self.save_original_input, bool):
            raise InvalidArgument(f"save_original_input: expected True or False, got {self.save_original_input!r}")

    def __repr__(self) -> str:
        """The class and the fields given other values than their defaults: `Float8Blockwise()`."""
        given = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(given)})"

    def block_scale(self, gemm: Gemm) -> tuple[int, int, int] | Microscaling:
        """The `Recipe(block_scale=)` of its kernel for `gemm`."""
        raise NotImplementedError

    def recipe(self, recipe: Recipe, gemm: Gemm) -> Recipe:
        """`recipe` (a bf16 or f16 GEMM's: its epilogue, D and aux dtypes) as this precision runs
        `gemm`: the same epilogue over its quantized A and B (K-major, e4m3)."""
        g = recipe.ir.gemm
        if g.a.bits != 16 or g.scaled or g.grouped or g.batched:
            raise InvalidArgument(f"recipe: expected a plain bf16 or f16 GEMM's recipe to run in {self}, got "
                                  f"{recipe!r}")
        ir = recipe.ir.epilogue
        return Recipe(f"{recipe.name}_{self.suffix}_{gemm.value}", replay(ir), a=DType.E4M3, b=DType.E4M3, d=g.d,
                      layout_a=Layout.ROW, layout_b=Layout.COL, layout_d=g.layout_d,
                      operands=declarations(ir.operands), aux={o.name: o.dtype for o in recipe.outputs[1:]},
                      block_scale=self.block_scale(gemm))

    def backward(self, recipe: Recipe) -> Backward:
        """The derived backward (`Recipe.backward`) of `recipe` (a bf16 or f16 layer's, followed by
        another layer) in this precision: the forward is fprop's recipe saving its accumulator, the
        kernel the next layer's dgrad GEMM carrying this recipe's derivative."""
        return self.recipe(recipe, Gemm.FPROP).backward(a=DType.E4M3, b=DType.E4M3, layout_b=Layout.COL,
                                                        block_scale=self.block_scale(Gemm.DGRAD))

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe) -> Operand:
        """`t`, whose last dimension is `gemm`'s K (A as M x K, B as N x K), quantized as `recipe`
        (made by `self.recipe` for `gemm`) reads it as `which` ("a" or "b")."""
        raise NotImplementedError

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe) -> QuantizedWeight:
        """W (out x in) quantized for fprop's and dgrad's B."""
        raise NotImplementedError

    @staticmethod
    def weight_version(w: torch.Tensor) -> tuple[Any, ...]:
        """Which values `w` holds: an optimizer step (in place) changes `w._version`, a replaced or
        moved or cast parameter its storage or dtype; micro-batches between steps share one."""
        return (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))


def _transposed_scale(scale: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A (rows, K blocks) scale tensor as B's (K blocks, rows) in `layout`, its leading dimension
    padded to 16 bytes (TMA)."""
    return copy_in_layout(scale.t(), layout, 4)


@dataclass(frozen=True, repr=False)
class Float8Blockwise(Precision):
    """DeepSeek-V3's recipe (Transformer Engine's Float8BlockScaling): e4m3 everywhere; activations
    and gradients in 1 x 128 blocks (per token and 128 features, and for the weight gradient per
    feature and 128 tokens), weights in 128 x 128 blocks (so W's transposed copy is exact: the same
    blocks, transposed); fp32 scales, each a block's largest magnitude over 448, or that rounded up
    to a power of two with `power_of_two_scales`; the main loop promotes its partial sums to fp32
    and applies the scales every 128 of K (CUTLASS's blockwise main loop; fprop and dgrad
    `block_scale=(1, 128, 128)`, wgrad `(1, 1, 128)`)."""

    power_of_two_scales: bool = False

    suffix: ClassVar[str] = "fp8block"
    block: ClassVar[int] = 128
    dtype: ClassVar[DType] = DType.E4M3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.power_of_two_scales, bool):
            raise InvalidArgument(f"power_of_two_scales: expected True or False, got {self.power_of_two_scales!r}")

    def block_scale(self, gemm: Gemm) -> tuple[int, int, int]:
        return (1, 1, self.block) if gemm is Gemm.WGRAD else DEEPSEEK_BLOCK_SCALE

    def quantize(self, t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scales): `t` (R x C) in e4m3 per `block`, with t's shape and memory order, and its
        fp32 scales (ceil(R / block[0]), ceil(C / block[1])): the recipe's one quantizer."""
        scaled, scale = quantize_blocks(t, block, self.dtype, self.power_of_two_scales)
        q = t.new_empty(t.shape, dtype=self.dtype.torch)
        q.copy_(round_to(scaled, self.dtype))
        return q, scale

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe) -> Operand:
        layout = recipe.ir.gemm.scale_layouts[which == "b"]
        q, scale = self.quantize(t.contiguous(), (1, self.block))
        if which == "a":
            return Operand(q, copy_in_layout(scale, layout, 4))
        return Operand(q.t(), _transposed_scale(scale, layout))

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe) -> QuantizedWeight:
        q, scale = self.quantize(w.detach(), (self.block, self.block))  # (out, in), (out / 128, in / 128)
        rows = Operand(q.t(), _transposed_scale(scale, fprop.ir.gemm.scale_layouts[1]))
        columns = Operand(q.t().contiguous().t(), copy_in_layout(scale, dgrad.ir.gemm.scale_layouts[1], 4))
        return QuantizedWeight(self.weight_version(w), rows, columns)


@dataclass(frozen=True, repr=False)
class MXFP8(Precision):
    """MXFP8 training (Transformer Engine's MXFP8BlockScaling), on sm_100a (B200) only: e4m3 for
    every operand in 1 x 32 blocks along each GEMM's K, one E8M0 scale per block rounded *up*,
    2^ceil(log2(amax / 448)) (the rounding that trained an 8B model on 15T tokens like bf16; the OCP
    spec's floor makes the largest values saturate). No transpose is exact here: the weight's
    column-wise copy is quantized from the weight again, along out_features. Column pairs (SwiGLU)
    have no microscaled kernel yet."""

    suffix: ClassVar[str] = "mxfp8"
    dtype: ClassVar[DType] = DType.E4M3
    column_pairs: ClassVar[bool] = False

    def block_scale(self, gemm: Gemm) -> Microscaling:
        return Microscaling.MXFP8

    def quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scales): `t` (R x K) in e4m3 per 32 values along K (row-major), and its UE8M0
        scales (R, ceil(K / 32)) in row order: the recipe's one quantizer."""
        return microscaling.quantize(t, Microscaling.MXFP8, self.dtype, round_up=True)

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe) -> Operand:
        q, scale = self.quantize(t.contiguous())
        blocked = microscaling.to_blocked(scale)
        return Operand(q.contiguous(), blocked) if which == "a" else Operand(q.contiguous().t(), blocked)

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe) -> QuantizedWeight:
        rows = self.operand(w.detach(), Gemm.FPROP, "b", fprop)  # along in_features
        columns = self.operand(w.detach().t(), Gemm.DGRAD, "b", dgrad)  # along out_features
        return QuantizedWeight(self.weight_version(w), rows, columns)


def as_precision(value: object, where: str) -> Precision | None:
    """`precision=` as layers and `fuse` take it: None (bf16, the default) or a precision object."""
    if value is None or (isinstance(value, Precision) and type(value) is not Precision):
        return value
    raise InvalidArgument(f"{where}: precision expected None (bf16 or f16, the default) or a low-precision recipe "
                          f"such as gemmgen.training.Float8Blockwise(), got {value!r}")


__all__ = ["MXFP8", "Float8Blockwise", "Gemm", "Operand", "Precision", "QuantizedWeight", "as_precision"]

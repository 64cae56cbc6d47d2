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
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..codegen.quantize import CastTransposeSpec, QuantizeSpec
from ..config import Arch
from ..dsl import DEEPSEEK_BLOCK_SCALE, Backward, Recipe, cast, quantize, quantize_columns
from ..dsl.backward import declarations, replay
from ..dsl.operands import OperandDecl
from ..errors import InvalidArgument
from ..ir import EpilogueIR, microscaling
from ..ir.ops import quantize_blocks, round_to
from ..runtime.cast_transpose import cast_transposable, cast_transpose
from ..runtime.checks import copy_in_layout
from ..runtime.quantize import quantize_k_grouped
from ..types import DType, Grouping, Layout, Microscaling
from .history import AmaxHistory


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

    #: what its kernels' names end in before the GEMM's
    suffix: ClassVar[str] = ""
    #: whether it runs a GroupedLinear's step (grouped and K-grouped kernels of its own)
    grouped: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.save_original_input, bool):
            raise InvalidArgument(f"save_original_input: expected True or False, got {self.save_original_input!r}")

    def __repr__(self) -> str:
        """The class and the fields given other values than their defaults: `Float8Blockwise()`."""
        given = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(given)})"

    def block_scale(self, gemm: Gemm) -> tuple[int, int, int] | Microscaling | None:
        """The `Recipe(block_scale=)` of its kernel for `gemm`."""
        raise NotImplementedError

    def dtypes(self, gemm: Gemm) -> tuple[DType, DType]:
        """`gemm`'s A and B types."""
        return DType.E4M3, DType.E4M3

    def epilogue(self, ir: EpilogueIR) -> tuple[Callable[..., Any], dict[str, OperandDecl]]:
        """The epilogue function and operand declarations of a kernel running `ir` over this
        precision's accumulator (block scales apply in the main loop: the accumulator is the
        bf16 GEMM's already)."""
        return replay(ir), declarations(ir.operands)

    def recipe(self, recipe: Recipe, gemm: Gemm) -> Recipe:
        """`recipe` (a bf16 or f16 GEMM's: its epilogue, D and aux dtypes) as this precision runs
        `gemm`: the same epilogue over its quantized A and B (K-major)."""
        self._check_plain(recipe)
        return self._converted(recipe, gemm, f"{recipe.name}_{self.suffix}_{gemm.value}")

    def grouped_recipe(self, recipe: Recipe, gemm: Gemm) -> Recipe:
        """`recipe` (a grouped bf16 or f16 GEMM's: rows-grouped for fprop and dgrad, K-grouped for
        wgrad) as this precision runs `gemm` over the experts: the same epilogue and grouping over
        its quantized A and B (K-major)."""
        g = recipe.ir.gemm
        if not self.grouped or g.a.bits != 16 or g.scaled or not g.grouped:
            raise InvalidArgument(f"recipe: expected a grouped bf16 or f16 GEMM's recipe to run in {self}, got "
                                  f"{recipe!r}")
        grouping = Grouping.K if g.k_grouped else Grouping.ROWS
        return self._converted(recipe, gemm, f"{recipe.name}_{self.suffix}_{gemm.value}", grouping)

    def backward(self, recipe: Recipe) -> Backward:
        """The derived backward (`Recipe.backward`) of `recipe` (a bf16 or f16 layer's, followed by
        another layer) in this precision: derived in bf16, then the forward saving its accumulator
        run as fprop and the kernel (the next layer's dgrad GEMM carrying this recipe's
        derivative) as dgrad."""
        self._check_plain(recipe)
        derived = recipe.backward()
        if derived.recompute:
            raise InvalidArgument(f"{recipe.name}: its backward recomputes the forward's GEMM (an epilogue over column "
                                  f"pairs that does more than take them), which {self} does not run yet")
        name = f"{recipe.name}_{self.suffix}_{Gemm.FPROP.value}"
        return Backward(self._converted(derived.forward, Gemm.FPROP, f"{name}_train"),
                        self._converted(derived.kernel, Gemm.DGRAD, f"{name}_bwd"),
                        derived.gradients, derived.recompute, derived.rest)

    def quantizing(self, recipe: Recipe, gemm: Gemm, name: str) -> Recipe | None:
        """`recipe` (a bf16 or f16 GEMM's) as this precision runs `gemm`, its D written as the next
        GEMMs read it (item 2 of the low-precision issue): rounded to D's type, then quantized per
        row (the next fprop's or dgrad's A, scales `d_scale`) and stored transposed, quantized per
        column (the weight gradient's operand along the tokens: `d_t`, `d_t_scale`), by the
        epilogue; bit for bit the layer's torch quantizers of the rounded D. With
        `save_original_input`, a forward's D is kept as it is instead of its column copy
        (`d_original`: the layer saves it and quantizes it again in the backward). None where this
        precision has no such epilogue: the layer quantizes D with torch."""
        return None

    def quantizing_operands(self, gemm: Gemm, history: AmaxHistory | None, device: torch.device
                            ) -> dict[str, torch.Tensor]:
        """What `quantizing(..., gemm, ...)`'s kernel reads beyond the recipe's operands (the D
        tensor's history is `history`): nothing here; a delayed scale under Float8Tensorwise."""
        return {}

    def quantized(self, outs: dict[str, torch.Tensor], gemm: Gemm, operands: dict[str, torch.Tensor],
                  history: AmaxHistory | None) -> tuple[Operand, Operand | torch.Tensor]:
        """The operands a `quantizing` kernel's outputs `outs` are, given the `operands` it read:
        (the next fprop's A, or this layer's dgrad A, from a DGRAD kernel; the next wgrad's B from
        an FPROP kernel, its A from a DGRAD one, or under `save_original_input` D itself, kept)."""
        raise NotImplementedError

    def quantizing_backward(self, recipe: Recipe) -> Backward | None:
        """`backward(recipe)` with both kernels' D written quantized (`quantizing`): the forward's
        activation as the next layer's fprop A and wgrad B, the backward kernel's dL/dacc as this
        layer's dgrad A and wgrad A. None where either has no such epilogue."""
        self._check_plain(recipe)
        derived = recipe.backward()
        name = f"{recipe.name}_{self.suffix}_{Gemm.FPROP.value}"
        forward = self.quantizing(derived.forward, Gemm.FPROP, f"{name}_train_q")
        kernel = self.quantizing(derived.kernel, Gemm.DGRAD, f"{name}_bwd_q")
        if derived.recompute or forward is None or kernel is None:
            return None
        return Backward(forward, kernel, derived.gradients, derived.recompute, derived.rest)

    def _check_plain(self, recipe: Recipe) -> None:
        g = recipe.ir.gemm
        if g.a.bits != 16 or g.scaled or g.grouped or g.batched:
            raise InvalidArgument(f"recipe: expected a plain bf16 or f16 GEMM's recipe to run in {self}, got "
                                  f"{recipe!r}")

    def _converted(self, recipe: Recipe, gemm: Gemm, name: str, grouping: Grouping | None = None) -> Recipe:
        """`recipe` (bf16 or f16, its epilogue, D and aux types kept) as this precision runs `gemm`."""
        g, ir = recipe.ir.gemm, recipe.ir.epilogue
        fn, operands = self.epilogue(ir)
        a, b = self.dtypes(gemm)
        return Recipe(name, fn, a=a, b=b, d=g.d, layout_a=Layout.ROW, layout_b=Layout.COL, layout_d=g.layout_d,
                      operands=operands, aux={o.name: o.dtype for o in recipe.outputs[1:]},
                      block_scale=self.block_scale(gemm), grouped=grouping or False)

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe,
                history: AmaxHistory | None = None) -> Operand:
        """`t`, whose last dimension is `gemm`'s K (A as M x K, B as N x K), quantized as `recipe`
        (made by `self.recipe` for `gemm`) reads it as `which` ("a" or "b"); `history` is the
        tensor's under delayed scaling (`self.history()`)."""
        raise NotImplementedError

    def quantize_specs(self, source: DType, arch: Arch) -> tuple[QuantizeSpec, ...]:
        """The quantize kernels (`codegen.quantize`) a layer's step in this precision launches on
        `arch` for its `source`-typed (bf16 or f16) tensors (`operands`): what to build ahead of
        time beside the GEMMs (`gemmgen.nn.model_quantize_specs`). None here: torch ops quantize."""
        return ()

    def operands(self, t: torch.Tensor, rows: tuple[Gemm, str, Recipe], columns: tuple[Gemm, str, Recipe],
                 history: AmaxHistory | None = None) -> tuple[Operand, Operand]:
        """`t` (tokens x C) twice: along C as `rows` = (gemm, "a" or "b", its recipe) reads it
        (`operand(t, ...)`), and along the tokens as `columns` reads it (`operand(t.t(), ...)`): a
        layer's input for fprop and wgrad, a gradient for dgrad and wgrad. Two quantizations here;
        one pass of t where a precision has a kernel for both (Float8Blockwise)."""
        return (self.operand(t, rows[0], rows[1], rows[2], history),
                self.operand(t.t(), columns[0], columns[1], columns[2], history))

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe,
               history: AmaxHistory | None = None) -> QuantizedWeight:
        """W (out x in) quantized for fprop's and dgrad's B."""
        raise NotImplementedError

    def experts(self, w: torch.Tensor, history: AmaxHistory | None = None) -> QuantizedWeight:
        """The experts' weights (E x out x in) quantized for a GroupedLinear's fprop and dgrad B
        (a precision with `grouped` kernels)."""
        raise NotImplementedError

    def tokens(self, t: torch.Tensor, gemm: Gemm, groups: int, history: AmaxHistory | None = None) -> Operand:
        """`t` (tokens x C) quantized along C as `gemm`'s A in a grouped kernel of `groups` groups
        (`grouped`)."""
        raise NotImplementedError

    def along_tokens(self, t: torch.Tensor, offsets: torch.Tensor, which: str,
                     history: AmaxHistory | None = None) -> Operand:
        """`t` (tokens x C) quantized along each group's tokens as the K-grouped weight gradient's
        A (`which="a"`: dL/dacc) or B (x) (`grouped`)."""
        raise NotImplementedError

    def grouped_dacc(self, recipe: Recipe) -> Recipe:
        """The grouped fprop of `recipe` (a grouped bf16 or f16 layer's, with an activation) again,
        its epilogue derived: dL/dacc from dL/dy. Derived in bf16, then run as fprop, so a
        per-tensor precision's scales dequantize the accumulator before the derivative reads it."""
        derived = recipe.backward(recompute=True, wrt=[o.name for o in recipe.operands])
        return self._converted(derived.kernel, Gemm.FPROP, f"{recipe.name}_{self.suffix}_{Gemm.FPROP.value}_dacc",
                               Grouping.ROWS)

    def history(self) -> AmaxHistory | None:
        """A new tensor's amax history, where this precision scales from one (delayed scaling)."""
        return None

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
    grouped: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.power_of_two_scales, bool):
            raise InvalidArgument(f"power_of_two_scales: expected True or False, got {self.power_of_two_scales!r}")

    def block_scale(self, gemm: Gemm) -> tuple[int, int, int]:
        return (1, 1, self.block) if gemm is Gemm.WGRAD else DEEPSEEK_BLOCK_SCALE

    def quantizing(self, recipe: Recipe, gemm: Gemm, name: str) -> Recipe | None:
        """gg.quantize and gg.quantize_columns of D rounded to its type, in 1 x 128 and 128 x 1 blocks,
        the scales rounded as this precision's (`power_of_two_scales`); under `save_original_input`
        a forward keeps D (rounded) in place of the column copy; not over column pairs (D of N/2
        columns)."""
        ir = recipe.ir.epilogue
        if ir.pairs:
            return None
        fn, operands = self.epilogue(ir)
        rounded_to, block, pow2 = recipe.ir.gemm.d, self.block, self.power_of_two_scales
        keep = self.save_original_input and gemm is Gemm.FPROP

        def epilogue(acc: Any, **values: Any) -> dict[str, Any]:
            out = fn(acc, **values)
            d = cast(out.pop("d"), rounded_to)
            q, scale = quantize(d, block=block, power_of_two=pow2)
            if keep:
                return {"d": q, "d_scale": scale, "d_original": d, **out}
            q_t, scale_t = quantize_columns(d, block=block, power_of_two=pow2)
            return {"d": q, "d_scale": scale, "d_t": q_t, "d_t_scale": scale_t, **out}

        epilogue.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        a, b = self.dtypes(gemm)
        copies = {"d_original": rounded_to} if keep else {"d_t": self.dtype, "d_t_scale": DType.F32}
        aux = {"d_scale": DType.F32, **copies, **{o.name: o.dtype for o in recipe.outputs[1:]}}
        name += "_pow2" * pow2 + "_orig" * keep
        return Recipe(name, epilogue, a=a, b=b, d=self.dtype, layout_a=Layout.ROW, layout_b=Layout.COL,
                      operands=operands, aux=aux, block_scale=self.block_scale(gemm))

    def quantized(self, outs: dict[str, torch.Tensor], gemm: Gemm, operands: dict[str, torch.Tensor],
                  history: AmaxHistory | None) -> tuple[Operand, Operand | torch.Tensor]:
        rows = Operand(outs["d"], outs["d_scale"])
        if "d_original" in outs:
            return rows, outs["d_original"]
        if gemm is Gemm.FPROP:  # the next wgrad's B: K x N, K-major (a column-major view)
            return rows, Operand(outs["d_t"].t(), outs["d_t_scale"].t())
        return rows, Operand(outs["d_t"], outs["d_t_scale"])  # this layer's wgrad A

    def quantize(self, t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scales): `t` (R x C) in e4m3 per `block`, with t's shape and memory order, and its
        fp32 scales (ceil(R / block[0]), ceil(C / block[1])): the recipe's one quantizer."""
        scaled, scale = quantize_blocks(t, block, self.dtype, self.power_of_two_scales)
        q = t.new_empty(t.shape, dtype=self.dtype.torch)
        q.copy_(round_to(scaled, self.dtype))
        return q, scale

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe,
                history: AmaxHistory | None = None) -> Operand:
        layout = recipe.ir.gemm.scale_layouts[which == "b"]
        q, scale = self.quantize(t.contiguous(), (1, self.block))
        if which == "a":
            return Operand(q, copy_in_layout(scale, layout, 4))
        return Operand(q.t(), _transposed_scale(scale, layout))

    def quantize_specs(self, source: DType, arch: Arch) -> tuple[QuantizeSpec, ...]:
        return (CastTransposeSpec(source, self.dtype, self.power_of_two_scales, arch),)

    def operands(self, t: torch.Tensor, rows: tuple[Gemm, str, Recipe], columns: tuple[Gemm, str, Recipe],
                 history: AmaxHistory | None = None) -> tuple[Operand, Operand]:
        """On the GPU both copies from one pass of t: the cast-transpose kernel (the same bits as
        `quantize`), each copy's scales written in the layout its GEMM reads; else (the CPU, a
        traced call, rows the kernel cannot read 16 bytes at a time, a kernel GEMMGEN_JIT keeps
        from compiling now: `runtime.cast_transpose.cast_transpose`) `quantize` twice."""
        if torch.compiler.is_compiling() or not cast_transposable(t):
            return super().operands(t, rows, columns, history)

        def layout(spec: tuple[Gemm, str, Recipe]) -> Layout:  # "b": scales made transposed, then viewed back
            read = spec[2].ir.gemm.scale_layouts[spec[1] == "b"]
            return read if spec[1] == "a" else read.transposed

        out = cast_transpose(t, self.dtype, self.power_of_two_scales, scale_layout=layout(rows),
                             scale_t_layout=layout(columns))
        if out is None:  # its kernel is not loadable yet (GEMMGEN_JIT=0 or async): torch's, the same bits
            return super().operands(t, rows, columns, history)
        assert out.q is not None and out.scale is not None and out.q_t is not None and out.scale_t is not None

        def as_read(q: torch.Tensor, scale: torch.Tensor, which: str) -> Operand:
            return Operand(q, scale) if which == "a" else Operand(q.t(), scale.t())

        return as_read(out.q, out.scale, rows[1]), as_read(out.q_t, out.scale_t, columns[1])

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe,
               history: AmaxHistory | None = None) -> QuantizedWeight:
        q, scale = self.quantize(w.detach(), (self.block, self.block))  # (out, in), (out / 128, in / 128)
        rows = Operand(q.t(), _transposed_scale(scale, fprop.ir.gemm.scale_layouts[1]))
        columns = Operand(q.t().contiguous().t(), copy_in_layout(scale, dgrad.ir.gemm.scale_layouts[1], 4))
        return QuantizedWeight(self.weight_version(w), rows, columns)

    def experts(self, w: torch.Tensor, history: AmaxHistory | None = None) -> QuantizedWeight:
        """The experts' weights (E x out x in) quantized for the grouped fprop's and dgrad's B, per
        expert in 128 x 128 blocks; the scales compact, as grouped kernels read them."""
        q, scale = self.quantize(w.detach(), (self.block, self.block))  # (E, out / 128, in / 128) scales
        rows = Operand(q.mT, copy_in_layout(scale.mT, Layout.COL, 1))  # B: (E, in, out), in contiguous
        columns = Operand(q.mT.contiguous().mT, copy_in_layout(scale, Layout.COL, 1))  # B: (E, out, in), out contiguous
        return QuantizedWeight(self.weight_version(w), rows, columns)

    def tokens(self, t: torch.Tensor, gemm: Gemm, groups: int, history: AmaxHistory | None = None) -> Operand:
        """`t` (tokens x C) per token and 128 of C, as a grouped kernel's A (its scales compact)."""
        q, scale = self.quantize(t.contiguous(), (1, self.block))
        return Operand(q, scale)

    def along_tokens(self, t: torch.Tensor, offsets: torch.Tensor, which: str,
                     history: AmaxHistory | None = None) -> Operand:
        """`t` (tokens x C) along each expert's tokens for the K-grouped weight gradient: its
        tokens-contiguous copy (C x T', each expert's tokens aligned) and scales per 128 of them
        (gg.quantize_k_grouped)."""
        copy, scales = quantize_k_grouped(t, offsets, self.dtype, self.power_of_two_scales)
        return Operand(copy, scales)


@dataclass(frozen=True, repr=False)
class MXFP8(Precision):
    """MXFP8 training (Transformer Engine's MXFP8BlockScaling), on sm_100a (B200) only: e4m3 for
    every operand in 1 x 32 blocks along each GEMM's K, one E8M0 scale per block rounded *up*,
    2^ceil(log2(amax / 448)) (the rounding that trained an 8B model on 15T tokens like bf16; the OCP
    spec's floor makes the largest values saturate). No transpose is exact here: the weight's
    column-wise copy is quantized from the weight again, along out_features."""

    suffix: ClassVar[str] = "mxfp8"
    dtype: ClassVar[DType] = DType.E4M3

    def block_scale(self, gemm: Gemm) -> Microscaling:
        return Microscaling.MXFP8

    def quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scales): `t` (R x K) in e4m3 per 32 values along K (row-major), and its UE8M0
        scales (R, ceil(K / 32)) in row order: the recipe's one quantizer."""
        return microscaling.quantize(t, Microscaling.MXFP8, self.dtype, round_up=True)

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe,
                history: AmaxHistory | None = None) -> Operand:
        q, scale = self.quantize(t.contiguous())
        blocked = microscaling.to_blocked(scale)
        return Operand(q.contiguous(), blocked) if which == "a" else Operand(q.contiguous().t(), blocked)

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe,
               history: AmaxHistory | None = None) -> QuantizedWeight:
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

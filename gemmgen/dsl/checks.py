"""What a recipe's epilogue may hold given its GEMM, checked when the recipe is made (`Recipe`):
the limits of a grouped kernel's epilogue and of reductions over column pairs; and what a
K-grouped GEMM (`grouped=gg.Grouping.K`) takes."""

from __future__ import annotations

from typing import Any

from ..errors import RecipeError
from ..ir import Columns, EpilogueIR, GemmSpec, Op
from ..types import DType, Grouping, Layout, OperandKind, as_dtype
from .values import OUTPUT_DTYPES


def check_grouped_epilogue(ir: EpilogueIR, k_grouped: bool = False) -> None:
    """What a grouped kernel's epilogue can read and write: CUTLASS's grouped (pointer-array)
    epilogue addresses C, D and the broadcast vectors per group, but not the extra tensor maps of
    auxiliary loads and stores; gemmgen's register visitors (column pairs) take per-group pointers
    too. A K-grouped kernel's (a weight gradient's) epilogue reads scalars and C (G x M x N) only."""
    if k_grouped:
        other = [o.name for o in ir.operands if o.kind not in (OperandKind.SCALAR, OperandKind.MATRIX)
                 or o.columns is not Columns.FULL]
        if other:
            raise RecipeError(f"operand {other[0]!r}: a K-grouped GEMM's epilogue reads scalars and one M x N matrix "
                              "per group (C, e.g. main_grad) only for now; apply vectors and column pairs outside "
                              "the weight gradient")
    if any(n.op is Op.ROW_INDEX for n in ir.nodes):
        raise RecipeError("epilogue: gg.row_index() in a grouped GEMM is not supported yet (a group's kernel "
                          "numbers its rows from the group's first); declare the recipe without grouped=True")
    matrices = [o.name for o in ir.operands if o.kind is OperandKind.MATRIX and o.columns is Columns.FULL]
    if len(matrices) > 1:
        raise RecipeError(f"operands {matrices}: a grouped GEMM's epilogue reads at most one M x N matrix "
                          "(it is loaded as C); combine the others before the GEMM")
    # each is a per-group pointer array the setup kernel fills (grouped.hpp's MaxColumns)
    per_group = [o.name for o in ir.operands if o.kind in (OperandKind.ROW, OperandKind.COL)
                 or (o.kind is OperandKind.MATRIX and o.columns is not Columns.FULL)]
    if len(per_group) > 8:
        raise RecipeError(f"operands {per_group}: a grouped GEMM's epilogue reads at most 8 row or column vectors "
                          "and matrices of column pairs; combine some before the GEMM")
    extra = [o.name for o in ir.outputs[1:]]
    if extra:
        raise RecipeError(f"aux output {extra[0]!r}: a grouped GEMM writes D only (auxiliary outputs and "
                          "reductions are not supported there yet); return D's value alone")


def check_reductions(ir: EpilogueIR) -> None:
    """A reduction over M of a value at N/2 columns (one of column pairs' halves) is not built: the
    kernel reduces its own N columns, of which such a value holds every other one."""
    for o in ir.outputs:
        if o.dim == 0 and o.columns is not Columns.FULL:
            raise RecipeError(f"aux output {o.name!r}: a reduction over M (dim=0) of a value of column pairs (at "
                              f"{o.columns.value} columns) is not supported; reduce it over N (dim=1), or reduce a "
                              "full-width value over M")


def grouping_of(grouped: Any) -> Grouping | None:
    """`grouped=`: False, True (gg.Grouping.ROWS), or a gg.Grouping (or its value, "rows" or "k")."""
    if grouped is False:
        return None
    if grouped is True:
        return Grouping.ROWS
    try:
        return Grouping(grouped.value if isinstance(grouped, Grouping) else grouped)
    except ValueError:
        raise RecipeError(f"grouped: expected True, False, gg.Grouping.ROWS or gg.Grouping.K, got "
                          f"{grouped!r}") from None


def check_k_grouped(da: DType, db: DType, d: Any, la: Layout, lb: Layout, ld: Layout, fp8: bool,
                    block_scale: Any) -> GemmSpec:
    """`grouped=gg.Grouping.K`: the experts' weight gradient, D_g = A_g @ B_g over group g's tokens,
    which are K. bf16: A is the M x T `.t()` of a tokens-major T x M tensor (the output gradient)
    and B the T x N tokens-major tensor (the layer's input), so A is column-major and B row-major.
    fp8: WGMMA reads K-major operands only, so A and B are tokens-contiguous copies (M x T'
    row-major, and the .t() of an N x T' one), each group's tokens aligned
    (`GemmSpec.token_align`), scaled per 128 tokens of each row and column (block_scale=(1, 1, 128),
    DeepSeek-V3's "1D1D" weight gradient) or per tensor in the epilogue."""
    dd = as_dtype(d if d is not None else (DType.F32 if fp8 else da), "d (dtype of D)")
    if dd not in OUTPUT_DTYPES:
        raise RecipeError(f"d: D may be bf16, f16, f32, e4m3 or e5m2, not {dd.value}")
    if ld is not Layout.ROW:
        raise RecipeError("layout_d: a K-grouped GEMM's D is G x M x N, each group's M x N row-major; drop "
                          "layout_d=ColMajor")
    if not fp8:
        if block_scale is not None:
            raise RecipeError("block_scale: block scaling is for fp8 A and B (e4m3/e5m2); bf16/f16 need no scales")
        if (la, lb) != (Layout.COL, Layout.ROW):
            raise RecipeError(f"layout_a/layout_b: a K-grouped GEMM's K is the tokens, and both operands hold each "
                              f"group's tokens one after another: A (M x T) is the .t() of a T x M tensor and B is "
                              f"T x N, so declare layout_a=gg.ColMajor, layout_b=gg.RowMajor (got "
                              f"{la.value}/{lb.value})")
        return GemmSpec(da, da, dd, la, lb, layout_d=ld, grouped=True, k_grouped=True)
    if block_scale not in (None, (1, 1, 128), [1, 1, 128]):
        raise RecipeError(f"block_scale: a K-grouped fp8 GEMM's scales are per row of A, column of B and 128 of "
                          f"each group's tokens; declare block_scale=(1, 1, 128), or leave it out to scale per "
                          f"tensor in the epilogue (got {block_scale!r})")
    if (la, lb) != (Layout.ROW, Layout.COL):
        raise RecipeError(f"layout_a/layout_b: fp8 WGMMA reads A and B K-major only, and a K-grouped GEMM's K is the "
                          f"tokens: A is an M x T' tokens-contiguous copy and B the .t() of an N x T' one (each "
                          f"group's tokens aligned: gg.quantize_k_grouped), so declare layout_a=gg.RowMajor, "
                          f"layout_b=gg.ColMajor (got {la.value}/{lb.value})")
    scale = None if block_scale is None else (1, 1, 128)
    return GemmSpec(da, db, dd, la, lb, layout_d=ld, grouped=True, k_grouped=True, block_scale=scale)


__all__ = ["check_grouped_epilogue", "check_k_grouped", "check_reductions", "grouping_of"]

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


def check_k_grouped(da: DType, d: Any, la: Layout, lb: Layout, ld: Layout, fp8: bool, block_scale: Any
                    ) -> GemmSpec:
    """`grouped=gg.Grouping.K`: the experts' weight gradient, D_g = A_g @ B_g over group g's tokens,
    which are K: A is the M x T `.t()` of a tokens-major T x M tensor (the output gradient) and B the
    T x N tokens-major tensor (the layer's input), so A is column-major and B row-major."""
    if fp8 or block_scale is not None:
        raise RecipeError("grouped: a K-grouped GEMM takes bf16 or f16 A and B for now (fp8 WGMMA reads K-major "
                          "operands, and tokens-major ones are not: the transposed copies are not built yet); "
                          "declare a=gg.bf16, b=gg.bf16 without block_scale")
    if (la, lb) != (Layout.COL, Layout.ROW):
        raise RecipeError(f"layout_a/layout_b: a K-grouped GEMM's K is the tokens, and both operands hold each "
                          f"group's tokens one after another: A (M x T) is the .t() of a T x M tensor and B is "
                          f"T x N, so declare layout_a=gg.ColMajor, layout_b=gg.RowMajor (got {la.value}/{lb.value})")
    if ld is not Layout.ROW:
        raise RecipeError("layout_d: a K-grouped GEMM's D is G x M x N, each group's M x N row-major; drop "
                          "layout_d=ColMajor")
    dd = as_dtype(d if d is not None else da, "d (dtype of D)")
    if dd not in OUTPUT_DTYPES:
        raise RecipeError(f"d: D may be bf16, f16, f32, e4m3 or e5m2, not {dd.value}")
    return GemmSpec(da, da, dd, la, lb, layout_d=ld, grouped=True, k_grouped=True)


__all__ = ["check_grouped_epilogue", "check_k_grouped", "check_reductions", "grouping_of"]

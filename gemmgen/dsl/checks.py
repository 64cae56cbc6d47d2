"""What a recipe's epilogue may hold given its GEMM, checked when the recipe is made (`Recipe`):
the limits of a grouped kernel's epilogue and of reductions over column pairs."""

from __future__ import annotations

from ..errors import RecipeError
from ..ir import Columns, EpilogueIR, Op
from ..types import OperandKind


def check_grouped_epilogue(ir: EpilogueIR) -> None:
    """What a grouped kernel's epilogue can read and write: CUTLASS's grouped (pointer-array)
    epilogue addresses C, D and the broadcast vectors per group, but not the extra tensor maps of
    auxiliary loads and stores; gemmgen's register visitors (column pairs) take per-group pointers
    too."""
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


__all__ = ["check_grouped_epilogue", "check_reductions"]

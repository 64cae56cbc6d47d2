"""What `Recipe.reference` checks: a kernel's rules for the values of a call, not for its layout."""

from __future__ import annotations

import torch

from ..errors import LayoutMismatch
from ..ir import RecipeIR
from ..types import Layout, OperandKind
from .checks import _need_tensor, check_call, tma_readable
from .grouped_checks import check_grouped_call


def check_values(recipe: RecipeIR, a: object, b: object, operands: dict[str, object],
                 offsets: object = None) -> None:
    """A kernel's checks of what a call computes (types, dtypes, shapes, devices), without its
    layout rules: `Recipe.reference` accepts what a kernel of the recipe accepts, in any layout.
    Each tensor is checked as a TMA-readable copy of itself, so only a value can be refused."""
    g = recipe.gemm
    layouts = {"a": Layout.ROW if g.grouped and not g.k_grouped else g.layout_a, "b": g.layout_b}
    layouts |= {o.name: Layout.COL if o.kind is OperandKind.SCALE_A and not g.k_grouped else Layout.ROW
                for o in recipe.operands}

    def copy(name: str, value: object) -> object:
        if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
            return value
        if g.microscaling is not None and name in ("scale_a", "scale_b"):  # the blocked order: contiguous bytes
            return value.clone(memory_format=torch.contiguous_format)
        return tma_readable(value, layouts.get(name, Layout.ROW))

    a, b = copy("a", _need_tensor("a", a)), copy("b", _need_tensor("b", b))
    ops = {k: copy(k, v) for k, v in operands.items()}
    try:
        if g.grouped:
            check_grouped_call(recipe, a, b, copy("offsets", offsets), ops, require_cuda=False)
        else:
            check_call(recipe, a, b, ops, require_cuda=False)
    except LayoutMismatch:  # of the copies: not the caller's to fix, and not a value the reference refuses
        pass

"""A recipe's repr: one line with what a user acts on, not the IR."""

from __future__ import annotations

from collections.abc import Sequence

from ..config import KernelConfig
from ..ir import GemmSpec, Operand, Output, Reduction
from ..types import Microscaling, OperandKind

_KINDS = {OperandKind.SCALAR: "Scalar", OperandKind.ROW: "RowVector", OperandKind.COL: "ColVector",
          OperandKind.MATRIX: "Matrix", OperandKind.SEED: "Seed"}


def summary(name: str, g: GemmSpec, operands: Sequence[Operand], outputs: Sequence[Output],
            config: KernelConfig | None) -> str:
    """`Recipe('name', [batched, grouped,] A x B -> D with dtypes and layouts, [block_scale=...,]
    operands={...}, outputs={...}, config=...)`: what the call takes after A and B (the block
    scales by `block_scale=`), what it returns, and which kernel (None: chosen per shape)."""
    flags = "".join(f"{flag}, " for flag in ("batched", "grouped") if getattr(g, flag))
    flags = flags.replace("grouped", "K-grouped") if g.k_grouped else flags
    scale = g.declared_block_scale
    scaled = "" if scale is None else f"block_scale={scale.name if isinstance(scale, Microscaling) else scale}, "
    takes = ", ".join(f"{o.name}: {_KINDS[o.kind]}" + ("" if o.kind is OperandKind.SEED else f"({o.dtype.value})")
                      for o in operands if not o.kind.block_scale)
    gives = ", ".join(f"{o.name}: {o.dtype.value}{_reduction(o)}" for o in outputs)
    kernel = config.name if config is not None else "None (per shape)"
    return (f"Recipe({name!r}, {flags}{g.a.value} {g.layout_a.value} x {g.b.value} {g.layout_b.value} -> "
            f"{g.d.value} {g.layout_d.value}, {scaled}operands={{{takes}}}, outputs={{{gives}}}, config={kernel})")


def _reduction(o: Output) -> str:
    """What an output reduces: ' amax', ' sum(dim=1)', ' block factors'; '' for an M x N value
    (' transposed, per column' for gg.quantize_columns's copy)."""
    if o.reduce is None:
        return " transposed, per column" if o.column_blocks else ""
    if o.reduce is Reduction.BLOCK_SCALE:
        return " block factors"
    if o.reduce is Reduction.COLUMN_BLOCK_SCALE:
        return " column block scales"
    return f" {o.reduce.value}" + (f"(dim={o.dim})" if o.dim is not None else "")

"""Random arguments of one call of a recipe's kernel, in the dtypes and layouts it reads: what
autotune times, and what tests and benchmarks feed."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..ir import RecipeIR
from ..types import DType, Layout, OperandKind
from .checks import tma_readable
from .quantize import random_block_scale


def example_call(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1, device: str = "cuda",  # noqa: E741
                 seed: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(A, B) and the operands by name; for a grouped recipe (A, B, offsets), its `m` rows split as
    evenly as they go over `l` groups, B and row vectors per group."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    gemm = recipe.gemm
    lead = (l,) if gemm.batched else ()  # of every matrix and scale of a batched recipe
    groups = (l,) if gemm.grouped else ()  # of a grouped recipe's B, its scales and its row vectors

    def matrix(lead: tuple[int, ...], rows: int, cols: int, dtype: DType, layout: Layout) -> Any:
        """In `layout`, its rows or columns 16 bytes apart (padded where the extent is odd), as TMA
        reads them; packed fp4 as random codes, its contiguous extent (K, rounded up to even) in pairs."""
        if dtype.packed > 1:
            rows, cols = (rows, -(-cols // 2)) if layout is Layout.ROW else (-(-rows // 2), cols)
            codes = torch.randint(0, 256, (*lead, rows, cols), generator=g, device=device, dtype=torch.uint8)
            return tma_readable(codes, layout).view(dtype.torch)
        return tma_readable(torch.randn(*lead, rows, cols, generator=g, device=device).to(dtype.torch), layout)

    args: tuple[Any, ...] = (matrix(lead, m, k, gemm.a, gemm.layout_a),
                             matrix(groups or lead, k, n, gemm.b, gemm.layout_b))
    if gemm.grouped:
        ends = [m * (i + 1) // l for i in range(l)]
        args += (torch.tensor(ends, dtype=torch.int32, device=device),)
    ops: dict[str, Any] = {}
    for o in recipe.operands:
        if o.kind.block_scale:
            ops[o.name] = random_block_scale(o.kind, gemm, m, n, k,
                                             (groups if o.kind is OperandKind.SCALE_B else ()) or lead, device, l)
        elif o.kind is OperandKind.SCALAR:
            ops[o.name] = torch.ones(lead, device=device) if o.per_batch else 1.0
        elif o.kind is OperandKind.SEED:  # read by the kernel at launch, as a training step's would be
            ops[o.name] = torch.tensor([0x5EED], dtype=torch.int64, device=device)
        elif o.kind is OperandKind.ROW:
            batch = lead if o.per_batch else groups
            ops[o.name] = tma_readable(torch.randn(*batch, n, generator=g, device=device).to(o.dtype.torch),
                                       Layout.ROW)
        elif o.kind is OperandKind.COL:
            ops[o.name] = tma_readable(torch.randn(*lead[:bool(o.per_batch)], m, generator=g, device=device)
                                       .to(o.dtype.torch), Layout.ROW)
        else:  # N/2 columns when it meets the halves of column pairs (`ir.columns`); shared: no batch
            ops[o.name] = matrix(lead if o.per_batch else (), m, o.columns.extent(n), o.dtype, gemm.layout_d)
    return args, ops

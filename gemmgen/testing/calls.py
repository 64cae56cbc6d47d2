"""Arguments of kernel calls for CPU tests: kernels with the driver replaced, random inputs in
padded layouts, outputs as callers give them, and the problem shapes every emulation covers."""

from __future__ import annotations

from typing import Any

import torch

from ..compile import CompiledKernel
from ..config import Arch, KernelConfig, Schedule
from ..dsl import Recipe
from ..ir import Op, Output, RecipeIR, post_order
from ..ir.reference import reference
from ..runtime.kernel import Kernel
from ..runtime.quantize import random_block_scale
from ..types import DType, Layout, OperandKind
from .recording import RecordingEncoder
from .tensors import strided_matrix

#: (M, N, K, L): M = 1, odd N and K with K tails, a tile-straddling M, N = 1 (one output column, a
#: row of 2 or 4 bytes) and a 1 x 1 output; L is used by batched recipes.
EMULATED = [(1, 24, 16, 2), (7, 40, 129, 3), (130, 9, 72, 2), (5, 1, 24, 2), (1, 1, 8, 3)]


def emulated_shapes(recipe: Recipe | RecipeIR) -> list[tuple[int, int, int, int]]:
    """EMULATED, each N made even for an epilogue over column pairs (which needs whole pairs)."""
    ir = recipe if isinstance(recipe, RecipeIR) else recipe.ir
    return [(m, n + n % 2, k, b) if ir.epilogue.pairs else (m, n, k, b) for m, n, k, b in EMULATED]


#: The kernels an epilogue feature's emulation runs through: sm90 cooperative, ping-pong and
#: swapped; sm100 on one SM, on a pair of SMs (2x1 cluster) and swapped. Each test keeps those
#: `codegen.is_valid` accepts for its recipe.
EMULATED_CONFIGS = (
    KernelConfig(tile=(128, 128, 64)), KernelConfig(tile=(64, 128, 64), schedule=Schedule.PINGPONG),
    KernelConfig(tile=(128, 64, 64), swap_ab=True),
    KernelConfig(tile=(128, 128, 64), schedule=Schedule.ONE_SM, arch=Arch.SM100A),
    KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1), schedule=Schedule.TWO_SM, arch=Arch.SM100A),
    KernelConfig(tile=(128, 128, 64), schedule=Schedule.ONE_SM, swap_ab=True, arch=Arch.SM100A),
)

#: Relative tolerance of an output of each dtype against the fp32 reference (fp8: one unit in the last place).
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4,
             torch.float8_e4m3fn: 2**-3, torch.float8_e5m2: 2**-2}


AnyRecipe = Recipe | RecipeIR  # the helpers take a recipe or its IR (what a CompiledKernel holds)


def ir_of(recipe: AnyRecipe) -> RecipeIR:
    return recipe if isinstance(recipe, RecipeIR) else recipe.ir


def by_dtype(output: Output, want: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) both TOLERANCE of the output's dtype (`testing.tensors.Tolerance`)."""
    tol = TOLERANCE[output.dtype.torch]
    return tol, tol


def output_tolerance(recipe: AnyRecipe, output: Output) -> float:
    """The relative tolerance of `output`: TOLERANCE of its dtype, or of the narrowest type a cast
    rounds its value to on the way. A value rounded mid-recipe (a quantize-dequantize, a cast to
    bf16) can tip to the neighbouring value of the cast's type when the accumulator's last bits,
    summed in another order than the reference's, put it at a rounding boundary."""
    nodes = ir_of(recipe).epilogue.nodes
    casts = [dtype.torch for i in post_order([output.node], lambda i: nodes[i].args)
             if nodes[i].op is Op.CAST and (dtype := nodes[i].dtype) is not None]
    return max(TOLERANCE[t] for t in (output.dtype.torch, *casts))


def dense(items: dict) -> dict:
    """Recipes or compiled kernels by name, but the grouped ones (they take offsets, and their
    groups' shapes live on the GPU: tested apart)."""
    return {name: x for name, x in items.items() if not getattr(x, "recipe", x).gemm.grouped}


def cpu_kernel(compiled: CompiledKernel, encoder: Any = None) -> Any:
    """The kernel with the driver replaced: recording tensor maps, an H100's SM count. (Typed Any:
    tests read the optional fields of its prepared calls, and its recording encoder, directly.)"""
    return Kernel(compiled, encoder=encoder or RecordingEncoder(), hardware=lambda i: (132, 0), require_cuda=False)


def padded(rows: int, cols: int, dtype: torch.dtype, row_major: bool, lead: tuple[int, ...],
           fill: float | None = None) -> torch.Tensor:
    """A (lead,) rows x cols tensor whose leading dimension is padded one 16-byte step past aligned."""
    make = torch.randn if fill is None else (lambda *shape: torch.full(shape, fill))
    return strided_matrix(make, rows, cols, dtype, Layout.ROW if row_major else Layout.COL, lead,
                          pad=16 // torch.empty((), dtype=dtype).element_size())


def _ab(rows: int, cols: int, dtype: DType, row_major: bool, lead: tuple[int, ...]) -> torch.Tensor:
    """A or B as `padded` makes them; packed fp4 as random codes, its contiguous extent (K, rounded
    up to even) in pairs."""
    if dtype.packed == 1:
        return padded(rows, cols, dtype.torch, row_major, lead)
    rows, cols = (rows, -(-cols // 2)) if row_major else (-(-rows // 2), cols)
    codes = strided_matrix(lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8), rows, cols, torch.uint8,
                           Layout.ROW if row_major else Layout.COL, lead, pad=16)
    return codes.view(dtype.torch)


def given_outputs(recipe: AnyRecipe, m: int, n: int, lead: tuple[int, ...], fill: float | None = float("nan")
                  ) -> tuple[torch.Tensor, ...]:
    """Outputs as a caller gives them (NaN-filled by default): M x N with padded rows (a
    column-quantized copy N x M), or a reduction's contiguous fp32 values per batch."""
    ir = ir_of(recipe)
    row_major = ir.gemm.layout_d is Layout.ROW
    return tuple(torch.full(o.shape((*lead, m, n)), fill if fill is not None else 1.0) if o.reduce is not None
                 else padded(n, m, o.dtype.torch, True, lead, fill=fill) if o.column_blocks  # (N, M) row-major
                 else padded(m, o.columns.extent(n), o.dtype.torch, row_major, lead, fill=fill)
                 for o in ir.epilogue.outputs)


def unwritten(recipe: AnyRecipe, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Fresh outputs made NaN where the kernel is to write them; an amax over M and N keeps the 0
    the runtime gave it, which the kernel max-combines into."""
    return tuple(t if o.reduce is not None and o.dim is None else t.fill_(float("nan"))
                 for o, t in zip(ir_of(recipe).epilogue.outputs, outputs, strict=True))


def fresh_args(recipe: AnyRecipe, m: int, n: int, k: int, lead: tuple[int, ...], scalar: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """New random A, B and operands (padded leading dimensions) for the recipe at (M, N, K); scalars
    are `scalar`, or random when it is None."""
    ir = ir_of(recipe)
    g = ir.gemm
    a = _ab(m, k, g.a, g.layout_a is Layout.ROW, lead)
    b = _ab(k, n, g.b, g.layout_b is Layout.ROW, lead)
    ops: dict[str, Any] = {}
    for o in ir.operands:
        if o.kind.block_scale:
            ops[o.name] = random_block_scale(o.kind, g, m, n, k, lead)
        elif o.kind is OperandKind.SCALAR and o.per_batch:
            ops[o.name] = torch.randn(lead) if scalar is None else torch.full(lead, scalar)
        elif o.kind is OperandKind.SCALAR:
            ops[o.name] = float(torch.randn(())) if scalar is None else scalar
        elif o.kind is OperandKind.SEED:  # any 63-bit value: both halves of the seed hashed
            ops[o.name] = int(torch.randint(0, 2**62, ())) * 2 + int(torch.randint(0, 2, ()))
        elif o.kind is OperandKind.MATRIX:  # in D's layout; one for every batch unless per batch
            ops[o.name] = padded(m, o.columns.extent(n), o.dtype.torch, g.layout_d is Layout.ROW,
                                 lead if o.per_batch else ())
        elif o.per_batch:  # (L, N) or (L, M), each batch's vector 16-byte aligned
            ops[o.name] = padded(lead[0], n if o.kind is OperandKind.ROW else m, o.dtype.torch, True, ())
        else:
            ops[o.name] = torch.randn(n if o.kind is OperandKind.ROW else m).to(o.dtype.torch)
        if o.dtype is DType.I32:  # indices (gg.gather): into the other dimension, one past each end too
            v = ops[o.name]
            v.copy_(torch.randint(-1, (m if o.kind is OperandKind.ROW else n) + 1, v.shape, dtype=torch.int32))
    return a, b, ops


def args_with_nonzero_reference(recipe: AnyRecipe, m: int, n: int, k: int, lead: tuple[int, ...]
                                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], tuple[torch.Tensor, ...]]:
    """`fresh_args` and the reference's outputs, redrawn while an output is all zeros: a 1 x 1 erf
    GELU of a value below about -5.9 is exactly 0, and a zero reference checks nothing."""
    for _ in range(20):
        a, b, ops = fresh_args(recipe, m, n, k, lead)
        want = reference(ir_of(recipe), a, b, ops)
        if all(w.float().abs().sum() > 0 for w in want):
            return a, b, ops, want
    raise AssertionError(f"{recipe.name}: 20 draws of inputs at {(m, n, k)} all gave a zero reference")

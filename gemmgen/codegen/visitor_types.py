"""The CUTLASS visitor type that spells each leaf, store and reduction of an epilogue (codegen.evt
builds the graph of them): broadcasts and loads of operands, aux stores, and the reductions'
functors, with the strides and descriptors each takes. Shared by both arches (sm100 reuses the
sm90 visitors)."""

from __future__ import annotations

from ..config import Arch
from ..ir import ColumnBlocks, Node, Op, Operand, Param, RecipeIR, Reduction, f32_bits
from ..ir.ops import FP8_MAX
from ..types import DType, Layout, OperandKind

FUSION = "cutlass::epilogue::fusion"
ROUND = "cutlass::FloatRoundStyle::round_to_nearest"
COMPUTE = "float"

EPI = "gemmgen::epi"  # gemmgen/include/gemmgen/epilogue.hpp: each op's functor (`ir.Op.functor`)

#: (load, store) descriptors of an aux tensor's epilogue tile, stages and smem layout, per arch;
#: each takes the kernel's `EpilogueDescriptor` (declared by the arch's types template).
AUX_DESCRIPTORS = {
    Arch.SM90A: ("cutlass::epilogue::collective::detail::AuxLoadDescriptor",
                 "cutlass::epilogue::collective::detail::AuxStoreDescriptor"),
    Arch.SM100A: ("cutlass::epilogue::collective::detail::Sm100AuxLoadDescriptor",
                  "cutlass::epilogue::collective::detail::Sm100AuxStoreDescriptor"),
}



#: An N/2- or 2N-column tensor's strides (pairs.hpp): rows, contiguous columns, batches.
HALF_STRIDE = "cute::Stride<int64_t, cute::_1, int64_t>"


def register_element(dtype: DType, recipe: RecipeIR) -> str:
    """The element a register visitor of pairs.hpp takes: a grouped kernel's is `Element*`, an array
    of per-group pointers (CUTLASS's form for its broadcasts), each at its group's first row."""
    return f"{dtype.cutlass}*" if recipe.gemm.grouped else dtype.cutlass


def aux_stride_type(layout: Layout) -> str:
    """An M x N aux tensor in D's layout, with a batch stride."""
    if layout is Layout.ROW:
        return "cute::Stride<int64_t, cute::_1, int64_t>"
    return "cute::Stride<cute::_1, int64_t, int64_t>"


def shared_stride(aux_stride: str) -> str:
    """A matrix shared by every batch: D's layout, a static batch stride of 0."""
    return aux_stride.removesuffix("int64_t>") + "cute::_0>"



def load_type(operand: Operand, is_source: bool, aux_stride: str, descriptor: str,
               grouping: str | None = None, rows_in_place: bool = False) -> str:
    """A grouped kernel's vectors are arrays of per-group pointers (CUTLASS's `Element*` form). The
    vector along the grouped mode starts at the group's first row of A, any element: it is read
    element by element (Alignment 1), not in 16-byte vectors. A vector per batch has a dynamic
    batch stride (the broadcasts allow one); a scalar's always is one (0 when shared: the value). A
    row vector is read in place where `rows_in_place` (`_rows_in_place`)."""
    kind, e = operand.kind, operand.dtype.cutlass
    v = f"{e}*" if grouping else e
    batch = "int64_t" if operand.per_batch else "cute::_0"
    if kind is OperandKind.SCALAR:
        return f"{FUSION}::Sm90ScalarBroadcast<{e}, cute::Stride<cute::_0, cute::_0, int64_t>>"
    if kind is OperandKind.ROW:
        align = ", 1" if grouping == "N" else ""
        stride = f"cute::Stride<cute::_0, cute::_1, {batch}>"
        row = f"{FUSION}::Sm90RowBroadcast<0, TileShape, {v}, {COMPUTE}, {stride}{align}>"
        return f"{EPI}::Sm100RowBroadcastInPlace<{row}>" if rows_in_place else row
    if kind is OperandKind.COL:
        align = ", 1" if grouping else ""
        stride = f"cute::Stride<cute::_1, cute::_0, {batch}>"
        return f"{FUSION}::Sm90ColBroadcast<0, TileShape, {v}, {COMPUTE}, {stride}{align}>"
    if is_source:
        return f"{FUSION}::Sm90SrcFetch<{e}>"
    if not operand.per_batch:  # one matrix for every batch: CUTLASS's register load (no TMA, no smem), batch stride 0
        return f"{FUSION}::Sm90AuxLoad<0, void, {e}, {shared_stride(aux_stride)}, void, void>"
    desc = f"{descriptor}<EpilogueDescriptor, {aux_stride}, {e}>"
    return (f"{FUSION}::Sm90AuxLoad<{desc}::Stages, typename {desc}::EpilogueTile, {e}, {aux_stride}, "
            f"typename {desc}::SmemLayoutAtom, typename {desc}::CopyOpS2R>")


#: (per element, into global memory) functors of a reduction over M and N: max |x| (CUTLASS's fp8
#: amax), a signed max or min. Each thread reduces its part of a tile from the reduction's identity,
#: then combines it atomically, once per thread and tile, into the batch's fp32, which must start at
#: the identity (the runtime fills it). Max and min do not depend on the order they combine in.
_SCALAR_REDUCE_FN = {
    Reduction.AMAX: ("cutlass::maximum_absolute_value_reduction", "cutlass::atomic_maximum"),
    Reduction.MAX: ("cutlass::maximum", "cutlass::atomic_maximum"),
    Reduction.MIN: ("cutlass::minimum", f"{EPI}::AtomicMinimum"),  # gemmgen/include/gemmgen/atomics.hpp
}


#: The reductions over M and N a kernel computes (the others, sum and log-sum-exp, are per row or column).
SCALAR_REDUCTIONS = frozenset(_SCALAR_REDUCE_FN)


def scalar_reduction_functors(reduce: Reduction) -> tuple[str, str, str]:
    """(per element, across lanes, into global memory) functor templates of a reduction over M and
    N, for a reducer that combines a warp's values with shuffles before its atomic (the direct
    epilogue's `ScalarReduction`): the vector reductions' lane combine."""
    reg, gmem = _SCALAR_REDUCE_FN[reduce]
    return reg, _VECTOR_REDUCE_FN[reduce][1], gmem


def scalar_reduction_type(reduce: Reduction) -> str:
    """Sm90ScalarReduction into one fp32 per batch (dynamic batch stride)."""
    reg, gmem = _SCALAR_REDUCE_FN[reduce]
    return (f"{FUSION}::Sm90ScalarReduction<{reg}, {gmem}, float, {COMPUTE}, {ROUND}, "
            f"cute::Stride<cute::_0, cute::_0, int64_t>>")


#: The visitor reducing over M (dim 0, to a row vector) or over N (dim 1, to a column vector).
REDUCTION_KIND = {0: "row_reduction", 1: "col_reduction"}

#: (per element, across lanes, across warps and tiles) functors of each reduction. They are not
#: atomics, so CUTLASS's reductions take their deterministic path: each CTA writes its tile's
#: partial to the workspace and the last CTA of a row (column) of tiles combines them in a fixed
#: order (the workspace's tile counters must start at 0: the runtime zeroes the workspace).
_VECTOR_REDUCE_FN = {
    Reduction.SUM: ("cutlass::plus", "cutlass::plus", "cutlass::plus"),
    Reduction.AMAX: ("cutlass::maximum_absolute_value_reduction", "cutlass::maximum", "cutlass::maximum"),
    Reduction.MAX: ("cutlass::maximum", "cutlass::maximum", "cutlass::maximum"),
    Reduction.MIN: ("cutlass::minimum", "cutlass::minimum", "cutlass::minimum"),
    Reduction.LSE: (f"{EPI}::LseCombine",) * 3,  # gemmgen/include/gemmgen/lse.hpp
}

#: The state a log-sum-exp reduces in (its ElementCompute): {max, sum of exp(x - max)}.
LSE_STATE = f"{EPI}::LseState"


def vector_reduction_type(kind: str, reduce: Reduction, arch: Arch = Arch.SM90A) -> str:
    """A reduction into fp32, one vector per batch (dynamic batch stride); a log-sum-exp's state is a
    pair (`LSE_STATE`), the others' fp32. Over the kernel's N: CUTLASS's Sm90ColReduction; over its
    M: on sm_90a gemmgen's Sm90RowReduction (gemmgen/include/gemmgen/row_reduction.hpp: CUTLASS's,
    with its state in shared memory rather than spilled), on sm_100a CUTLASS's own, whose per-thread
    state the tensor-memory loads' layout keeps in registers (docs/design/blackwell.md)."""
    reg, shuffle, gmem = _VECTOR_REDUCE_FN[reduce]
    compute = LSE_STATE if reduce is Reduction.LSE else COMPUTE
    if kind == "row_reduction" and arch is Arch.SM100A:
        return (f"{FUSION}::Sm90RowReduction<{reg}, {shuffle}, {gmem}, 0, TileShape, float, {compute}, {ROUND}, "
                "cute::Stride<cute::_0, cute::_1, int64_t>>")
    if kind == "row_reduction":
        return (f"{EPI}::Sm90RowReduction<{reg}, {shuffle}, {gmem}, TileShape, EpilogueSchedule, float, {compute}, "
                f"{ROUND}, cute::Stride<cute::_0, cute::_1, int64_t>>")
    return (f"{FUSION}::Sm90ColReduction<{reg}, {shuffle}, {gmem}, 0, TileShape, float, {compute}, {ROUND}, "
            "cute::Stride<cute::_1, cute::_0, int64_t>>")


def aux_store_type(dtype: DType, aux_stride: str, descriptor: str) -> str:
    e = dtype.cutlass
    desc = f"{descriptor}<EpilogueDescriptor, {aux_stride}, {e}>"
    return (f"{FUSION}::Sm90AuxStore<{desc}::Stages, typename {desc}::EpilogueTile, {e}, {ROUND}, {aux_stride}, "
            f"typename {desc}::SmemLayoutAtom, typename {desc}::CopyOpR2S>")


def column_blocks_type(blocks: ColumnBlocks) -> str:
    """column_blocks.hpp's store of a transposed copy quantized per block of rows (gg.quantize's
    scale rule: its fp8 type's largest value), over the kernel's resolved epilogue subtile."""
    qmax = f32_bits(FP8_MAX[blocks.dtype])
    return (f"{EPI}::Sm90ColumnBlocksStore<{qmax:#010x}u, {blocks.block}, {blocks.dtype.cutlass}, TileShape, "
            f"typename EpilogueDescriptor::EpilogueTile{', true' * blocks.power_of_two}>")


def functor_of(node: Node, nodes: tuple[Node, ...]) -> tuple[str, list[int]]:
    """The functor of a compute node (a pair functor whole, an elementwise one as the F of
    Map<F>::Fn) and the args that remain visitor children: a compile-time parameter (leaky_relu's
    slope) and a constant operand are template arguments."""
    ns = EPI
    if node.op.pairs:  # a functor of the whole fragment (pairs.hpp); a constant side built in
        consts = [nodes[a] for a in node.args if nodes[a].op is Op.CONST]
        if consts:
            const_even = nodes[node.args[0]].op is Op.CONST
            kept = [a for a in node.args if nodes[a].op is not Op.CONST]
            value = f32_bits(consts[0].attr)  # type: ignore[arg-type]
            return f"{ns}::InterleaveConst<{value:#010x}u, {str(const_even).lower()}>::Fn", kept
        return f"{ns}::{node.op.functor}", list(node.args)
    if node.op.param is Param.SLOPE:
        return f"{ns}::{node.op.functor}<{f32_bits(node.attr):#010x}u>", list(node.args)  # type: ignore[arg-type]
    base = f"{ns}::{node.op.functor}"
    if node.op is Op.WHERE:  # constant branches built in (a constant condition was folded by the IR)
        _, x, y = (nodes[a] for a in node.args)
        bits = [f"{f32_bits(v.attr):#010x}u" for v in (x, y) if v.op is Op.CONST]  # type: ignore[arg-type]
        which = "X" * (x.op is Op.CONST) + "Y" * (y.op is Op.CONST)
        if which:
            kept = [a for a in node.args if nodes[a].op is not Op.CONST]
            return f"{ns}::SelectConst{which}<{', '.join(bits)}>", kept
    if len(node.args) == 2:
        lhs, rhs = (nodes[a] for a in node.args)
        if rhs.op is Op.CONST:
            return f"{ns}::WithRhs<{base}, {f32_bits(rhs.attr):#010x}u>", [node.args[0]]  # type: ignore[arg-type]
        if lhs.op is Op.CONST:
            return f"{ns}::WithLhs<{base}, {f32_bits(lhs.attr):#010x}u>", [node.args[1]]  # type: ignore[arg-type]
    return base, list(node.args)

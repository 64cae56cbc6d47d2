"""The epilogue IR: a normalized, frozen, hashable DAG with a stable content key.

Tracing (gemmgen.dsl) builds nodes in any order; `normalize` rebuilds them canonically:
constants folded, commutative operands ordered, common subexpressions merged, dead nodes
dropped, and nodes numbered in a fixed post-order from the outputs. The same math therefore
gives the same IR and the same key, whatever order the user wrote it in.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import numbers
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..types import DType, Layout, Microscaling, OperandKind
from .columns import Columns, annotate
from .ops import RANDOM_OPS, Op


def f32(value: numbers.Real | float) -> float:
    """Round a Python number to the nearest fp32, as the kernel will hold it: +-inf past fp32's
    range (an int past a double's included), as torch rounds it for the reference."""
    try:
        return struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", f32(value)))[0]


#: Where a K-grouped fp8 GEMM's groups start in its operands: a multiple of 16 tokens (`GemmSpec.token_align`).
K_GROUPED_TOKEN_ALIGN = 16


@dataclass(frozen=True)
class Node:
    """One value in the epilogue. `args` index earlier nodes of the same IR."""

    op: Op
    args: tuple[int, ...] = ()
    name: str | None = None  # INPUT: operand name; RANDOM: its seed's
    attr: float | None = None  # CONST: value; LEAKY_RELU: slope (fp32-rounded)
    dtype: DType | None = None  # INPUT: element type; CAST: target type


@dataclass(frozen=True)
class Operand:
    """A declared epilogue input. A matrix operand's `columns` is inferred from its use
    (`ir.columns`): N, or N/2 where it meets the halves of column pairs.

    `per_batch` says whether a batched GEMM's operand has one value, vector or matrix per batch:
    a scalar (L,), a row vector (L, N), a column vector (L, M), a matrix (L, M, N); else every
    batch reads the same one. A scalar per batch is read through its pointer: a non-batched GEMM's
    is a one-element tensor (`gg.Scalar(tensor=True)`). None takes the kind's default: scalars and vectors are shared by
    every batch, matrices are per batch. It enters the key only where it is not the default."""

    name: str
    kind: OperandKind
    dtype: DType
    columns: Columns = Columns.FULL
    per_batch: bool | None = None

    def __post_init__(self) -> None:
        if self.per_batch is None:
            object.__setattr__(self, "per_batch", self.kind is OperandKind.MATRIX)

    @property
    def batching(self) -> list[list]:
        """`per_batch` in the canonical form: only where it differs from the kind's default."""
        return [] if self.per_batch == (self.kind is OperandKind.MATRIX) else [["per_batch", self.per_batch]]


class Reduction(enum.Enum):
    """How an output reduces its value instead of storing it."""

    AMAX = "amax"  # the largest absolute value (NaNs skipped), for fp8 scaling
    SUM = "sum"
    MAX = "max"  # the largest value (NaNs skipped; -inf when there is none)
    MIN = "min"  # the smallest value (NaNs skipped; +inf when there is none)
    LSE = "lse"  # log(sum(exp(x))), as torch.logsumexp (NaN propagated; -inf when there is none)
    #: the factor of each block of D's rows (`RowBlocks`): the scale gg.quantize divides by, the
    #: 1 / rms gg.rms_norm multiplies by, the max gg.exp_minus_max subtracts; one per row and block
    BLOCK_SCALE = "block_scale"
    #: the scale of each block of rows of a column (`ColumnBlocks`): what gg.quantize_columns divides
    #: by, one per column and block, of the transposed copy (N, ceil(M / block))
    COLUMN_BLOCK_SCALE = "column_block_scale"

    @property
    def identity(self) -> float:
        """The value a reduction gives where there is nothing to reduce (and, but for the log-sum-exp,
        whose state is a pair, starts from: `LSE_IDENTITY`)."""
        return {Reduction.MAX: -math.inf, Reduction.MIN: math.inf, Reduction.LSE: -math.inf}.get(self, 0.0)


#: The reductions that pick one of their values (NaNs skipped): off by at most what any value is.
EXTREMA = frozenset((Reduction.AMAX, Reduction.MAX, Reduction.MIN))


#: The log-sum-exp's starting state (max, sum of exp(x - max)): nothing reduced
#: (gemmgen/include/gemmgen/lse.hpp's LseState).
LSE_IDENTITY = (-math.inf, 0.0)


class BlockOp(enum.Enum):
    """What D's row blocks compute (`RowBlocks`)."""

    QUANTIZE = "quantize"  # D = x / scale, scale = max |x| / D's fp8 maximum (1 where not above 0): gg.quantize
    RMS_NORM = "rms_norm"  # D = v / sqrt(mean of x^2 + eps) over the block: gg.rms_norm
    EXP = "exp_minus_max"  # D = exp(scale * (x - max)), max over the block: gg.exp_minus_max


@dataclass(frozen=True)
class RowBlocks:
    """D computed per block of `block` columns of each row from a statistic of node `stat` over the
    block (D's own value for QUANTIZE and EXP; an RMS_NORM's x, where D's value is x times a
    weight), which the kernel reduces within one epilogue subtile (gemmgen/include/gemmgen/
    row_blocks.hpp) and an output of `Reduction.BLOCK_SCALE` holds (the factor each value of the
    block took)."""

    op: BlockOp
    block: int
    stat: int
    constant: float = 0.0  # RMS_NORM's eps, EXP's scale; fp32-rounded
    power_of_two: bool = False  # QUANTIZE's scales rounded up to a power of two (ops.quantize_blocks)


@dataclass(frozen=True)
class ColumnBlocks:
    """A value stored transposed, (N, M) with M contiguous, and quantized per block of `block` rows
    of each column (gg.quantize_columns): the copy a weight-gradient GEMM reads K-major, K being
    D's rows (the tokens). The output of `Reduction.COLUMN_BLOCK_SCALE` with the same `ColumnBlocks`
    holds each block's scale (gemmgen/include/gemmgen/column_blocks.hpp). `dtype` is the copy's fp8
    type, whose largest value the scales map each block's largest magnitude to."""

    block: int
    dtype: DType
    power_of_two: bool = False  # the scales rounded up to a power of two (ops.quantize_blocks)


@dataclass(frozen=True)
class Output:
    """An epilogue output: `d` is the GEMM's D; others are auxiliary M x N outputs, or with
    `reduce` fp32 reductions of a value, per batch: over M and N when `dim` is None (one value,
    shape (L,) or ()), over M when `dim` is 0 (one value per column: (L, N) or (N,)), over N when
    `dim` is 1 (one value per row: (L, M) or (M,)); with `over_batch`, over a batched GEMM's batches
    too (no L).

    `blocks` computes D per block of columns of each row (gg.quantize, gg.rms_norm,
    gg.exp_minus_max: `RowBlocks`); the output of `Reduction.BLOCK_SCALE` with the same `blocks`
    holds each block's factor, one per row and block: (L, M, ceil(N / block)) or (M, ceil(N / block)).
    `column_blocks` stores the value transposed and quantized per block of rows of each column
    (`ColumnBlocks`): (L, N, M) or (N, M), and its scales' output (L, N, ceil(M / block)) or
    (N, ceil(M / block))."""

    name: str
    node: int
    dtype: DType
    reduce: Reduction | None = None
    dim: int | None = None
    columns: Columns = Columns.FULL  # N/2 for a value of column pairs' halves (`ir.columns`)
    over_batch: bool = False
    blocks: RowBlocks | None = None
    column_blocks: ColumnBlocks | None = None

    def shape(self, problem: tuple[int, ...]) -> tuple[int, ...]:
        """This output's shape for a problem whose accumulator is `problem`, (L, M, N) or (M, N)."""
        if self.column_blocks is not None:
            m, n = problem[-2], problem[-1]
            rows = -(-m // self.column_blocks.block) if self.reduce is Reduction.COLUMN_BLOCK_SCALE else m
            return (*problem[:-2], n, rows)
        if self.reduce is Reduction.BLOCK_SCALE:
            assert self.blocks is not None
            return (*problem[:-1], -(-problem[-1] // self.blocks.block))
        if self.reduce is None:
            return (*problem[:-1], self.columns.extent(problem[-1]))
        extent = () if self.dim is None else (problem[-2],) if self.dim == 1 else (problem[-1],)
        batch = () if self.over_batch else problem[:-2]
        return (*batch, *extent)

    @property
    def transposed(self) -> Output:
        """The same output of the transposed problem: a reduction over M becomes one over N."""
        return replace(self, dim=None if self.dim is None else 1 - self.dim)


@dataclass(frozen=True)
class GemmSpec:
    """The main loop's problem: D[l] = epilogue(A[l] @ B[l]) with fp32 accumulation.

    `grouped` is the MoE form: A (T x K) holds the rows of G groups one after another (group g's
    rows end at offsets[g]), B is G x K x N (one matrix per group), and D (T x N) gets each row
    from its own group's B. With `k_grouped` the groups split K instead (`Grouping.K`, the experts'
    weight gradient): A (M x T, column-major: a T x M tensor's `.t()`) and B (T x N, row-major) hold
    the K columns and rows of G groups one after another (group g's tokens end at offsets[g]), and
    D (G x M x N) gets D_g = A_g @ B_g, a sum over the group's tokens alone; an empty group's D_g is
    the epilogue of a zero accumulator.

    `layout_d` is the memory order of D and of every M x N epilogue tensor (C, aux loads and
    stores): row-major unless a recipe declares column-major D; a swapped kernel's view of the
    recipe has the other one (`RecipeIR.transposed`).

    `block_scale` (M, N, K) is the granularity of fp8 block scaling (DeepSeek-V3's (1, 128, 128)):
    A's values are scaled by one fp32 per `M` rows and `K` columns, B's by one per `K` rows and `N`
    columns, and the main loop adds each K block's partial product into the fp32 accumulator times
    its two scales (CUTLASS's blockwise fp8 main loop): acc = sum over K blocks of (A_kb @ B_kb) *
    scale_a * scale_b. The scales are the call's first operands (`RecipeIR.operands`). A grouped
    GEMM's are per row of A (M granularity 1) and per group's B, both K-major (`scale_layouts`). A
    K-grouped fp8 GEMM's (a weight gradient's) are (1, 1, 128): per row of A and column of B and 128
    of each group's tokens, the blocks restarting at each group's first token.

    `microscaling` (gg.MXFP8, gg.NVFP4) is the MMA's own block scaling: A[m, k] counts as A[m, k] *
    scale_a[m, k // v] and B[k, n] as B[k, n] * scale_b[n, k // v], v its vector (32 UE8M0
    exponents, 16 unsigned e4m3 scales), read by the tcgen05 MMA from tensor memory. The scales are
    the call's first operands, each in the blocked order of the MMA (`ir.microscaling`).
    """

    a: DType
    b: DType
    d: DType
    layout_a: Layout
    layout_b: Layout
    batched: bool = False
    accumulator: DType = DType.F32
    layout_d: Layout = Layout.ROW
    grouped: bool = False
    block_scale: tuple[int, int, int] | None = None
    microscaling: Microscaling | None = None
    k_grouped: bool = False  # with `grouped`: the groups split K (Grouping.K)

    @property
    def declared_block_scale(self) -> tuple[int, int, int] | Microscaling | None:
        """What a recipe declares as `block_scale=`: a granularity, a microscaling format, or None."""
        return self.block_scale or self.microscaling

    @property
    def scaled(self) -> bool:
        """Whether the call passes scale_a and scale_b for the main loop (`RecipeIR.operands`)."""
        return self.declared_block_scale is not None

    @property
    def quantized(self) -> bool:
        """A and B are fp8 or fp4: no gradient, and torch has no plain GEMM of them."""
        return self.a.bits <= 8

    @property
    def fp8(self) -> bool:
        """A and B are fp8: CUTLASS's fp8 mainloop (partial sums promoted into fp32), QGMMA."""
        return self.a.bits == 8

    @property
    def scale_layouts(self) -> tuple[Layout, Layout]:
        """The memory order the kernel reads the block scales in: `scale_a` (M blocks x K blocks)
        and `scale_b` (K blocks x N blocks, per group when grouped). M/N-major for one GEMM, where
        CUTLASS may load them with TMA; K-major for a grouped one, whose main loop reads each
        group's scales as a compact K-major block from the group's first row (a slice of the
        caller's tensor only in that order). A K-grouped GEMM's are M/N-major: group g's K blocks
        are whole rows of (blocks, M) and (blocks, N) tensors from row g + first token // 128 on,
        found without a prefix sum (`reference.k_grouped_scale_block`)."""
        return (Layout.ROW, Layout.COL) if self.grouped and not self.k_grouped else (Layout.COL, Layout.ROW)

    @property
    def token_align(self) -> int:
        """A K-grouped fp8 GEMM's alignment of each group's tokens in its operands; 0 for any other.
        fp8 WGMMA reads K-major operands only, so A and B are tokens-contiguous copies (M x T' and
        N x T'), and TMA needs each group's first byte 16-byte aligned: group g's tokens start at
        column 16 * (g + ceil(first / 16)) of copies 16 * (G + ceil(T / 16)) columns wide, with
        zeros between the groups (`reference.k_grouped_token_column`). No token is padded into a
        block: each group's partial K tile is masked by its extent, and its 128-token scale blocks
        start at its first token."""
        return K_GROUPED_TOKEN_ALIGN if self.k_grouped and self.fp8 else 0


@dataclass(frozen=True)
class EpilogueIR:
    nodes: tuple[Node, ...]
    outputs: tuple[Output, ...]  # `d` first, then aux outputs in declaration order
    operands: tuple[Operand, ...]  # operands the outputs actually read, in declaration order

    def users(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for a in n.args:
                users[a].append(i)
        return users

    def operand(self, name: str) -> Operand:
        return next(o for o in self.operands if o.name == name)

    @property
    def source(self) -> str | None:
        """The M x N operand the kernel loads as C (CUTLASS's source): the first matrix operand as
        wide as the accumulator and batched like it (a shared one is read from registers)."""
        return next((o.name for o in self.operands if o.kind is OperandKind.MATRIX and o.columns is Columns.FULL
                     and o.per_batch), None)

    @property
    def pairs(self) -> bool:
        """Whether the epilogue works on adjacent column pairs (`ir.columns`)."""
        return any(n.op.pairs for n in self.nodes)

    @property
    def row_blocks(self) -> RowBlocks | None:
        """How D is computed per block of columns of each row (gg.quantize, gg.rms_norm,
        gg.exp_minus_max), if it is."""
        return self.outputs[0].blocks

    @property
    def column_blocks(self) -> ColumnBlocks | None:
        """How a value is stored transposed and quantized per block of rows of each column
        (gg.quantize_columns), if one is."""
        return next((o.column_blocks for o in self.outputs if o.column_blocks is not None), None)

    @property
    def along_rows(self) -> bool:
        """Whether the epilogue combines neighbouring columns of a row (column pairs, D's row
        blocks) or neighbouring rows of a column (gg.quantize_columns): only an unswapped kernel's
        tiles hold them as the recipe's (a swapped kernel's columns are rows)."""
        return self.pairs or self.row_blocks is not None or self.column_blocks is not None


#: The block scales' operands, first among a block-scaled recipe's operands.
BLOCK_SCALE_OPERANDS = (Operand("scale_a", OperandKind.SCALE_A, DType.F32),
                        Operand("scale_b", OperandKind.SCALE_B, DType.F32))
#: A microscaled recipe's (GemmSpec.microscaling): UE8M0 exponents in the MMA's blocked order.
def microscaling_operands(fmt: Microscaling) -> tuple[Operand, Operand]:
    """scale_a and scale_b of a microscaled recipe, in the format's scale type."""
    return (Operand("scale_a", OperandKind.SCALE_A, fmt.scale_dtype),
            Operand("scale_b", OperandKind.SCALE_B, fmt.scale_dtype))


@dataclass(frozen=True)
class RecipeIR:
    """Everything that determines a kernel's math; `key` is its content address."""

    name: str
    gemm: GemmSpec
    epilogue: EpilogueIR

    @property
    def operands(self) -> tuple[Operand, ...]:
        """What a call passes after A and B, in order: the block scales (when the GEMM is
        block-scaled or microscaled), then the epilogue's operands."""
        g = self.gemm
        scales = BLOCK_SCALE_OPERANDS if g.block_scale else microscaling_operands(g.microscaling) \
            if g.microscaling else ()
        return scales + self.epilogue.operands

    @property
    def outputs(self) -> tuple[Output, ...]:
        """D, then the aux outputs (`EpilogueIR.outputs`)."""
        return self.epilogue.outputs

    @functools.cached_property
    def key(self) -> str:
        """Computed once per IR (a JSON dump and a SHA-256: ~10 us, and read on every op call)."""
        return content_key(self.canonical())

    def transposed(self) -> RecipeIR:
        """The same math over transposed operands: D^T = epilogue(B^T @ A^T).

        A swapped kernel computes this recipe on the caller's tensors reinterpreted in place: A and
        B trade places with flipped layouts, D and every M x N tensor become column-major views of
        the same memory, row vectors (one value per column of D) become column vectors of D^T, and
        a reduction over M (one value per column) becomes one over N, and a row's index a column's.
        Block scales trade places with their operands: the swapped kernel's A is the caller's B.
        """
        g = self.gemm
        scale = None if g.block_scale is None else (g.block_scale[1], g.block_scale[0], g.block_scale[2])
        gemm = GemmSpec(a=g.b, b=g.a, d=g.d, layout_a=g.layout_b.transposed, layout_b=g.layout_a.transposed,
                        batched=g.batched, accumulator=g.accumulator, layout_d=g.layout_d.transposed,
                        grouped=g.grouped, block_scale=scale, microscaling=g.microscaling, k_grouped=g.k_grouped)
        operands = tuple(replace(o, kind=o.kind.transposed) for o in self.epilogue.operands)
        outputs = tuple(o.transposed for o in self.epilogue.outputs)
        nodes = tuple(replace(n, op=n.op.transposed) for n in self.epilogue.nodes)
        return RecipeIR(self.name, gemm, EpilogueIR(nodes, outputs, operands))

    def canonical(self) -> dict:
        """A JSON-able form with no names that do not change the math (the recipe name is left out).
        A field added later enters only when it differs from its default, so existing keys stay."""
        g = self.gemm
        layout_d = [] if g.layout_d is Layout.ROW else [g.layout_d.value]
        grouped = [["grouped", True]] if g.grouped else []
        grouped += [["k_grouped", True]] if g.k_grouped else []
        block_scale = [["block_scale", list(g.block_scale)]] if g.block_scale else []
        microscaling = [["microscaling", g.microscaling.value]] if g.microscaling else []
        return {
            "gemm": [g.a.value, g.b.value, g.d.value, g.layout_a.value, g.layout_b.value, g.batched,
                     g.accumulator.value, *layout_d, *grouped, *block_scale, *microscaling],
            "nodes": [[n.op.key, list(n.args), n.name, n.attr, n.dtype.value if n.dtype else None]
                      for n in self.epilogue.nodes],
            "outputs": [[o.name, o.node, o.dtype.value, *([o.reduce.value] if o.reduce else []),
                         *([o.dim] if o.dim is not None else []), *_columns(o.columns),
                         *([["over_batch", True]] if o.over_batch else []),
                         *([_row_blocks(o.blocks)] if o.blocks else []),
                         *([["column_blocks", o.column_blocks.block, o.column_blocks.dtype.value,
                             *(["power_of_two"] if o.column_blocks.power_of_two else [])]]
                           if o.column_blocks else [])]
                        for o in self.epilogue.outputs],
            "operands": [[o.name, o.kind.value, o.dtype.value, *_columns(o.columns), *o.batching]
                         for o in self.epilogue.operands],
        }


def _row_blocks(blocks: RowBlocks) -> list:
    return ["blocks", blocks.op.value, blocks.block, blocks.stat, *([blocks.constant] if blocks.constant else []),
            *(["power_of_two"] if blocks.power_of_two else [])]


def _columns(columns: Columns) -> list[str]:
    return [] if columns is Columns.FULL else [columns.value]


def content_key(obj: object) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def fold_constant(op: Op, values: tuple[float, ...], attr: float | None, dtype: DType | None) -> float:
    """Evaluate `op` on fp32 constants with the reference's own semantics (so folding changes nothing)."""
    import torch

    return float(op.apply(tuple(torch.tensor(v, dtype=torch.float32) for v in values), attr, dtype))


def post_order(roots: list[int], args_of: Callable[[int], tuple[int, ...]]) -> list[int]:
    """The nodes reachable from `roots`, each once, arguments before their users, in the order a
    depth-first walk from each root in turn (arguments left to right) finishes them. An explicit
    stack: an epilogue of any depth, no recursion limit."""
    order: list[int] = []
    seen: set[int] = set()
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        i, finished = stack.pop()
        if finished:
            order.append(i)
        elif i not in seen:
            seen.add(i)
            stack.append((i, True))
            stack.extend((a, False) for a in reversed(args_of(i)))
    return order


def normalize(nodes: list[Node], outputs: list[Output], operands: tuple[Operand, ...]) -> EpilogueIR:
    """Fold, order, merge and renumber a traced graph (see module docstring)."""
    canon: dict[Node, int] = {}
    new_nodes: list[Node] = []
    structure: list[str] = []  # per new node: a structural digest, used to order commutative args
    memo: dict[int, int] = {}

    def intern(node: Node, digest: str) -> int:
        if node in canon:
            return canon[node]
        canon[node] = len(new_nodes)
        new_nodes.append(node)
        structure.append(digest)
        return canon[node]

    def digest_of(node: Node, child_digests: list[str]) -> str:
        head = json.dumps([node.op.key, node.name, node.attr, node.dtype.value if node.dtype else None])
        return hashlib.sha256((head + "|" + ",".join(child_digests)).encode()).hexdigest()

    def rebuild(node: Node) -> int:
        args = [memo[a] for a in node.args]
        if node.op.commutative:
            args.sort(key=lambda a: structure[a])
        argn = [new_nodes[a] for a in args]
        if node.op is Op.WHERE and argn[0].op is Op.CONST:  # a constant condition picks its side
            return args[1] if argn[0].attr != 0 else args[2]  # NaN is true, as Op.WHERE's formula says
        if args and all(a.op is Op.CONST for a in argn) and node.op is not Op.INTERLEAVE:  # constants alternate
            value = fold_constant(node.op, tuple(a.attr for a in argn), node.attr, node.dtype)  # type: ignore[misc]
            folded = Node(Op.CONST, attr=value)
            r = intern(folded, digest_of(folded, []))
        else:
            new = Node(node.op, tuple(args), node.name, node.attr, node.dtype)
            r = intern(new, digest_of(new, [structure[a] for a in args]))
        return r

    # Visit in output order so numbering is canonical; then renumber to a compact post-order.
    stats = [o.blocks.stat for o in outputs if o.blocks]  # reachable from D's value, but kept in any case
    for i in post_order([o.node for o in outputs] + stats, lambda i: nodes[i].args):
        memo[i] = rebuild(nodes[i])
    roots = [memo[o.node] for o in outputs]
    order = post_order(roots + [memo[s] for s in stats], lambda i: new_nodes[i].args)
    remap = {old: new for new, old in enumerate(order)}
    final = tuple(Node(new_nodes[o].op, tuple(remap[a] for a in new_nodes[o].args), new_nodes[o].name,
                       new_nodes[o].attr, new_nodes[o].dtype) for o in order)
    outs = tuple(replace(o, node=remap[r], columns=Columns.FULL,
                         blocks=o.blocks and replace(o.blocks, stat=remap[memo[o.blocks.stat]]))
                 for o, r in zip(outputs, roots, strict=True))
    used = {n.name for n in final if n.op is Op.INPUT or n.op in RANDOM_OPS}
    kept = tuple(replace(o, columns=Columns.FULL) for o in operands if o.name in used)
    if any(n.op.pairs for n in final):
        outs, kept = annotate(final, outs, kept)
    return EpilogueIR(final, outs, kept)

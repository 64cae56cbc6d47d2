"""The recipe's own semantics, evaluated with torch in fp32.

What each op means is its formula in the op table (`ops.Op`); this module applies them to a
GEMM's accumulator and operands, and rounds and reduces the outputs as the kernel does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..types import DType, OperandKind
from . import microscaling
from .graph import EXTREMA, BlockOp, EpilogueIR, GemmSpec, Operand, Output, RecipeIR, Reduction
from .ops import COMPARISONS, FP8_MAX, RANDOM_OPS, Op, quantize_blocks, random_uniform, round_to

__all__ = ["FP8_MAX", "accumulate", "error_scale", "evaluate_epilogue", "expand_block_scale", "group_bounds",
           "k_grouped_scale_block", "k_grouped_scale_blocks", "k_grouped_token_column", "k_grouped_tokens",
           "k_grouped_width", "masked_group_bounds", "masked_rows", "reference", "round_to",
           "row_operands"]


def _broadcast(t: torch.Tensor, operand: Operand, batched: bool) -> torch.Tensor:
    """Shape an operand so it broadcasts against the (L, M, N) / (M, N) output: a row vector
    (N,) -> (1, N), a column vector (M,) -> (M, 1); one per batch (`Operand.per_batch`) keeps its
    leading L: (L, N) -> (L, 1, N), (L, M) -> (L, M, 1), a scalar's (L,) -> (L, 1, 1) (a
    non-batched GEMM's one-element tensor -> ())."""
    t = t.to(torch.float32)
    if operand.kind is OperandKind.MATRIX:
        return t
    if operand.kind is OperandKind.SCALAR and not batched:
        return t.reshape(())
    batch = (t.shape[0],) if operand.per_batch else ()
    shape = {OperandKind.ROW: (1, -1), OperandKind.COL: (-1, 1), OperandKind.SCALAR: (1, 1) if batch else ()}
    return t.reshape((*batch, *shape[operand.kind]))


def _coordinates(acc: torch.Tensor, row: bool) -> torch.Tensor:
    """Each element's row (`row`) or column in its batch's M x N accumulator, rounded to fp32 as
    the kernel converts its integer coordinates."""
    extent = acc.shape[-2] if row else acc.shape[-1]
    index = torch.arange(extent, dtype=torch.int64).to(torch.float32)
    return index.reshape(-1, 1) if row else index


def seed_value(seed: torch.Tensor | float | int) -> int:
    """A seed operand's 64 bits: a Python int, or the value a one-element int64 tensor holds."""
    return int(seed.reshape(-1)[0]) if isinstance(seed, torch.Tensor) else int(seed)


def _random(acc: torch.Tensor, seed: int, stream: int, transposed: bool) -> torch.Tensor:
    """gemmgen.rand at each element of the (L, M, N) / (M, N) accumulator (`ops.random_uniform`);
    `transposed`: a swapped kernel's view, whose rows are the recipe's columns."""
    m, n = acc.shape[-2:]
    batch = torch.arange(acc.shape[0] if acc.dim() == 3 else 1).reshape(-1, 1, 1)
    rows, columns = torch.arange(m).reshape(1, -1, 1), torch.arange(n).reshape(1, 1, -1)
    u = random_uniform(seed, stream, batch, columns, rows) if transposed else \
        random_uniform(seed, stream, batch, rows, columns)
    return u if acc.dim() == 3 else u[0]


def evaluate_epilogue(ir: EpilogueIR, acc: torch.Tensor, operands: dict[str, torch.Tensor | float],
                      round_outputs: bool = True, magnitudes: bool = False,
                      acc_magnitude: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Evaluate the epilogue on an fp32 accumulator; return the outputs rounded to their dtypes
    (or kept in fp32 with `round_outputs=False`, for differentiation). With `magnitudes` each
    output is instead the scale of its rounding error, in fp32 (an fp8 type would saturate it): a
    sum's, the sum of its terms' magnitudes (`_magnitudes`; the accumulator's is `acc_magnitude`,
    |A| @ |B|, else |acc|); a max's, min's or amax's, the largest of theirs
    (`testing.tensors.assert_outputs_close`)."""
    values = _values(ir, acc, operands)
    scales = _magnitudes(ir, values, acc_magnitude) if magnitudes else values
    n = acc.shape[-1]

    def reduced(o: Output) -> torch.Tensor:
        shape = (*acc.shape[:-1], o.columns.extent(n))
        if magnitudes and o.reduce in EXTREMA:  # a max is off by at most the most any value is off by
            return _reduced(scales[o.node].expand(shape), Reduction.AMAX, o.dim, over_batch=o.over_batch)
        return _reduced((scales if o.reduce is Reduction.SUM else values)[o.node].expand(shape), o.reduce, o.dim,
                        magnitudes, o.over_batch)

    outs = tuple(_row_blocks(ir, o, values, scales if magnitudes else None, acc.shape) if o.blocks else
                 _column_blocks(o, values, scales if magnitudes else None, acc.shape) if o.column_blocks else
                 reduced(o) for o in ir.outputs)
    if magnitudes or not round_outputs:
        return outs
    return tuple(round_to(v, o.dtype) for v, o in zip(outs, ir.outputs, strict=True))


def error_scale(ir: EpilogueIR, acc: torch.Tensor, operands: dict[str, torch.Tensor | float],
                output: int = 0) -> torch.Tensor:
    """The scale of an unreduced output's rounding error (`_magnitudes`): what the same formulas
    computed with last-place differences in exp, tanh or erf (another libm's) can be off by,
    relative to."""
    node = ir.outputs[output].node
    return _magnitudes(ir, _values(ir, acc, operands), None)[node]


#: The largest |f'| of the unary ops whose derivative is bounded (sin, cos, erf: at most 2/sqrt(pi)).
_LIPSCHITZ = 1.2


def _magnitudes(ir: EpilogueIR, values: list[torch.Tensor], acc_magnitude: torch.Tensor | None
                ) -> list[torch.Tensor]:
    """Per node, the scale of its rounding error: what a value computed from rounded inputs can be
    off by, relative to. A sum or difference is off relative to its operands' magnitudes, not to
    its result (acc + bias can cancel to almost nothing); a product scales with both; an op of
    bounded derivative passes its input's magnitude on (times the bound), exp and division scale
    it by their value; min, max and where take the larger side."""
    out: list[torch.Tensor] = []
    exact = _exact(ir)
    for node, v in zip(ir.nodes, values, strict=True):
        args = [out[a] for a in node.args]
        op = node.op
        if op is Op.ACC and acc_magnitude is not None:
            m = acc_magnitude
        elif op.is_leaf:
            m = v.abs()
        elif op in (Op.ADD, Op.SUB):
            m = args[0] + args[1]
        elif op is Op.MUL:
            m = args[0] * args[1]
        elif op is Op.DIV:
            m = (args[0] + v.abs() * args[1]) / values[node.args[1]].abs()
        elif op in (Op.NEG, Op.ABS, Op.CAST, Op.STOCHASTIC_ROUND):
            m = args[0]
        elif op.pairs:  # the magnitudes moved as the values are
            m = op.apply(tuple(args))
        elif op is Op.EXP:
            m = v.abs() * (1.0 + args[0])
        elif op in (Op.MIN, Op.MAX):
            m = args[0].maximum(args[1])
        elif op is Op.WHERE and exact[node.args[0]]:  # the kernel picks the reference's side
            m = args[1].where(values[node.args[0]] != 0, args[2])
        elif op is Op.WHERE:
            m = args[1].maximum(args[2])
        elif op.arity == 1:
            m = v.abs() + _LIPSCHITZ * args[0]
        else:  # comparisons: 0 or 1
            m = v.abs()
        out.append(m.to(torch.float32))
    return out


def _exact(ir: EpilogueIR) -> list[bool]:
    """Per node, whether the kernel computes it exactly as the reference does: coordinates,
    constants, random numbers, integer operands and comparisons of them (a gather's, a mask's or a
    dropout's condition), so a select on one takes the same side in both."""
    dtypes = {o.name: o.dtype for o in ir.operands}
    out: list[bool] = []
    for node in ir.nodes:
        if node.op in (Op.ROW_INDEX, Op.COLUMN_INDEX, Op.CONST) or node.op in RANDOM_OPS:
            out.append(True)
        elif node.op is Op.INPUT:
            out.append(dtypes[node.name] is DType.I32)  # type: ignore[index]
        else:
            out.append(node.op in COMPARISONS and all(out[a] for a in node.args))
    return out


def _values(ir: EpilogueIR, acc: torch.Tensor, operands: dict[str, torch.Tensor | float]) -> list[torch.Tensor]:
    """Every node's fp32 value (the op table's formulas)."""
    values: list[torch.Tensor] = []
    for node in ir.nodes:
        if node.op is Op.ACC:
            v = acc
        elif node.op is Op.CONST:
            v = torch.tensor(node.attr, dtype=torch.float32)
        elif node.op in (Op.ROW_INDEX, Op.COLUMN_INDEX):
            v = _coordinates(acc, row=node.op is Op.ROW_INDEX)
        elif node.op in RANDOM_OPS:
            v = _random(acc, seed_value(operands[node.name]), int(node.attr),  # type: ignore[index,arg-type]
                        transposed=node.op is Op.RANDOM_T)
        elif node.op is Op.INPUT:
            raw = operands[node.name]  # type: ignore[index]
            t = raw if isinstance(raw, torch.Tensor) else torch.tensor(float(raw))
            v = _broadcast(t, ir.operand(node.name), acc.dim() == 3)  # type: ignore[arg-type]
        else:
            v = node.op.apply(tuple(values[a] for a in node.args), node.attr, node.dtype)
        values.append(v.to(torch.float32))
    return values


def _row_blocks(ir: EpilogueIR, o: Output, values: list[torch.Tensor], magnitudes: list[torch.Tensor] | None,
                shape: torch.Size) -> torch.Tensor:
    """D computed per block of columns of each row (`RowBlocks`), or the blocks' factors
    (`Reduction.BLOCK_SCALE`): gg.quantize's scales (`ops.quantize_blocks`, as gg.quantize_blockwise),
    gg.rms_norm's 1 / sqrt(mean of x^2 + eps) over each block (a partial last block's mean over its
    columns), gg.exp_minus_max's max of each block. With `magnitudes`, D's is the scale of its
    rounding error: its value's times the factor (exp_minus_max: D times scale times x's and the
    max's)."""
    blocks = o.blocks
    assert blocks is not None
    value, stat = values[o.node].expand(shape), values[blocks.stat].expand(shape)
    n, width, c = shape[-1], blocks.block, blocks.constant

    def grouped(t: torch.Tensor, fill: float) -> torch.Tensor:  # (..., blocks, width), a partial last one filled
        return torch.nn.functional.pad(t, (0, -n % width), value=fill).unflatten(-1, (-1, width))

    def spread(f: torch.Tensor) -> torch.Tensor:  # each block's value at each of its columns
        return f.repeat_interleave(width, -1)[..., :n]

    if blocks.op is BlockOp.QUANTIZE:
        scaled, factor = quantize_blocks(value, (1, width), ir.outputs[0].dtype, blocks.power_of_two)
        per_value = 1.0 / spread(factor)
    elif blocks.op is BlockOp.EXP:
        factor = grouped(stat, -math.inf).amax(dim=-1)  # NaN propagates
        scaled = torch.exp(c * (value - spread(factor)))
        if o.reduce is not Reduction.BLOCK_SCALE and magnitudes is not None:
            # an error e in x, or in the max, moves D by about scale * e * D
            mag = magnitudes[o.node].expand(shape)
            return scaled.abs() * (1 + c * (mag + spread(grouped(mag, 0.0).amax(dim=-1))))
    else:
        squares = grouped(stat, 0.0).square().sum(dim=-1)
        counts = (n - torch.arange(0, n, width)).clamp(max=width)  # a partial last block's columns
        factor = (squares / counts + c).rsqrt()
        per_value = spread(factor)
        scaled = value * per_value
    if o.reduce is Reduction.BLOCK_SCALE:
        return factor
    if magnitudes is None:
        return scaled
    return magnitudes[o.node].expand(shape) * per_value


def _column_blocks(o: Output, values: list[torch.Tensor], magnitudes: list[torch.Tensor] | None,
                   shape: torch.Size) -> torch.Tensor:
    """A value transposed and quantized per block of rows of each column (`ColumnBlocks`), or the
    blocks' scales (`Reduction.COLUMN_BLOCK_SCALE`): gg.quantize's formula (`ops.quantize_blocks`)
    over the rows of x^T. With `magnitudes`, the copy's is the scale of its rounding error."""
    blocks = o.column_blocks
    assert blocks is not None
    scaled, factor = quantize_blocks(values[o.node].expand(shape).transpose(-1, -2), (1, blocks.block),
                                     blocks.dtype, blocks.power_of_two)
    if o.reduce is Reduction.COLUMN_BLOCK_SCALE:
        return factor
    if magnitudes is None:
        return scaled
    per_value = factor.repeat_interleave(blocks.block, -1)[..., :shape[-2]]
    return magnitudes[o.node].expand(shape).transpose(-1, -2) / per_value


def _reduced(v: torch.Tensor, reduce: Reduction | None, dim: int | None, magnitude: bool = False,
             over_batch: bool = False) -> torch.Tensor:
    """An output's value: the M x N tensor, or its reduction per batch over M and N (`dim` None),
    over M (0) or over N (1), and `over_batch` over the batches too. An empty reduction gives the
    identity (`Reduction.identity`)."""
    if reduce is None:
        return v
    dims = ((-3,) if over_batch else ()) + ((-2, -1) if dim is None else (dim - 2,))
    if reduce is Reduction.SUM:
        return (v.abs() if magnitude else v).sum(dim=dims)
    if reduce is Reduction.LSE:
        return v.logsumexp(dim=dims)  # -inf over nothing
    # the kernel's max and min skip NaN, as CUTLASS's maximum<float> and minimum<float> (fmaxf, fminf) do
    identity = reduce.identity
    skipped = torch.where(torch.isnan(v), identity, v.abs() if reduce is Reduction.AMAX else v)
    if any(v.shape[d] == 0 for d in dims):
        return skipped.sum(dim=dims).fill_(identity)  # the reduced shape
    return skipped.amin(dim=dims) if reduce is Reduction.MIN else skipped.amax(dim=dims)


def reference(recipe: RecipeIR, a: torch.Tensor, b: torch.Tensor, operands: Mapping[str, torch.Tensor | float],
              offsets: torch.Tensor | None = None, magnitudes: bool = False) -> tuple[torch.Tensor, ...]:
    """fp32 GEMM on the CPU followed by the epilogue; one tensor per output (`d` first). With
    `magnitudes`, sums are of their terms' absolute values (see `evaluate_epilogue`)."""
    ops = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in operands.items()}
    if recipe.gemm.k_grouped:
        assert offsets is not None
        return _k_grouped_reference(recipe, a.detach().cpu(), b.detach().cpu(), ops, offsets.detach().cpu())
    if recipe.gemm.grouped:
        assert offsets is not None
        if a.dim() == 3:  # the masked layout: (groups, max_m, K), offsets each group's count (masked_m)
            groups, max_m = a.shape[:2]
            flat = masked_rows(recipe, a.detach().cpu(), ops)
            bounds = masked_group_bounds(offsets.tolist(), max_m)
            (d,) = _grouped_reference(recipe, flat[0], b.detach().cpu(), flat[1], bounds)
            return (d.view(groups, max_m, d.shape[-1]),)
        bounds = group_bounds(offsets.tolist(), a.shape[0])
        return _grouped_reference(recipe, a.detach().cpu(), b.detach().cpu(), ops, bounds)
    a, b = a.detach().cpu(), b.detach().cpu()
    acc = accumulate(recipe.gemm, a, b, ops)
    if not magnitudes:
        return evaluate_epilogue(recipe.epilogue, acc, ops)
    scales = {k: v.abs() for k, v in ops.items()  # (a microscaled GEMM's scales are positive already)
              if k in ("scale_a", "scale_b") and isinstance(v, torch.Tensor) and recipe.gemm.block_scale is not None}
    g = recipe.gemm
    acc_magnitude = accumulate(g, microscaling.absolute(a, g.a), microscaling.absolute(b, g.b), {**ops, **scales})
    return evaluate_epilogue(recipe.epilogue, acc, ops, magnitudes=True, acc_magnitude=acc_magnitude)


def accumulate(gemm: GemmSpec, a: torch.Tensor, b: torch.Tensor, operands: dict) -> torch.Tensor:
    """The fp32 accumulator A @ B; with block scales, each of A's and B's values times its block's
    scale (the same sum as the kernel's per-K-block rescaling, up to rounding); microscaled, each
    times its vector's scale, read from the blocked order (`microscaling`; packed fp4 unpacked)."""
    if gemm.microscaling is not None:  # packed fp4 unpacks along K: A's rows, B's columns
        fmt = gemm.microscaling
        a32, b32t = microscaling.values(a, gemm.a), microscaling.values(b.mT, gemm.b)
        columns = microscaling.scale_columns(a32.shape[-1], fmt)
        a32 = microscaling.dequantize(a32, microscaling.from_blocked(operands["scale_a"], a.shape[-2], columns), fmt)
        b32 = microscaling.dequantize(b32t, microscaling.from_blocked(operands["scale_b"], b.shape[-1], columns),
                                      fmt).mT
    else:
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if gemm.block_scale is not None:
        gm, gn, gk = gemm.block_scale
        a32 = a32 * expand_block_scale(operands["scale_a"], gm, gk, a.shape[-2:])
        b32 = b32 * expand_block_scale(operands["scale_b"], gk, gn, b.shape[-2:])
    return torch.matmul(a32, b32)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, shape: tuple[int, ...]) -> torch.Tensor:
    """One scale per `rows` x `cols` block, repeated over its block and cut to `shape` (the last
    block of each dimension may be partial)."""
    s = scale.to(torch.float32).repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return s[..., :shape[-2], :shape[-1]]


def group_bounds(offsets: list[int], rows: int) -> list[tuple[int, int]]:
    """(first row, end row) of each group of a grouped GEMM with `rows` rows of A: group g ends at
    offsets[g] and starts where the groups before it end. Offsets are clamped to [0, rows] and a
    group that would end before it starts is empty, so no row is outside A and no row is in two
    groups whatever the offsets hold (gemmgen/include/gemmgen/grouped.hpp does the same on the GPU)."""
    bounds, start = [], 0
    for off in offsets:
        end = min(max(int(off), start), rows)
        bounds.append((start, end))
        start = end
    return bounds


def masked_group_bounds(masked_m: list[int], max_m: int) -> list[tuple[int, int]]:
    """`group_bounds` of the masked layout (DeepGEMM's, for decode: A is groups x max_m x K, read
    as groups * max_m rows): group g's rows start at g * max_m, and it has masked_m[g] of them,
    clamped to [0, max_m]; the rest of its max_m rows are in no group (grouped.hpp's `fill`)."""
    return [(g * max_m, g * max_m + min(max(int(m), 0), max_m)) for g, m in enumerate(masked_m)]


def masked_rows(recipe: RecipeIR, a: torch.Tensor, operands: Mapping[str, torch.Tensor | float]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """A masked-layout call's A (groups, max_m, K) and every operand that has one entry per row of A
    (a matrix (groups, max_m, N), a column vector (groups, max_m), blockwise scale_a (groups,
    max_m, K blocks)) with their first two dimensions as one: the rows the kernel reads."""
    per_row = row_operands(recipe)
    return a.flatten(0, 1), {k: v.flatten(0, 1) if k in per_row and isinstance(v, torch.Tensor) and v.dim() >= 2
                             else v for k, v in operands.items()}


def row_operands(recipe: RecipeIR) -> frozenset[str]:
    """The operands of a rows-grouped recipe with one entry per row of A (a matrix, a column
    vector, blockwise scale_a): those the masked layout gives a leading (groups, max_m)."""
    return frozenset(o.name for o in recipe.operands
                     if o.kind in (OperandKind.MATRIX, OperandKind.COL)
                     or (o.kind is OperandKind.SCALE_A and recipe.gemm.block_scale is not None))


def k_grouped_token_column(group: int, first: int, align: int) -> int:
    """Where group `group`, whose first token is `first`, starts in a K-grouped GEMM's operands:
    `first`, or over fp8 copies (`GemmSpec.token_align`) the aligned column align * (group +
    ceil(first / align)). Each group ends at least one column before the next starts, whatever its
    size, so an empty group's own column is a zero one."""
    return align * (group + -(-first // align)) if align else first


def k_grouped_width(tokens: int, groups: int, align: int) -> int:
    """The columns of a K-grouped GEMM's operands over `tokens` tokens in `groups` groups, aligned
    per group (`k_grouped_token_column`); `tokens` when not aligned."""
    return align * (groups + -(-tokens // align)) if align else tokens


def k_grouped_tokens(width: int, groups: int, align: int) -> int:
    """The most tokens operands `width` columns wide hold in `groups` aligned groups (the inverse of
    `k_grouped_width`: the tokens a kernel clamps the offsets to)."""
    return width - align * groups if align else width


def k_grouped_scale_block(group: int, first: int, block: int = 128) -> int:
    """The first of group `group`'s scale blocks (of `block` tokens, from its first token `first`)
    in a K-grouped GEMM's scale tensors: group + first // block. Group g needs ceil(n_g / block)
    blocks, and 1 + (first + n_g) // block - first // block of them lie before the next group's,
    so no two groups share one and no prefix sum is needed (`k_grouped_scale_blocks` in all)."""
    return group + first // block


def k_grouped_scale_blocks(tokens: int, groups: int, block: int = 128) -> int:
    """The scale blocks (rows of scale_a and scale_b) of a K-grouped GEMM over at most `tokens`
    tokens in `groups` groups (`k_grouped_scale_block`; over fp8 copies, `tokens` is what their width
    holds: `k_grouped_tokens`)."""
    return groups + tokens // block


def _k_grouped_reference(recipe: RecipeIR, a: torch.Tensor, b: torch.Tensor,
                         operands: dict[str, torch.Tensor | float], offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A K-grouped GEMM (`GemmSpec.k_grouped`): a is M x T, b is T x N, and group g's D (G x M x N)
    is the epilogue of a[:, first:end] @ b[first:end] with its own matrices (C); an empty group's
    accumulator is zero, whatever the offsets hold (`group_bounds`). Over fp8 copies the group's
    columns are aligned (`k_grouped_token_column`) and its scales are rows of scale_a (blocks x M)
    and scale_b (blocks x N) from `k_grouped_scale_block` on."""
    ir = recipe.epilogue
    gemm = recipe.gemm
    m, width = a.shape
    bounds = group_bounds(offsets.tolist(), k_grouped_tokens(width, len(offsets), gemm.token_align))
    d = torch.empty((len(bounds), m, b.shape[-1]), dtype=torch.float32)
    kinds = {o.name: o.kind.value for o in ir.operands}
    for g, (start, end) in enumerate(bounds):
        at = k_grouped_token_column(g, start, gemm.token_align)
        scales = {}
        if gemm.block_scale is not None:
            scale_a, scale_b = operands["scale_a"], operands["scale_b"]
            assert isinstance(scale_a, torch.Tensor) and isinstance(scale_b, torch.Tensor)
            block = gemm.block_scale[2]
            first, blocks = k_grouped_scale_block(g, start, block), -(-(end - start) // block)
            scales = {"scale_a": scale_a[first:first + blocks].t(), "scale_b": scale_b[first:first + blocks]}
        acc = accumulate(gemm, a[:, at:at + end - start], b[at:at + end - start], scales)
        ops = {k: v[g] if isinstance(v, torch.Tensor) and kinds[k] in ("matrix", "scalar") else v
               for k, v in operands.items() if k in kinds}  # C and a tensor scalar: the group's
        d[g] = evaluate_epilogue(ir, acc, ops, round_outputs=False)[0]
    return (round_to(d, ir.outputs[0].dtype),)


def _grouped_reference(recipe: RecipeIR, a: torch.Tensor, b: torch.Tensor, operands: dict[str, torch.Tensor | float],
                       bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Each group's rows (`bounds`) through its own B and its own row vectors (and block scales: its
    rows' and its B's); rows in no group are not written by the kernel, and are NaN here."""
    ir = recipe.epilogue
    rows = a.shape[0]
    d = torch.full(ir.outputs[0].shape((rows, b.shape[-1])), math.nan, dtype=torch.float32)  # N/2 over pairs
    kinds = {o.name: o.kind.value for o in ir.operands}
    for g, (start, end) in enumerate(bounds):
        if start == end:
            continue
        scales = {}
        if recipe.gemm.scaled:  # the group's rows' scales and its B's
            scale_a, scale_b = operands["scale_a"], operands["scale_b"]
            assert isinstance(scale_a, torch.Tensor) and isinstance(scale_b, torch.Tensor)
            if recipe.gemm.microscaling is not None:  # the group's blocks (microscaling's grouped blocked order)
                first = (start // microscaling.BLOCK_ROWS + g) * microscaling.BLOCK_ROWS
                scale_a = scale_a[first:first + -(-(end - start) // microscaling.BLOCK_ROWS) * microscaling.BLOCK_ROWS]
            else:
                scale_a = scale_a[start:end]
            scales = {"scale_a": scale_a, "scale_b": scale_b[g]}
        acc = accumulate(recipe.gemm, a[start:end], b[g], scales)
        ops = {k: v if not isinstance(v, torch.Tensor) else v[g] if kinds[k] in ("row", "scalar") else v[start:end]
               for k, v in operands.items() if k in kinds}  # a tensor scalar: the group's value
        d[start:end] = evaluate_epilogue(ir, acc, ops, round_outputs=False)[0]
    return (round_to(d, ir.outputs[0].dtype),)

"""Checking a grouped (MoE) call's tensors: `checks.check_call`'s rules for rows of A split into
groups by offsets, one B per group (see docs/design/arguments.md, grouped GEMMs)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..errors import InvalidArgument, LayoutMismatch
from ..ir import GemmSpec, Operand, RecipeIR
from ..ir.microscaling import blocked_shape, grouped_blocked_rows
from ..ir.reference import k_grouped_scale_blocks, k_grouped_tokens, row_operands
from ..types import DType, Layout, OperandKind
from .checks import (
    INT32_MAX,
    TMA_ALIGN,
    Span,
    _aligned_ptr,
    _bytes,
    _dtype,
    _even_columns,
    _matrix,
    _need_tensor,
    _operand,
    unpacked,
)
from .problem import TensorArg


class GroupedCall(NamedTuple):
    """A grouped call's arguments, checked: A is rows x K, B is G x (K x N), offsets has G entries."""

    rows: int
    n: int
    k: int
    groups: int
    device: torch.device
    a: TensorArg  # (row stride, 1, 0)
    b: TensorArg  # (N, K, group) strides, as check_call's B
    offsets: int  # address of the int32 offsets
    operands: dict[str, TensorArg | float]  # row vectors: (0, 0, group stride); columns: contiguous; C: (ld, 1, 0)
    extents: tuple[int, ...]  # bytes each input spans (alias checks): a, b, offsets, tensor operands
    m: int = 0  # K-grouped (`check_k_grouped_call`): every group's M; rows and k are then the tokens
    masked: int = 0  # the masked layout (`check_masked_call`): each group's max_m rows, offsets their counts


def check_grouped_call(recipe: RecipeIR, a: object, b: object, offsets: object, operands: dict[str, object],
                       require_cuda: bool = True) -> GroupedCall:
    """`check_call` for a grouped recipe. The offsets stay on the GPU (reading them would
    synchronize): their values cannot be checked here, and need not be, as the kernel clamps them
    (reference.group_bounds)."""
    g = recipe.gemm
    if g.k_grouped:
        return check_k_grouped_call(recipe, a, b, offsets, operands, require_cuda)
    a, b = _need_tensor("a", a), _need_tensor("b", b)
    if a.dim() == 3:
        return check_masked_call(recipe, a, b, offsets, operands, require_cuda)
    _dtype("a", a, g.a)
    _dtype("b", b, g.b)
    if a.dim() != 2:
        raise InvalidArgument(f"a: expected a 2-D (rows, K) tensor holding every group's rows, got shape "
                              f"{tuple(a.shape)}")
    if b.dim() != 3:
        raise InvalidArgument(f"b: expected a 3-D (groups, K, N) tensor, one K x N matrix per group, got shape "
                              f"{tuple(b.shape)}")
    # packed fp4 holds two values of K per byte (torch.float4_e2m1fn_x2): A is rows x K/2, B G x K/2 x N
    packed, k_name = g.a.packed, "K" if g.a.packed == 1 else "K/2"
    rows, k = a.shape[0], a.shape[1] * packed
    groups, n = b.shape[0], b.shape[2]
    for extent, name in ((rows, "rows of a"), (n, "N"), (k, "K"), (groups, "groups")):
        if extent > INT32_MAX - 256:  # the kernel's per-group shapes and the setup's offsets are 32-bit
            raise InvalidArgument(f"{name} = {extent}: too large for the grouped kernel's 32-bit shapes; split "
                                  "the call")
    if b.shape[1] != a.shape[1]:
        raise InvalidArgument(f"b: expected (groups, {a.shape[1]}, N) ({k_name} of a, shape {tuple(a.shape)}), got "
                              f"{tuple(b.shape)}")
    _even_columns(recipe, n)
    offsets = _offsets(offsets, groups, "one per group of b: where its rows of a end")
    device = _device(a, require_cuda)
    _known_operands(recipe, operands)
    named: list[tuple[str, torch.Tensor]] = [("a", a), ("b", b), ("offsets", offsets)]
    checked: dict[str, TensorArg | float] = {}
    for o in recipe.operands:
        if o.name not in operands:
            raise InvalidArgument(f"{o.name}: missing operand; pass {o.name}=... ({_describe_grouped(o, g)})")
        value = operands[o.name]
        if o.kind.block_scale and g.microscaling is not None:
            checked[o.name] = _grouped_microscales(o, value, (rows, n, k, groups), g)
        elif o.kind.block_scale:
            checked[o.name] = _grouped_block_scale(o, value, (rows, n, k, groups), g)
        else:
            checked[o.name] = _grouped_operand(o, value, rows, n, groups)
        if isinstance(value, torch.Tensor):
            named.append((o.name, value))
    for name, t in named:
        if t.device != device:
            raise InvalidArgument(f"{name}: on {t.device} but a is on {device}; put all tensors on one device")
    ta = TensorArg(_aligned_ptr("a", a), _matrix("a", a, rows, a.shape[1], Layout.ROW, False, 1, ("rows", k_name)))
    bk, bn, bl = _matrix("b", b, b.shape[1], n, g.layout_b, True, groups, (k_name, "N"))
    tb = TensorArg(_aligned_ptr("b", b), (bn, bk, bl))
    extents = [_bytes(ta, a.element_size(), (rows, a.shape[1], 1)),
               _bytes(tb, b.element_size(), (n, b.shape[1], groups)), 4 * groups]
    if packed > 1:  # CUTLASS's strides count elements, two per byte (K contiguous: its stride stays 1)
        ta, tb = (unpacked(t, packed) for t in (ta, tb))
    for o in recipe.operands:
        v = checked[o.name]
        if o.kind.block_scale and g.microscaling is not None:
            extents.append(math.prod(grouped_microscaling_shape(o, g, rows, n, k, groups)))
        elif o.kind.block_scale:
            extents.append(_bytes(v, 4, grouped_scale_extents(o, g, rows, n, k, groups)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.MATRIX:
            extents.append(_bytes(v, o.dtype.nbytes, (rows, o.columns.extent(n), 1)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.ROW:
            extents.append(_bytes(v, o.dtype.nbytes, (1, n, groups)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.COL:
            extents.append(rows * o.dtype.nbytes)
        elif isinstance(v, TensorArg):  # a tensor scalar per group
            extents.append(_bytes(v, 4, (1, 1, groups)))
    return GroupedCall(rows, n, k, groups, device, ta, tb, offsets.data_ptr(), checked, tuple(extents))


def check_masked_call(recipe: RecipeIR, a: torch.Tensor, b: torch.Tensor, masked_m: object,
                      operands: dict[str, object], require_cuda: bool = True) -> GroupedCall:
    """`check_grouped_call` for the masked layout (DeepGEMM's, for CUDA-graph decode): a is (groups,
    max_m, K), group g's first masked_m[g] rows its tokens (int32 on the GPU, clamped to [0, max_m]
    by the kernel: `reference.masked_group_bounds`); every per-row operand has the same leading
    (groups, max_m). The call is checked as the rows-grouped one over a's groups * max_m rows."""
    g = recipe.gemm
    if g.microscaling is not None:
        raise InvalidArgument("a: the masked layout (a 3-D a) is not supported for microscaled kernels, whose "
                              "scales follow the offsets' grouped blocked order; pass a as (rows, K) with offsets")
    if b.dim() != 3 or b.shape[0] != a.shape[0]:
        raise InvalidArgument(f"a/b: the masked layout takes a (groups, max_m, K) and b (groups, K, N), got a "
                              f"{tuple(a.shape)} and b {tuple(b.shape)}")
    groups, max_m = a.shape[:2]
    masked_m = _offsets(masked_m, groups, "how many of each group's max_m rows of a are tokens: masked_m",
                        "masked_m")
    flat_a = _rows_of(a, "a", groups, max_m, "(groups, max_m, K)")
    flat: dict[str, object] = dict(operands)
    per_row = row_operands(recipe)
    for o in recipe.operands:
        if o.name in per_row and o.name in operands:
            what = "(groups, max_m)" if o.kind is OperandKind.COL else \
                f"(groups, max_m, {'K blocks' if o.kind.block_scale else 'N'})"
            flat[o.name] = _rows_of(_need_tensor(o.name, operands[o.name]), o.name, groups, max_m, what)
    call = check_grouped_call(recipe, flat_a, b, masked_m, flat, require_cuda)
    return call._replace(masked=max_m)


def _rows_of(t: torch.Tensor, name: str, groups: int, max_m: int, what: str) -> torch.Tensor:
    """A masked-layout tensor with its (groups, max_m) as one dimension of rows: a view (the kernel
    addresses the caller's memory), so the two must be one stride apart."""
    if t.dim() < 2 or tuple(t.shape[:2]) != (groups, max_m) or t.dim() != len(what.split(",")):
        raise InvalidArgument(f"{name}: the masked layout takes {what} = ({groups}, {max_m}, ...) (a's groups and "
                              f"max_m), got shape {tuple(t.shape)}")
    try:
        return t.view(groups * max_m, *t.shape[2:])
    except RuntimeError:
        raise LayoutMismatch(name, f"{name}: its groups and max_m rows must be one stride apart (strides "
                             f"{tuple(t.stride())}); pass {name}.contiguous()") from None


def _offsets(offsets: object, groups: int | None, what: str, name: str = "offsets") -> torch.Tensor:
    """The int32 group ends (`groups` of them where the other arguments say how many), or the
    masked layout's counts (`name`); a layout refusal names the call's argument, `offsets`."""
    t = _need_tensor(name, offsets)
    if t.dtype != torch.int32 or t.dim() != 1 or (groups is not None and t.shape[0] != groups):
        entries = f"{groups} entries" if groups is not None else "one entry per group"
        raise InvalidArgument(f"{name}: expected an int32 tensor of {entries} ({what}), got {t.dtype} of shape "
                              f"{tuple(t.shape)}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise LayoutMismatch("offsets", f"{name}: expected a contiguous tensor; use {name}.contiguous()")
    return t


def _device(a: torch.Tensor, require_cuda: bool) -> torch.device:
    if require_cuda and a.device.type != "cuda":
        raise InvalidArgument(f"a: expected a CUDA tensor, got one on {a.device}; move it with a.cuda()")
    return a.device


def _known_operands(recipe: RecipeIR, operands: dict[str, object]) -> None:
    names = {o.name for o in recipe.operands}
    unknown = sorted(set(operands) - names)
    if unknown:
        raise InvalidArgument(f"{unknown[0]}: not an operand of this recipe; it takes {sorted(names) or 'none'}")


def check_k_grouped_call(recipe: RecipeIR, a: object, b: object, offsets: object, operands: dict[str, object],
                         require_cuda: bool = True) -> GroupedCall:
    """`check_grouped_call` for a K-grouped recipe (`Grouping.K`, a weight gradient): a is M x T
    (column-major: the `.t()` of the tokens-major output gradient), b is T x N (row-major: the
    layer's input), offsets (int32, G) say where each group's tokens end, a matrix operand (C) is
    G x M x N. fp8: a is M x T' and b T' x N, both tokens-contiguous copies with each group's
    tokens aligned (`GemmSpec.token_align`, gg.quantize_k_grouped), and the scales (blocks, M) and
    (blocks, N). The GroupedCall's rows and k are the tokens the offsets are clamped to, its m is M."""
    g = recipe.gemm
    a, b = _need_tensor("a", a), _need_tensor("b", b)
    _dtype("a", a, g.a)
    _dtype("b", b, g.b)
    copies = "copies of dY and X from gg.quantize_k_grouped, passed as a and b.t()" if g.token_align else \
        "a is grad_out.t() and b the input, both tokens-major"
    if a.dim() != 2 or b.dim() != 2 or b.shape[0] != a.shape[1]:
        raise InvalidArgument(f"a/b: a K-grouped GEMM takes a (M, tokens) and b (tokens, N), the tokens of every "
                              f"group one after another ({copies}), got a {tuple(a.shape)} and b {tuple(b.shape)}")
    (m, width), n = a.shape, b.shape[1]
    for extent, name in ((m, "M"), (n, "N"), (width, "tokens")):
        if extent > INT32_MAX - 256:  # the kernel's per-group shapes and the setup's offsets are 32-bit
            raise InvalidArgument(f"{name} = {extent}: too large for the grouped kernel's 32-bit shapes; split "
                                  "the call")
    offsets = _offsets(offsets, None, "where each group's tokens end")
    groups = offsets.shape[0]
    align = g.token_align
    tokens = k_grouped_tokens(width, groups, align)
    if align and (width % align or tokens < 0):
        raise InvalidArgument(f"a/b: {width} columns of tokens for {groups} groups; a K-grouped fp8 GEMM's copies are "
                              f"{align} * (groups + ceil(tokens / {align})) columns wide, each group's tokens aligned "
                              f"({copies})")
    device = _device(a, require_cuda)
    _known_operands(recipe, operands)
    named: list[tuple[str, torch.Tensor]] = [("a", a), ("b", b), ("offsets", offsets)]
    checked: dict[str, TensorArg | float] = {}
    extents = []
    for o in recipe.operands:
        if o.name not in operands:
            what = _describe_grouped(o, g) if o.kind is OperandKind.SCALAR else \
                f"a (groups, M, N) = ({groups}, {m}, {n}) {o.dtype.value} tensor"
            if o.kind.block_scale:
                what = f"fp32 ({k_grouped_scale_blocks(tokens, groups)}, {m if o.kind is OperandKind.SCALE_A else n})"
            raise InvalidArgument(f"{o.name}: missing operand; pass {o.name}=... ({what})")
        value = operands[o.name]
        if o.kind is OperandKind.SCALAR:
            checked[o.name] = _group_scalar(o, value, groups) if o.per_batch else _operand(o, value, m, n, 1, False)
            if isinstance(value, torch.Tensor):
                named.append((o.name, value))
                extents.append(_bytes(checked[o.name], 4, (1, 1, groups)))  # type: ignore[arg-type]
            continue
        t = _need_tensor(o.name, value)
        named.append((o.name, t))
        if o.kind.block_scale:  # (blocks, M or N), contiguous: each group's blocks a compact M/N-major layout
            columns = m if o.kind is OperandKind.SCALE_A else n
            shape = (k_grouped_scale_blocks(tokens, groups), columns)
            if t.dtype != torch.float32 or tuple(t.shape) != shape:
                raise InvalidArgument(f"{o.name}: expected fp32 scales of shape {shape} (groups + {tokens} // 128 "
                                      f"blocks of 128 tokens, {tokens} the most a and b hold, each group's from "
                                      f"block g + first // 128: gg.quantize_k_grouped), got {t.dtype} "
                                      f"{tuple(t.shape)}")
            if not t.is_contiguous():
                raise LayoutMismatch(o.name, f"{o.name}: expected contiguous scales (each group's blocks a compact "
                                     f"M/N-major layout), got strides {tuple(t.stride())}; call {o.name}.contiguous()")
            arg = TensorArg(_aligned_ptr(o.name, t), (columns, 1, 0))
            checked[o.name] = arg
            extents.append(4 * math.prod(shape))
            continue
        _dtype(o.name, t, o.dtype)
        if tuple(t.shape) != (groups, m, n):
            raise InvalidArgument(f"{o.name}: expected a (groups, M, N) = ({groups}, {m}, {n}) tensor, one M x N "
                                  f"matrix per group, got shape {tuple(t.shape)}")
        arg = TensorArg(_aligned_ptr(o.name, t), _matrix(o.name, t, m, n, Layout.ROW, True, groups, ("M", "N")))
        checked[o.name] = arg
        extents.append(_bytes(arg, o.dtype.nbytes, (m, n, groups)))
    for name, t in named:
        if t.device != device:
            raise InvalidArgument(f"{name}: on {t.device} but a is on {device}; put all tensors on one device")
    ta = TensorArg(_aligned_ptr("a", a), _matrix("a", a, m, width, g.layout_a, False, 1, ("M", "tokens")))
    tb = TensorArg(_aligned_ptr("b", b), _matrix("b", b, width, n, g.layout_b, False, 1, ("tokens", "N")))
    extents = [_bytes(ta, a.element_size(), (m, width, 1)), _bytes(tb, b.element_size(), (width, n, 1)),
               4 * groups, *extents]
    return GroupedCall(tokens, n, tokens, groups, device, ta, tb, offsets.data_ptr(), checked, tuple(extents), m)


def grouped_input_spans(call: GroupedCall) -> tuple[Span, ...]:
    """`input_spans` of a grouped call (the offsets included)."""
    ptrs = (("a", call.a.ptr), ("b", call.b.ptr), ("offsets", call.offsets),
            *((k, v.ptr) for k, v in call.operands.items() if isinstance(v, TensorArg)))
    return tuple((name, p, p + e) for (name, p), e in zip(ptrs, call.extents, strict=True) if e)


def grouped_microscaling_shape(o: Operand, gemm: GemmSpec, rows: int, n: int, k: int, groups: int
                               ) -> tuple[int, ...]:
    """A grouped microscaled GEMM's scales: scale_a every group's rows in the grouped blocked order
    (`ir.microscaling`), scale_b (groups, padded N, padded scale columns) in the blocked order."""
    assert gemm.microscaling is not None
    if o.kind is OperandKind.SCALE_A:
        return grouped_blocked_rows(rows, groups), blocked_shape(rows, k, gemm.microscaling)[1]
    return (groups, *blocked_shape(n, k, gemm.microscaling))


def _grouped_microscales(o: Operand, value: object, problem: tuple[int, int, int, int], gemm: GemmSpec
                         ) -> TensorArg:
    """A grouped microscaled GEMM's scales, contiguous (the TMA reads each group's blocks at its own
    address, which the setup kernel computes): TensorArg strides (bytes per block of 128 rows, 0,
    bytes per group)."""
    rows, n, k, groups = problem
    t = _need_tensor(o.name, value)
    _dtype(o.name, t, o.dtype)
    want = grouped_microscaling_shape(o, gemm, rows, n, k, groups)
    if tuple(t.shape) != want:
        raise InvalidArgument(f"{o.name}: expected shape {want} ({_describe_grouped(o, gemm)}), got "
                              f"{tuple(t.shape)}")
    if math.prod(want[-2:]) > INT32_MAX:
        raise InvalidArgument(f"{o.name}: {math.prod(want[-2:])} scales lie past the 2^31 - 1 bytes the kernel's "
                              "scale layout indexes in 32 bits; split the call")
    if t.numel() == 0:
        return TensorArg(0, (0, 0, 0))
    if not t.is_contiguous():
        raise LayoutMismatch(o.name, f"{o.name}: the blocked order is a contiguous tensor, got strides "
                             f"{tuple(t.stride())}; pass {o.name}.contiguous() if it holds the blocked order")
    block = 128 * want[-1]  # the bytes of one block of 128 rows
    return TensorArg(_aligned_ptr(o.name, t), (block, 0, math.prod(want[-2:]) if len(want) == 3 else 0))


def _describe_grouped(o: Operand, gemm: GemmSpec) -> str:
    if o.kind.block_scale and gemm.microscaling is not None:
        v, what = gemm.microscaling.vector, gemm.microscaling.scale_dtype.torch
        if o.kind is OperandKind.SCALE_A:
            return (f"{what} ((ceil(rows/128) + groups) * 128, round_up(ceil(K/{v}), 4)), contiguous: one scale per "
                    f"{v} values of K of each row of a, each group's rows from a block of their own "
                    "(gg.quantize_mx(x, fmt, offsets=offsets) or gg.to_blocked_scales(scales, offsets=offsets))")
        return (f"{what} (groups, round_up(N, 128), round_up(ceil(K/{v}), 4)), contiguous: one scale per {v} values "
                "of K of each column of each group's B, in the MMA's blocked order (gg.to_blocked_scales)")
    if o.kind.block_scale:
        assert gemm.block_scale is not None
        _, gn, gk = gemm.block_scale
        if o.kind is OperandKind.SCALE_A:
            return f"fp32 (rows, ceil(K/{gk})), K contiguous: one scale per row of a and {gk} values of K"
        return (f"fp32 (groups, ceil(K/{gk}), ceil(N/{gn})), K contiguous: one scale per {gk} x {gn} block of each "
                "group's B")
    if o.kind is OperandKind.SCALAR and o.per_batch:
        return GROUP_SCALAR.format(groups="groups")
    return {OperandKind.SCALAR: "a Python number", OperandKind.ROW: f"a (groups, N) {o.dtype.value} tensor",
            OperandKind.COL: f"a {o.dtype.value} vector with one entry per row of a",
            OperandKind.MATRIX: f"a (rows, {o.columns.symbol}) {o.dtype.value} matrix"}[o.kind]


def grouped_scale_extents(o: Operand, gemm: GemmSpec, rows: int, n: int, k: int, groups: int
                          ) -> tuple[int, int, int]:
    """(rows or N blocks, K blocks, groups) of a grouped block scale: the modes of its TensorArg."""
    assert gemm.block_scale is not None
    _, gn, gk = gemm.block_scale
    if o.kind is OperandKind.SCALE_A:
        return rows, -(-k // gk), 1
    return -(-n // gn), -(-k // gk), groups


def _grouped_block_scale(o: Operand, value: object, problem: tuple[int, int, int, int], gemm: GemmSpec
                         ) -> TensorArg:
    """A grouped block scale, as CUTLASS's grouped blockwise main loop reads it: group g's scales are
    a compact K-major block at its own address (`scale_a` from the group's first row, `scale_b` at
    the group's index), laid out from the group's shape alone. So K blocks are contiguous and the
    rows (N blocks) exactly ceil(K/128) apart; only scale_b's group stride is free. The loads are
    4-byte cp.async: no 16-byte alignment. TensorArg strides: (rows or N blocks, K blocks, group)."""
    rows, n, k, groups = problem
    t = _need_tensor(o.name, value)
    _dtype(o.name, t, DType.F32)
    blocks, k_blocks, _ = grouped_scale_extents(o, gemm, rows, n, k, groups)
    is_a = o.kind is OperandKind.SCALE_A
    want = (blocks, k_blocks) if is_a else (groups, k_blocks, blocks)
    if tuple(t.shape) != want:
        raise InvalidArgument(f"{o.name}: expected shape {want} ({_describe_grouped(o, gemm)}), got "
                              f"{tuple(t.shape)}")
    if t.numel() == 0:
        return TensorArg(0, (k_blocks, 1, 0))
    if blocks * k_blocks - 1 > INT32_MAX:  # one group could span them all
        raise InvalidArgument(f"{o.name}: {blocks} x {k_blocks} scales, and the kernel indexes a group's block "
                              "scales in 32 bits; split the call")
    k_dim, mn_dim = t.dim() - (1 if is_a else 2), t.dim() - (2 if is_a else 1)
    if (k_blocks > 1 and t.stride(k_dim) != 1) or (blocks > 1 and t.stride(mn_dim) != k_blocks):
        fix = f"{o.name}.contiguous()" if is_a else f"{o.name}.mT.contiguous().mT"
        raise LayoutMismatch(o.name, f"{o.name}: a grouped kernel reads each group's block scales as a compact "
                             f"K-major block (strides {k_blocks} and 1 for its {'rows' if is_a else 'N blocks'} and "
                             f"K blocks), got strides {tuple(t.stride())}; pass {fix}")
    group_stride = t.stride(0) if not is_a and groups > 1 else 0
    return TensorArg(_natural_ptr(o.name, t), (k_blocks, 1, group_stride))


#: What a grouped recipe's tensor scalar is.
GROUP_SCALAR = "an fp32 ({groups},) tensor, one value per group (s.expand(groups) shares one)"


def _group_scalar(o: Operand, value: object, groups: int) -> TensorArg:
    """A tensor scalar of a grouped recipe: fp32 (groups,), one value per group, read at the group's
    index, one fp32 at a time (any stride, 0 sharing one value; 4-byte aligned): TensorArg strides
    (0, 0, group stride)."""
    t = _need_tensor(o.name, value)
    if t.dtype != torch.float32 or tuple(t.shape) != (groups,):
        raise InvalidArgument(f"{o.name}: expected {GROUP_SCALAR.format(groups=groups)}, got {t.dtype} "
                              f"{tuple(t.shape)}")
    return TensorArg(_natural_ptr(o.name, t) if t.numel() else 0, (0, 0, t.stride(0) if groups > 1 else 0))


def _natural_ptr(name: str, t: torch.Tensor) -> int:
    """The address of a tensor read element by element: aligned to its elements."""
    ptr = t.data_ptr()
    if ptr % t.element_size():
        raise LayoutMismatch(name, f"{name}: data pointer {ptr:#x} is not aligned to its {t.element_size()}-byte "
                             f"elements; use {name}.clone()")
    return ptr


def _grouped_operand(o: Operand, value: object, rows: int, n: int, groups: int) -> TensorArg | float:
    """A grouped recipe's operand: row vectors are per group (groups, N), each group's row 16-byte
    aligned (the kernel reads it in 16-byte vectors), and tensor scalars per group (groups,), any
    stride (0: one value for every group); the rest are per row of A, as check_call's (a matrix
    of column pairs' halves N/2 wide: `ir.columns`)."""
    if o.kind is OperandKind.SCALAR and o.per_batch:
        return _group_scalar(o, value, groups)
    if o.kind is not OperandKind.ROW:
        return _operand(o, value, rows, o.columns.extent(n), 1, False)
    t = _need_tensor(o.name, value)
    _dtype(o.name, t, o.dtype)
    if t.dim() != 2 or tuple(t.shape) != (groups, n):
        raise InvalidArgument(f"{o.name}: expected a (groups, N) = ({groups}, {n}) tensor, one row per group, got "
                              f"shape {tuple(t.shape)}")
    if n > 1 and t.stride(1) != 1:
        raise LayoutMismatch(o.name, f"{o.name}: expected contiguous rows, got strides {tuple(t.stride())}; use "
                             f"{o.name}.contiguous()")
    step = t.stride(0) if groups > 1 else 0
    if (step * t.element_size()) % TMA_ALIGN:
        raise LayoutMismatch(o.name, f"{o.name}: row stride {step} must be a multiple of "
                             f"{TMA_ALIGN // t.element_size()} elements (16 bytes: each group's row is read in "
                             f"16-byte vectors); pad N or copy it into a padded buffer")
    return TensorArg(_aligned_ptr(o.name, t), (0, 0, step))

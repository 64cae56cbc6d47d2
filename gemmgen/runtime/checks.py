"""Checking a call's tensors against the compiled recipe, before anything is launched.

Every failure is a gemmgen.InvalidArgument that names the argument, says what was expected, and
how to fix it. The result is the problem in CUTLASS's terms (problem.py), ready for argument
building. TMA needs 16-byte aligned base addresses and 16-byte multiples for every stride but the
contiguous one; extents are free (out-of-bounds reads are zero-filled and stores are clipped).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..codegen.sm90.geometry import SCALE_TMA_THRESHOLD
from ..errors import InvalidArgument, LayoutMismatch
from ..ir import Columns, GemmSpec, Op, Operand, RecipeIR, f32
from ..ir.microscaling import blocked_shape
from ..types import DType, Layout, OperandKind
from .problem import TensorArg

TMA_ALIGN = 16


class CheckedCall(NamedTuple):
    """A call's arguments, checked, in CUTLASS's terms (a tuple: rebuilt for every new address set)."""

    m: int
    n: int
    k: int
    l: int  # noqa: E741
    device: torch.device
    a: TensorArg
    b: TensorArg
    operands: dict[str, TensorArg | float]
    extents: tuple[int, ...]  # bytes each input spans from its address: a, b, tensor operands (alias checks)


def _need_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise InvalidArgument(f"{name}: expected a dense (strided) tensor, got layout {t.layout}; "
                              f"call {name}.to_dense()")
    return t


def _dtype(name: str, t: torch.Tensor, want: DType) -> None:
    if t.dtype != want.torch and want.packed > 1:  # no torch op converts to packed fp4
        raise InvalidArgument(f"{name}: expected dtype {want.torch} (packed fp4 pairs, K/2 bytes per row: the "
                              f"recipe declares {want.value}), got {t.dtype}; quantize it with "
                              f"gg.quantize_mx(x, gg.NVFP4), or view packed uint8 codes as "
                              f"{name}.view({want.torch})")
    if t.dtype != want.torch:
        raise InvalidArgument(f"{name}: expected dtype {want.torch} (the recipe declares {want.value}), got {t.dtype}; "
                              f"convert it with {name}.to({want.torch})")


def _aligned_ptr(name: str, t: torch.Tensor) -> int:
    ptr = t.data_ptr()
    if t.numel() and ptr % TMA_ALIGN:
        raise LayoutMismatch(name, f"{name}: data pointer {ptr:#x} is not 16-byte aligned (TMA needs it); this "
                             f"usually comes from slicing at an odd offset, use {name}.clone()")
    return ptr


def _stride(name: str, t: torch.Tensor, dim: int, extent_min: int, itemsize: int, what: str, extent: str,
            fix: str) -> int:
    """A non-contiguous stride (in elements): at least the contiguous extent (`extent`, by name) and
    16-byte aligned; `fix` is the copy that makes it so."""
    size, stride = t.shape[dim], t.stride(dim)
    align = TMA_ALIGN // itemsize
    if size == 1:  # any stride is legal for a size-1 dim; pick one TMA accepts
        return max(1, -(-extent_min * itemsize // TMA_ALIGN)) * TMA_ALIGN // itemsize
    if stride < extent_min:
        raise LayoutMismatch(name, f"{name}: {what} stride {stride} is less than {extent} = {extent_min}, so its "
                             f"{what}s overlap (an expanded or strided view); pass a copy: {fix}")
    if (stride * itemsize) % TMA_ALIGN:
        cause = (f"with {extent} = {extent_min}, a contiguous {name}'s {what}s are {stride * itemsize} bytes"
                 if stride == extent_min else f"its {what}s are {stride * itemsize} bytes apart")
        or_extent = f"; or make {extent} a multiple of {align}" if (extent_min * itemsize) % TMA_ALIGN else ""
        raise LayoutMismatch(name, f"{name}: {what} stride {stride} must be a multiple of {align} elements (16 bytes: "
                             f"TMA reads {what}s at 16-byte aligned addresses), but {cause}. Pass a copy in padded "
                             f"storage: {fix}{or_extent}")
    return stride


def _padded_copy(name: str, t: torch.Tensor, layout: Layout, itemsize: int) -> str:
    """Python that copies `t` into storage whose leading dimension is 16-byte aligned (what
    `copy_in_layout` does for torch ops), as a message's fix."""
    *lead, rows, cols = t.shape
    align = TMA_ALIGN // itemsize
    if layout is Layout.ROW:
        padded = -(-cols // align) * align
        shape = ", ".join(map(str, (*lead, rows, padded)))
        return f"p = {name}.new_empty({shape}); p[..., :{cols}] = {name}; {name} = p[..., :{cols}]"
    padded = -(-rows // align) * align
    shape = ", ".join(map(str, (*lead, cols, padded)))
    return f"p = {name}.new_empty({shape}).mT; p[..., :{rows}, :] = {name}; {name} = p[..., :{rows}, :]"


def _new_output(name: str, t: torch.Tensor, layout: Layout, padded: bool = False) -> str:
    """Python for a fresh tensor shaped like `t` in `layout`, its leading dimension padded to 16
    bytes (a view of the first rows or columns) with `padded`."""
    *lead, rows, cols = t.shape
    align = TMA_ALIGN // t.element_size()
    up = (lambda x: -(-x // align) * align) if padded else (lambda x: x)
    where = f"dtype={t.dtype}, device={str(t.device)!r}"
    if layout is Layout.ROW:
        view = f"[..., :{cols}]" if up(cols) != cols else ""
        return f"{name} = torch.empty({', '.join(map(str, (*lead, rows, up(cols))))}, {where}){view}"
    view = f"[..., :{rows}, :]" if up(rows) != rows else ""
    return f"{name} = torch.empty({', '.join(map(str, (*lead, cols, up(rows))))}, {where}).mT{view}"


def _matrix(name: str, t: torch.Tensor, rows: int, cols: int, layout: Layout, batched: bool, l: int,  # noqa: E741
            dims: tuple[str, str], output: bool = False) -> tuple[int, int, int]:
    """(row stride, col stride, batch stride) of a (L,) rows x cols tensor in the declared layout;
    `dims` names rows and cols ("M", "K"), `output` says it is written (no copy can stand in for it)."""
    if t.numel() == 0:  # nothing is read or written: no stride to check
        return 0, 0, 0
    item = t.element_size()
    r, c = t.dim() - 2, t.dim() - 1
    contiguous = c if layout is Layout.ROW else r
    if output and t.shape[contiguous] > 1 and t.stride(contiguous) != 1:
        order = "row-major (last dim contiguous)" if layout is Layout.ROW else "column-major (dim -2 contiguous)"
        raise LayoutMismatch(name, f"{name}: gemmgen writes this recipe's outputs {order}, got strides "
                             f"{tuple(t.stride())}; a copy would not land in your tensor, so pass one in that "
                             f"order ({_new_output(name, t, layout, padded=True)}) or omit {name}= to get a new one")
    if output:
        fix = f"{_new_output(name, t, layout, padded=True)}, or omit {name}= to get a new one"
    else:
        fix = _padded_copy(name, t, layout, item)
    if layout is Layout.ROW:
        if t.shape[c] > 1 and t.stride(c) != 1:
            raise LayoutMismatch(name, f"{name}: expected a row-major tensor (last dim contiguous), got strides "
                                 f"{tuple(t.stride())}; call {name}.contiguous() or declare it ColMajor")
        rs, cs = _stride(name, t, r, cols, item, "row", dims[1], fix), 1
    else:
        if t.shape[r] > 1 and t.stride(r) != 1:
            raise LayoutMismatch(name, f"{name}: expected a column-major tensor (dim -2 contiguous), got strides "
                                 f"{tuple(t.stride())}; pass {name}.mT.contiguous().mT or declare it RowMajor")
        rs, cs = 1, _stride(name, t, c, rows, item, "column", dims[0], fix)
    bs = 0
    if batched and l > 1:
        bs = t.stride(0)
        if bs == 0 or (bs * item) % TMA_ALIGN:
            raise LayoutMismatch(name, f"{name}: batch stride {bs} must be a non-zero multiple of {TMA_ALIGN // item} "
                                 f"elements (16 bytes); materialize the batch with {name}.contiguous()")
    return rs, cs, bs


def tma_readable(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A copy of `t` that the checks above accept: a fresh (hence aligned) buffer, matrices in
    `layout` with the leading dimension rounded up to 16 bytes, a batch materialised, vectors
    contiguous. What torch ops do for a tensor a kernel refuses only for its layout."""
    if t.dim() < 2:
        return t.clone(memory_format=torch.contiguous_format)
    return copy_in_layout(t, layout, TMA_ALIGN // t.element_size())


def copy_in_layout(t: torch.Tensor, layout: Layout, pad_to: int) -> torch.Tensor:
    """A fresh copy of `t` (..., rows, cols), its last two dimensions in `layout`, the contiguous
    dimension's extent rounded up to a multiple of `pad_to` elements in memory (1: no padding)."""
    rows, cols = t.shape[-2], t.shape[-1]
    if layout is Layout.ROW:
        buf = t.new_empty(*t.shape[:-1], -(-cols // pad_to) * pad_to)[..., :cols]
    else:
        buf = t.new_empty(*t.shape[:-2], cols, -(-rows // pad_to) * pad_to)[..., :rows].transpose(-1, -2)
    return buf.copy_(t)


def _shape(name: str, t: torch.Tensor, batched: bool) -> tuple[int, ...]:
    want = 3 if batched else 2
    if t.dim() != want:
        kind = "batched (L, rows, cols)" if batched else "(rows, cols)"
        raise InvalidArgument(f"{name}: expected a {want}-D {kind} tensor, got shape {tuple(t.shape)}")
    return tuple(t.shape)


SizeCheck = Callable[[int, int, int, int], None]  # (M, N, K, L): raises for a problem a kernel cannot take


def _even_columns(recipe: RecipeIR, n: int) -> None:
    """B's N columns, in pairs where the epilogue works on adjacent column pairs."""
    if recipe.epilogue.pairs and n % 2:
        raise InvalidArgument(f"b: {n} columns; this recipe's epilogue works on adjacent column pairs (gg.pairs), "
                              f"so B needs an even number of columns (each pair's two interleaved): pass B with "
                              f"{n + 1} or {n - 1} columns")


def check_call(recipe: RecipeIR, a: object, b: object, operands: dict[str, object],
               require_cuda: bool = True, size_check: SizeCheck | None = None) -> CheckedCall:
    g = recipe.gemm
    a = _need_tensor("a", a)
    b = _need_tensor("b", b)
    _dtype("a", a, g.a)
    _dtype("b", b, g.b)
    sa, sb = _shape("a", a, g.batched), _shape("b", b, g.batched)
    l = sa[0] if g.batched else 1  # noqa: E741
    # packed fp4 holds two values of K per byte (torch.float4_e2m1fn_x2): A is M x K/2, B K/2 x N
    packed, k_name = g.a.packed, "K" if g.a.packed == 1 else "K/2"
    m, k = sa[-2], sa[-1] * packed
    if g.batched and sb[0] != l:
        raise InvalidArgument(f"b: batch size {sb[0]} does not match a's {l}")
    if sb[-2] != sa[-1]:
        raise InvalidArgument(f"b: expected {sa[-1]} rows ({k_name} of a, shape {tuple(sa)}), got shape {tuple(sb)}")
    n = sb[-1]
    _even_columns(recipe, n)
    if size_check is not None:
        size_check(m, n, k, l)
    _index_extents(recipe, m, n)
    device = a.device
    if require_cuda and device.type != "cuda":
        raise InvalidArgument(f"a: expected a CUDA tensor, got one on {device}; move it with a.cuda()")
    named: list[tuple[str, torch.Tensor]] = [("a", a), ("b", b)]
    names = {o.name for o in recipe.operands}
    unknown = sorted(set(operands) - names)
    if unknown:
        raise InvalidArgument(f"{unknown[0]}: not an operand of this recipe; it takes {sorted(names) or 'none'}")
    checked: dict[str, TensorArg | float] = {}
    for o in recipe.operands:
        if o.name not in operands:
            raise InvalidArgument(f"{o.name}: missing operand; pass {o.name}=... ({_describe(o, g)})")
        value = operands[o.name]
        if o.kind.block_scale and g.microscaling is not None:
            checked[o.name] = _microscales(o, value, (m, n, k, l), g)
        elif o.kind.block_scale:
            checked[o.name] = _block_scale(o, value, (m, n, k, l), g)
        else:
            checked[o.name] = _operand(o, value, m, o.columns.extent(n), l, g.batched, g.layout_d)
        if isinstance(value, torch.Tensor):
            named.append((o.name, value))
    for name, t in named:
        if t.device != device:
            raise InvalidArgument(f"{name}: on {t.device} but a is on {device}; put all tensors on one device")
    a_ptr, b_ptr = _aligned_ptr("a", a), _aligned_ptr("b", b)
    am, ak, al = _matrix("a", a, m, sa[-1], g.layout_a, g.batched, l, ("M", k_name))
    # B is K x N in torch terms and (N, K, L) in CUTLASS's: swap the per-mode strides.
    bk, bn, bl = _matrix("b", b, sb[-2], n, g.layout_b, g.batched, l, (k_name, "N"))
    ta, tb = TensorArg(a_ptr, (am, ak, al)), TensorArg(b_ptr, (bn, bk, bl))
    extents = [_bytes(ta, a.element_size(), (m, sa[-1], l)), _bytes(tb, b.element_size(), (n, sb[-2], l))]
    if packed > 1:  # CUTLASS's strides count elements, two per byte (K contiguous: its stride stays 1)
        ta, tb = (unpacked(t, packed) for t in (ta, tb))
    for o in recipe.operands:
        v = checked[o.name]
        if o.kind.block_scale and g.microscaling is not None:
            extents.append(l * math.prod(microscaling_shape(o, g, m, n, k)))
        elif o.kind.block_scale:
            extents.append(_bytes(v, 4, block_scale_extents(o, g, m, n, k, l)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.MATRIX:
            extents.append(_bytes(v, o.dtype.nbytes, (m, o.columns.extent(n), l)))  # type: ignore[arg-type]
        elif o.per_batch:  # (L,), (L, N) or (L, M), contiguous in a batch
            length = 1 if o.kind is OperandKind.SCALAR else n if o.kind is OperandKind.ROW else m
            extents.append(o.dtype.nbytes * (length + (l - 1) * v.strides[2]) if length and l else 0)  # type: ignore[union-attr]
        elif o.kind is OperandKind.SEED:
            if isinstance(v, TensorArg):
                extents.append(8)
        elif o.kind is not OperandKind.SCALAR:
            extents.append((n if o.kind is OperandKind.ROW else m) * o.dtype.nbytes)
    return CheckedCall(m, n, k, l, device, ta, tb, checked, tuple(extents))


def unpacked(t: TensorArg, packed: int) -> TensorArg:
    """A packed operand's strides in elements (`packed` per byte) from its strides in bytes: the
    contiguous dim's stays 1."""
    return TensorArg(t.ptr, tuple(x if x == 1 else x * packed for x in t.strides))  # type: ignore[arg-type]


INT32_MAX = 2**31 - 1
#: Past 2^24, fp32 does not hold every integer: gg.row_index() and gg.column_index() would give two
#: rows or columns one index (coordinates.hpp).
EXACT_INDEX_LIMIT = 2**24


def _index_extents(recipe: RecipeIR, m: int, n: int) -> None:
    """The rows and columns an epilogue numbers (gg.row_index(), gg.column_index(), gg.gather) must
    each have an exact fp32 index."""
    ops = {node.op for node in recipe.epilogue.nodes}
    for op, extent, name, operand in ((Op.ROW_INDEX, m, "M", "a"), (Op.COLUMN_INDEX, n, "N", "b")):
        if op in ops and extent > EXACT_INDEX_LIMIT:
            raise InvalidArgument(f"{operand}: {name} = {extent}; this recipe's epilogue numbers its {name} "
                                  f"(gg.{op.key}() or gg.gather), whose fp32 index is exact up to 2^24 = "
                                  f"{EXACT_INDEX_LIMIT}: split the problem along {name}")


def problem_size_check(tile: tuple[int, int, int], cluster: tuple[int, int, int], swapped: bool) -> SizeCheck:
    """CUTLASS's host and device code count rows, columns, K and output tiles in 32-bit ints: a
    problem past that would get wrapped-around scheduler values (checked against CUTLASS's host
    code by tests/runtime/test_oracle.py), so it is refused. `tile` and `cluster` are the kernel's; a
    swapped kernel's M is the caller's N. `check_call` runs it before any layout check, so a torch
    op refuses a problem that is too large before it would copy an input to realign it."""
    def check(m_caller: int, n_caller: int, k: int, l: int) -> None:  # noqa: E741
        if 0 in (m_caller, n_caller, k, l):
            return
        (m, m_name), (n, n_name) = ((n_caller, "N"), (m_caller, "M")) if swapped else \
            ((m_caller, "M"), (n_caller, "N"))
        for extent, name, step in ((m, m_name, tile[0] * cluster[0]), (n, n_name, tile[1] * cluster[1]),
                                   (k, "K", tile[2])):
            if extent + step - 1 > INT32_MAX:
                raise InvalidArgument(f"{name} = {extent}: too large for the kernel's 32-bit tile arithmetic "
                                      f"({name} + {step - 1} must stay below 2^31); split the problem along {name}")
        tiles = -(-m // (tile[0] * cluster[0])) * cluster[0] * -(-n // (tile[1] * cluster[1])) * cluster[1] * l
        if tiles > INT32_MAX:
            raise InvalidArgument(f"M = {m_caller}, N = {n_caller}, batch {l}: {tiles} output tiles, more than the "
                                  "kernel's 32-bit tile count holds (2^31 - 1); split the batch")
    return check


def rebind(call: CheckedCall, a: torch.Tensor, b: torch.Tensor, operands: dict[str, object]) -> CheckedCall:
    """`call` for tensors of the same shapes, strides, dtypes and device at other addresses.

    Only the address checks run again (16-byte alignment), and a seed's range: an int seed is keyed
    as an address (`base.seed_signature`). The caller guarantees the rest: its cache key holds every
    property the other checks read.
    """
    ops = {k: TensorArg(_aligned_ptr(k, operands[k]), v.strides) if isinstance(v, TensorArg) else  # type: ignore[arg-type]
           _seed(k, operands[k]) if isinstance(v, int) else v  # an int is a seed (scalars are floats)
           for k, v in call.operands.items()}
    return CheckedCall(call.m, call.n, call.k, call.l, call.device, TensorArg(_aligned_ptr("a", a), call.a.strides),
                       TensorArg(_aligned_ptr("b", b), call.b.strides), ops, call.extents)


Span = tuple[str, int, int]  # an input's name and the [first, last byte) it is read from


def input_spans(call: CheckedCall) -> tuple[Span, ...]:
    """The memory each non-empty input is read from, by name (for alias checks)."""
    ptrs = (("a", call.a.ptr), ("b", call.b.ptr),
            *((k, v.ptr) for k, v in call.operands.items() if isinstance(v, TensorArg)))
    return tuple((name, p, p + e) for (name, p), e in zip(ptrs, call.extents, strict=True) if e)


def _bytes(t: TensorArg, itemsize: int, extents: tuple[int, int, int]) -> int:
    """Bytes from a tensor's address to the end of its last element (0 if it is empty)."""
    if 0 in extents:
        return 0
    return itemsize * (1 + sum((e - 1) * s for e, s in zip(extents, t.strides, strict=True)))


def _describe(o: Operand, gemm: GemmSpec | None = None) -> str:
    if o.kind.block_scale and gemm is not None and gemm.microscaling is not None:
        rows, vector = "M" if o.kind is OperandKind.SCALE_A else "N", gemm.microscaling.vector
        what = "exponent" if o.dtype is DType.UE8M0 else "scale"
        return (f"{o.dtype.torch} (round_up({rows}, 128), round_up(ceil(K/{vector}), 4)), contiguous: one "
                f"{what} per {vector} values of K of each {'row of A' if rows == 'M' else 'column of B'}, in the "
                "MMA's blocked order (gg.to_blocked_scales, or gg.quantize_mx)")
    if o.kind.block_scale:
        assert gemm is not None and gemm.block_scale is not None
        gm, gn, gk = gemm.block_scale
        if o.kind is OperandKind.SCALE_A:
            return f"fp32 (ceil(M/{gm}), ceil(K/{gk})), M-major: one scale per {gm} x {gk} block of A"
        return f"fp32 (ceil(K/{gk}), ceil(N/{gn})), N contiguous: one scale per {gk} x {gn} block of B"
    if o.per_batch and o.kind is not OperandKind.MATRIX:
        return {OperandKind.SCALAR: "an fp32 tensor with one value per batch",
                OperandKind.ROW: f"a {o.dtype.value} tensor, one length-N vector per batch",
                OperandKind.COL: f"a {o.dtype.value} tensor, one length-M vector per batch"}[o.kind]
    return {OperandKind.SCALAR: "a Python number", OperandKind.SEED: "a Python int or a one-element int64 tensor",
            OperandKind.ROW: f"a length-N {o.dtype.value} vector",
            OperandKind.COL: f"a length-M {o.dtype.value} vector",
            OperandKind.MATRIX: f"an M x N {o.dtype.value} matrix{'' if o.per_batch else ' for every batch'}"}[o.kind]


def block_scale_extents(o: Operand, gemm: GemmSpec, m: int, n: int, k: int, l: int  # noqa: E741
                        ) -> tuple[int, int, int]:
    """(blocks along M or N, blocks along K, L): the modes of a block scale's TensorArg."""
    assert gemm.block_scale is not None
    gm, gn, gk = gemm.block_scale
    rows, g = (m, gm) if o.kind is OperandKind.SCALE_A else (n, gn)
    return -(-rows // g), -(-k // gk), l


def microscaling_shape(o: Operand, gemm: GemmSpec, m: int, n: int, k: int) -> tuple[int, int]:
    """A microscaled operand's scales per batch: (padded rows, padded scale columns)."""
    assert gemm.microscaling is not None
    return blocked_shape(m if o.kind is OperandKind.SCALE_A else n, k, gemm.microscaling)


def _microscales(o: Operand, value: object, problem: tuple[int, int, int, int], gemm: GemmSpec) -> TensorArg:
    """A microscaled GEMM's scales: UE8M0 or e4m3, contiguous (L, padded rows, padded scale columns) in the
    MMA's blocked order (`ir.microscaling`), which the kernel loads with TMA (16-byte aligned)."""
    m, n, k, l = problem  # noqa: E741
    t = _need_tensor(o.name, value)
    if t.dtype == torch.uint8:  # scale bytes: a view reads them as they are (`.to` would convert the numbers)
        what = "UE8M0 exponents (2^(e - 127))" if o.dtype is DType.UE8M0 else "e4m3 scales"
        raise InvalidArgument(f"{o.name}: expected dtype {o.dtype.torch}, got uint8; if it holds {what}, pass "
                              f"{o.name}.view({o.dtype.torch})")
    _dtype(o.name, t, o.dtype)
    per_batch = microscaling_shape(o, gemm, m, n, k)
    if math.prod(per_batch) > INT32_MAX:  # CUTLASS's scale layout: int strides, the batch's the whole order
        raise InvalidArgument(f"{o.name}: {math.prod(per_batch)} scales per batch lie past the 2^31 - 1 bytes the "
                              "kernel's scale layout indexes in 32 bits; split the problem along "
                              f"{'M' if o.kind is OperandKind.SCALE_A else 'N'} or K into several calls")
    want = (l, *per_batch) if gemm.batched else per_batch
    if tuple(t.shape) != want:
        raise InvalidArgument(f"{o.name}: expected shape {want} ({_describe(o, gemm)}), got {tuple(t.shape)}")
    if t.numel() == 0:
        return TensorArg(0, (1, 0, 0))
    if not t.is_contiguous():
        raise LayoutMismatch(o.name, f"{o.name}: the blocked order is a contiguous tensor, got strides "
                             f"{tuple(t.stride())}; pass {o.name}.contiguous() if it holds the blocked order")
    return TensorArg(_aligned_ptr(o.name, t), (1, 0, math.prod(per_batch)))


def _block_scale(o: Operand, value: object, problem: tuple[int, int, int, int], gemm: GemmSpec) -> TensorArg:
    """A block scale: fp32, A's (L, M blocks, K blocks) with M contiguous, B's (L, K blocks, N
    blocks) with N contiguous (both M/N-major, as the kernel reads them). Its TensorArg holds the
    (M or N blocks, K blocks, L) mode strides. The kernel indexes it in 32 bits, and loads an
    operand's scales with TMA when a tile reads at least 32 of them per K step: then its strides
    must be 16-byte multiples (its address is 16-byte aligned either way)."""
    m, n, k, l = problem  # noqa: E741
    t = _need_tensor(o.name, value)
    _dtype(o.name, t, DType.F32)
    blocks, k_blocks, _ = block_scale_extents(o, gemm, m, n, k, l)
    is_a = o.kind is OperandKind.SCALE_A
    want: tuple[int, ...] = (blocks, k_blocks) if is_a else (k_blocks, blocks)
    want = (l, *want) if gemm.batched else want
    if tuple(t.shape) != want:
        raise InvalidArgument(f"{o.name}: expected shape {want} ({_describe(o, gemm)}), got {tuple(t.shape)}")
    if t.numel() == 0:
        return TensorArg(0, (1, 0, 0))
    mn_dim, k_dim = (t.dim() - 2, t.dim() - 1) if is_a else (t.dim() - 1, t.dim() - 2)
    what = "M" if is_a else "N"
    if blocks > 1 and t.stride(mn_dim) != 1:
        fix = f"{o.name}.mT.contiguous().mT" if is_a else f"{o.name}.contiguous()"
        raise LayoutMismatch(o.name, f"{o.name}: the kernel reads block scales {what}-major (dim {mn_dim} "
                             f"contiguous), got strides {tuple(t.stride())}; pass {fix}")
    # whether a kernel loads them with TMA depends on its tile (codegen.sm90.geometry.scale_tma): required here
    # whenever a tile (up to 256 rows or columns) could read enough of them per K step
    tma = 256 // gemm.block_scale[0 if is_a else 1] >= SCALE_TMA_THRESHOLD  # type: ignore[index]
    align = TMA_ALIGN if tma else 4
    k_stride = t.stride(k_dim) if k_blocks > 1 else (-(-blocks // 4) * 4)
    batch_stride = t.stride(0) if gemm.batched and l > 1 else 0
    if k_blocks > 1 and (k_stride < blocks or (k_stride * 4) % align):
        multiple = f" and a multiple of {align // 4} (the kernel loads these scales with TMA)" if tma else ""
        raise LayoutMismatch(o.name, f"{o.name}: stride {k_stride} between K blocks must be >= {blocks}{multiple}; "
                             f"pad the {what} blocks{' to a multiple of 4' if tma else ''}")
    if gemm.batched and l > 1 and ((batch_stride * 4) % align or (tma and batch_stride == 0)):
        raise LayoutMismatch(o.name, f"{o.name}: batch stride {batch_stride} must be a non-zero multiple of "
                             f"{align // 4} (TMA); pass {o.name}.contiguous()" if tma else
                             f"{o.name}: batch stride {batch_stride} must be a multiple of {align // 4}; pass "
                             f"{o.name}.contiguous()")
    if (blocks - 1) + (k_blocks - 1) * k_stride + (l - 1) * batch_stride > INT32_MAX:
        raise InvalidArgument(f"{o.name}: its last scale lies past 2^31 - 1 elements from the first, and the "
                              "kernel indexes block scales in 32 bits; split the batch or the problem")
    return TensorArg(_aligned_ptr(o.name, t), (1, k_stride, batch_stride))


def _operand(o: Operand, value: object, m: int, n: int, l: int, batched: bool,  # noqa: E741
             layout_d: Layout = Layout.ROW) -> TensorArg | float:
    """A scalar's value, or a tensor operand's address and (M, N, L) strides; M x N matrices in D's
    layout (a half- or double-width one, read from registers, row-major)."""
    if o.kind is OperandKind.SEED:
        return _seed(o.name, value)
    if o.per_batch and o.kind is not OperandKind.MATRIX:
        return _per_batch(o, value, m, n, l, batched)
    if o.kind is OperandKind.SCALAR:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return f32(value)  # as the kernel reads it, and the reference computes with it
        raise InvalidArgument(f"{o.name}: expected a Python number (a runtime scalar), got {type(value).__name__}; "
                              "tensors would need a device sync to read")
    t = _need_tensor(o.name, value)
    _dtype(o.name, t, o.dtype)
    if o.kind in (OperandKind.ROW, OperandKind.COL):
        length, what = (n, "N (columns of the output)") if o.kind is OperandKind.ROW else (m, "M (rows of the output)")
        if t.dim() != 1 or t.shape[0] != length:
            raise InvalidArgument(f"{o.name}: expected a 1-D tensor of length {length} = {what}, got shape "
                                  f"{tuple(t.shape)}")
        if length > 1 and t.stride(0) != 1:
            raise LayoutMismatch(o.name, f"{o.name}: expected a contiguous vector, got stride {t.stride(0)}; "
                                 f"use {o.name}.contiguous()")
        return TensorArg(_aligned_ptr(o.name, t))
    per_batch = batched and bool(o.per_batch)  # else one matrix for every batch (batch stride 0)
    shape = tuple(t.shape)
    want = (l, m, n) if per_batch else (m, n)
    if shape != want:
        whose = "the output's" if per_batch == batched else "one M x N matrix, shared by every batch"
        raise InvalidArgument(f"{o.name}: expected shape {want} ({whose}), got {shape}")
    layout = layout_d if o.columns is Columns.FULL else Layout.ROW
    return TensorArg(_aligned_ptr(o.name, t), _matrix(o.name, t, m, n, layout, per_batch, l, ("M", "N")))


#: Seeds a call may pass as Python ints: what a torch int64 tensor holds too, so either form gives a seed.
SEED_LIMIT = 2**63


def _seed(name: str, value: object) -> TensorArg | int:
    """A seed (`gemmgen.Seed`): a Python int's value, or the address of a one-element int64 tensor
    the kernel reads at launch."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if not 0 <= int(value) < SEED_LIMIT:
            raise InvalidArgument(f"{name}: seed {value} is outside [0, 2^63); pass {name} % 2**63")
        return int(value)
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a seed, a Python int or a one-element torch.int64 tensor on the "
                              f"kernel's device, got {type(value).__name__}")
    if value.dtype != torch.int64 or value.numel() != 1:
        raise InvalidArgument(f"{name}: a seed tensor holds one torch.int64, got {value.dtype} of shape "
                              f"{tuple(value.shape)}; pass e.g. torch.tensor([{name}_value], device='cuda')")
    return TensorArg(_aligned_ptr(name, value))  # 16-byte aligned, as every tensor a call reads


def _per_batch(o: Operand, value: object, m: int, n: int, l: int, batched: bool) -> TensorArg:  # noqa: E741
    """A scalar or vector per batch (`Operand.per_batch`): (L,), (L, N) or (L, M), its TensorArg's
    strides (0, 0, batch stride). Its address is 16-byte aligned, as every tensor's. A scalar is
    read one fp32 at a time (any batch stride); a vector 16 bytes at a time, so each batch's must
    start 16-byte aligned, and its elements be contiguous. A batch stride of 0 (an expanded
    tensor) reads the same value or vector for every batch."""
    t = _need_tensor(o.name, value)
    _dtype(o.name, t, o.dtype)
    length = 0 if o.kind is OperandKind.SCALAR else n if o.kind is OperandKind.ROW else m
    want = (l,) if o.kind is OperandKind.SCALAR else (l, length)
    one = o.kind is OperandKind.SCALAR and l == 1 and t.dim() == 0  # a 0-d tensor: one batch's value
    if tuple(t.shape) != want and not one:
        what = _describe(o) if batched or o.kind is not OperandKind.SCALAR else \
            "a one-element fp32 tensor: gg.Scalar(tensor=True)"
        raise InvalidArgument(f"{o.name}: expected shape {want} ({what}), got {tuple(t.shape)}")
    if t.numel() == 0:
        return TensorArg(0)
    batch_stride = t.stride(0) if l > 1 else 0
    if o.kind is OperandKind.SCALAR:
        return TensorArg(_aligned_ptr(o.name, t), (0, 0, batch_stride))
    if length > 1 and t.stride(1) != 1:
        raise LayoutMismatch(o.name, f"{o.name}: expected contiguous vectors (dim 1 contiguous), got strides "
                             f"{tuple(t.stride())}; pass {o.name}.contiguous()")
    item = t.element_size()
    if (batch_stride * item) % TMA_ALIGN:
        align = TMA_ALIGN // item
        padded = -(-length // align) * align
        raise LayoutMismatch(o.name, f"{o.name}: batch stride {batch_stride} must be a multiple of {align} elements "
                             f"(the kernel reads each batch's vector 16 bytes at a time, from a 16-byte aligned "
                             f"start); pass a copy in padded storage: p = {o.name}.new_empty({l}, {padded}); "
                             f"p[:, :{length}] = {o.name}; {o.name} = p[:, :{length}]")
    return TensorArg(_aligned_ptr(o.name, t), (0, 0, batch_stride))

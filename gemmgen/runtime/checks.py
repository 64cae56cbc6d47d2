"""Checking a call's tensors against the compiled recipe, before anything is launched.

Every failure is a gemmgen.InvalidArgument that names the argument, says what was expected, and
how to fix it. The result is the problem in CUTLASS's terms (problem.py), ready for argument
building. TMA needs 16-byte aligned base addresses and 16-byte multiples for every stride but the
contiguous one; extents are free (out-of-bounds reads are zero-filled and stores are clipped).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from ..codegen.sm90.geometry import SCALE_TMA_THRESHOLD
from ..errors import InvalidArgument, LayoutMismatch
from ..ir import GemmSpec, Operand, RecipeIR, f32
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
    if t.dtype != want.torch:
        raise InvalidArgument(f"{name}: expected dtype {want.torch}, got {t.dtype}; convert it with "
                              f"{name}.to({want.torch}) or declare the recipe with {want.value}")


def _aligned_ptr(name: str, t: torch.Tensor) -> int:
    ptr = t.data_ptr()
    if t.numel() and ptr % TMA_ALIGN:
        raise LayoutMismatch(name, f"{name}: data pointer {ptr:#x} is not 16-byte aligned (TMA needs it); this "
                             f"usually comes from slicing at an odd offset, use {name}.clone()")
    return ptr


def _stride(name: str, t: torch.Tensor, dim: int, extent_min: int, itemsize: int, what: str) -> int:
    """A non-contiguous stride (in elements): at least the contiguous extent and 16-byte aligned."""
    size, stride = t.shape[dim], t.stride(dim)
    if size == 1:  # any stride is legal for a size-1 dim; pick one TMA accepts
        return max(1, -(-extent_min * itemsize // TMA_ALIGN)) * TMA_ALIGN // itemsize
    if stride < extent_min or (stride * itemsize) % TMA_ALIGN:
        raise LayoutMismatch(name, f"{name}: {what} stride {stride} must be >= {extent_min} and a multiple of "
                             f"{TMA_ALIGN // itemsize} elements (16 bytes, for TMA); pad the tensor or "
                             f"call {name}.contiguous() on a padded copy")
    return stride


def _matrix(name: str, t: torch.Tensor, rows: int, cols: int, layout: Layout, batched: bool, l: int  # noqa: E741
            ) -> tuple[int, int, int]:
    """(row stride, col stride, batch stride) of a (L,) rows x cols tensor in the declared layout."""
    if t.numel() == 0:  # nothing is read or written: no stride to check
        return 0, 0, 0
    item = t.element_size()
    r, c = t.dim() - 2, t.dim() - 1
    if layout is Layout.ROW:
        if t.shape[c] > 1 and t.stride(c) != 1:
            raise LayoutMismatch(name, f"{name}: expected a row-major tensor (last dim contiguous), got strides "
                                 f"{tuple(t.stride())}; call {name}.contiguous() or declare it ColMajor")
        rs, cs = _stride(name, t, r, cols, item, "row"), 1
    else:
        if t.shape[r] > 1 and t.stride(r) != 1:
            raise LayoutMismatch(name, f"{name}: expected a column-major tensor (dim -2 contiguous), got strides "
                                 f"{tuple(t.stride())}; pass {name}.t().contiguous().t() or declare it RowMajor")
        rs, cs = 1, _stride(name, t, c, rows, item, "column")
    bs = 0
    if batched and l > 1:
        bs = t.stride(0)
        if bs == 0 or (bs * item) % TMA_ALIGN:
            raise LayoutMismatch(name, f"{name}: batch stride {bs} must be a non-zero multiple of {TMA_ALIGN // item} "
                                 "elements (16 bytes); materialize the batch with .contiguous()")
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


def check_call(recipe: RecipeIR, a: object, b: object, operands: dict[str, object],
               require_cuda: bool = True) -> CheckedCall:
    g = recipe.gemm
    a = _need_tensor("a", a)
    b = _need_tensor("b", b)
    _dtype("a", a, g.a)
    _dtype("b", b, g.b)
    sa, sb = _shape("a", a, g.batched), _shape("b", b, g.batched)
    l = sa[0] if g.batched else 1  # noqa: E741
    m, k = sa[-2], sa[-1]
    if g.batched and sb[0] != l:
        raise InvalidArgument(f"b: batch size {sb[0]} does not match a's {l}")
    if sb[-2] != k:
        raise InvalidArgument(f"b: expected {k} rows (K of a, shape {tuple(sa)}), got shape {tuple(sb)}")
    n = sb[-1]
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
        if o.kind.block_scale:
            checked[o.name] = _block_scale(o, value, (m, n, k, l), g)
        else:
            checked[o.name] = _operand(o, value, m, n, l, g.batched)
        if isinstance(value, torch.Tensor):
            named.append((o.name, value))
    for name, t in named:
        if t.device != device:
            raise InvalidArgument(f"{name}: on {t.device} but a is on {device}; put all tensors on one device")
    a_ptr, b_ptr = _aligned_ptr("a", a), _aligned_ptr("b", b)
    am, ak, al = _matrix("a", a, m, k, g.layout_a, g.batched, l)
    # B is K x N in torch terms and (N, K, L) in CUTLASS's: swap the per-mode strides.
    bk, bn, bl = _matrix("b", b, k, n, g.layout_b, g.batched, l)
    ta, tb = TensorArg(a_ptr, (am, ak, al)), TensorArg(b_ptr, (bn, bk, bl))
    extents = [_bytes(ta, g.a.nbytes, (m, k, l)), _bytes(tb, g.b.nbytes, (n, k, l))]
    for o in recipe.operands:
        v = checked[o.name]
        if o.kind.block_scale:
            extents.append(_bytes(v, 4, block_scale_extents(o, g, m, n, k, l)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.MATRIX:
            extents.append(_bytes(v, o.dtype.nbytes, (m, n, l)))  # type: ignore[arg-type]
        elif o.kind is not OperandKind.SCALAR:
            extents.append((n if o.kind is OperandKind.ROW else m) * o.dtype.nbytes)
    return CheckedCall(m, n, k, l, device, ta, tb, checked, tuple(extents))


INT32_MAX = 2**31 - 1


def check_problem_size(call: CheckedCall, tile: tuple[int, int, int], cluster: tuple[int, int, int],
                       swapped: bool) -> None:
    """CUTLASS's host and device code count rows, columns, K and output tiles in 32-bit ints: a
    problem past that would get wrapped-around scheduler values (checked against CUTLASS's host
    code by tests/runtime/test_oracle.py), so it is refused. `tile` and `cluster` are the kernel's; a
    swapped kernel's M is the caller's N."""
    (m, m_name), (n, n_name) = ((call.n, "N"), (call.m, "M")) if swapped else ((call.m, "M"), (call.n, "N"))
    for extent, name, step in ((m, m_name, tile[0] * cluster[0]), (n, n_name, tile[1] * cluster[1]),
                               (call.k, "K", tile[2])):
        if extent + step - 1 > INT32_MAX:
            raise InvalidArgument(f"{name} = {extent}: too large for the kernel's 32-bit tile arithmetic "
                                  f"({name} + {step - 1} must stay below 2^31); split the problem along {name}")
    tiles = -(-m // (tile[0] * cluster[0])) * cluster[0] * -(-n // (tile[1] * cluster[1])) * cluster[1] * call.l
    if tiles > INT32_MAX:
        raise InvalidArgument(f"M = {call.m}, N = {call.n}, batch {call.l}: {tiles} output tiles, more than the "
                              "kernel's 32-bit tile count holds (2^31 - 1); split the batch")


def rebind(call: CheckedCall, a: torch.Tensor, b: torch.Tensor, operands: dict[str, object]) -> CheckedCall:
    """`call` for tensors of the same shapes, strides, dtypes and device at other addresses.

    Only the address checks run again (16-byte alignment). The caller guarantees the rest: its
    cache key holds every property the other checks read.
    """
    ops = {k: TensorArg(_aligned_ptr(k, operands[k]), v.strides) if isinstance(v, TensorArg) else v  # type: ignore[arg-type]
           for k, v in call.operands.items()}
    return CheckedCall(call.m, call.n, call.k, call.l, call.device, TensorArg(_aligned_ptr("a", a), call.a.strides),
                       TensorArg(_aligned_ptr("b", b), call.b.strides), ops, call.extents)


def input_spans(call: CheckedCall) -> tuple[tuple[int, int], ...]:
    """[first, last byte) of the memory each non-empty input is read from (for alias checks)."""
    ptrs = (call.a.ptr, call.b.ptr, *(v.ptr for v in call.operands.values() if isinstance(v, TensorArg)))
    return tuple((p, p + e) for p, e in zip(ptrs, call.extents, strict=True) if e)


def _bytes(t: TensorArg, itemsize: int, extents: tuple[int, int, int]) -> int:
    """Bytes from a tensor's address to the end of its last element (0 if it is empty)."""
    if 0 in extents:
        return 0
    return itemsize * (1 + sum((e - 1) * s for e, s in zip(extents, t.strides, strict=True)))


def _describe(o: Operand, gemm: GemmSpec | None = None) -> str:
    if o.kind.block_scale:
        assert gemm is not None and gemm.block_scale is not None
        gm, gn, gk = gemm.block_scale
        if o.kind is OperandKind.SCALE_A:
            return f"fp32 (ceil(M/{gm}), ceil(K/{gk})), M-major: one scale per {gm} x {gk} block of A"
        return f"fp32 (ceil(K/{gk}), ceil(N/{gn})), N contiguous: one scale per {gk} x {gn} block of B"
    return {OperandKind.SCALAR: "a Python number", OperandKind.ROW: f"a length-N {o.dtype.value} vector",
            OperandKind.COL: f"a length-M {o.dtype.value} vector",
            OperandKind.MATRIX: f"an M x N {o.dtype.value} matrix"}[o.kind]


def block_scale_extents(o: Operand, gemm: GemmSpec, m: int, n: int, k: int, l: int  # noqa: E741
                        ) -> tuple[int, int, int]:
    """(blocks along M or N, blocks along K, L): the modes of a block scale's TensorArg."""
    assert gemm.block_scale is not None
    gm, gn, gk = gemm.block_scale
    rows, g = (m, gm) if o.kind is OperandKind.SCALE_A else (n, gn)
    return -(-rows // g), -(-k // gk), l


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


def _operand(o: Operand, value: object, m: int, n: int, l: int, batched: bool) -> TensorArg | float:  # noqa: E741
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
    shape = _shape(o.name, t, batched)
    want = (l, m, n) if batched else (m, n)
    if shape != want:
        raise InvalidArgument(f"{o.name}: expected shape {want} (the output's), got {shape}")
    return TensorArg(_aligned_ptr(o.name, t), _matrix(o.name, t, m, n, Layout.ROW, batched, l))


def check_output(name: str, t: object, dtype: DType, shape: tuple[int, ...], device: torch.device,
                 batched: bool, l: int) -> TensorArg:  # noqa: E741
    """An output tensor on its own (dtype, shape, device, alignment, strides); see `check_no_alias`."""
    t = _need_tensor(name, t)
    _dtype(name, t, dtype)
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgument(f"{name}: on {t.device} but the inputs are on {device}")
    m, n = shape[-2], shape[-1]
    return TensorArg(_aligned_ptr(name, t), _matrix(name, t, m, n, Layout.ROW, batched, l))


def check_reduction_output(name: str, t: object, shape: tuple[int, ...], device: torch.device,
                           modes: tuple[int, int, int]) -> TensorArg:
    """A reduced output (`gg.amax`, `gg.sum`): fp32 of `shape` ((L,) or () over M and N; (L, M)
    or (M,) per row; (L, N) or (N,) per column), contiguous; its TensorArg's strides are the
    (M, N, L) mode strides `modes` the kernel's reduction indexes it with."""
    t = _need_tensor(name, t)
    _dtype(name, t, DType.F32)
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name}: expected shape {shape} (the reduction's values per batch), got "
                              f"{tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgument(f"{name}: on {t.device} but the inputs are on {device}")
    if not t.is_contiguous():
        raise LayoutMismatch(name, f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}; "
                             f"pass a contiguous tensor")
    if t.data_ptr() % 4:
        raise LayoutMismatch(name, f"{name}: address {t.data_ptr():#x} is not 4-byte aligned (fp32 stores need it)")
    return TensorArg(t.data_ptr(), modes)


def check_no_alias(name: str, span: tuple[int, int] | None, inputs: tuple[tuple[int, int], ...]) -> None:
    """An output's bytes (`span`, None if empty) must not overlap any input's (`input_spans`)."""
    if span is None:
        return
    lo, hi = span
    for i, (x_lo, x_hi) in enumerate(inputs):
        if lo < x_hi and x_lo < hi:
            raise InvalidArgument(f"{name}: shares memory with input #{i}; gemmgen does not write in place, "
                                  "pass a separate output tensor")


def check_outputs_disjoint(spans: list[tuple[str, tuple[int, int] | None]]) -> None:
    """Given outputs (name, byte span) must not overlap each other: the kernel's stores to them
    would race, leaving one output's values in another."""
    for i, (name, span) in enumerate(spans):
        for other, other_span in spans[:i]:
            if span is not None and other_span is not None and span[0] < other_span[1] and other_span[0] < span[1]:
                raise InvalidArgument(f"{name}: shares memory with {other}; give each output its own tensor")


def output_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last byte) a strided tensor can touch; None if it is empty."""
    return _span(t) if t.numel() else None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last byte) a non-empty strided tensor can touch."""
    lo = t.data_ptr()
    return lo, lo + t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)))


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


def check_grouped_call(recipe: RecipeIR, a: object, b: object, offsets: object, operands: dict[str, object],
                       require_cuda: bool = True) -> GroupedCall:
    """`check_call` for a grouped recipe. The offsets stay on the GPU (reading them would
    synchronize): their values cannot be checked here, and need not be, as the kernel clamps them
    (reference.group_bounds)."""
    g = recipe.gemm
    a, b = _need_tensor("a", a), _need_tensor("b", b)
    _dtype("a", a, g.a)
    _dtype("b", b, g.b)
    if a.dim() != 2:
        raise InvalidArgument(f"a: expected a 2-D (rows, K) tensor holding every group's rows, got shape "
                              f"{tuple(a.shape)}")
    if b.dim() != 3:
        raise InvalidArgument(f"b: expected a 3-D (groups, K, N) tensor, one K x N matrix per group, got shape "
                              f"{tuple(b.shape)}")
    rows, k = a.shape
    groups, n = b.shape[0], b.shape[2]
    for extent, name in ((rows, "rows of a"), (n, "N"), (k, "K"), (groups, "groups")):
        if extent > INT32_MAX - 256:  # the kernel's per-group shapes and the setup's offsets are 32-bit
            raise InvalidArgument(f"{name} = {extent}: too large for the grouped kernel's 32-bit shapes; split "
                                  "the call")
    if b.shape[1] != k:
        raise InvalidArgument(f"b: expected (groups, {k}, N) (K of a, shape {tuple(a.shape)}), got {tuple(b.shape)}")
    offsets = _need_tensor("offsets", offsets)
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.shape[0] != groups:
        raise InvalidArgument(f"offsets: expected an int32 tensor of {groups} entries (one per group of b: where "
                              f"its rows of a end), got {offsets.dtype} of shape {tuple(offsets.shape)}")
    if groups > 1 and offsets.stride(0) != 1:
        raise LayoutMismatch("offsets", "offsets: expected a contiguous tensor; use offsets.contiguous()")
    device = a.device
    if require_cuda and device.type != "cuda":
        raise InvalidArgument(f"a: expected a CUDA tensor, got one on {device}; move it with a.cuda()")
    names = {o.name for o in recipe.operands}
    unknown = sorted(set(operands) - names)
    if unknown:
        raise InvalidArgument(f"{unknown[0]}: not an operand of this recipe; it takes {sorted(names) or 'none'}")
    named: list[tuple[str, torch.Tensor]] = [("a", a), ("b", b), ("offsets", offsets)]
    checked: dict[str, TensorArg | float] = {}
    for o in recipe.operands:
        if o.name not in operands:
            raise InvalidArgument(f"{o.name}: missing operand; pass {o.name}=... ({_describe_grouped(o, g)})")
        value = operands[o.name]
        checked[o.name] = _grouped_block_scale(o, value, (rows, n, k, groups), g) if o.kind.block_scale else \
            _grouped_operand(o, value, rows, n, groups)
        if isinstance(value, torch.Tensor):
            named.append((o.name, value))
    for name, t in named:
        if t.device != device:
            raise InvalidArgument(f"{name}: on {t.device} but a is on {device}; put all tensors on one device")
    ta = TensorArg(_aligned_ptr("a", a), _matrix("a", a, rows, k, Layout.ROW, False, 1))
    bk, bn, bl = _matrix("b", b, k, n, g.layout_b, True, groups)
    tb = TensorArg(_aligned_ptr("b", b), (bn, bk, bl))
    extents = [_bytes(ta, g.a.nbytes, (rows, k, 1)), _bytes(tb, g.b.nbytes, (n, k, groups)), 4 * groups]
    for o in recipe.operands:
        v = checked[o.name]
        if o.kind.block_scale:
            extents.append(_bytes(v, 4, grouped_scale_extents(o, g, rows, n, k, groups)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.MATRIX:
            extents.append(_bytes(v, o.dtype.nbytes, (rows, n, 1)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.ROW:
            extents.append(_bytes(v, o.dtype.nbytes, (1, n, groups)))  # type: ignore[arg-type]
        elif o.kind is OperandKind.COL:
            extents.append(rows * o.dtype.nbytes)
    return GroupedCall(rows, n, k, groups, device, ta, tb, offsets.data_ptr(), checked, tuple(extents))


def grouped_input_spans(call: GroupedCall) -> tuple[tuple[int, int], ...]:
    """`input_spans` of a grouped call (the offsets included)."""
    ptrs = (call.a.ptr, call.b.ptr, call.offsets, *(v.ptr for v in call.operands.values() if isinstance(v, TensorArg)))
    return tuple((p, p + e) for p, e in zip(ptrs, call.extents, strict=True) if e)


def _describe_grouped(o: Operand, gemm: GemmSpec) -> str:
    if o.kind.block_scale:
        assert gemm.block_scale is not None
        _, gn, gk = gemm.block_scale
        if o.kind is OperandKind.SCALE_A:
            return f"fp32 (rows, ceil(K/{gk})), K contiguous: one scale per row of a and {gk} values of K"
        return (f"fp32 (groups, ceil(K/{gk}), ceil(N/{gn})), K contiguous: one scale per {gk} x {gn} block of each "
                "group's B")
    return {OperandKind.SCALAR: "a Python number", OperandKind.ROW: f"a (groups, N) {o.dtype.value} tensor",
            OperandKind.COL: f"a {o.dtype.value} vector with one entry per row of a",
            OperandKind.MATRIX: f"a (rows, N) {o.dtype.value} matrix"}[o.kind]


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


def _natural_ptr(name: str, t: torch.Tensor) -> int:
    """The address of a tensor read element by element: aligned to its elements."""
    ptr = t.data_ptr()
    if ptr % t.element_size():
        raise LayoutMismatch(name, f"{name}: data pointer {ptr:#x} is not aligned to its {t.element_size()}-byte "
                             f"elements; use {name}.clone()")
    return ptr


def _grouped_operand(o: Operand, value: object, rows: int, n: int, groups: int) -> TensorArg | float:
    """A grouped recipe's operand: row vectors are per group (groups, N), each group's row 16-byte
    aligned (the kernel reads it in 16-byte vectors); the rest are per row of A, as check_call's."""
    if o.kind is not OperandKind.ROW:
        return _operand(o, value, rows, n, 1, False)
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

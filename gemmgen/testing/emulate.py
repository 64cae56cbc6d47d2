"""What a kernel would compute from the Params gemmgen built, evaluated in fp32 on the CPU (tests only).

The oracle (oracle.py) checks that gemmgen's Params equal CUTLASS's for the same problem; this
checks that the problem itself is the caller's and that the kernel's epilogue computes the recipe:
it reads A and B through the tensor maps the Params hold (read back through the RecordingEncoder
or the stub driver that made them), then runs the epilogue the kernel's source declares
(`visitors.EpilogueInterpreter`), whose leaves read C, the aux inputs, vectors and scalars from
the Params fields at their own places, and whose stores write D and the aux outputs through their
tensor maps (an amax through its pointer). A wrong stride, extent, operand role, transposition,
visitor or Params position shows up as a wrong or unwritten (NaN) output element.
"""

from __future__ import annotations

import itertools
import re
from functools import lru_cache
from typing import Protocol

import torch

from ..codegen.fields import ParamsLayout
from ..compile import CompiledKernel
from ..ir.microscaling import BLOCK_COLUMNS, BLOCK_ROWS, blocked_shape, from_blocked, scale_values, values
from ..ir.reference import expand_block_scale, group_bounds, k_grouped_token_column, masked_group_bounds
from ..runtime.grouped import MAX_COLUMNS, SCALE_LAYOUT_BYTES, SETUP, SETUP_FIELDS
from ..runtime.tma import EncodeArgs, TmaDataType
from ..types import DType, Microscaling
from .direct_epilogue import DirectInterpreter
from .visitors import EpilogueInterpreter


class MapReader(Protocol):
    """What made the tensor maps, asked what a map holds (RecordingEncoder, stub_driver.StubDriver)."""

    def of(self, desc: bytes) -> EncodeArgs | None: ...


@lru_cache(maxsize=64)
def _interpreter(source: str) -> EpilogueInterpreter | DirectInterpreter:
    """The kernel's epilogue as its source declares it: a visitor tree, or a direct epilogue's functor."""
    if "gemmgen::direct::Sm90Direct<" in source:
        return DirectInterpreter(source)
    return EpilogueInterpreter(source)


class _ParamsBytes:
    """A Params block as the device reads it: fields at their probed offsets, addresses resolved
    to the caller's tensors, tensor maps to what they address (implements visitors.ParamsView)."""

    def __init__(self, layout: ParamsLayout, params: bytes, encoder: MapReader, tensors: list[torch.Tensor]) -> None:
        self._params = params
        self._encoder = encoder
        self._at = {f.expr: (f, offset) for f, offset, _ in layout.fields}
        self.lvalue = {f.name: f.expr for f, _, _ in layout.fields}
        self._by_addr = {t.data_ptr(): t for t in tensors if t.numel()}

    def raw(self, lvalue: str) -> bytes:
        if lvalue not in self._at:
            raise AssertionError(f"the kernel reads {lvalue}, where gemmgen writes no Params field")
        f, offset = self._at[lvalue]
        return self._params[offset:offset + f.size]

    def pointer(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor | None:
        addr = int.from_bytes(self.raw(lvalue), "little")
        if addr == 0:
            return None
        return _within(_as(self._by_addr[addr], dtype), (length,), (1,), lvalue)

    group = -1  # a grouped kernel's current group (emulate_grouped sets it)

    def at(self, addr: int, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], what: str
           ) -> torch.Tensor:
        """The elements at `addr`, inside one of the call's tensors (a group's rows start inside them)."""
        for t in self._by_addr.values():
            start = t.data_ptr()
            end = start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
            if start <= addr < end:
                base = t.view(dtype) if t.dtype is torch.uint8 else _as(t, dtype)  # a raw buffer holds any type
                item = base.element_size()
                if (addr - start) % item:
                    raise AssertionError(f"{what}: address {addr:#x} is not aligned to its {item}-byte elements")
                offset = base.storage_offset() + (addr - start) // item
                try:
                    return base.as_strided(size, stride, offset)
                except RuntimeError as e:
                    raise AssertionError(f"{what} reaches past the memory of the tensor at {start:#x}: {e}") from None
        raise AssertionError(f"{what}: address {addr:#x} is in none of the call's tensors")

    def holds(self, addr: int) -> bool:
        return any(t.data_ptr() <= addr < t.data_ptr() + t.untyped_storage().nbytes() - t.storage_offset() *
                   t.element_size() for t in self._by_addr.values())

    def inside(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor:
        return self.at(int.from_bytes(self.raw(lvalue), "little"), dtype, (length,), (1,), lvalue)

    def entry(self, lvalue: str) -> int:
        """The current group's 64-bit entry of the array whose address the field at `lvalue` holds."""
        array = int.from_bytes(self.raw(lvalue), "little")
        return int(self.at(array + 8 * self.group, torch.int64, (1,), (1,), lvalue)[0])

    def group_pointer(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor | None:
        if int.from_bytes(self.raw(lvalue), "little") == 0:
            return None
        return self.at(self.entry(lvalue), dtype, (length,), (1,), lvalue)

    def group_matrix(self, pointers: str, strides: str, dtype: torch.dtype, acc: torch.Tensor, column_major: bool
                     ) -> torch.Tensor:
        _, m, n = acc.shape
        ld = self.entry(strides)
        return self.at(self.entry(pointers), dtype, (1, m, n), (0, 1, ld) if column_major else (0, ld, 1), pointers)

    def encoded(self, lvalue: str) -> EncodeArgs:
        """What the tensor map at `lvalue` was encoded from."""
        args = self._encoder.of(self.raw(lvalue))
        assert args is not None, f"{self._at[lvalue][0].name}: no tensor map written"
        return args

    def mapped(self, lvalue: str, dtype: torch.dtype, rows_contiguous: bool) -> torch.Tensor:
        """(L, rows, cols) of what the tensor map at `lvalue` addresses; packed fp4 (its dims count
        elements, two per byte) unpacked to fp32."""
        args = self.encoded(lvalue)
        base = _as(self._by_addr[args.addr], dtype)
        item = base.element_size()
        d0, d1, d2 = args.dims
        packed = args.dtype == TmaDataType.U4X16_ALIGN8B
        if packed != (dtype == DType.E2M1.torch):
            raise AssertionError(f"{lvalue}: a tensor map of type {args.dtype} over {dtype} elements")
        if packed and d0 % 2:
            raise AssertionError(f"{lvalue}: {d0} packed fp4 elements along its contiguous dim, not whole bytes")
        size = (d2, d1, d0 // 2 if packed else d0)
        view = _within(base, size, (args.strides[1] // item, args.strides[0] // item, 1), lvalue)
        if packed:
            view = values(view, DType.E2M1)
        return view.transpose(1, 2) if rows_contiguous else view


def _within(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], lvalue: str) -> torch.Tensor:
    """The elements a pointer or tensor map at `lvalue` reaches from `t`'s address, inside its allocation."""
    try:
        return t.as_strided(size, stride)
    except RuntimeError as e:  # past the end of the storage: the device would read or write out of bounds
        raise AssertionError(f"{lvalue} reaches past the memory of the tensor at its address: {e}") from None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The memory of `t` read as `dtype`, as a kernel with that element type reads it."""
    if t.element_size() != torch.empty((), dtype=dtype).element_size():
        raise AssertionError(f"the kernel reads {t.dtype} memory as {dtype}")
    return t.view(dtype)


def emulate(compiled: CompiledKernel, params: bytes, encoder: MapReader, tensors: list[torch.Tensor]) -> None:
    """Run `compiled` on `params` in fp32; `tensors` are every tensor the call passed or returned.
    The kernel's source says how it reads each tensor map: A is M x K and B K x N of ElementA and
    ElementB, row- or column-major (LayoutA, LayoutB); the interpreter reads C, D and the aux
    tensors likewise."""
    kernel = _interpreter(compiled.generated.source)
    view = _ParamsBytes(compiled.params_layout, params, encoder, tensors)
    a = view.mapped(view.lvalue["mainloop.tma_a"], kernel.element_a, kernel.column_major["LayoutA"])  # (L, M, K)
    b = view.mapped(view.lvalue["mainloop.tma_b"], kernel.element_b, not kernel.column_major["LayoutB"])  # (L, N, K)
    if a.shape[::2] != b.shape[::2]:
        raise AssertionError(f"A's tensor map addresses {tuple(a.shape)} (L, M, K), B's {tuple(b.shape)} (L, N, K)")
    a32, b32 = a.float(), b.float()
    vector = _microscaling_vector(compiled.generated.source)
    if vector is not None:
        a32 = a32 * _microscales(view, "a", vector, a.shape)
        b32 = b32 * _microscales(view, "b", vector, b.shape)
    granularity = _scale_config(compiled.generated.source)
    if granularity is not None:
        gm, gn, gk, _, _ = granularity
        a32 = a32 * _block_scales(view, "a", gm, gk, a.shape)
        b32 = b32 * _block_scales(view, "b", gn, gk, b.shape)
    kernel.run(torch.matmul(a32, b32.transpose(1, 2)), view)


def _scale_config(source: str) -> tuple[int, int, int, bool, bool] | None:
    """The kernel's block scale granularity (M, N, K) and whether A's and B's scales are K-major,
    from its Sm90BlockwiseScaleConfig or Sm100BlockwiseScaleConfig (M/N-major unless it says
    otherwise); None without one."""
    found = re.search(r"Sm(?:90|100)BlockwiseScaleConfig<(\d+), (\d+), (\d+)(?:, cute::[GU]MMA::Major::(\w+), "
                      r"cute::[GU]MMA::Major::(\w+))?>", source)
    if found is None:
        return None
    gm, gn, gk = map(int, found.groups()[:3])
    return gm, gn, gk, found.group(4) == "K", found.group(5) == "K"


def _microscaling_vector(source: str) -> int | None:
    """Values of K per scale of a microscaled kernel (its Sm1xxBlockScaledConfig), else None."""
    found = re.search(r"Sm1xxBlockScaledConfig<(\d+)>", source)
    return None if found is None else int(found.group(1))


def _microscales(view: _ParamsBytes, operand: str, vector: int, shape: torch.Size) -> torch.Tensor:
    """A microscaled operand's scales as the block-scaled main loop loads them: through its tensor
    map (16-bit words of whole 128 x 4 blocks, over row blocks, K blocks and L), each block's bytes
    in the blocked order (`ir.microscaling`); its layout fields must describe the same memory.
    Each value's scale: (L, M or N, K)."""
    l, mn, k = shape  # noqa: E741
    lvalue = view.lvalue[f"mainloop.tma_sf{operand}"]
    args = view.encoded(lvalue)
    blocks, k_blocks = -(-mn // BLOCK_ROWS), -(-k // (vector * BLOCK_COLUMNS))
    block = BLOCK_ROWS * BLOCK_COLUMNS
    # (row blocks, K blocks, L) as the map's modes after the words, in whatever order it lists them
    modes = {perm: ([args.dims[1 + perm.index(i)] for i in range(3)], [args.strides[perm.index(i)] for i in range(3)])
             for perm in itertools.permutations(range(3))}
    found = [(dims, strides) for dims, strides in modes.values()
             if args.dims[0] == block // 2 and dims == [blocks, k_blocks, l] and strides[1] == block]
    if not found:
        raise AssertionError(f"scale_{operand}: its tensor map addresses {args.dims} words with strides "
                             f"{args.strides}, want ({block // 2}, {blocks}, {k_blocks}, {l}) of whole blocks")
    field = {n: int.from_bytes(view.raw(view.lvalue[f"mainloop.layout_sf{operand}.{n}"]), "little", signed=True)
             for n in ("blocks", "k_blocks", "l", "block_stride", "batch_stride")}
    layout = (field["blocks"], field["k_blocks"], field["l"], field["block_stride"], field["batch_stride"])
    same = [strides for _, strides in found if layout == (blocks, k_blocks, l, strides[0], strides[2])]
    if not same:
        raise AssertionError(f"scale_{operand}: its layout fields {field} describe other memory than its tensor "
                             f"map {args.dims}, strides {args.strides}")
    strides = same[0]
    raw = view.at(args.addr, torch.uint8, (l, blocks, k_blocks, block), (strides[2], strides[0], block, 1), lvalue)
    scales = from_blocked(raw.reshape(l, blocks * BLOCK_ROWS, k_blocks * BLOCK_COLUMNS), mn, -(-k // vector))
    fmt = next(f for f in Microscaling if f.vector == vector)
    return scale_values(scales.view(fmt.scale_dtype.torch), fmt).repeat_interleave(vector, dim=-1)[..., :k]


def _group_scales(view: _ParamsBytes, operand: str, gran: int, gran_k: int, k_major: bool, mn: int, k: int
                  ) -> torch.Tensor:
    """The current group's scales of A or B as the grouped blockwise main loop reads them: at the
    group's entry of the pointer array, laid out compactly from the group's shape alone (CUTLASS's
    ScaleConfig::tile_atom_to_shape_SF*), each repeated over its block: (M or N, K)."""
    blocks, k_blocks = -(-mn // gran), -(-k // gran_k)
    strides = (k_blocks, 1) if k_major else (1, blocks)
    ptr = view.lvalue[f"mainloop.ptr_sf{operand}"]
    scales = view.at(view.entry(ptr), torch.float32, (blocks, k_blocks), strides, ptr)
    return expand_block_scale(scales, gran, gran_k, (mn, k))


def _block_scales(view: _ParamsBytes, operand: str, gran: int, gran_k: int, shape: torch.Size) -> torch.Tensor:
    """The blockwise main loop's scales of A or B as it reads them (pointer and layout fields; the
    tensor map, where it loads them with TMA, must address the same scales), each repeated over its
    block: (L, M or N, K)."""
    field = {n: int.from_bytes(view.raw(view.lvalue[f"mainloop.layout_sf{operand}.{n}"]), "little", signed=True)
             for n in ("blocks", "k_blocks", "l", "k_stride", "batch_stride")}
    l, mn, k = shape  # noqa: E741
    want = (-(-mn // gran), -(-k // gran_k), l)
    if (field["blocks"], field["k_blocks"], field["l"]) != want:
        raise AssertionError(f"scale_{operand}: layout extents {field} for a ({l}, {mn}, {k}) operand, want {want}")
    ptr = view.lvalue[f"mainloop.ptr_sf{operand}"]
    addr = int.from_bytes(view.raw(ptr), "little")
    scales = view.at(addr, torch.float32, (l, want[1], want[0]), (field["batch_stride"], field["k_stride"], 1), ptr)
    tma = view.lvalue.get(f"mainloop.tma_sf{operand}")
    if tma is not None:
        mapped = view.mapped(tma, torch.float32, rows_contiguous=True)  # (L, blocks, K blocks)
        if mapped.data_ptr() != addr or mapped.shape != (l, want[0], want[1]) or \
                mapped.stride()[:2] != (field["batch_stride"], 1) or mapped.stride(2) != field["k_stride"]:
            raise AssertionError(f"scale_{operand}: its tensor map addresses {tuple(mapped.shape)} at "
                                 f"{mapped.data_ptr():#x} strides {mapped.stride()}, its pointer and layout {field}")
    return expand_block_scale(scales.transpose(1, 2), gran, gran_k, (mn, k))


def emulate_grouped(compiled: CompiledKernel, setup: bytes, params: bytes, encoder: MapReader,
                    tensors: list[torch.Tensor]) -> None:
    """`emulate` for a grouped kernel: first what its setup kernel does with `setup` (grouped.hpp's
    `fill`, as `fill_groups` computes it, written into the call's buffer, one of `tensors`), then per
    group what the GEMM does with `params`: it reads the group's shape, A and B (and a block-scaled
    kernel's scales) through the pointer and stride arrays, and runs the epilogue the source
    declares on A_g @ B_g."""
    kernel = _interpreter(compiled.generated.source)
    assert isinstance(kernel, EpilogueInterpreter), "a grouped kernel's epilogue is a visitor tree"
    view = _ParamsBytes(compiled.params_layout, params, encoder, tensors)
    fields = SETUP.unpack(setup)
    offsets_at, shapes_at, table_at, groups = fields[:4]
    offsets = view.at(offsets_at, torch.int32, (groups,), (1,), "setup.offsets").tolist()
    shapes, table = fill_groups(fields, offsets)
    view.at(shapes_at, torch.int32, (groups, 3), (3, 1), "setup.shapes").copy_(torch.tensor(shapes).reshape(-1, 3))
    if table:
        view.at(table_at, torch.int64, (len(table[0]), groups), (groups, 1), "setup.table").copy_(
            torch.tensor(table).t())
    lv = view.lvalue
    scale_config = _scale_config(compiled.generated.source)
    vector = _microscaling_vector(compiled.generated.source)
    if "fill_scale_layouts<" in compiled.generated.source:
        _check_scale_layouts(view, fields, groups)
    if int.from_bytes(view.raw(lv["problem.groups"]), "little") != groups:
        raise AssertionError("Params and the setup block disagree on the number of groups")
    problem_shapes = int.from_bytes(view.raw(lv["problem.shapes"]), "little")
    for g in range(groups):
        view.group = g
        m, n, k = view.at(problem_shapes + 12 * g, torch.int32, (3,), (1,), "problem.shapes").tolist()
        if m == 0 or n == 0:
            continue
        lda, ldb = view.entry(lv["mainloop.stride_a"]), view.entry(lv["mainloop.stride_b"])
        a32 = _group_operand(view, "a", kernel.element_a, m, k, lda, not kernel.column_major["LayoutA"])  # (M, K)
        b32 = _group_operand(view, "b", kernel.element_b, n, k, ldb, kernel.column_major["LayoutB"])  # (N, K)
        if vector is not None:
            a32 = a32 * _group_microscales(view, "a", vector, m, k)
            b32 = b32 * _group_microscales(view, "b", vector, n, k)
        if scale_config is not None:
            gm, gn, gk, a_k_major, b_k_major = scale_config
            a32 = a32 * _group_scales(view, "a", gm, gk, a_k_major, m, k)
            b32 = b32 * _group_scales(view, "b", gn, gk, b_k_major, n, k)
        kernel.run(torch.matmul(a32, b32.t()).reshape(1, m, n), view)


def _group_operand(view: _ParamsBytes, operand: str, element: torch.dtype, rows: int, k: int, ld: int,
                   k_major: bool) -> torch.Tensor:
    """The current group's A or B as fp32 (rows, K), at its pointer array's entry with its leading
    dimension `ld` (elements); packed fp4 (K-major: two values of K per byte) unpacked."""
    field = f"mainloop.ptr_{operand}"
    addr = view.entry(view.lvalue[field])
    if element == DType.E2M1.torch:
        if not k_major or ld % 2 or k % 2:
            raise AssertionError(f"{field}: packed fp4 read {'K' if k_major else 'MN'}-major, leading dimension {ld}, "
                                 f"K = {k}: not whole bytes along K")
        return values(view.at(addr, torch.uint8, (rows, k // 2), (ld // 2, 1), field), DType.E2M1)
    return view.at(addr, element, (rows, k), (ld, 1) if k_major else (1, ld), field).float()


def _group_microscales(view: _ParamsBytes, operand: str, vector: int, mn: int, k: int) -> torch.Tensor:
    """The current group's scales of A or B as the block-scaled main loop reads them: at its pointer
    array's entry, the blocked order of the group's (M or N, K) (the layout the setup writes from
    the group's shape), each value's scale: (M or N, K)."""
    fmt = next(f for f in Microscaling if f.vector == vector)
    rows, columns = blocked_shape(mn, k, fmt)
    field = f"mainloop.ptr_sf{operand}"
    raw = view.at(view.entry(view.lvalue[field]), torch.uint8, (rows, columns), (columns, 1), field)
    scales = from_blocked(raw, mn, -(-k // vector))
    return scale_values(scales.view(fmt.scale_dtype.torch), fmt).repeat_interleave(vector, dim=-1)[..., :k]


def _check_scale_layouts(view: _ParamsBytes, setup: tuple, groups: int) -> None:
    """Where the setup kernel writes each group's scale layouts (CUTLASS's own function of the
    group's shape: the emulation derives the same from the shape, `_group_scales`): the arrays the
    GEMM reads, inside the buffer, apart from the shapes, the table and each other."""
    shapes_at, table_at, columns = setup[1], setup[2], setup[7]
    regions = [(shapes_at, 12 * groups), (table_at, 8 * columns * groups)]
    for operand, at in zip("ab", setup[SETUP_FIELDS + 4 * MAX_COLUMNS:], strict=True):
        if int.from_bytes(view.raw(view.lvalue[f"mainloop.layout_sf{operand}"]), "little") != at:
            raise AssertionError(f"scale_{operand}: the GEMM reads its layouts where the setup does not write them")
        view.at(at, torch.uint8, (SCALE_LAYOUT_BYTES * groups,), (1,), f"setup.scale_layouts[{operand}]")
        regions.append((at, SCALE_LAYOUT_BYTES * groups))
    regions.sort()
    for (start, size), (after, _) in itertools.pairwise(regions):
        if start + size > after:
            raise AssertionError(f"the setup's arrays overlap: {regions}")


def fill_groups(setup: tuple, offsets: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """What gemmgen/include/gemmgen/grouped.hpp's `fill` writes for a Setup block (its fields, as
    runtime.grouped.SETUP unpacks them): each group's (M, N, K) and its column values
    (tests/runtime/test_grouped_oracle.py runs the C++ on the host against this)."""
    groups, rows, n, k, columns, swapped, m, k_grouped, token_align, masked, zero = setup[3:SETUP_FIELDS]
    c = MAX_COLUMNS
    base, per_row, per_block, per_group = (setup[SETUP_FIELDS + i * c:SETUP_FIELDS + (i + 1) * c] for i in range(4))
    bounds = masked_group_bounds(offsets[:groups], masked) if masked else group_bounds(offsets[:groups], rows)
    if k_grouped:  # an empty group: K = 1 over zeros (A's and B's columns, which move with its first token)
        shapes = [[m, n, max(end - start, 1)] for start, end in bounds]
    else:
        shapes = [[n, end - start, k] if swapped else [end - start, n, k] for start, end in bounds]

    align = token_align if k_grouped else 0

    def value(c: int, g: int, start: int, end: int) -> int:
        if k_grouped and start == end and (per_block[c] if align else per_row[c] or per_block[c]):
            return zero
        at = k_grouped_token_column(g, start, align)
        return base[c] + per_row[c] * at + per_block[c] * (start // 128) + per_group[c] * g

    table = [[value(c, g, start, end) for c in range(columns)] for g, (start, end) in enumerate(bounds)]
    return shapes, table

"""`recipe.compile()` for a grouped (MoE) recipe: each group of rows of A through its own B.

    kernel = moe.compile()
    d = kernel(a, b, offsets, bias=bias)   # a: rows x K, b: G x K x N, offsets: int32 (G,)
    d = kernel(a3, b, masked_m, bias=bias) # the masked layout: a3 G x max_m x K, d G x max_m x N

In the masked layout (DeepGEMM's, for decode under CUDA graphs: fixed shapes) group g's rows are
its first masked_m[g] of a3[g]; the other rows are neither read nor written. The kernel is the
same; only the setup kernel's rows differ (`Setup::masked_rows`).

A call checks its arguments (gemmgen.InvalidArgument before any launch), allocates D and one
device buffer, and launches two kernels on the current stream. The first (`<entry>_groups`,
gemmgen/include/gemmgen/grouped.hpp) turns `offsets` into the per-group shapes, pointers and
strides CUTLASS's grouped kernel reads; the second is the GEMM. The host never reads `offsets`:
no synchronization, and the pair can be captured in a CUDA graph.

The buffer holds CUTLASS's workspace (per-SM copies of the tensor maps the kernel rewrites for each
group) and the per-group arrays. It is allocated per call from torch's caching allocator, on the
call's stream, so calls on different streams never share one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..codegen import sm100
from ..codegen.fields import REGISTER_LOADS, REGISTER_STORES, reads_scale_layouts
from ..config import Arch, KernelConfig
from ..errors import InvalidArgument
from ..ir import Columns, EpilogueIR, Operand, RecipeIR
from ..ir.microscaling import BLOCK_COLUMNS, BLOCK_ROWS
from ..ir.reference import evaluate_epilogue, masked_rows
from ..types import Layout, OperandKind
from . import driver, scheduler, tma
from .arguments import TensorMapEncoder
from .base import Hardware, KernelBase, argument_signature, padded_strides, put_bounded
from .grouped_checks import GroupedCall, check_grouped_call, grouped_input_spans
from .output_checks import check_no_alias, check_output, output_span
from .problem import TensorArg

if TYPE_CHECKING:
    from ..compile import CompiledKernel

MODE_GROUPED = 4  # cutlass::gemm::GemmUniversalMode::kGrouped
MAX_COLUMNS = 18  # gemmgen::grouped::MaxColumns
SCALE_LAYOUT_BYTES = 20  # gemmgen::grouped::ScaleLayoutBytes: one group's scale layout of A or B
# gemmgen::grouped::Setup: its scalars (offsets, shapes, table; groups, rows, n, k, columns, swapped,
# m, k_grouped, token_align, masked_rows; zero), then base, per_row, per_block and per_group, then the layouts
SETUP_SCALARS = "<QQQiiiiiiiiiiq"
SETUP_FIELDS = 14  # how many scalars SETUP unpacks before the columns
SETUP = struct.Struct(f"{SETUP_SCALARS}{4 * (str(MAX_COLUMNS) + 'q')}QQ")
SETUP_BASES = struct.calcsize(SETUP_SCALARS)  # where Setup::base starts
SETUP_BLOCK = 128  # threads per block of the setup kernel: one per group
_MAP_BYTES = 128  # sizeof(cute::TmaDescriptor)
_MAP_ALIGN = 64  # MinTensorMapWorkspaceAlignment


def _round(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets in the per-call buffer: the workspace as CUTLASS's to_underlying_arguments
    splits it (the epilogue's tensor maps, then the mainloop's, per SM), then the group arrays."""

    epilogue_maps: int
    mainloop_maps: int
    shapes: int  # int32 (M, N, K) per group
    table: int  # int64 columns x groups
    size: int
    scale_layouts: tuple[int, int] = (0, 0)  # A's and B's scale layout per group, where the setup writes them

    @classmethod
    def of(cls, groups: int, columns: int, sm_count: int, has_source: bool, arch: Arch = Arch.SM90A,
           scale_layouts: bool = False, mainloop_map_count: int = 2) -> BufferLayout:
        """`mainloop_map_count`: the maps the main loop rewrites per group (A's and B's, and a microscaled
        kernel's two of scales: `codegen.sm100.smem.mainloop_maps`)."""
        # sm90: two epilogue warp groups' D maps, and C's; sm100: D's and C's
        d_maps = 1 if arch is Arch.SM100A else 2
        epilogue = sm_count * (d_maps + int(has_source)) * _MAP_BYTES
        mainloop_at = _round(epilogue, _MAP_ALIGN)
        shapes_at = _round(mainloop_at + sm_count * mainloop_map_count * _MAP_BYTES, _MAP_ALIGN)  # CUTLASS's workspace
        table_at = _round(shapes_at + 12 * groups, 16)
        end = table_at + 8 * columns * groups
        if not scale_layouts:
            return cls(0, mainloop_at, shapes_at, table_at, end)
        layouts_a = _round(end, 16)
        layouts_b = _round(layouts_a + SCALE_LAYOUT_BYTES * groups, 16)
        return cls(0, mainloop_at, shapes_at, table_at, _round(layouts_b + SCALE_LAYOUT_BYTES * groups, 16),
                   (layouts_a, layouts_b))


class Column(NamedTuple):
    """One per-group array the setup kernel fills: value(g) = base + per_row * first row +
    per_block * (first row // 128) + per_group * g."""

    field: str  # the Params field that points at the array
    base: int
    per_row: int
    per_group: int
    per_block: int = 0


class GroupedArguments:
    """The setup kernel's `Setup` and the GEMM's Params for one call, from the checked call, D and
    the buffer's address. Values follow CUTLASS's host code for grouped kernels (checked field by
    field by tests/runtime/test_oracle.py).

    `recipe` is the kernel's view (`GeneratedKernel.kernel_recipe`). A swapped kernel computes each
    group as D_g^T = B_g^T A_g^T on the same memory: its A is the caller's B, its B the caller's A,
    its problem (N, M_g, K), and its row vectors are the caller's column vectors (per row of A)."""

    def __init__(self, recipe: RecipeIR, config: KernelConfig) -> None:
        g = recipe.gemm
        self.recipe, self.tile, self.cluster = recipe, config.tile, config.cluster
        self.arch, self.cta_tile = config.arch, config.cta_tile
        self.swapped = config.swap_ab
        self.scale_layouts = reads_scale_layouts(recipe, config)  # the setup writes them
        self.microscaling = g.microscaling
        self.mainloop_map_count = sm100.smem.mainloop_maps(recipe) if config.arch is Arch.SM100A else 2
        # a microscaled kernel's starting maps of its scales (the setup's layouts replace them per group)
        self.scale_maps = [tma.scale_block_template(config, recipe, x) for x in "ab"] if g.microscaling else []
        epi = recipe.epilogue
        matrices = [o for o in epi.operands if o.kind is OperandKind.MATRIX]
        self.source = matrices[0] if matrices else None
        self.scalars = [o.name for o in epi.operands if o.kind is OperandKind.SCALAR]
        self.vectors = [o for o in epi.operands if o.kind in (OperandKind.ROW, OperandKind.COL)]
        # the caller's A and B element widths in bits (packed fp4: 4), and D's
        self.bits = (g.b.bits, g.a.bits, g.d.bits) if self.swapped else (g.a.bits, g.b.bits, g.d.bits)
        # the tensor maps the kernel starts from: any shape, as it rewrites them per group before use
        self.a = tma.mainloop_template(recipe, config, "a")
        self.b = tma.mainloop_template(recipe, config, "b")
        self.c = tma.epilogue_template(recipe, config, self.source.dtype) if self.source else None
        # N/2- and 2N-column tensors, read and written from the registers (pairs.hpp): a per-group
        # pointer each (at the group's first row) and the stride between rows
        self.register_loads = [(f"epilogue.{kind}.{o.name}", o.name) for o in epi.operands
                               if o.kind is OperandKind.MATRIX for kind in REGISTER_LOADS.get(o.columns, ())]
        d_columns = epi.outputs[0].columns
        # D through the collective's TMA store, or (N/2 or 2N columns) a PairStore or DoubleStore
        self.d = tma.epilogue_template(recipe, config, g.d) if d_columns is Columns.FULL else None
        self.d_store = None if self.d else f"epilogue.{REGISTER_STORES[d_columns]}.d"
        self.d_field = f"{self.d_store}.ptr" if self.d_store else "epilogue.ptr_d"

    def k_grouped_columns(self, call: GroupedCall, d: TensorArg) -> list[Column]:
        """A K-grouped call's columns (`GemmSpec.k_grouped`): A's and B's pointers at the group's
        first token (A's column, B's row; over fp8 copies its aligned column), block scales from
        the group's first block (`reference.k_grouped_scale_block`: a row per block, with `per_block`
        and `per_group`), C's and D's at the group's matrix; then the strides: A's and B's leading
        dimensions and C's and D's row strides, the same for every group."""
        bits_a, bits_b, bits_d = self.bits
        g = self.recipe.gemm
        # a token's step is A's column stride and B's row stride, whichever is contiguous
        cols = [Column("mainloop.ptr_a", call.a.ptr, call.a.strides[1] * bits_a // 8, 0),
                Column("mainloop.ptr_b", call.b.ptr, call.b.strides[0] * bits_b // 8, 0)]
        if g.scaled:  # fp32 (blocks, M) and (blocks, N)
            for x in "ab":
                sf = call.operands[f"scale_{x}"]
                assert isinstance(sf, TensorArg)
                cols.append(Column(f"mainloop.ptr_sf{x}", sf.ptr, 0, 4 * sf.strides[0], 4 * sf.strides[0]))
        c = call.operands[self.source.name] if self.source else None
        if isinstance(c, TensorArg):
            cols.append(Column("epilogue.ptr_c", c.ptr, 0, c.strides[2] * self.source.dtype.nbytes))  # type: ignore[union-attr]
        cols.append(Column(self.d_field, d.ptr, 0, d.strides[2] * bits_d // 8))
        lda = call.a.strides[0 if g.layout_a is Layout.ROW else 1]
        ldb = call.b.strides[0 if g.layout_b is Layout.ROW else 1]
        cols += [Column("mainloop.stride_a", lda, 0, 0), Column("mainloop.stride_b", ldb, 0, 0)]
        if isinstance(c, TensorArg):
            cols.append(Column("epilogue.stride_c", c.strides[0], 0, 0))
        cols.append(Column("epilogue.stride_d", d.strides[0], 0, 0))
        return cols

    def columns(self, call: GroupedCall, d: TensorArg) -> list[Column]:
        """Pointers first (A, B, C, D, the vectors), then the strides (one int64 per group each):
        each pointer at the group's first row of A (A, C, D, column vectors) or at the group (B,
        row vectors), whichever of the kernel's operands the tensor is."""
        bits_a, bits_b, bits_d = self.bits
        kernel_a, kernel_b = ("b", "a") if self.swapped else ("a", "b")
        cols = [Column(f"mainloop.ptr_{kernel_a}", call.a.ptr, call.a.strides[0] * bits_a // 8, 0),
                Column(f"mainloop.ptr_{kernel_b}", call.b.ptr, 0, call.b.strides[2] * bits_b // 8)]
        if self.recipe.gemm.scaled:
            sa, sb = call.operands["scale_a"], call.operands["scale_b"]
            assert isinstance(sa, TensorArg) and isinstance(sb, TensorArg)
            if self.microscaling is not None:  # bytes: scale_a's group from block first // 128 + g on
                # (ir.microscaling's grouped blocked order), scale_b's per group
                block = sa.strides[0]
                cols += [Column(f"mainloop.ptr_sf{kernel_a}", sa.ptr, 0, block, block),
                         Column(f"mainloop.ptr_sf{kernel_b}", sb.ptr, 0, sb.strides[2])]
            else:  # fp32: scale_a from the group's first row, scale_b per group
                cols += [Column(f"mainloop.ptr_sf{kernel_a}", sa.ptr, 4 * sa.strides[0], 0),
                         Column(f"mainloop.ptr_sf{kernel_b}", sb.ptr, 0, 4 * sb.strides[2])]
        c = call.operands[self.source.name] if self.source else None
        if isinstance(c, TensorArg):
            cols.append(Column("epilogue.ptr_c", c.ptr, c.strides[0] * self.source.dtype.nbytes, 0))  # type: ignore[union-attr]
        cols.append(Column(self.d_field, d.ptr, d.strides[0] * bits_d // 8, 0))
        for prefix, name in self.register_loads:
            m = call.operands[name]
            assert isinstance(m, TensorArg)
            item = self.recipe.epilogue.operand(name).dtype.nbytes
            cols.append(Column(f"{prefix}.ptr", m.ptr, m.strides[0] * item, 0))
        per_row_kind = OperandKind.ROW if self.swapped else OperandKind.COL  # the caller's column vectors
        for o in self.vectors:
            v = call.operands[o.name]
            assert isinstance(v, TensorArg)
            field = f"epilogue.{'row' if o.kind is OperandKind.ROW else 'col'}.{o.name}.ptr"
            if o.kind is per_row_kind:
                cols.append(Column(field, v.ptr, o.dtype.nbytes, 0))
            else:
                cols.append(Column(field, v.ptr, 0, v.strides[2] * o.dtype.nbytes))
        # the one dynamic stride of each operand, in elements: A's and B's K-major or N-major leading dim
        b_ld = call.b.strides[0] if call.b.strides[1] == 1 else call.b.strides[1]
        cols += [Column(f"mainloop.stride_{kernel_a}", call.a.strides[0], 0, 0),
                 Column(f"mainloop.stride_{kernel_b}", b_ld, 0, 0)]
        if isinstance(c, TensorArg):
            cols.append(Column("epilogue.stride_c", c.strides[0], 0, 0))
        if self.d is not None:
            cols.append(Column("epilogue.stride_d", d.strides[0], 0, 0))
        return cols

    def setup(self, call: GroupedCall, columns: list[Column], buffer: int, layout: BufferLayout, zero: int = 0
              ) -> bytes:
        """The setup kernel's block; `zero`, a K-grouped call's: the address of max(M, N) zero
        elements of A's type, which an empty group's A and B point at (grouped.hpp)."""
        pad = [0] * (MAX_COLUMNS - len(columns))
        layouts = [buffer + at if self.scale_layouts else 0 for at in layout.scale_layouts]
        return SETUP.pack(call.offsets, buffer + layout.shapes, buffer + layout.table, call.groups, call.rows,
                          call.n, call.k, len(columns), int(self.swapped), call.m, int(self.recipe.gemm.k_grouped),
                          self.recipe.gemm.token_align, call.masked, zero, *[c.base for c in columns], *pad,
                          *[c.per_row for c in columns], *pad, *[c.per_block for c in columns], *pad,
                          *[c.per_group for c in columns], *pad, *layouts)

    def values(self, call: GroupedCall, columns: list[Column], buffer: int, layout: BufferLayout, sm_count: int,
               max_active_clusters: int, device_id: int, encode: TensorMapEncoder, d_stride: int
               ) -> dict[str, int | float | bytes]:
        """Every Params field by name (the grid is `scheduler.group_plan`'s); `d_stride` is D's row
        stride, in elements."""
        shapes = buffer + layout.shapes
        v: dict[str, int | float | bytes] = {"mode": MODE_GROUPED, "problem.groups": call.groups,
                                             "problem.shapes": shapes, "problem.host_shapes": 0,
                                             "scheduler.problem.groups": call.groups,
                                             "scheduler.problem.shapes": shapes, "scheduler.problem.host_shapes": 0}
        for i, col in enumerate(columns):
            v[col.field] = buffer + layout.table + 8 * i * call.groups
        # CUTLASS encodes each starting map with extents of 1 (A, B) or one tile (C, D; a CTA's on
        # sm100), zero strides and no batch mode, at its pointer array's address rounded down to 16
        # bytes (sm90) or at null (sm100)
        sm100 = self.arch is Arch.SM100A
        tm, tn = self.cta_tile[:2] if sm100 else self.tile[:2]

        def at(name: str) -> int:
            return 0 if sm100 else int(v[name]) & ~15

        # (the block-scaled collective's over the MMA's tile: CUTLASS's init_M, init_N and init_K)
        ea, eb, ek = self.tile if self.microscaling else (1, 1, 1)
        v["mainloop.tma_a"] = encode(_rank2(self.a.operand(at("mainloop.ptr_a"), ea, ek, 1, (0, 0, 0))))
        v["mainloop.tma_b"] = encode(_rank2(self.b.operand(at("mainloop.ptr_b"), eb, ek, 1, (0, 0, 0))))
        if sm100:  # the maps for a fallback cluster: copies (gemmgen launches a static cluster)
            v["mainloop.tma_a_fallback"], v["mainloop.tma_b_fallback"] = v["mainloop.tma_a"], v["mainloop.tma_b"]
            v.update({f"mainloop.cluster_shape_fallback.{a}": 0 for a in "xyz"})
        if self.c is not None:
            v["epilogue.tma_c"] = encode(_rank2(self.c.matrix(at("epilogue.ptr_c"), tm, tn, 1, (0, 0, 0))))
        if self.d is not None:
            v["epilogue.tma_d"] = encode(_rank2(self.d.matrix(at("epilogue.ptr_d"), tm, tn, 1, (0, 0, 0))))
        else:  # a register store's one row stride (each group's pointer is at its first row)
            v.update({f"{self.d_store}.stride_m": d_stride, f"{self.d_store}.stride_l": 0})
        for prefix, name in self.register_loads:
            m = call.operands[name]
            assert isinstance(m, TensorArg)
            v.update({f"{prefix}.stride_m": m.strides[0], f"{prefix}.stride_l": 0})
        if self.recipe.gemm.scaled:  # sm100: the setup's per-group layouts; sm90: never read
            v["mainloop.layout_sfa"], v["mainloop.layout_sfb"] = (
                (buffer + layout.scale_layouts[0], buffer + layout.scale_layouts[1]) if self.scale_layouts else (0, 0))
        if self.microscaling is not None:  # as CUTLASS starts them, at null: both over A's layout of one MMA
            # tile (tile_atom_to_shape_SFA for B's too)
            row_blocks = -(-self.tile[0] // BLOCK_ROWS)
            k_blocks = -(-self.tile[2] // (self.microscaling.vector * BLOCK_COLUMNS))
            for x, template in zip("ab", self.scale_maps, strict=True):
                v[f"mainloop.tma_sf{x}"] = v[f"mainloop.tma_sf{x}_fallback"] = encode(
                    template.encode(0, row_blocks, k_blocks, 1))
        v["epilogue.tensormaps"] = buffer + layout.epilogue_maps
        v["mainloop.tensormaps"] = buffer + layout.mainloop_maps
        v["workspace"] = buffer
        for name in self.scalars:  # a number, or a tensor's value per group (the epilogue reads it at the group)
            value = call.operands[name]
            if isinstance(value, TensorArg):
                v[f"epilogue.scalar.{name}.ptr"] = value.ptr
                v[f"epilogue.scalar.{name}.batch_stride"] = value.strides[2]
            else:
                v[f"epilogue.scalar.{name}.value"] = float(value)
                v[f"epilogue.scalar.{name}.batch_stride"] = 0
        v.update({"hw_info.device_id": device_id, "hw_info.sm_count": sm_count,
                  "hw_info.max_active_clusters": max_active_clusters})
        v.update(self.scheduler(sm_count, max_active_clusters).fields)
        return v

    def scheduler(self, sm_count: int, max_active_clusters: int) -> scheduler.SchedulerPlan:
        """The group scheduler's Params and grid; its tiles are the CTAs' (half a pair's MMA tile)."""
        return scheduler.group_plan(self.cta_tile, self.cluster, sm_count, max_active_clusters,
                                    occupancy=self.arch is not Arch.SM100A)


def _rank2(args: tma.EncodeArgs) -> tma.EncodeArgs:
    """A map without its batch mode (a grouped kernel's operands have a stride-0 L of one)."""
    return args._replace(rank=2, dims=args.dims[:2], strides=args.strides[:1], box=args.box[:2],
                         elem_strides=args.elem_strides[:2])


class PreparedGroupedCall(NamedTuple):
    """Both launches of a call; `params is None` when there is nothing to launch."""

    output: torch.Tensor
    buffer: torch.Tensor | None
    setup: bytes | None
    setup_grid: tuple[int, int, int]
    params: bytes | None
    grid: tuple[int, int, int]
    device_index: int


@dataclass
class _GroupedPlan:
    """The part of a call that depends on neither D's address nor the buffer's: kept per signature."""

    call: GroupedCall
    device_index: int
    d_shape: tuple[int, ...]
    d_strides: tuple[int, ...]
    d_template: torch.Tensor  # empty, D's dtype, on the call's device: D is its new_empty_strided
    bytes_template: torch.Tensor  # empty, uint8, on the call's device: the buffer is its new_empty
    columns: list[Column] | None = None  # None: nothing to launch (an empty dimension, or K = 0)
    d_at: int = 0  # where D's column's base (D's address, set per call) sits in the setup block
    layout: BufferLayout = BufferLayout(0, 0, 0, 0, 0)
    zero: torch.Tensor | None = None  # K-grouped: what an empty group's A and B read (`GroupedArguments.setup`)
    sm_count: int = 0
    clusters: int = 0
    grid: tuple[int, int, int] = (0, 0, 0)
    setup_grid: tuple[int, int, int] = (0, 0, 0)
    blocks: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # (Params, setup) by buffer address


class GroupedKernel(KernelBase):
    """A compiled grouped recipe, callable on torch tensors: `kernel(a, b, offsets, *operands)` (see
    the module docstring)."""

    def __init__(self, compiled: CompiledKernel, *, encoder: TensorMapEncoder | None = None,
                 hardware: Hardware | None = None, require_cuda: bool = True) -> None:
        super().__init__(compiled, encoder=encoder, hardware=hardware, require_cuda=require_cuda)
        self._args = GroupedArguments(compiled.generated.kernel_recipe, self._config)
        self._loaded_pairs: dict[int, tuple[driver.LoadedFunction, Any]] = {}  # (GEMM, setup kernel) per device

    def _launch(self, device_index: int, launch: tuple) -> None:
        """Both kernels: the setup kernel, then the GEMM. (buffer, setup block, setup grid, Params,
        grid): the buffer is what both read, kept alive until both launches are enqueued."""
        _buffer, setup, setup_grid, params, grid = launch
        gemm, setup_function = self._loaded_pairs.get(device_index) or self._functions(device_index)
        stream = driver.current_stream(device_index)
        driver.launch_function(setup_function, setup, setup_grid, SETUP_BLOCK, 0, stream)
        driver.launch(gemm, params, grid, self.compiled.info.max_threads, self._config.cluster,
                      self.compiled.info.smem_bytes, stream)

    def _functions(self, device_index: int) -> tuple[driver.LoadedFunction, Any]:
        """The GEMM and the setup kernel of the module loaded for the device (once)."""
        pair = self._loaded_pairs.get(device_index)
        if pair is None:
            gemm = self._function(device_index)
            setup = driver.module_function(gemm, f"{self.compiled.entry}_groups")
            pair = self._loaded_pairs[device_index] = (gemm, setup)
        return pair

    def prepare(self, a: Any, b: Any, *args: Any, out: Any = None, **operands: Any) -> PreparedGroupedCall:
        """Check, allocate and build both launches (everything but the driver calls). The checks
        and the columns are kept per call signature, and Params and the setup block per buffer
        address: a repeated call only allocates D and the buffer, and writes D's address into the
        setup block."""
        (d,), launch, index = self._prepare(a, b, args, out, operands)
        if launch is None:
            return PreparedGroupedCall(d, None, None, (0, 0, 0), None, (0, 0, 0), index)
        buffer, setup, setup_grid, params, grid = launch
        return PreparedGroupedCall(d, buffer, setup, setup_grid, params, grid, index)

    def _prepare(self, a: Any, b: Any, args: tuple, out: Any, operands: dict
                 ) -> tuple[tuple[torch.Tensor, ...], tuple | None, int]:
        if args:
            offsets, args = args[0], args[1:]
        elif "offsets" in operands:
            operands = dict(operands)
            offsets = operands.pop("offsets")
        else:
            raise InvalidArgument("offsets: missing; a grouped kernel takes (a, b, offsets, *operands), offsets an "
                                  "int32 tensor of one entry per group of b: where its rows of a end")
        if self._on_driver and not driver.THREAD.has_context:
            self._bind_context(a)
        values = self._operand_values(args, operands)
        try:
            key: tuple | None = (argument_signature(a), argument_signature(b), argument_signature(offsets),
                                 *map(argument_signature, values), None if out is None else argument_signature(out)) \
                if values is not None else None
        except (TypeError, RuntimeError):  # not a number or a strided tensor: the checks say what
            key = None
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            named = self._named(args, operands)
            plan = self._remember(key, lambda: self._plan(a, b, offsets, named, out))
        call = plan.call
        d = out if out is not None else plan.d_template.new_empty_strided(plan.d_shape, plan.d_strides)
        if call.masked and out is None:  # the masked layout: D is (groups, max_m, N) (`out` is already)
            d = d.view(call.groups, call.masked, d.shape[-1])
        if plan.columns is None:
            if call.k == 0 and 0 not in (call.rows, call.n, call.groups):
                self._epilogue_of_zero(d, call, self._named(args, operands), offsets)
            return (d,), None, plan.device_index
        buffer = plan.bytes_template.new_empty(plan.layout.size)
        addr = buffer.data_ptr()
        blocks = plan.blocks.get(addr)
        if blocks is None:  # the setup block with D's base 0, patched per call: D is allocated per call
            fields = self._args.values(call, plan.columns, addr, plan.layout, plan.sm_count, plan.clusters,
                                       max(plan.device_index, 0), self._encode, plan.d_strides[-2])
            zero = plan.zero.data_ptr() if plan.zero is not None else 0
            blocks = (bytes(self._writer.write(fields)), self._args.setup(call, plan.columns, addr, plan.layout, zero))
            put_bounded(plan.blocks, addr, blocks)
        params, setup = blocks
        setup = setup[:plan.d_at] + d.data_ptr().to_bytes(8, "little") + setup[plan.d_at + 8:]
        return (d,), (buffer, setup, plan.setup_grid, params, plan.grid), plan.device_index

    def _plan(self, a: Any, b: Any, offsets: Any, operands: dict, out: Any) -> _GroupedPlan:
        """Check every argument and work out what does not depend on D's or the buffer's address."""
        call = check_grouped_call(self._ir, a, b, offsets, operands, require_cuda=self._require_cuda)
        device_index = self._device_index(call.device)
        k_grouped = self._ir.gemm.k_grouped
        # K-grouped: a G x M x N D; else rows x N (N/2 or 2N columns over pairs: `ir.columns`)
        shape: tuple[int, ...] = (call.groups, call.m, call.n) if k_grouped else \
            (call.rows, self._ir.outputs[0].columns.extent(call.n))
        strides = padded_strides(shape, self._ir.gemm.d.torch)
        if out is not None:
            if k_grouped:
                check_output("out", out, self._ir.gemm.d, shape, call.device, True, call.groups)
            elif call.masked:  # (groups, max_m, N), its rows one stride apart: D's rows as the kernel writes them
                check_output("out", out, self._ir.gemm.d, (call.groups, call.masked, shape[1]), call.device, True,
                             call.groups)
                if out.stride(0) != call.masked * out.stride(1) and call.groups > 1:
                    raise InvalidArgument(f"out: the masked layout's D is (groups, max_m, N) with its groups and "
                                          f"rows one stride apart, got strides {tuple(out.stride())}")
            else:
                check_output("out", out, self._ir.gemm.d, shape, call.device, False, 1)
            check_no_alias("out", output_span(out), grouped_input_spans(call))
            strides = tuple(out.stride()[1:] if call.masked else out.stride())
        plan = _GroupedPlan(call, device_index, shape, strides, torch.empty(0, dtype=self._ir.gemm.d.torch,
                                                                            device=call.device),
                            torch.empty(0, dtype=torch.uint8, device=call.device))
        # nothing to launch where D is empty; K = 0 (rows-grouped; a K-grouped D_g is then the epilogue of zero)
        if 0 in ((call.m, call.n, call.groups) if k_grouped else (call.rows, call.n, call.groups, call.k)):
            return plan
        plan.sm_count, plan.clusters = self._hardware(device_index)
        if k_grouped:
            plan.columns = self._args.k_grouped_columns(call, TensorArg(0, (strides[1], 1, strides[0])))
            # what an empty group reads: A's and B's zeros, or over fp8 copies (their own zero column) zero scales
            zero_type = torch.float32 if self._ir.gemm.token_align else self._ir.gemm.a.torch
            plan.zero = torch.zeros(max(call.m, call.n), dtype=zero_type, device=call.device)
        else:
            plan.columns = self._args.columns(call, TensorArg(0, (strides[0], 1, 0)))
        plan.d_at = SETUP_BASES + 8 * next(i for i, c in enumerate(plan.columns) if c.field == self._args.d_field)
        plan.layout = BufferLayout.of(call.groups, len(plan.columns), plan.sm_count, self._args.source is not None,
                                      self._config.arch, self._args.scale_layouts, self._args.mainloop_map_count)
        plan.grid = self._args.scheduler(plan.sm_count, plan.clusters).grid
        plan.setup_grid = (-(-call.groups // SETUP_BLOCK), 1, 1)
        return plan

    def _epilogue_of_zero(self, d: torch.Tensor, call: GroupedCall, operands: dict, offsets: torch.Tensor) -> None:
        """K = 0: each group's epilogue applied to a zero accumulator, by torch ops on the stream (no
        sync); rows in no group are left as they are, as the kernel leaves them."""
        _, group, covered = row_groups(offsets, call.rows, call.groups, call.masked)
        acc = torch.zeros((call.rows, call.n), dtype=torch.float32, device=d.device)  # D: N/2 wide over pairs
        epilogue_operands = {o.name: operands[o.name] for o in self._ir.epilogue.operands}
        if call.masked:  # per row of A: (groups, max_m, ...) as rows
            epilogue_operands = masked_rows(self._ir, d, epilogue_operands)[1]
        value = evaluate_epilogue(vectors_as_matrices(self._ir), acc,
                                  operands_per_row(self._ir, epilogue_operands, group))[0]
        flat = d.view(call.rows, d.shape[-1])
        flat.copy_(torch.where(covered.reshape(-1, 1), value, flat))


def vectors_as_matrices(ir: RecipeIR) -> EpilogueIR:
    """The epilogue with its row and column vectors and tensor scalars read as tensors broadcast as
    given (already gathered per row of A: a row's group's vector or scalar, the row's entry)."""
    ops = tuple(Operand(o.name, OperandKind.MATRIX if _per_row(o) else o.kind, o.dtype) for o in ir.epilogue.operands)
    return EpilogueIR(ir.epilogue.nodes, ir.epilogue.outputs, ops)


def operands_per_row(ir: RecipeIR, operands: dict[str, Any], group: torch.Tensor) -> dict[str, Any]:
    """The operands as `vectors_as_matrices` reads them: each row's group's row vector and tensor
    scalar, column vectors as columns, the rest as given (gathering is differentiable: row vectors'
    and tensor scalars' gradients sum back per group)."""
    kinds = {o.name: o.kind for o in ir.epilogue.operands}
    return {k: v[group] if kinds[k] is OperandKind.ROW else
            v[group].reshape(-1, 1) if kinds[k] is OperandKind.SCALAR and isinstance(v, torch.Tensor) else
            v.reshape(-1, 1) if kinds[k] is OperandKind.COL else v for k, v in operands.items()}


def _per_row(o: Operand) -> bool:
    """Whether the grouped backward's torch path reads `o` gathered per row of A (`operands_per_row`)."""
    return o.kind in (OperandKind.ROW, OperandKind.COL) or (o.kind is OperandKind.SCALAR and bool(o.per_batch))


def row_groups(offsets: torch.Tensor, rows: int, groups: int, masked: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clamped group ends, each row's group (clamped to a valid index), whether the row is in a
    group), by torch ops on the offsets' device: reference.group_bounds, without reading them; with
    `masked` (max_m), the masked layout's (`offsets` each group's count: reference.masked_group_bounds),
    its ends each group's last row + 1, over all groups * max_m rows."""
    if masked:
        index = torch.arange(rows, device=offsets.device)
        group = index // masked
        ends = torch.arange(1, groups + 1, device=offsets.device, dtype=offsets.dtype) * masked
        return ends, group, index % masked < offsets.clamp(0, masked)[group]
    ends = torch.cummax(offsets.clamp(0, rows), 0).values
    group = torch.searchsorted(ends, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)
    return ends, group.clamp(max=max(groups - 1, 0)), group < groups

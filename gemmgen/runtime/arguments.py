"""The kernel's argument block (CUTLASS's Params, as NVRTC laid it out), built in Python.

Values come from ports of CUTLASS's host logic (tma.py, scheduler.py) and the problem; offsets
and the defaults of constant fields come from the layout probe compiled into the kernel itself
(codegen.fields, each arch's params). Nothing here needs a host compiler or the CUDA driver:
descriptors are produced by a `TensorMapEncoder`, the driver at run time or a recording stand-in
in tests. sm100 kernels differ in their A/B maps (`tma`), the fallback pair of them, and their
schedulers (`scheduler.sm100_plan`, `scheduler.sm100_stream_k_plan`); the epilogue's fields are
the same visitors'.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from ..codegen import sm100
from ..codegen.fields import REGISTER_LOADS, REGISTER_STORES, ParamsLayout, sinks_d
from ..codegen.sm90.geometry import scale_tma, scales_per_tile
from ..codegen.visitor_types import REDUCTION_KIND
from ..config import Arch, EpilogueCollective, KernelConfig, Schedule, TileScheduler
from ..errors import InvalidArgument
from ..ir import LSE_IDENTITY, Columns, RecipeIR, Reduction
from ..ir.microscaling import BLOCK_COLUMNS, BLOCK_ROWS, blocked_shape
from ..ir.ops import RANDOM_OPS
from ..types import Layout, OperandKind
from . import scheduler, tma
from .problem import Problem, TensorArg

MODE_GEMM, MODE_BATCHED = 0, 2  # cutlass::gemm::GemmUniversalMode
WORKSPACE_ALIGN = 16  # cutlass::MinWorkspaceAlignment
_INT32_MAX = 2**31 - 1
SCALE_BLOCK_BYTES = BLOCK_ROWS * BLOCK_COLUMNS  # one block of a microscaled operand's scales (UE8M0)

#: Turns encode arguments into a 128-byte CUtensorMap.
TensorMapEncoder = Callable[[tma.EncodeArgs], bytes]

@dataclass(frozen=True)
class Workspace:
    """The memory a launch's Params point into: its size, where each pointer field points (an
    offset into it) and the byte ranges that must be zero at launch."""

    size: int
    pointers: tuple[tuple[str, int], ...] = ()
    zeroed: tuple[tuple[int, int], ...] = ()


class ArgumentBuilder:
    """Computes the runtime fields of one kernel's Params; what is fixed per kernel is prepared once."""

    def __init__(self, recipe: RecipeIR, config: KernelConfig) -> None:
        self.tile, self.cluster = config.tile, config.cluster
        # sm100: a second pair of A/B maps for a fallback cluster (copies: the cluster is static)
        self.sm100 = config.arch is Arch.SM100A
        self.mma_ctas = sm100.geometry.mma_ctas(config) if self.sm100 else 1
        self.a = tma.mainloop_template(recipe, config, "a")
        self.b = tma.mainloop_template(recipe, config, "b")
        # block scales: (operand, Params prefix, granularity along M or N, granularity along K, TMA or None)
        self.block_scales: list[tuple[str, str, int, int, tma.TmaTemplate | None]] = []
        if recipe.gemm.block_scale is not None:
            gm, gn, gk = recipe.gemm.block_scale
            per_tile = scales_per_tile(config, recipe)
            # sm100's blockwise main loop reads the scales with cp.async only
            tma_loads = (False, False) if self.sm100 else scale_tma(config, recipe)
            for i, (operand, gran, loaded) in enumerate(zip("ab", (gm, gn), tma_loads, strict=True)):
                template = tma.block_scale_template(per_tile[i]) if loaded else None
                self.block_scales.append((f"scale_{operand}", f"mainloop.layout_sf{operand}", gran, gk, template))
        # microscaled: (operand, Params prefix, the TMA of its scales) per A and B
        fmt = recipe.gemm.microscaling
        self.microscaling = fmt
        self.microscales = [(f"scale_{x}", f"mainloop.layout_sf{x}", tma.scale_block_template(config, recipe, x))
                            for x in "ab"] if fmt is not None else []
        epi = recipe.epilogue
        matrices = [o for o in epi.operands if o.kind is OperandKind.MATRIX and o.columns is Columns.FULL]
        # a matrix for every batch, read into registers (Sm90AuxLoad<0>): a pointer and the stride
        # between D's rows (columns, when D is column-major); per-batch ones with TMA (C first)
        self.shared = [(f"epilogue.shared_load.{o.name}", o.name, int(recipe.gemm.layout_d is Layout.COL))
                       for o in matrices if not o.per_batch]
        matrices = [o for o in matrices if o.per_batch]
        # N/2- and 2N-column tensors, read and written from the registers (pairs.hpp): a pointer and
        # strides each (a 2N one's two halves read by two visitors)
        self.half_loads = [(f"epilogue.{kind}.{o.name}", o.name) for o in epi.operands
                           if o.kind is OperandKind.MATRIX
                           for kind in REGISTER_LOADS.get(o.columns, ())]
        half_stores = {o.name: f"epilogue.{REGISTER_STORES[o.columns]}.{o.name}" for o in epi.outputs
                       if o.reduce is None and o.columns is not Columns.FULL}
        self.scalars = [(f"epilogue.scalar.{o.name}.value", o.name) for o in epi.operands
                        if o.kind is OperandKind.SCALAR and not o.per_batch]
        # vectors, and scalars per batch (read through their pointer): (field prefix, name, per batch)
        by_pointer = [o for o in epi.operands
                      if o.kind in (OperandKind.ROW, OperandKind.COL) or (o.kind is OperandKind.SCALAR and o.per_batch)]
        self.vectors = [(f"epilogue.{o.kind.value}.{o.name}", o.name, bool(o.per_batch)) for o in by_pointer]
        # seeds: a Random node's Params per (seed, stream) drawn (coordinates.hpp's SeedArguments)
        self.seeds: list[tuple[str, str]] = sorted(
            {(f"epilogue.seed.{n.name}.{int(n.attr)}", str(n.name)) for n in epi.nodes  # type: ignore[arg-type]
             if n.op in RANDOM_OPS})
        self.loads = [("epilogue.tma_c" if i == 0 else f"epilogue.aux_load.{o.name}.tma", o.name,
                       tma.epilogue_template(recipe, config, o.dtype)) for i, o in enumerate(matrices)]
        self.stores = [(f"epilogue.aux_store.{o.name}.tma", o.name, tma.epilogue_template(recipe, config, o.dtype))
                       for o in epi.outputs[1:] if o.reduce is None and o.name not in half_stores
                       and o.column_blocks is None]
        self.reductions = [(f"epilogue.amax.{o.name}", o.name) for o in epi.outputs[1:]
                           if o.reduce is not None and o.dim is None and o.column_blocks is None]
        # vector reductions: (visitor kind, Params field prefix, output name), in the outputs' order
        kinds = {o.name: REDUCTION_KIND[o.dim] for o in epi.outputs[1:] if o.dim is not None and o.blocks is None}
        self.vector_reductions = [(kind, f"epilogue.{kind}.{name}", name) for name, kind in kinds.items()]
        # where each starts: its Reduction's identity (0 but for max and min; a log-sum-exp's state a pair)
        self.identities: list[tuple[str, float]] = []
        for o in epi.outputs[1:]:
            if o.reduce is not None and o.blocks is None and o.column_blocks is None:
                prefix = f"epilogue.{'amax' if o.dim is None else REDUCTION_KIND[o.dim]}.{o.name}"
                if o.reduce is Reduction.LSE:
                    self.identities += zip((f"{prefix}.identity", f"{prefix}.identity_sum"), LSE_IDENTITY,
                                           strict=True)
                else:
                    self.identities.append((f"{prefix}.identity", o.reduce.identity))
        # the bytes of each vector reduction's partial values (its ElementCompute)
        self.partial_bytes = {o.name: 8 if o.reduce is Reduction.LSE else 4 for o in epi.outputs[1:]}
        self.over_batch = {o.name for o in epi.outputs if o.over_batch}
        self.kernel_workspace = config.schedule is Schedule.COOPERATIVE  # only its Params keep the pointer
        self.stream_k = config.tile_scheduler is TileScheduler.STREAM_K
        self.splits = config.splits  # the stream-K scheduler's split count and reduction order:
        self.deterministic = config.deterministic  # launch arguments
        self.d = None if "d" in half_stores else ("epilogue.tma_d", "d",
                                                  tma.epilogue_template(recipe, config, recipe.gemm.d))
        # registers write D, and the collective's D store goes to its module's sink (`fields.sinks_d`)
        self.d_sink = tma.epilogue_template(recipe, config, recipe.gemm.d) if sinks_d(recipe, config.arch) else None
        # per output index (0 is D): the field prefix written per call and the tensor map's
        # template, "ptr" for a reduction's pointer, "half" for a pointer and strides
        maps: dict[str, tuple[str, tma.TmaTemplate | str]] = {
            name: (field, template) for field, name, template in ((*([self.d] if self.d else []), *self.stores))}
        maps.update({name: (field, "ptr") for field, name in self.reductions})
        maps.update({name: (prefix, "ptr") for _, prefix, name in self.vector_reductions})
        maps.update({name: (prefix, "half") for name, prefix in half_stores.items()})
        # the factors of D's row blocks (row_blocks.hpp): a pointer and (M, N / block, L) strides
        maps.update({o.name: (f"epilogue.row_blocks.{o.name}", "blocks") for o in epi.outputs
                     if o.reduce is Reduction.BLOCK_SCALE})
        # a copy's column blocks (column_blocks.hpp): its pointer and (N, M, L) strides, its scales'
        copies = {o.column_blocks: o.name for o in epi.outputs if o.column_blocks and o.reduce is None}
        maps.update({o.name: (f"epilogue.column_blocks.{copies[o.column_blocks]}",
                              "column_scales" if o.reduce else "column_blocks")
                     for o in epi.outputs if o.column_blocks})
        self.by_index = [maps[o.name] for o in epi.outputs]
        self.outputs = [o.name for o in epi.outputs]
        # the direct epilogue (direct.hpp): every M x N tensor, read or written, a pointer and strides
        self.matrices: list[tuple[str, str, bool]] = []
        self.stride_mode = int(recipe.gemm.layout_d is Layout.COL)  # D's non-unit stride: between rows, or columns
        if config.epilogue is EpilogueCollective.DIRECT:
            self.matrices = [(f"epilogue.matrix.{o.name}", o.name, bool(o.per_batch)) for o in epi.operands
                             if o.kind is OperandKind.MATRIX]
            self.shared, self.loads, self.stores, self.d, self.d_sink = [], [], [], None, None
            self.by_index = [(f"epilogue.matrix.{o.name}", "matrix") if o.reduce is None else
                             (f"epilogue.amax.{o.name}", "ptr") for o in epi.outputs]

    def values(self, p: Problem, encode: TensorMapEncoder, outputs: bool = True, workspace: int = 0
               ) -> tuple[dict[str, int | float | bytes], tuple[int, int, int]]:
        """Every runtime field by name (constant fields keep their probed defaults), and the grid.
        With `outputs=False` the tensor maps of D and the aux outputs and the workspace pointers are
        left out (written per call); else the workspace (`self.workspace(p)`) is at `workspace`."""
        v, grid = self.shape_values(p)
        v.update(self.input_values(p, encode))
        if outputs:
            v.update({field: workspace + offset for field, offset in self.workspace(p).pointers})
            for i, o in enumerate(self.outputs):
                for field, raw in self.output_map(i, p, p.aux.get(o, p.d), encode):
                    v[field] = _unpacked(field, raw)
        return v, grid

    def shape_values(self, p: Problem) -> tuple[dict[str, int | float | bytes], tuple[int, int, int]]:
        """The fields that do not depend on any address (extents, scalars, hardware, scheduler), and the grid."""
        v: dict[str, int | float | bytes] = {"mode": MODE_BATCHED if p.l > 1 else MODE_GEMM, "problem.m": p.m,
                                             "problem.n": p.n, "problem.k": p.k, "problem.l": p.l}
        for field, name in self.scalars:
            v[field] = float(p.operands[name])  # type: ignore[arg-type]
        # one value or vector per batch, contiguous (checks.check_reduction_output); a batch stride of 0
        # reduces over the batches too (CUTLASS's reductions combine every batch into one then)
        for field, name in self.reductions:
            v[f"{field}.batch_stride"] = 1 if p.l > 1 and name not in self.over_batch else 0
        for kind, prefix, name in self.vector_reductions:
            per_batch = p.l > 1 and name not in self.over_batch
            v[f"{prefix}.batch_stride"] = (p.n if kind == "row_reduction" else p.m) if per_batch else 0
        v.update(self.identities)
        for name, prefix, gran, gk, _ in self.block_scales:  # the scales' layout: extents and strides
            strides = p.operands[name].strides  # type: ignore[union-attr]
            blocks, k_blocks = _scale_blocks(p, name, gran, gk)
            v.update({f"{prefix}.blocks": blocks, f"{prefix}.k_blocks": k_blocks, f"{prefix}.l": p.l,
                      f"{prefix}.k_stride": strides[1], f"{prefix}.batch_stride": strides[2]})
        for name, prefix, _ in self.microscales:  # the blocked order's extents and byte strides (ir.microscaling)
            blocks, k_blocks = self._scale_row_blocks(p, name)
            v.update({f"{prefix}.blocks": blocks, f"{prefix}.k_blocks": k_blocks, f"{prefix}.l": p.l,
                      f"{prefix}.block_stride": k_blocks * SCALE_BLOCK_BYTES,
                      f"{prefix}.batch_stride": blocks * k_blocks * SCALE_BLOCK_BYTES})
        v.update({"hw_info.device_id": p.device_id, "hw_info.sm_count": p.sm_count,
                  "hw_info.max_active_clusters": p.max_active_clusters})
        if self.sm100:
            v.update({f"mainloop.cluster_shape_fallback.{a}": 0 for a in "xyz"})
        plan = self._scheduler(p)
        v.update(plan.fields)
        return v, plan.grid

    def _scale_row_blocks(self, p: Problem, name: str) -> tuple[int, int]:
        """(row blocks, K blocks) of a microscaled operand's scales in the blocked order."""
        assert self.microscaling is not None
        rows, columns = blocked_shape(p.m if name == "scale_a" else p.n, p.k, self.microscaling)
        return rows // BLOCK_ROWS, columns // BLOCK_COLUMNS

    def _scheduler(self, p: Problem) -> scheduler.SchedulerPlan:
        if self.sm100 and self.stream_k:
            return scheduler.sm100_stream_k_plan(p.m, p.n, -(-p.k // self.tile[2]), p.l, self.tile, self.cluster,
                                                 self.mma_ctas, p.sm_count, p.max_active_clusters, self.splits,
                                                 self.deterministic)
        if self.sm100:
            return scheduler.sm100_plan(p.m, p.n, p.l, self.tile, self.cluster, self.mma_ctas)
        if self.stream_k:
            return scheduler.stream_k_plan(p.m, p.n, -(-p.k // self.tile[2]), p.l, self.tile, self.cluster,
                                           p.sm_count, p.max_active_clusters, self.splits, self.deterministic)
        return scheduler.plan(p.m, p.n, p.l, self.tile, self.cluster, p.sm_count, p.max_active_clusters)

    def workspace(self, p: Problem) -> Workspace:
        """The workspace a launch needs, as CUTLASS's `to_underlying_arguments` lays it out: the
        epilogue's first, each vector reduction's partials per tile (rounded to 16 bytes) then its
        tile counters; then the stream-K scheduler's partial accumulators and tile barriers. CUTLASS
        orders the reductions as its host compiler evaluates a pack expansion's arguments
        (unspecified in C++); the device reads only the pointers, so here they follow the recipe's
        outputs. Counters and barriers must be 0 at launch; the partials need not be."""
        fields: list[tuple[str, int]] = []
        zeroed: list[tuple[int, int]] = []
        at = self._reduction_workspace(p, fields)
        if at:
            zeroed.append((0, at))
        if self.stream_k:
            plan = self._scheduler(p)
            fields.append((f"scheduler.{'sk.' if self.sm100 else ''}reduction_workspace", at))
            if plan.barrier_bytes:
                zeroed.append((at + plan.reduction_bytes, at + plan.reduction_bytes + plan.barrier_bytes))
            at += plan.reduction_bytes + plan.barrier_bytes
        if (at or self.stream_k) and self.kernel_workspace:  # CUTLASS keeps the pointer it is given
            fields.append(("workspace", 0))
        return Workspace(at, tuple(fields), tuple(zeroed))

    def _reduction_workspace(self, p: Problem, fields: list[tuple[str, int]]) -> int:
        """Bytes of the vector reductions' workspace; appends their pointer fields' offsets. Their
        tiles are the CTAs' (half the MMA's along M under sm100's 2-SM schedule)."""
        tm, tn = self.tile[0] // self.mma_ctas, self.tile[1]
        tiles_m, tiles_n = -(-p.m // tm), -(-p.n // tn)
        at = 0
        for kind, prefix, name in self.vector_reductions:
            over_m = kind == "row_reduction"  # partials per tile of a row (N) or of a column (M) vector
            values = tiles_m * tiles_n * p.l * (tn if over_m else tm)
            if values > _INT32_MAX:  # the device indexes the partials with int
                raise InvalidArgument(f"out[{name}]: this problem ({p.m} x {p.n}, {p.l} batch(es)) needs {values} "
                                      f"partial values for the reduction, past the 2^31 CUTLASS indexes them with "
                                      f"in 32 bits; split the batch or the rows into several calls")
            partials = _round(values * self.partial_bytes[name])
            counters = (tiles_n if over_m else tiles_m) * 4
            fields += [(f"{prefix}.buffer", at), (f"{prefix}.counters", at + partials)]
            at += _round(partials + counters)
        return at

    def input_values(self, p: Problem, encode: TensorMapEncoder) -> dict[str, int | float | bytes]:
        """The fields that depend on input addresses: A's and B's tensor maps, vector pointers, C and
        aux-load tensor maps, seeds (a value or a pointer)."""
        v: dict[str, int | float | bytes] = {
            "mainloop.tma_a": encode(self.a.operand(p.a.ptr, p.m, p.k, p.l, p.a.strides)),
            "mainloop.tma_b": encode(self.b.operand(p.b.ptr, p.n, p.k, p.l, p.b.strides))}
        if self.sm100:
            v["mainloop.tma_a_fallback"], v["mainloop.tma_b_fallback"] = v["mainloop.tma_a"], v["mainloop.tma_b"]
        for name, _, gran, gk, template in self.block_scales:
            scale: TensorArg = p.operands[name]  # type: ignore[assignment]
            operand = name[-1]
            v[f"mainloop.ptr_sf{operand}"] = scale.ptr
            if template is not None:
                blocks, k_blocks = _scale_blocks(p, name, gran, gk)
                v[f"mainloop.tma_sf{operand}"] = encode(template.operand(scale.ptr, blocks, k_blocks, p.l,
                                                                         scale.strides))
        for name, _, block_template in self.microscales:  # and the fallback cluster's copy
            blocks, k_blocks = self._scale_row_blocks(p, name)
            scales: TensorArg = p.operands[name]  # type: ignore[assignment]
            v[f"mainloop.tma_sf{name[-1]}"] = v[f"mainloop.tma_sf{name[-1]}_fallback"] = encode(
                block_template.encode(scales.ptr, blocks, k_blocks, p.l))
        if self.d_sink is not None:
            v["epilogue.tma_d"] = encode(self.d_sink.sink(p.d_sink))
        for prefix, name, per_batch in self.vectors:
            vector: TensorArg = p.operands[name]  # type: ignore[assignment]
            v[f"{prefix}.ptr"] = vector.ptr
            if per_batch:
                v[f"{prefix}.batch_stride"] = vector.strides[2]
        for prefix, name, per_batch in self.matrices:
            matrix: TensorArg = p.operands[name]  # type: ignore[assignment]
            v.update(_direct_matrix(prefix, matrix, self.stride_mode, per_batch))
        for prefix, name, mode in self.shared:
            shared: TensorArg = p.operands[name]  # type: ignore[assignment]
            v[f"{prefix}.ptr"], v[f"{prefix}.stride"] = shared.ptr, shared.strides[mode]
        for field, name, t in self.loads:
            arg = p.operands[name]
            v[field] = encode(t.matrix(arg.ptr, p.m, p.n, p.l, arg.strides))  # type: ignore[union-attr]
        for prefix, name in self.half_loads:
            v.update(_half_tensor(prefix, p.operands[name]))  # type: ignore[arg-type]
        for seed_prefix, seed_name in self.seeds:  # a value, or a device int64 the kernel reads instead
            seed = p.operands[seed_name]
            v[f"{seed_prefix}.value"], v[f"{seed_prefix}.ptr"] = (0, seed.ptr) if isinstance(seed, TensorArg) else \
                (int(seed), 0)
        return v

    def output_map(self, index: int, p: Problem, t: TensorArg, encode: TensorMapEncoder
                   ) -> tuple[tuple[str, bytes], ...]:
        """The fields of output `index` (0 is D, then the aux outputs) at `t`, with their bytes: a
        tensor map, a reduction's pointer, or an N/2-column tensor's pointer and strides."""
        field, template = self.by_index[index]
        if template == "ptr":
            return ((f"{field}.ptr", t.ptr.to_bytes(8, "little")),)
        if template == "half":
            return tuple((f, struct.pack("<q", x)) for f, x in _half_tensor(field, t).items())
        if template == "matrix":
            return tuple((f, struct.pack("<q", x)) for f, x in _direct_matrix(field, t, self.stride_mode, True).items())
        if template == "column_blocks":  # (N, M, L) strides, M's 1
            return ((f"{field}.ptr", t.ptr.to_bytes(8, "little")),
                    (f"{field}.stride_n", struct.pack("<q", t.strides[0])),
                    (f"{field}.stride_l", struct.pack("<q", t.strides[2])))
        if template == "column_scales":
            strides = tuple((f"{field}.scale_stride_{mode}", struct.pack("<q", x))
                            for mode, x in zip("nml", t.strides, strict=True))
            return ((f"{field}.scale_ptr", t.ptr.to_bytes(8, "little")), *strides)
        if template == "blocks":
            strides = tuple((f"{field}.stride_{mode}", struct.pack("<q", x)) for mode, x in zip("mnl", t.strides,
                                                                                               strict=True))
            return ((f"{field}.ptr", t.ptr.to_bytes(8, "little")), *strides)
        assert isinstance(template, tma.TmaTemplate)
        return ((field, encode(template.matrix(t.ptr, p.m, p.n, p.l, t.strides))),)


def _unpacked(field: str, raw: bytes) -> int | bytes:
    """An output field's value as `values` gives it: a tensor map's bytes, an integer else."""
    return raw if len(raw) == 128 else int.from_bytes(raw, "little", signed=not field.endswith(".ptr"))


def _half_tensor(prefix: str, t: TensorArg) -> dict[str, int]:
    """An N/2-column tensor's fields (pairs.hpp's HalfTensor): its address, row and batch strides
    (columns are contiguous: `checks`)."""
    return {f"{prefix}.ptr": t.ptr, f"{prefix}.stride_m": t.strides[0], f"{prefix}.stride_l": t.strides[2]}


def _direct_matrix(prefix: str, t: TensorArg, mode: int, per_batch: bool) -> dict[str, int]:
    """An M x N tensor's fields in the direct epilogue (direct.hpp's Matrix): its address, the
    stride between its rows (columns, where D is column-major: `mode` 1), and between batches (0
    for one shared by every batch)."""
    return {f"{prefix}.ptr": t.ptr, f"{prefix}.stride": t.strides[mode],
            f"{prefix}.batch_stride": t.strides[2] if per_batch else 0}


def _scale_blocks(p: Problem, name: str, gran: int, gran_k: int) -> tuple[int, int]:
    """(blocks along the kernel's M or N, blocks along K) of block scale `name` in the kernel's terms."""
    return -(-(p.m if name == "scale_a" else p.n) // gran), -(-p.k // gran_k)


def _round(nbytes: int) -> int:
    return -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def field_values(recipe: RecipeIR, config: KernelConfig, problem: Problem, encode: TensorMapEncoder,
                 outputs: bool = True, workspace: int = 0
                 ) -> tuple[dict[str, int | float | bytes], tuple[int, int, int]]:
    return ArgumentBuilder(recipe, config).values(problem, encode, outputs, workspace)


class ParamsWriter:
    """Writes Params blocks for one kernel.

    A whole block is one `struct.pack_into` of a format compiled from the probed layout (fields in
    offset order, padding as pad bytes), with each field's default where no value is given;
    single fields (the per-call output tensor maps) are patched in place.
    """

    def __init__(self, layout: ParamsLayout) -> None:
        self.size = layout.size
        self.slots: dict[str, tuple[int, struct.Struct]] = {}
        order: list[tuple[str, int | float | bool | bytes]] = []
        fmt, pos = "<", 0
        for f, offset, default in sorted(layout.fields, key=lambda x: x[1]):
            code = _FORMAT[f.kind]
            fmt += "x" * (offset - pos) + code
            pos = offset + f.size
            self.slots[f.name] = (offset, struct.Struct("<" + code))
            order.append((f.name, bytes(128) if f.kind == "desc" else _coerce(f.kind, default)))
        self._struct = struct.Struct(fmt + "x" * (layout.size - pos))
        self._order = order
        self.template = self.write({})

    def write(self, values: dict[str, int | float | bytes], into: bytearray | None = None) -> bytearray:
        if into is None:
            buf = bytearray(self.size)
            self._struct.pack_into(buf, 0, *[values.get(name, default) for name, default in self._order])
            return buf
        for name, value in values.items():
            offset, st = self.slots[name]
            st.pack_into(into, offset, value)
        return into


_FORMAT = {"u32": "I", "i32": "i", "u64": "Q", "i64": "q", "ptr": "Q", "bool": "?", "e16": "H", "f32": "f",
           "desc": "128s"}


def _coerce(kind: str, bits: int) -> int | float | bool:
    """A probed default (raw bits, signed values sign-extended to 64) as the value struct packs."""
    if kind == "f32":
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]
    if kind in ("i32", "i64"):
        width = 32 if kind == "i32" else 64
        bits &= (1 << width) - 1
        return bits - (1 << width) if bits >> (width - 1) else bits
    if kind == "bool":
        return bool(bits)
    return bits


def pack(layout: ParamsLayout, values: dict[str, int | float | bytes]) -> bytes:
    """Every field at its probed offset: the given value, else the field's default."""
    return bytes(ParamsWriter(layout).write(values))

"""Params fields: what the host writes into a kernel's argument block, named once.

Each architecture's emitter lists its kernel's fields (`sm90.params`); the same list drives the
NVRTC layout probe compiled into every kernel (offset and default value of each field as NVRTC
lays Params out), the nvcc host oracle (the values CUTLASS's own host code produces), and the
Python argument builder (which writes each field at its probed offset). Field names are stable
strings; `expr` is a C++ lvalue with `{p}` standing for the Params object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..config import Arch, KernelConfig
from ..ir import Columns, RecipeIR
from ..types import DType

if TYPE_CHECKING:
    from .direct import DirectEpilogue

#: The bindings of pairs.hpp's register visitors, by the width of the tensor they read (two: a
#: 2N-column tensor's even and odd halves) or write: a HalfTensor {ptr, dHalf} each.
REGISTER_LOADS = {Columns.HALF: ("pair_load",), Columns.DOUBLE: ("double_load_even", "double_load_odd")}
REGISTER_STORES = {Columns.HALF: "pair_store", Columns.DOUBLE: "double_store"}
PAIR_LOADS = tuple(kind for kinds in REGISTER_LOADS.values() for kind in kinds)
PAIR_BINDINGS = (*PAIR_LOADS, *REGISTER_STORES.values())


class Binding(Protocol):
    """What a visitor's fields are named by (`evt.ParamBinding`)."""

    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def per_batch(self) -> bool: ...
    @property
    def column_major(self) -> bool: ...
    @property
    def log_sum_exp(self) -> bool: ...
    @property
    def stream(self) -> int: ...

    def member(self, root: str) -> str: ...

#: Bytes of each field kind. `desc` is a 128-byte TMA descriptor (CUtensorMap).
KIND_SIZE = {"desc": 128, "u32": 4, "i32": 4, "u64": 8, "i64": 8, "f32": 4, "ptr": 8, "bool": 1, "e16": 2}


@dataclass(frozen=True)
class ParamField:
    name: str
    expr: str
    kind: str

    @property
    def size(self) -> int:
        return KIND_SIZE[self.kind]

    def lvalue(self, base: str) -> str:
        return self.expr.format(p=base)


@dataclass(frozen=True)
class ParamsLayout:
    """Where each field sits in Params under NVRTC, and its default value (from the layout probe)."""

    size: int
    fields: tuple[tuple[ParamField, int, int], ...]  # (field, offset, default bits)


def divmod_32(name: str, expr: str) -> list[ParamField]:
    """cutlass::FastDivmod."""
    return [ParamField(f"{name}.divisor", f"{expr}.divisor", "i32"),
            ParamField(f"{name}.multiplier", f"{expr}.multiplier", "u32"),
            ParamField(f"{name}.shift_right", f"{expr}.shift_right", "u32")]


def desc(atom: str) -> str:
    return f"(*{atom}.get_tma_descriptor())"


def element_kind(dtype: DType) -> str:
    return {1: "bool", 2: "e16", 4: "f32"}[dtype.nbytes]  # raw bits of the element type


def divmod_u64(name: str, expr: str) -> list[ParamField]:
    return [ParamField(f"{name}.divisor", f"{expr}.divisor", "u64"),
            ParamField(f"{name}.multiplier", f"{expr}.multiplier", "u64"),
            ParamField(f"{name}.shift_right", f"{expr}.shift_right", "u32"),
            ParamField(f"{name}.round_up", f"{expr}.round_up", "u32")]


def divmod_pow2(name: str, expr: str) -> list[ParamField]:
    return [ParamField(f"{name}.divisor", f"{expr}.divisor", "u64"),
            ParamField(f"{name}.shift_right", f"{expr}.shift_right", "u32")]


def hw_info() -> list[ParamField]:
    """KernelHardwareInfo, as every sm90 and sm100 kernel's Params holds it."""
    f = [ParamField(f"hw_info.{n}", f"{{p}}.hw_info.{n}", "i32") for n in ("device_id", "sm_count",
                                                                       "max_active_clusters")]
    for shape in ("cluster_shape", "cluster_shape_fallback"):
        f += [ParamField(f"hw_info.{shape}.{a}", f"{{p}}.hw_info.{shape}.{a}", "u32") for a in "xyz"]
    return f


def block_scale_fields(tma: tuple[bool, bool]) -> list[ParamField]:
    """The blockwise fp8 main loop's scales (sm90's and sm100's): pointers, the layouts' dynamic
    extents and strides (int32: blocks along M or N, along K, and L; the K-block and batch
    strides), and, where the main loop loads them with TMA (`tma`, per operand: sm90 only), their
    tensor maps."""
    f = []
    for operand, loaded in zip("ab", tma, strict=True):
        sf = f"SF{operand.upper()}"
        m = "{p}.mainloop"
        if loaded:
            f.append(ParamField(f"mainloop.tma_sf{operand}", desc(f"{m}.tma_load_sf{operand}"), "desc"))
        f += [ParamField(f"mainloop.ptr_sf{operand}", f"{m}.ptr_{sf}", "ptr"),
              ParamField(f"mainloop.layout_sf{operand}.blocks", f"{m}.layout_{sf}.shape<0, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{operand}.k_blocks", f"{m}.layout_{sf}.shape<1, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{operand}.l", f"{m}.layout_{sf}.shape<2>()", "i32"),
              ParamField(f"mainloop.layout_sf{operand}.k_stride", f"{m}.layout_{sf}.stride<1, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{operand}.batch_stride", f"{m}.layout_{sf}.stride<2>()", "i32")]
    return f


def microscaling_fields(grouped: bool = False) -> list[ParamField]:
    """The block-scaled (MX, NVFP4) main loop's scales (sm100): tensor maps (a fallback pair beside
    them, as A's and B's) and the layouts' dynamic extents and strides (`Sm1xxBlockScaledConfig`:
    row blocks of 128, K blocks of 4 scales, L; the row-block and batch strides, in bytes); a
    grouped kernel's per-group arrays of addresses and layouts instead of the layouts."""
    m = "{p}.mainloop"
    f = [ParamField(f"mainloop.tma_sf{x}{fallback}", desc(f"{m}.tma_load_sf{x}{fallback}"), "desc")
         for fallback in ("", "_fallback") for x in "ab"]
    if grouped:
        return f + grouped_block_scale_fields(m)
    for x in "ab":
        layout = f"{m}.layout_SF{x.upper()}"
        f += [ParamField(f"mainloop.layout_sf{x}.blocks", f"{layout}.shape<0, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{x}.k_blocks", f"{layout}.shape<1, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{x}.l", f"{layout}.shape<2, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{x}.block_stride", f"{layout}.stride<0, 1>()", "i32"),
              ParamField(f"mainloop.layout_sf{x}.batch_stride", f"{layout}.stride<2, 1>()", "i32")]
    return f


def grouped_block_scale_fields(m: str) -> list[ParamField]:
    """A grouped blockwise main loop's per-group arrays (at `m`, the mainloop's Params): each
    group's scales' address and (compact, K-major) layout. sm100's main loop reads the layouts;
    sm90's derives each group's from its shape."""
    return [ParamField(f"mainloop.{part}_sf{x}", f"{m}.{part}_SF{x.upper()}", "ptr")
            for x in "ab" for part in ("ptr", "layout")]


#: The `__device__` bytes of a kernel module that its collective's D store is aimed at where
#: registers write D (`sinks_d`), and the header that defines them; the runtime asks the driver
#: for their address.
D_SINK_SYMBOL = "gemmgen_d_sink"
D_SINK_HEADER = "gemmgen/d_sink.hpp"


def sinks_d(recipe: RecipeIR, arch: Arch) -> bool:
    """Whether a kernel writes D from its registers (N/2 or 2N columns: pairs.hpp) while its
    collective still stores a D of its own: CUTLASS 4.2's sm100 epilogue has no void D (its
    pointer-array one has, as sm90's both do), so a dense sm_100a kernel over pairs aims that TMA
    store at a one-element tensor map of a sink in its module (`D_SINK_SYMBOL`): every box but
    the first lies outside it, and the first writes one element there."""
    return arch is Arch.SM100A and not recipe.gemm.grouped and recipe.epilogue.outputs[0].columns is not Columns.FULL


def reads_scale_layouts(recipe: RecipeIR, config: KernelConfig) -> bool:
    """Whether a grouped kernel's main loop reads each group's scale layouts from memory (sm100's
    blockwise and block-scaled ones; sm90's derives them from the group's shape): its setup kernel
    then writes them (grouped.hpp's `fill_scale_layouts`), after the group table
    (`runtime.grouped.BufferLayout`)."""
    return recipe.gemm.grouped and recipe.gemm.scaled and config.arch is Arch.SM100A


def group_problem(name: str, expr: str) -> list[ParamField]:
    """GroupProblemShape: the group count and the device's (and, unused, the host's) shapes."""
    return [ParamField(f"{name}.groups", f"{expr}.num_groups", "i32"),
            ParamField(f"{name}.shapes", f"{expr}.problem_shapes", "ptr"),
            ParamField(f"{name}.host_shapes", f"{expr}.host_problem_shapes", "ptr")]


def group_scheduler(s: str) -> list[ParamField]:
    """PersistentTileSchedulerSm90GroupParams at `s` (sm100's group scheduler wraps the same)."""
    f = divmod_pow2("scheduler.cluster_shape_major", f"{s}.divmod_cluster_shape_major_")
    f += divmod_pow2("scheduler.cluster_shape_minor", f"{s}.divmod_cluster_shape_minor_")
    f += divmod_u64("scheduler.cta_shape_m", f"{s}.divmod_cta_shape_m_")
    f += divmod_u64("scheduler.cta_shape_n", f"{s}.divmod_cta_shape_n_")
    f += [ParamField("scheduler.blocks_across_problem", f"{s}.blocks_across_problem_", "u64"),
          ParamField("scheduler.pre_processed_problem_shapes", f"{s}.pre_processed_problem_shapes", "bool"),
          ParamField("scheduler.log_swizzle_size", f"{s}.log_swizzle_size_", "i32"),
          ParamField("scheduler.raster_order", f"{s}.raster_order_", "i32")]
    f += group_problem("scheduler.problem", f"{s}.problem_shapes_")
    for coord in ("cta_shape", "cluster_shape"):
        f += [ParamField(f"scheduler.{coord}.{d}", f"{s}.{coord}_[{i}]", "i32") for i, d in enumerate("mnk")]
    return f


def stream_k_scheduler(name: str, s: str) -> list[ParamField]:
    """PersistentTileSchedulerSm90StreamKParams at `s`, its fields named under `name`
    (`runtime.scheduler.stream_k_plan` fills them); sm100's stream-K Params hold one."""
    f = divmod_pow2(f"{name}.cluster_shape_major", f"{s}.divmod_cluster_shape_major_")
    f += divmod_pow2(f"{name}.cluster_shape_minor", f"{s}.divmod_cluster_shape_minor_")
    for part in ("batch", "cluster_blk_major", "clusters_mnl", "sk_groups", "sk_units_per_group", "epilogue_subtile"):
        f += divmod_u64(f"{name}.{part}", f"{s}.divmod_{part}_")
    for part in ("tiles_per_output_tile", "splits", "k_tiles_per_sk_unit", "k_tiles_per_sk_big_unit"):
        f += divmod_32(f"{name}.{part}", f"{s}.divmod_{part}_")
    f += [ParamField(f"{name}.units_per_problem", f"{s}.units_per_problem_", "u64"),
          ParamField(f"{name}.log_swizzle_size", f"{s}.log_swizzle_size_", "i32"),
          ParamField(f"{name}.raster_order", f"{s}.raster_order_", "i32"),
          ParamField(f"{name}.reduction_mode", f"{s}.reduction_mode_", "i32"),
          ParamField(f"{name}.reduction_workspace", f"{s}.reduction_workspace_", "ptr")]
    f += [ParamField(f"{name}.{part}", f"{s}.{part}_", "u32") for part in (
        "big_units", "big_groups", "sk_tiles", "sk_units", "separate_reduction_units", "ktile_start_alignment_count")]
    return f


def clc_scheduler(name: str, s: str) -> list[ParamField]:
    """PersistentTileSchedulerSm100Params (cluster launch control) at `s`, named under `name`
    (`runtime.scheduler.sm100_plan`)."""
    f = [ParamField(f"{name}.problem_tiles_{d}", f"{s}.problem_tiles_{d}_", "u32") for d in "mnl"]
    f += divmod_32(f"{name}.cluster_shape_m", f"{s}.divmod_cluster_shape_m_")
    f += divmod_32(f"{name}.cluster_shape_n", f"{s}.divmod_cluster_shape_n_")
    f += divmod_32(f"{name}.swizzle_size", f"{s}.divmod_swizzle_size_")
    f += [ParamField(f"{name}.raster_order", f"{s}.raster_order_", "i32"),
          ParamField(f"{name}.log_swizzle_size", f"{s}.log_swizzle_size_", "i32")]
    return f


def direct_fields(direct: DirectEpilogue) -> list[ParamField]:
    """The direct epilogue's Params (its functor's Arguments: direct.hpp's views), named as the
    visitors' fields of the same operands where there are such (scalars, vectors), so one argument
    builder writes both; an M x N tensor read or written is `epilogue.matrix.<name>`, an output
    reduced over M and N `epilogue.amax.<name>` as the TMA epilogue's."""
    f = []
    for o in direct.operands:
        at = f"{{p}}.epilogue.{o.member}"
        n = f"epilogue.{o.kind}.{o.name}"
        if o.kind == "amax":
            f += [ParamField(f"{n}.ptr", f"{at}.ptr", "ptr"), ParamField(f"{n}.identity", f"{at}.identity", "f32"),
                  ParamField(f"{n}.batch_stride", f"{at}.batch_stride", "i64")]
        elif o.kind == "scalar":
            f += [ParamField(f"{n}.value", f"{at}.value", "f32"), ParamField(f"{n}.ptr", f"{at}.ptr", "ptr"),
                  ParamField(f"{n}.batch_stride", f"{at}.batch_stride", "i64")]
        elif o.kind in ("row", "col"):  # the host writes the batch stride of a vector per batch only
            f += [ParamField(f"{n}.ptr", f"{at}.ptr", "ptr"),
                  ParamField(f"{n}.batch_stride", f"{at}.batch_stride", "i64")]
        else:
            f += [ParamField(f"{n}.ptr", f"{at}.ptr", "ptr"), ParamField(f"{n}.stride", f"{at}.stride", "i64"),
                  ParamField(f"{n}.batch_stride", f"{at}.batch_stride", "i64")]
    return f


def binding_fields(b: Binding) -> list[ParamField]:
    """The Params of an epilogue visitor the host writes (the same visitors on every arch)."""
    node = b.member("{p}.epilogue.thread")
    n = f"epilogue.{b.kind}.{b.name}"
    if b.kind in ("row", "col"):
        # Sm90RowBroadcast's Params keep null_default as the vector's element, Sm90ColBroadcast's
        # convert it to ElementCompute (float).
        batch = [ParamField(f"{n}.batch_stride", f"cute::get<2>({node}.d{b.kind.title()})", "i64")]
        return [ParamField(f"{n}.ptr", f"{node}.ptr_{b.kind}", "ptr"),
                ParamField(f"{n}.null_default", f"{node}.null_default",
                           element_kind(b.dtype) if b.kind == "row" else "f32"), *(batch if b.per_batch else [])]
    if b.kind == "scalar":
        return [ParamField(f"{n}.value", f"{node}.scalars[0]", "f32"),
                ParamField(f"{n}.ptr", f"{node}.scalar_ptrs[0]", "ptr"),
                ParamField(f"{n}.batch_stride", f"cute::get<2>({node}.dScalar[0])", "i64")]
    if b.kind == "aux_load":
        return [ParamField(f"{n}.tma", desc(f"{node}.tma_load_aux"), "desc"),
                ParamField(f"{n}.null_default", f"{node}.null_default", element_kind(b.dtype)),
                ParamField(f"{n}.use_default", f"{node}.use_default", "bool")]
    if b.kind == "amax":
        return [ParamField(f"{n}.ptr", f"{node}.ptr_scalar", "ptr"),
                ParamField(f"{n}.identity", f"{node}.reduction_identity", "f32"),
                ParamField(f"{n}.batch_stride", f"cute::get<2>({node}.dScalar)", "i64")]
    if b.kind in ("row_reduction", "col_reduction"):
        vector = "Row" if b.kind == "row_reduction" else "Col"
        # a log-sum-exp's identity is its state's pair (gemmgen/include/gemmgen/lse.hpp)
        identity = [ParamField(f"{n}.identity", f"{node}.reduction_identity.max", "f32"),
                    ParamField(f"{n}.identity_sum", f"{node}.reduction_identity.sum", "f32")] if b.log_sum_exp else \
            [ParamField(f"{n}.identity", f"{node}.reduction_identity", "f32")]
        return [ParamField(f"{n}.ptr", f"{node}.ptr_{vector.lower()}", "ptr"), *identity,
                ParamField(f"{n}.batch_stride", f"cute::get<2>({node}.d{vector})", "i64"),
                ParamField(f"{n}.buffer", f"{node}.reduction_buffer", "ptr"),
                ParamField(f"{n}.counters", f"{node}.tile_counters", "ptr")]
    if b.kind == "seed":  # coordinates.hpp's SeedArguments, one per stream drawn: the value, or where it is read
        return [ParamField(f"{n}.{b.stream}.value", f"{node}.seed", "u64"),
                ParamField(f"{n}.{b.stream}.ptr", f"{node}.seed_ptr", "ptr")]
    if b.kind in PAIR_BINDINGS:  # pairs.hpp's HalfTensor
        return [ParamField(f"{n}.ptr", f"{node}.ptr", "ptr"),
                ParamField(f"{n}.stride_m", f"cute::get<0>({node}.dHalf)", "i64"),
                ParamField(f"{n}.stride_l", f"cute::get<2>({node}.dHalf)", "i64")]
    if b.kind == "row_blocks":  # row_blocks.hpp: the factors' pointer and (M, N / Block, L) strides
        return [ParamField(f"{n}.ptr", f"{node}.ptr_factor", "ptr"),
                *(ParamField(f"{n}.stride_{mode}", f"cute::get<{i}>({node}.dFactor)", "i64")
                  for i, mode in enumerate("mnl"))]
    if b.kind == "column_blocks":  # column_blocks.hpp: the copy's pointer and (N, M, L) strides (M's is 1),
        #                             the scales' pointer and (N, M / Block, L) strides
        return [ParamField(f"{n}.ptr", f"{node}.ptr_q", "ptr"),
                ParamField(f"{n}.stride_n", f"cute::get<0>({node}.dQ)", "i64"),
                ParamField(f"{n}.stride_l", f"cute::get<2>({node}.dQ)", "i64"),
                ParamField(f"{n}.scale_ptr", f"{node}.ptr_scale", "ptr"),
                *(ParamField(f"{n}.scale_stride_{mode}", f"cute::get<{i}>({node}.dScale)", "i64")
                  for i, mode in enumerate("nml"))]
    if b.kind == "shared_load":  # Sm90AuxLoad<0>: a pointer and the stride between rows (columns, column-major)
        return [ParamField(f"{n}.ptr", f"{node}.ptr_aux", "ptr"),
                ParamField(f"{n}.null_default", f"{node}.null_default", element_kind(b.dtype)),
                ParamField(f"{n}.stride", f"cute::get<{int(b.column_major)}>({node}.dAux)", "i64")]
    if b.kind == "aux_store":
        return [ParamField(f"{n}.tma", desc(f"{node}.tma_store_aux"), "desc"),
                ParamField(f"{n}.is_nullptr", f"{node}.is_nullptr", "bool")]
    raise AssertionError(b.kind)

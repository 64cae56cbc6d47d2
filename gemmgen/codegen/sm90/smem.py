"""An sm90 kernel's shared memory: the mainloop's stages and the epilogue's storage, laid out as
CUTLASS 4.2 lays out `CollectiveEpilogue::SharedStorage`.

StageCountAutoCarveout gives the mainloop what the epilogue leaves of an sm_90 block's shared
memory, so gemmgen's stage count, and whether a config fits at all, depend on the epilogue's exact
size, padding included: an aux tensor's tile is aligned to its swizzle (up to 1024 bytes) and each nested
visitor tuple is rounded up to its alignment. The model follows the C++ types:

    SharedStorage { TensorStorage { collective (C and D tiles); thread (the visitors') } tensors;
                    pipeline (C's load barriers) }

where the visitors' storage nests like their Params (a tree's children then its node; a
graph's ops in order) in cute::tuples, which leave out empty visitors. NVRTC checks the model
against `sizeof` for every example, coverage and random recipe (tests/codegen/test_codegen.py,
tests/codegen/test_epilogue_source.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...config import EpilogueCollective, KernelConfig
from ...ir import Columns, RecipeIR
from ...types import DType, Layout
from ..evt import ParamBinding, build_epilogue
from .geometry import consumer_warpgroups, epilogue_tile, scales_per_tile, swizzle_span

_BARRIER_BYTES = 8  # one cutlass::arch::ClusterBarrier (an mbarrier)
_VECTOR_ALIGN = 16  # cute::array_aligned's default alignment (Sm90RowBroadcast's smem)
SM90_SMEM_CAPACITY = 232448  # bytes of shared memory per block on sm_90 (cutlass::gemm::collective::detail)
_STAGE_ALIGN = 128  # compute_stage_count_or_override rounds stage and carveout bytes to this (its default)
#: A grouped mainloop's stages leave out A's and B's tensor maps and the group scheduler's 8-stage
#: pipeline barriers (the builder's KernelSmemCarveout)...
_GROUPED_CARVEOUT = 2 * 128 + 16 * 8
#: ...and the grouped kernel's shared storage adds those and the epilogue's tensor maps: at most this
#: much over the stages and the epilogue storage (docs/design/measurements.md, "Grouped shared storage").
_GROUPED_KERNEL_EXTRA = 1024


@dataclass(frozen=True)
class Storage:
    """A C++ object's size and alignment. Size 0: an empty class, which a cute::tuple stores in no
    bytes and a struct member in one."""

    size: int
    align: int = 1


EMPTY = Storage(0)


def _round(x: int, to: int) -> int:
    return -(-x // to) * to


def struct(members: Iterable[Storage]) -> Storage:
    """A C++ struct of `members` in order: each at the next offset its alignment allows (an empty
    member takes a byte), the whole rounded up to the largest alignment."""
    offset, align = 0, 1
    for m in members:
        offset = _round(offset, m.align) + max(m.size, 1)
        align = max(align, m.align)
    return Storage(_round(offset, align), align)


def cute_tuple(members: list[Storage]) -> Storage:
    """A cute::tuple: its "empty structure optimization" stores the first element and then the
    tuple of the rest as one member (recursively), and leaves out empty elements, so a large
    alignment later in the tuple pads the whole rest, not just that element."""
    if not members:
        return EMPTY
    first, rest = members[0], cute_tuple(members[1:])
    if not first.size:
        return rest
    if not rest.size:
        return first
    return struct([first, rest])


def _swizzle_alignment(cfg: KernelConfig, recipe: RecipeIR, dtype: DType) -> int:
    """alignment_for_swizzle of an epilogue smem tile of `dtype`: 8 rows of its swizzle span (the
    span covers the tile's contiguous extent, N for row-major D, M for column-major)."""
    em, en = epilogue_tile(cfg, recipe)
    span = swizzle_span(en if recipe.gemm.layout_d is Layout.ROW else em, dtype.bits)
    return 8 * (span or 16)


@dataclass(frozen=True)
class EpilogueStages:
    """sm90_get_tma_dispatch_policy's stage counts (C and D smem tiles in flight)."""

    c: int
    d: int
    reuse_c: bool  # D's tiles reuse C's buffers


def epilogue_stages(cfg: KernelConfig, recipe: RecipeIR) -> EpilogueStages:
    em, en = epilogue_tile(cfg, recipe)
    tiles = (cfg.tile[0] // em) * (cfg.tile[1] // en)
    source = recipe.epilogue.source  # C: the first full-width matrix (N/2 ones are read from registers)
    matrices = [o for o in recipe.epilogue.operands if o.name == source]
    c_bits = matrices[0].dtype.bits if matrices else 0  # sizeof_bits<void> is 0
    reuse = c_bits == recipe.gemm.d.bits and recipe.gemm.d.bits > 8
    d = min(tiles, 2)
    return EpilogueStages(max(min(tiles, 4), d + 1) if reuse else min(tiles, 4), d, reuse)


def _visitor(b: ParamBinding, cfg: KernelConfig, recipe: RecipeIR, stages: EpilogueStages) -> Storage:
    """One visitor's SharedStorage: an aux tensor's staged tiles, a row vector's tile-wide copy, a
    reduction over M's partials."""
    em, en = epilogue_tile(cfg, recipe)
    if b.kind in ("aux_load", "aux_store"):
        count = stages.c if b.kind == "aux_load" else stages.d
        return Storage(count * em * en * b.dtype.nbytes, _swizzle_alignment(cfg, recipe, b.dtype))
    if b.kind == "row":
        return Storage(cfg.tile[1] * b.dtype.nbytes, _VECTOR_ALIGN)
    if b.kind == "row_reduction":  # row_reduction.hpp: each consumer warp's value of each column, a tile count
        state = 8 if b.log_sum_exp else 4
        return struct([Storage(4 * consumer_warpgroups(cfg) * cfg.tile[1] * state, _VECTOR_ALIGN), Storage(4, 4)])
    if b.kind == "column_blocks":  # column_blocks.hpp: the subtile's values, fp32, each column padded by 4
        return Storage(4 * en * (em + 4), 16)
    return EMPTY  # column vectors and scalars are read from global memory


def _nested(bindings: list[ParamBinding], depth: int, count: int, leaf: Callable[[ParamBinding], Storage]
            ) -> Storage:
    """The tuple of `count` visitors at `depth` of the Params/SharedStorage nesting."""
    members = []
    for i in range(count):
        here = [b for b in bindings if b.path[depth][0] == i]
        own = [b for b in here if len(b.path) == depth + 1]
        if own:
            members.append(leaf(own[0]))
        elif here:
            members.append(_nested(here, depth + 1, here[0].path[depth + 1][1], leaf))
        else:
            members.append(EMPTY)
    return cute_tuple(members)


def fusion_storage(cfg: KernelConfig, recipe: RecipeIR) -> Storage:
    """`FusionCallbacks::SharedStorage` of the kernel-side recipe under `cfg`."""
    stages = epilogue_stages(cfg, recipe)
    bindings = [b for b in build_epilogue(recipe).bindings if b.path]
    if not bindings:
        return EMPTY
    return _nested(bindings, 0, bindings[0].path[0][1], lambda b: _visitor(b, cfg, recipe, stages))


_SIZES: dict[tuple, int] = {}  # by (recipe key, tile, schedule): all the size depends on


def epilogue_smem_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """sizeof(CollectiveEpilogue::SharedStorage): C/D tiles, the visitors' storage, padding and
    barriers, for the kernel-side recipe under `cfg`; remembered:
    a config search checks every candidate of a recipe for each new shape. The direct epilogue's
    is empty (one byte, as C++ sizes an empty struct)."""
    if cfg.epilogue is EpilogueCollective.DIRECT:
        return 1
    key = (recipe.key, cfg.tile, cfg.schedule)
    size = _SIZES.get(key)
    if size is None:
        if len(_SIZES) >= 4096:
            _SIZES.clear()
        size = _SIZES[key] = _epilogue_storage_bytes(cfg, recipe)
    return size


def _epilogue_storage_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    em, en = epilogue_tile(cfg, recipe)
    stages = epilogue_stages(cfg, recipe)
    source = recipe.epilogue.source  # C: the first full-width matrix (N/2 ones are read from registers)
    matrices = [o for o in recipe.epilogue.operands if o.name == source]
    d = recipe.gemm.d
    d_align = _swizzle_alignment(cfg, recipe, d)
    if not matrices:  # CollectiveStorageWithoutC: a union holding D's tiles
        collective = Storage(_round(stages.d * em * en * d.nbytes, d_align), d_align)
    else:
        c = matrices[0].dtype
        c_align = _swizzle_alignment(cfg, recipe, c)
        # CollectiveStorageReuseC: C's and D's tiles overlap; not where a PairStore writes D (void
        # ElementD), whose collective keeps D's tiles of D's element apart all the same
        if stages.reuse_c and recipe.outputs[0].columns is Columns.FULL:
            size, align = stages.c * em * en * max(c.nbytes, d.nbytes), max(c_align, d_align)
            collective = Storage(_round(size, align), align)
        else:
            collective = struct([Storage(stages.c * em * en * c.nbytes, c_align),
                                 Storage(stages.d * em * en * d.nbytes, d_align)])
    tensors = struct([collective, fusion_storage(cfg, recipe)])
    pipeline = Storage(2 * stages.c * _BARRIER_BYTES, _BARRIER_BYTES)  # full and empty barrier per C stage
    return struct([tensors, pipeline]).size


# ----------------------------------------------------------------------------- the mainloop's stages


def mainloop_stage_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """One stage's A and B tiles and block scales, as compute_stage_count_or_override (and
    compute_stage_count_with_blockwise_scale) count them to choose the stage count."""
    return _stage_bytes(cfg, recipe, sum(scales_per_tile(cfg, recipe)))


def _stage_bytes(cfg: KernelConfig, recipe: RecipeIR, scales: int) -> int:
    tm, tn, tk = cfg.tile
    g = recipe.gemm
    raw = (tm * tk * g.a.bits + tn * tk * g.b.bits) // 8 + 4 * scales
    return _round(raw, _STAGE_ALIGN) + 16  # + the pipeline's full/empty barriers


def stage_count(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """Mainloop stages: the explicit count, or what StageCountAutoCarveout will choose
    (compute_stage_count_or_override), one fewer while the kernel's bound (`smem_need`) passes an
    sm_90 block's shared memory: CUTLASS's count leaves out the block scales' padding, so a
    block-scaled kernel's may not fit (the kernel then spells its count out: `explicit_stages`)."""
    if cfg.stages is not None:
        return cfg.stages
    stages = _stages(cfg, recipe, epilogue_smem_bytes(cfg, recipe))
    while stages > 2 and _need(cfg, recipe, stages) > SM90_SMEM_CAPACITY:
        stages -= 1
    return stages


def explicit_stages(cfg: KernelConfig, recipe: RecipeIR) -> int | None:
    """The stage count a kernel spells out (StageCount<N>): the config's own, or `stage_count`'s
    where it is below CUTLASS's automatic count; None where that count is CUTLASS's."""
    if cfg.stages is not None:
        return cfg.stages
    stages = stage_count(cfg, recipe)
    return None if stages == _stages(cfg, recipe, epilogue_smem_bytes(cfg, recipe)) else stages


def blockwise_carveout(cfg: KernelConfig, recipe: RecipeIR, stages: int) -> int:
    """The StageCountAutoCarveout bytes for which the blockwise builder chooses `stages`: it takes
    no StageCount<N> (compute_stage_count_with_blockwise_scale has no such overload), so the
    builder's spelling of an explicit count is the shared memory left beside that many stages."""
    capacity = SM90_SMEM_CAPACITY - (_GROUPED_CARVEOUT if recipe.gemm.grouped else 0)
    left = capacity // _STAGE_ALIGN * _STAGE_ALIGN - stages * mainloop_stage_bytes(cfg, recipe)
    if left < 0:
        raise ValueError(f"{stages} stages of {cfg.tile} exceed an sm_90 block's shared memory")
    return left // _STAGE_ALIGN * _STAGE_ALIGN


def _stages(cfg: KernelConfig, recipe: RecipeIR, epilogue_bytes: int) -> int:
    if cfg.stages is not None:
        return cfg.stages
    carveout = _round(epilogue_bytes, _STAGE_ALIGN)
    capacity = SM90_SMEM_CAPACITY - (_GROUPED_CARVEOUT if recipe.gemm.grouped else 0)
    return (capacity // _STAGE_ALIGN * _STAGE_ALIGN - carveout) // mainloop_stage_bytes(cfg, recipe)


def smem_need(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """The kernel's shared memory: its stages (tiles and barriers) and the epilogue's storage. An
    upper bound on GemmKernel::SharedStorageSize, at most 1 KB over (NVRTC checks both for every
    kernel of tests/codegen/test_codegen.py's translation unit).

    Block scales are stored apart from the tiles, one 128-byte aligned array per operand for all
    stages, and they leave the kernel's tensors off the 512- or 1024-byte alignment the epilogue's
    swizzled buffers give them: bounded by rounding the two arrays up to 1 KB together."""
    return _need(cfg, recipe, stage_count(cfg, recipe))


def _need(cfg: KernelConfig, recipe: RecipeIR, stages: int) -> int:
    """`smem_need` under `stages` mainloop stages."""
    epilogue_bytes = epilogue_smem_bytes(cfg, recipe)
    extra = _GROUPED_KERNEL_EXTRA if recipe.gemm.grouped else 0
    ms, ns = scales_per_tile(cfg, recipe)
    scales = _round(_round(4 * ms * stages, _STAGE_ALIGN) + _round(4 * ns * stages, _STAGE_ALIGN), 1024) \
        if ms + ns else 0
    return stages * _stage_bytes(cfg, recipe, 0) + scales + epilogue_bytes + extra

"""The tile schedulers' Params, launch grid and workspace, ported from CUTLASS 4.2
(cutlass/gemm/kernel/tile_scheduler_params.h): the persistent scheduler
(PersistentTileSchedulerSm90Params), the stream-K one (PersistentTileSchedulerSm90StreamKParams,
with CUTLASS's default arguments but the split count and the reduction mode: its heuristic picks
data-parallel, split-K or stream-K work per problem, or a split count above one forces split-K)
and the grouped one (PersistentTileSchedulerSm90GroupParams); for sm100, the cluster-launch-control
scheduler (PersistentTileSchedulerSm100Params, `sm100_plan`) and its stream-K one
(PersistentTileSchedulerSm100StreamKParams, `sm100_stream_k_plan`).

Checked field by field against CUTLASS's own host code by the oracle tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import Arch, KernelConfig

RASTER_ALONG_M, RASTER_ALONG_N = 0, 1  # cutlass::gemm::kernel::detail::RasterOrder
MAX_SM_PER_GPC = 18  # GH100, as CUTLASS assumes


def _log2_floor(x: int) -> int:
    return max(x.bit_length() - 1, 0)


def fast_divmod_u64(divisor: int) -> dict[str, int]:
    """cutlass::FastDivmodU64(divisor)."""
    if divisor == 0:
        return {"divisor": 0, "multiplier": 0, "shift_right": 0, "round_up": 0}
    shift = _log2_floor(divisor)
    if divisor & (divisor - 1) == 0:
        return {"divisor": divisor, "multiplier": 0, "shift_right": shift, "round_up": 0}
    p = 1 << shift
    lo = ((p << 64) // divisor) & (2**64 - 1)  # uint128_t(0, p) / divisor, truncated to 64 bits
    mult = (((p << 64) | p) // divisor) & (2**64 - 1)  # uint128_t(p, p) / divisor
    return {"divisor": divisor, "multiplier": mult, "shift_right": shift, "round_up": int(lo == mult)}


def fast_divmod_pow2(divisor: int) -> dict[str, int]:
    return {"divisor": divisor, "shift_right": _log2_floor(divisor)}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _log_swizzle(ctas_m: int, ctas_n: int, max_swizzle: int) -> int:
    lo = min(ctas_m, ctas_n)
    if max_swizzle >= 8 and lo >= 6:
        return 3
    if max_swizzle >= 4 and lo >= 3:
        return 2
    if max_swizzle >= 2 and lo >= 2:
        return 1
    return 0


def fast_divmod(divisor: int) -> dict[str, int]:
    """cutlass::FastDivmod(divisor), the 32-bit one."""
    if divisor == 1:
        return {"divisor": 1, "multiplier": 0, "shift_right": 0}
    log2 = (divisor - 1).bit_length()  # find_log2: rounded up
    p = 31 + log2
    return {"divisor": divisor, "multiplier": ((1 << p) + divisor - 1) // divisor & 0xFFFFFFFF, "shift_right": p - 32}


@dataclass(frozen=True)
class SchedulerPlan:
    fields: dict[str, int]  # scheduler.* Params fields by gemmgen name
    grid: tuple[int, int, int]
    reduction_bytes: int = 0  # stream-K: the partial accumulators the workspace holds...
    barrier_bytes: int = 0  # ...then the tile barriers, which must be 0 at launch


@functools.lru_cache(maxsize=1024)
def plan(m: int, n: int, l: int, tile: tuple[int, int, int], cluster: tuple[int, int, int], sm_count: int,  # noqa: E741
         max_active_clusters: int = 0, max_swizzle: int = 1) -> SchedulerPlan:
    """Scheduler Params and grid for a problem (raster order by CUTLASS's heuristic)."""
    cm, cn = cluster[0], cluster[1]
    blocks_m = _round_up(-(-m // tile[0]), cm)
    blocks_n = _round_up(-(-n // tile[1]), cn)
    log_swizzle = _log_swizzle(blocks_m, blocks_n, max_swizzle)
    blocks_m = _round_up(blocks_m, (1 << log_swizzle) * cm)
    blocks_n = _round_up(blocks_n, (1 << log_swizzle) * cn)
    raster = RASTER_ALONG_M if blocks_n > blocks_m else RASTER_ALONG_N
    if raster == RASTER_ALONG_N:
        major, minor, blk_major = cn, cm, blocks_n // cn
    else:
        major, minor, blk_major = cm, cn, blocks_m // cm
    fields: dict[str, int] = {}
    divmods = (("cluster_shape_major", fast_divmod_pow2(major)), ("cluster_shape_minor", fast_divmod_pow2(minor)),
               ("batch", fast_divmod_u64(blocks_m * blocks_n)), ("cluster_blk_major", fast_divmod_u64(blk_major)))
    for prefix, dm in divmods:
        fields.update({f"scheduler.{prefix}.{k}": v for k, v in dm.items()})
    fields.update({
        "scheduler.blocks_per_problem": blocks_m * blocks_n * l, "scheduler.log_swizzle_size": log_swizzle,
        "scheduler.raster_order": raster, "scheduler.problem_tiles_m": blocks_m // cm,
        "scheduler.problem_tiles_n": blocks_n // cn, "scheduler.problem_tiles_l": l,
        "scheduler.cluster_shape_m": cm, "scheduler.cluster_shape_n": cn,
    })
    return SchedulerPlan(fields, _grid(blocks_m * blocks_n * l, raster, cm, cn, sm_count, max_active_clusters))


def _grid(total: int, raster: int, cm: int, cn: int, sm_count: int, max_active_clusters: int,
          truncate_clusters: bool = True, truncate: bool = True, occupancy: bool = True) -> tuple[int, int, int]:
    """PersistentTileSchedulerSm90Params::get_grid_shape: with truncate_by_problem_size, or without
    it (`truncate=False`, the stream-K scheduler's: one full wave whatever the problem); the group
    scheduler's does not truncate the grid it sizes by max active clusters (`truncate_clusters`).
    Clusters on a device whose max active clusters are unknown fill GH100's GPCs, or every SM
    (`occupancy=False`: bypass_sm90_occupancy_calculation, sm100's stream-K scheduler)."""
    def cap(x: int, y: int) -> int:
        return min(x, y) if truncate else x

    size = cm * cn
    if size == 1:
        ctas = cap(sm_count, total)
        return (1, ctas, 1) if raster == RASTER_ALONG_N else (ctas, 1, 1)
    if max_active_clusters and max_active_clusters * size <= sm_count:
        along_n, along_m = max_active_clusters * cn, max_active_clusters * cm
        if truncate_clusters:
            along_n, along_m = cap(along_n, total // cm), cap(along_m, total // cn)
        return (cm, along_n, 1) if raster == RASTER_ALONG_N else (along_m, cn, 1)
    per_device = sm_count
    if occupancy:
        min_gpcs = 1 if sm_count < MAX_SM_PER_GPC else sm_count // MAX_SM_PER_GPC
        per_gpc = MAX_SM_PER_GPC - MAX_SM_PER_GPC % size
        residual = 0 if sm_count < MAX_SM_PER_GPC else sm_count % MAX_SM_PER_GPC
        per_device = min(sm_count, min_gpcs * per_gpc + residual - residual % size)
    if raster == RASTER_ALONG_N:
        return cm, cap(per_device // cm, total // cm), 1
    return cap(per_device // cn, total // cn), cn, 1


MIN_ITERS_PER_SK_UNIT = 8  # the stream-K scheduler's floor on K tiles per stream-K unit
MAX_SK_GROUPS = 8
_GRID_Y_MAX = (1 << 16) - 1


@functools.lru_cache(maxsize=1024)
def sm100_plan(m: int, n: int, l: int, tile: tuple[int, int, int], cluster: tuple[int, int, int],  # noqa: E741
               mma_ctas: int, raster: int | None = None) -> SchedulerPlan:
    """The sm100 scheduler's Params and grid: every CTA of the tile grid is launched (rounded up to
    whole clusters; a 2-SM MMA tile is `mma_ctas` CTAs along M), and the hardware's cluster launch
    control hands the tiles out. CUTLASS's raster heuristic on cluster counts, or `raster`; along N
    the grid is transposed (unless its Y would pass 65535); no swizzle (max_swizzle_size 1)."""
    cm, cn, _ = cluster
    ctas_m = _round_up(-(-m // tile[0]) * mma_ctas, cm)
    ctas_n = _round_up(-(-n // tile[1]), cn)
    clusters_m, clusters_n = ctas_m // cm, ctas_n // cn
    if raster is None:
        raster = RASTER_ALONG_M if clusters_n > clusters_m else RASTER_ALONG_N
        if raster == RASTER_ALONG_N and clusters_m * cn > _GRID_Y_MAX:
            raster = RASTER_ALONG_M
    fields = {"scheduler.problem_tiles_m": clusters_m, "scheduler.problem_tiles_n": clusters_n,
              "scheduler.problem_tiles_l": l, "scheduler.raster_order": raster, "scheduler.log_swizzle_size": 0,
              "scheduler.swizzle_size.divisor": 0, "scheduler.swizzle_size.multiplier": 0,
              "scheduler.swizzle_size.shift_right": 0}
    for name, c in (("m", cm), ("n", cn)):
        fields.update({f"scheduler.cluster_shape_{name}.{k}": v for k, v in fast_divmod(c).items()})
    grid = (clusters_n * cm, clusters_m * cn, l) if raster == RASTER_ALONG_N else (ctas_m, ctas_n, l)
    return SchedulerPlan(fields, grid)


MMA_WARP_GROUPS = 2  # sm90's cooperative kernel (stream-K requires it): one tile barrier per warpgroup
SM100_FIXUP_BARRIERS = 1  # sm100 kernels' NumFixupBarriers: one per tile
#: Whether a stream-K wave follows GH100's GPC occupancy model, by arch: sm100's scheduler bypasses
#: it (bypass_sm90_occupancy_calculation), a wave being every SM.
STREAM_K_OCCUPANCY = {Arch.SM90A: True, Arch.SM100A: False}
_L2_LINE = 128  # the stream-K workspace's parts are rounded to this


@dataclass(frozen=True)
class Decomposition:
    """How the stream-K scheduler shares out a problem's work (its heuristic's outcome, or the
    split count it was given): the first `output_tiles - sk_tiles` tiles data-parallel; the K
    iterations of the last `sk_tiles` over `sk_units` CTAs, as `splits` equal parts per tile
    (split-K) or unevenly (stream-K, splits == 1). No stream-K tiles: data-parallel."""

    output_tiles: int
    k_tiles: int
    grid: tuple[int, int, int]  # one full wave, whatever the problem
    sk_tiles: int
    sk_units: int
    splits: int

    @property
    def ctas_per_wave(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def kind(self) -> str:
        return "data-parallel" if self.sk_tiles == 0 else "split-K" if self.splits > 1 else "stream-K"


@functools.lru_cache(maxsize=1024)
def decompose(m: int, n: int, k_tiles: int, l: int, tile: tuple[int, int, int],  # noqa: E741
              cluster: tuple[int, int, int], sm_count: int, max_active_clusters: int = 0,
              splits: int = 1, occupancy: bool = True) -> Decomposition:
    """PersistentTileSchedulerSm90StreamKParams::select_decomposition_mode under CUTLASS's default
    arguments (max swizzle 1, heuristic decomposition) and the split count `splits`. Above one,
    every tile is split into that many parts (`adjust_split_count`: at most the SMs and the K
    tiles). Otherwise CUTLASS's heuristic: a problem that fills whole waves, or whose tiles have at
    most MIN_ITERS_PER_SK_UNIT K tiles, runs data-parallel; one whose last wave is less than half
    full spreads the K iterations of up to its last two waves' tiles over one wave of CTAs, as
    split-K when the CTAs divide evenly among those tiles. `occupancy=False`: a wave is every SM
    (sm100's, `_grid`)."""
    f = plan(m, n, l, tile, cluster, sm_count, max_active_clusters).fields
    cm, cn = cluster[0], cluster[1]
    output_tiles = f["scheduler.problem_tiles_m"] * cm * f["scheduler.problem_tiles_n"] * cn * l
    grid = _grid(output_tiles, f["scheduler.raster_order"], cm, cn, sm_count, max_active_clusters, truncate=False,
                 occupancy=occupancy)
    splits = min(splits, sm_count, k_tiles)  # adjust_split_count; lowered to 1 (one K tile or SM): data-parallel
    if splits > 1:
        return Decomposition(output_tiles, k_tiles, grid, output_tiles, output_tiles * splits, splits)
    ctas_per_wave = grid[0] * grid[1]
    cluster_size = cm * cn
    sk_tiles = _sk_tiles(output_tiles, ctas_per_wave, cluster_size, k_tiles)
    ctas_full = ctas_per_wave // cluster_size * cluster_size
    sk_units = min(ctas_full, k_tiles * sk_tiles // MIN_ITERS_PER_SK_UNIT // cluster_size * cluster_size)
    if sk_tiles == 0 or sk_units == 0:
        return Decomposition(output_tiles, k_tiles, grid, 0, 0, 1)
    splits = sk_units // sk_tiles if sk_tiles < sk_units and sk_units % sk_tiles == 0 else 1
    return Decomposition(output_tiles, k_tiles, grid, sk_tiles, sk_units, splits)


def config_decomposition(cfg: KernelConfig, m: int, n: int, k: int, l: int, sm_count: int,  # noqa: E741
                         max_active_clusters: int = 0) -> Decomposition:
    """`decompose` for a stream-K config's kernel on a problem in its terms, as the kernel's plan
    decomposes it: over the CTA's tile (half a pair's MMA tile), its arch's waves."""
    return decompose(m, n, -(-k // cfg.tile[2]), l, cfg.cta_tile, cfg.cluster, sm_count, max_active_clusters,
                     cfg.splits, occupancy=STREAM_K_OCCUPANCY[cfg.arch])


@functools.lru_cache(maxsize=1024)
def stream_k_plan(m: int, n: int, k_tiles: int, l: int, tile: tuple[int, int, int],  # noqa: E741
                  cluster: tuple[int, int, int], sm_count: int, max_active_clusters: int = 0,
                  splits: int = 1, deterministic: bool = True, occupancy: bool = True,
                  fixup_barriers: int = MMA_WARP_GROUPS) -> SchedulerPlan:
    """The stream-K scheduler's Params, grid (one full wave, whatever the problem) and workspace
    for `decompose`'s decomposition; `deterministic=False` is ReductionMode::Nondeterministic, which
    changes no other field; `fixup_barriers` per split tile. Ported from
    PersistentTileSchedulerSm90StreamKParams (initialize, set_params_basic, set_params_stream_k,
    get_workspace_component_sizes)."""
    f = plan(m, n, l, tile, cluster, sm_count, max_active_clusters).fields  # the underlying scheduler's
    cm, cn = cluster[0], cluster[1]
    cluster_size = cm * cn
    blocks_mn = f["scheduler.problem_tiles_m"] * cm * f["scheduler.problem_tiles_n"] * cn
    d = decompose(m, n, k_tiles, l, tile, cluster, sm_count, max_active_clusters, splits, occupancy)
    fields = {k: v for k, v in f.items() if k.split(".")[1] in ("cluster_shape_major", "cluster_shape_minor",
                                                                 "cluster_blk_major", "log_swizzle_size",
                                                                 "raster_order")}

    def put(prefix: str, dm: dict[str, int]) -> None:
        fields.update({f"scheduler.{prefix}.{k}": v for k, v in dm.items()})

    put("batch", fast_divmod_u64(blocks_mn))
    put("tiles_per_output_tile", fast_divmod(k_tiles))
    if d.kind != "stream-K":  # set_params_basic
        put("sk_groups", fast_divmod_u64(1))
        put("sk_units_per_group", fast_divmod_u64(1))
        put("clusters_mnl", fast_divmod_u64(d.output_tiles // cluster_size))
        put("splits", fast_divmod(d.splits))
        put("k_tiles_per_sk_unit", fast_divmod(k_tiles // d.splits))
        put("k_tiles_per_sk_big_unit", fast_divmod(k_tiles // d.splits + 1))
        fields.update({"scheduler.units_per_problem": d.output_tiles, "scheduler.big_units": k_tiles % d.splits,
                       "scheduler.sk_tiles": 0, "scheduler.sk_units": 0})
        workspace_tiles = d.output_tiles if d.splits > 1 else 0  # split-K: every tile; data-parallel: none
    else:  # set_params_stream_k
        groups = _sk_groups(f["scheduler.raster_order"], f["scheduler.problem_tiles_m"],
                            f["scheduler.problem_tiles_n"], cluster_size, d.sk_tiles, d.sk_units, k_tiles)
        k_tiles_per_group = k_tiles * (d.sk_tiles // cluster_size // groups * cluster_size)
        k_tiles_per_sk_unit = k_tiles_per_group // (d.sk_units // groups)
        put("sk_groups", fast_divmod_u64(groups))
        put("sk_units_per_group", fast_divmod_u64(d.sk_units // groups))
        put("clusters_mnl", fast_divmod_u64(d.sk_units // cluster_size))
        put("splits", fast_divmod(1))
        put("k_tiles_per_sk_unit", fast_divmod(k_tiles_per_sk_unit))
        put("k_tiles_per_sk_big_unit", fast_divmod(k_tiles_per_sk_unit + 1))
        put("epilogue_subtile", fast_divmod_u64(1))
        fields.update({"scheduler.units_per_problem": d.output_tiles - d.sk_tiles + d.sk_units,
                       "scheduler.big_units": k_tiles_per_group % d.sk_units // cluster_size,
                       "scheduler.big_groups": d.sk_tiles // cluster_size % groups, "scheduler.sk_tiles": d.sk_tiles,
                       "scheduler.sk_units": d.sk_units})
        workspace_tiles = d.sk_tiles
    fields.update({"scheduler.reduction_mode": int(not deterministic), "scheduler.separate_reduction_units": 0,
                   "scheduler.ktile_start_alignment_count": 1})
    reduction = _round_up(workspace_tiles * tile[0] * tile[1] * 4, _L2_LINE)  # fp32 accumulators
    barriers = _round_up(workspace_tiles * fixup_barriers * 4, _L2_LINE)  # 32-bit barriers
    return SchedulerPlan(fields, d.grid, reduction, barriers)


@functools.lru_cache(maxsize=1024)
def sm100_stream_k_plan(m: int, n: int, k_tiles: int, l: int, tile: tuple[int, int, int],  # noqa: E741
                        cluster: tuple[int, int, int], mma_ctas: int, sm_count: int, max_active_clusters: int = 0,
                        splits: int = 1, deterministic: bool = True) -> SchedulerPlan:
    """PersistentTileSchedulerSm100StreamKParams: sm90's stream-K Params over the CTA tile with a
    wave of every SM (bypass_sm90_occupancy_calculation), named `scheduler.sk.*`, beside sm100's
    Params along M without swizzle, `scheduler.clc.*`. The grid: with stream-K units, waves of them
    (X the units over the cluster's N, Y the cluster's N, Z the waves); else every CTA tile, along
    Z once per split, as cluster launch control hands them out."""
    cta_tile = (tile[0] // mma_ctas, tile[1], tile[2])
    sk = stream_k_plan(m, n, k_tiles, l, cta_tile, cluster, sm_count, max_active_clusters, splits, deterministic,
                       occupancy=STREAM_K_OCCUPANCY[Arch.SM100A], fixup_barriers=SM100_FIXUP_BARRIERS)
    clc = sm100_plan(m, n, l, tile, cluster, mma_ctas, raster=RASTER_ALONG_M)
    fields = {"scheduler.raster_order": sk.fields["scheduler.raster_order"],
              "scheduler.log_swizzle_size": sk.fields["scheduler.log_swizzle_size"]}
    for part, p in (("sk", sk), ("clc", clc)):
        fields.update({f"scheduler.{part}.{name.removeprefix('scheduler.')}": v for name, v in p.fields.items()})
    units, per_problem = sk.fields["scheduler.sk_units"], sk.fields["scheduler.units_per_problem"]
    cn = cluster[1]
    grid = ((units // cn, cn, -(-per_problem // units)) if units else
            (clc.grid[0], clc.grid[1], clc.grid[2] * sk.fields["scheduler.splits.divisor"]))
    return SchedulerPlan(fields, grid, sk.reduction_bytes, sk.barrier_bytes)


def _sk_tiles(output_tiles: int, ctas_per_wave: int, cluster_size: int, k_tiles: int) -> int:
    """get_num_sk_tiles under the heuristic decomposition: the tiles of the last two waves when the
    last is less than half full and a tile has more than MIN_ITERS_PER_SK_UNIT K tiles."""
    full_waves = output_tiles // ctas_per_wave
    total_waves = -(-output_tiles // ctas_per_wave)
    dp_waves = full_waves - 1 if full_waves > 1 else 0
    if full_waves == total_waves or k_tiles <= MIN_ITERS_PER_SK_UNIT:
        return 0
    if 2 * (output_tiles - full_waves * ctas_per_wave) >= ctas_per_wave:
        return 0
    return (output_tiles - dp_waves * ctas_per_wave) // cluster_size * cluster_size


def _sk_groups(raster: int, cluster_tiles_m: int, cluster_tiles_n: int, cluster_size: int, sk_tiles: int,
               sk_units: int, k_tiles: int) -> int:
    """calculate_groups: the most groups of stream-K units (at most MAX_SK_GROUPS, at most the
    clusters along the rasterized dimension) that divide the units and tiles evenly and leave each
    unit at least MIN_ITERS_PER_SK_UNIT K tiles; else the largest that divides the units."""
    groups = min(cluster_tiles_m if raster == RASTER_ALONG_M else cluster_tiles_n, MAX_SK_GROUPS)
    sk_cluster_tiles, sk_cluster_units = sk_tiles // cluster_size, sk_units // cluster_size

    def too_small(g: int) -> bool:
        return (sk_cluster_tiles // g) * cluster_size * k_tiles // (sk_units // g) < MIN_ITERS_PER_SK_UNIT

    fallback = 0
    while groups > 1 and not (sk_cluster_units % groups == 0 and sk_cluster_tiles % groups == 0
                              and not too_small(groups)):
        if fallback == 0 and sk_cluster_units % groups == 0 and not too_small(groups):
            fallback = groups
        groups -= 1
    return fallback if groups == 1 and fallback > 0 else groups


@functools.lru_cache(maxsize=256)
def group_plan(tile: tuple[int, int, int], cluster: tuple[int, int, int], sm_count: int,
               max_active_clusters: int = 0, max_swizzle: int = 1, occupancy: bool = True) -> SchedulerPlan:
    """PersistentTileSchedulerSm90Group's Params and grid when the host does not know the groups'
    shapes (they are on the GPU): CUTLASS sizes the problem as one tile per SM, and the kernel
    walks every group's tiles from the device-side shapes. sm100's group scheduler wraps the same
    Params but sizes a static cluster's grid without GH100's GPC occupancy (`occupancy=False`:
    every SM, where a cluster of 4 fills 132 of sm90's 148)."""
    cm, cn = cluster[0], cluster[1]
    ctas_m, ctas_n = sm_count, 1  # get_tiled_cta_shape_mnl without host problem shapes
    log_swizzle = _log_swizzle(ctas_m, ctas_n, max_swizzle)
    blocks_m = _round_up(ctas_m, (1 << log_swizzle) * cm)
    blocks_n = _round_up(ctas_n, (1 << log_swizzle) * cn)
    raster = RASTER_ALONG_M  # the group scheduler's default: no heuristic, as each group's largest dimension differs
    major, minor = cm, cn
    fields: dict[str, int] = {}
    divmods = (("cluster_shape_major", fast_divmod_pow2(major)), ("cluster_shape_minor", fast_divmod_pow2(minor)),
               ("cta_shape_m", fast_divmod_u64(tile[0])), ("cta_shape_n", fast_divmod_u64(tile[1])))
    for prefix, dm in divmods:
        fields.update({f"scheduler.{prefix}.{k}": v for k, v in dm.items()})
    fields.update({
        "scheduler.blocks_across_problem": ctas_m * ctas_n, "scheduler.pre_processed_problem_shapes": 0,
        "scheduler.log_swizzle_size": log_swizzle, "scheduler.raster_order": raster,
        "scheduler.cta_shape.m": tile[0], "scheduler.cta_shape.n": tile[1], "scheduler.cta_shape.k": tile[2],
        "scheduler.cluster_shape.m": cm, "scheduler.cluster_shape.n": cn, "scheduler.cluster_shape.k": cluster[2],
    })
    # unlike the dense scheduler, the group scheduler does not truncate its max-active-clusters grid
    return SchedulerPlan(fields, _grid(blocks_m * blocks_n, raster, cm, cn, sm_count, max_active_clusters,
                                       truncate_clusters=False, occupancy=occupancy))

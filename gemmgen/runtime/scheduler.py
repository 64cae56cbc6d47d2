"""The persistent tile scheduler's Params and launch grid, ported from CUTLASS 4.2
(PersistentTileSchedulerSm90Params in cutlass/gemm/kernel/tile_scheduler_params.h).

Checked field by field against CUTLASS's own host code by the oracle tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SchedulerPlan:
    fields: dict[str, int]  # scheduler.* Params fields by gemmgen name
    grid: tuple[int, int, int]


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
          truncate_clusters: bool = True) -> tuple[int, int, int]:
    """PersistentTileSchedulerSm90Params::get_grid_shape with truncate_by_problem_size (and the
    group scheduler's, which does not truncate the grid it sizes by max active clusters)."""
    size = cm * cn
    if size == 1:
        ctas = min(sm_count, total)
        return (1, ctas, 1) if raster == RASTER_ALONG_N else (ctas, 1, 1)
    if max_active_clusters and max_active_clusters * size <= sm_count:
        along_n, along_m = max_active_clusters * cn, max_active_clusters * cm
        if truncate_clusters:
            along_n, along_m = min(along_n, total // cm), min(along_m, total // cn)
        return (cm, along_n, 1) if raster == RASTER_ALONG_N else (along_m, cn, 1)
    min_gpcs = 1 if sm_count < MAX_SM_PER_GPC else sm_count // MAX_SM_PER_GPC
    per_gpc = MAX_SM_PER_GPC - MAX_SM_PER_GPC % size
    residual = 0 if sm_count < MAX_SM_PER_GPC else sm_count % MAX_SM_PER_GPC
    per_device = min(sm_count, min_gpcs * per_gpc + residual - residual % size)
    if raster == RASTER_ALONG_N:
        return cm, min(per_device // cm, total // cm), 1
    return min(per_device // cn, total // cn), cn, 1


@functools.lru_cache(maxsize=256)
def group_plan(tile: tuple[int, int, int], cluster: tuple[int, int, int], sm_count: int,
               max_active_clusters: int = 0, max_swizzle: int = 1) -> SchedulerPlan:
    """PersistentTileSchedulerSm90Group's Params and grid when the host does not know the groups'
    shapes (they are on the GPU): CUTLASS sizes the problem as one tile per SM, and the kernel
    walks every group's tiles from the device-side shapes."""
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
                                       truncate_clusters=False))

"""sm90 constraints: one function per rule, each returning what a config breaks (human-readable,
naming the fix). `validate` raises them as one ConfigError before anything is compiled; a config
search prunes its candidates with the same functions (`is_valid`).

Each rule takes the kernel-side recipe (`config.kernel_recipe`: transposed under swap_ab);
`violations` applies the view.
"""

from __future__ import annotations

from ...config import KernelConfig, Schedule, TileScheduler
from ...ir import RecipeIR
from ...types import Microscaling
from ..rules import (
    arch_schedule_violations,
    block_scale_violations,
    cluster_violations,
    direct_epilogue_violations,
    k_grouped_violations,
    row_block_violations,
    tile_k_violations,
    tile_scheduler_violations,
)
from .geometry import MAX_ACCUMULATORS_PER_THREAD, accumulators_per_thread, epilogue_tile
from .smem import SM90_SMEM_CAPACITY, smem_need, stage_count


def tile_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """WGMMA's M and N (its K: `rules.tile_k_violations`)."""
    tm, tn, _ = cfg.tile
    out = []
    if tm not in (64, 128, 256):
        out.append(f"tile M = {tm}: must be 64, 128 or 256 (multiples of the 64-row WGMMA atom)")
    if tn % 16 or not 16 <= tn <= 256:
        out.append(f"tile N = {tn}: must be a multiple of 16 between 16 and 256 (WGMMA N)")
    return out


def schedule_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    if cfg.schedule.arch is not cfg.arch:
        return arch_schedule_violations(cfg)
    tm = cfg.tile[0]
    if cfg.schedule is Schedule.COOPERATIVE and tm % 128:
        return [f"schedule cooperative: tile M = {tm} must be 128 or 256 (two consumer warpgroups split M); "
                "use Schedule.PINGPONG for tile M = 64"]
    if cfg.schedule is Schedule.PINGPONG and tm not in (64, 128):
        return [f"schedule pingpong: tile M = {tm} must be 64 or 128 (each consumer warpgroup owns a tile)"]
    return []


def stream_k_schedule_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """CUTLASS's stream-K scheduler runs in its cooperative kernel only (the pingpong kernel
    static_asserts against it). (Its arguments: `rules.tile_scheduler_violations`.)"""
    if cfg.tile_scheduler is TileScheduler.STREAM_K and cfg.schedule is not Schedule.COOPERATIVE:
        return [f"tile scheduler stream_k: needs the cooperative schedule (CUTLASS's {cfg.schedule.value} kernel "
                "does not support stream-K); use Schedule.COOPERATIVE or TileScheduler.PERSISTENT"]
    return []


def register_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    n = accumulators_per_thread(cfg, recipe)
    if n <= MAX_ACCUMULATORS_PER_THREAD:
        return []
    fp8 = " (fp8 keeps two copies)" if recipe.gemm.fp8 else ""
    return [f"registers: tile {cfg.tile[0]}x{cfg.tile[1]} under the {cfg.schedule.value} schedule keeps {n} fp32 "
            f"accumulators per consumer thread{fp8}, over the {MAX_ACCUMULATORS_PER_THREAD} that fit without "
            "spilling; use a smaller tile M or N"
            + (", or the cooperative schedule" if cfg.schedule is Schedule.PINGPONG else "")]


def smem_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    stages = stage_count(cfg, recipe)
    need = smem_need(cfg, recipe)
    if stages < 2:
        return [f"shared memory: tile {cfg.tile} leaves room for {stages} mainloop stage(s), need at least 2; "
                "use a smaller tile K or N"]
    if need > SM90_SMEM_CAPACITY:
        return [f"shared memory: {stages} stages of tile {cfg.tile} plus the epilogue need up to {need} bytes, "
                f"more than the {SM90_SMEM_CAPACITY} an sm_90 block can use; lower stages or the tile"]
    return []


def column_block_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """gg.quantize_columns's blocks of rows lie in one epilogue subtile (column_blocks.hpp): the
    cooperative schedule's, whose M is the tile's (128 rows; pingpong's subtile has 64)."""
    blocks = recipe.epilogue.column_blocks
    if blocks is None:
        return []
    em, _ = epilogue_tile(cfg, recipe)
    if em % blocks.block:
        return [f"schedule {cfg.schedule.value}, tile M = {cfg.tile[0]}: gg.quantize_columns's blocks of "
                f"{blocks.block} rows must lie in one epilogue subtile, which has {em} rows here; use "
                "Schedule.COOPERATIVE with tile M = 128 or 256"]
    return []


def microscaling_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Microscaled fp8 and fp4 are scaled by sm_100a's block-scaled MMA; WGMMA has none (nor fp4)."""
    fmt = recipe.gemm.microscaling
    if fmt is None:
        return []
    mx = fmt is Microscaling.MXFP8
    other = ", or declare block_scale=gg.DEEPSEEK_BLOCK_SCALE for sm_90a" if mx else " (sm_90a has no fp4 MMA)"
    return [f"block_scale={fmt!r}: the MMA scales microscaled {'fp8' if mx else 'fp4'} on sm_100a (B200) only; "
            f"build it with arch=Arch.SM100A{other}"]


#: Each config's violations in this order: a recipe sm_90a cannot build at all (microscaled A and
#: B) is told so first.
CONSTRAINTS = (microscaling_violations, tile_violations, tile_k_violations, schedule_violations,
               tile_scheduler_violations, stream_k_schedule_violations, cluster_violations,
               register_violations, smem_violations, row_block_violations, column_block_violations,
               block_scale_violations, k_grouped_violations, direct_epilogue_violations)

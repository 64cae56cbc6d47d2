"""What CUTLASS's sm90 builders derive from a config: the epilogue tile, TMA swizzles, accumulator
registers, block-scale loads. Pure functions of (config, kernel-side recipe), shared by the
constraints, the storage model, the emitted types and the argument builder."""

from __future__ import annotations

from ...config import KernelConfig, Schedule
from ...ir import RecipeIR

#: fp32 accumulators a consumer thread can hold without spilling: it has 240 registers (setmaxnreg),
#: and the mainloop's addressing and the epilogue need the rest. 128 never spilled in gemmgen's
#: kernels, more did (docs/design/measurements.md, "Accumulator registers").
MAX_ACCUMULATORS_PER_THREAD = 128


def consumer_warpgroups(cfg: KernelConfig) -> int:
    """The warpgroups that share a tile's MMA and epilogue: two under the cooperative schedule, one
    under ping-pong (whose two take turns with tiles of their own)."""
    return 2 if cfg.schedule is Schedule.COOPERATIVE else 1


def accumulators_per_thread(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """fp32 accumulator registers per consumer thread: its warpgroup's part of the tile (half of it
    under the cooperative schedule, all of it under pingpong) over 128 threads, twice for fp8 A/B,
    whose mainloop keeps WGMMA's partial sums apart from the promoted fp32 sums."""
    tm, tn, _ = cfg.tile
    per_warpgroup = tm * tn // consumer_warpgroups(cfg)
    return per_warpgroup // 128 * (2 if recipe.gemm.fp8 else 1)


def epilogue_tile(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int]:
    """CUTLASS's EpilogueTileAuto (sm90_compute_tile_shape_or_override), widened to hold whole
    row blocks where D has them (gg.quantize, gg.rms_norm, gg.exp_minus_max: a block's statistic
    is reduced within one subtile, `epilogue_tile_override`)."""
    tm, tn, _ = cfg.tile
    if cfg.schedule is Schedule.COOPERATIVE:
        m, n = min(128, tm), _gcd(min(32, tn), tn)
    else:
        n = 64 if recipe.gemm.d.bits == 8 and tn % 64 == 0 else 32
        m, n = min(64, tm), _gcd(min(n, tn), tn)
    blocks = recipe.epilogue.row_blocks
    return (m, max(n, blocks.block)) if blocks else (m, n)


def epilogue_tile_override(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int] | None:
    """The epilogue tile a kernel spells out instead of EpilogueTileAuto, where D has row blocks
    (`epilogue_tile`); None for the Auto tile."""
    return epilogue_tile(cfg, recipe) if recipe.epilogue.row_blocks else None


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def swizzle_span(extent: int, bits: int) -> int:
    """The widest TMA swizzle span (128, 64 or 32 bytes; 0 for none) whose atom width in elements
    divides a tile's contiguous `extent` (ss_smem_selector, and the epilogue's smem atoms)."""
    for span in (128, 64, 32):
        if extent % (span * 8 // bits) == 0:
            return span
    return 0


def scales_per_tile(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int]:
    """Block scales of A and of B one tile reads per K step (CUTLASS's ScaleMsPerTile and
    ScaleNsPerTile); (0, 0) without block scaling."""
    g = recipe.gemm.block_scale
    if g is None:
        return 0, 0
    return cfg.tile[0] // g[0], cfg.tile[1] // g[1]


#: CUTLASS's blockwise main loop loads the scales of A (of B) with TMA when a tile reads at least this
#: many of them per K step and fewer than this many of the other's (its ScaleTmaThreshold), else with
#: cp.async by the producer warp.
SCALE_TMA_THRESHOLD = 32


def scale_tma(cfg: KernelConfig, recipe: RecipeIR) -> tuple[bool, bool]:
    """Whether the kernel loads A's and B's block scales with TMA (IsTmaLoadSFA/SFB; both are
    M/N-major in gemmgen's one-GEMM kernels). A grouped kernel's main loop reads them with cp.async
    only, as each group's scales start at its own first row."""
    if recipe.gemm.grouped:
        return False, False
    ms, ns = scales_per_tile(cfg, recipe)
    t = SCALE_TMA_THRESHOLD
    return ms >= t and ns < t, ns >= t and ms < t

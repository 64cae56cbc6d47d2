"""sm100 constraints: one function per rule (see `codegen.rules`), each returning what a config
breaks, naming the fix. The shapes are tcgen05.mma's (PTX ISA, "Matrix shape") as CUTLASS 4.2's
sm100 builders accept them; shared memory and tensor memory are B200's.

gemmgen's sm100 kernels so far: dense and batched GEMMs (16-bit or fp8 A and B, fp8 with block
scales through CUTLASS's blockwise main loop, microscaled MXFP8 through its block-scaled MMA)
with any EVT epilogue, D's row blocks and column pairs too, under CUTLASS's
cluster-launch-control scheduler or its stream-K scheduler (split-K too), and grouped
(pointer-array) GEMMs under its group scheduler, block-scaled or over column pairs too. What it
does not emit (`reduction_violations`) is refused by name, with the fix.
"""

from __future__ import annotations

from ...config import KernelConfig, Schedule, TileScheduler
from ...ir import RecipeIR, Reduction
from ...types import Microscaling
from ..rules import (
    arch_schedule_violations,
    block_scale_violations,
    cluster_violations,
    direct_epilogue_violations,
    k_grouped_violations,
    row_block_violations,
    row_violations,
    tile_k_violations,
    tile_scheduler_violations,
)
from .geometry import tmem_warps
from .smem import SM100_SMEM_CAPACITY, smem_fit, stage_count


def schedule_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    return arch_schedule_violations(cfg) if cfg.schedule.arch is not cfg.arch else []


def tile_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """tcgen05.mma shapes: one SM (cta_group::1) M = 64 (N a multiple of 8) or 128 (of 16); a pair
    (cta_group::2) M = 128 (N a multiple of 32) or 256 (of 16); N at most 256, which also keeps at
    least two fp32 accumulator buffers in the SM's 512 tensor-memory columns (`smem.accumulator_stages`).
    (K: `rules.tile_k_violations`.)"""
    if cfg.schedule.arch is not cfg.arch:
        return []
    tm, tn, _ = cfg.tile
    two = cfg.schedule is Schedule.TWO_SM
    n_step = {(False, 64): 8, (False, 128): 16, (True, 128): 32, (True, 256): 16}.get((two, tm))
    out = []
    if n_step is None:
        ms, other = ("128 or 256", "Schedule.ONE_SM for tile M = 64") if two else \
            ("64 or 128", "Schedule.TWO_SM for tile M = 256")
        out.append(f"tile M = {tm}: the {cfg.schedule.value} MMA computes M = {ms}; use one of those, or {other}")
    elif tn % n_step or not n_step <= tn <= 256:
        out.append(f"tile N = {tn}: the {cfg.schedule.value} MMA with M = {tm} needs N a multiple of {n_step} "
                   f"from {n_step} to 256")
    return out


def pair_cluster_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """A 2-SM MMA spans two CTAs along M, so the cluster's M is even (the rest: `rules.cluster_violations`)."""
    cm = cfg.cluster[0]
    if cfg.schedule is Schedule.TWO_SM and cm % 2:
        return [f"cluster M = {cm}: the 2sm schedule pairs two CTAs along M; use a cluster M of 2 or 4"]
    return []


def smem_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """At least two mainloop stages beside the epilogue; explicit `stages` that fit (auto stages
    fill what is left, as CUTLASS's builder counts it)."""
    stages = stage_count(cfg, recipe)
    if stages < 2:
        return [f"shared memory: tile {cfg.tile} leaves room for {stages} mainloop stage(s) per CTA, need at least 2; "
                "use a smaller tile K or N"]
    need = smem_fit(cfg, recipe)
    if cfg.stages is not None and need > SM100_SMEM_CAPACITY:
        return [f"shared memory: {stages} stages of tile {cfg.tile} plus the epilogue need up to {need} bytes per "
                f"CTA, more than the {SM100_SMEM_CAPACITY} an sm_100 block can use; lower stages or the tile"]
    return []


def reduction_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """sm_100a kernels reduce over their N with CUTLASS's Sm90ColReduction, within each thread's
    rows of the tensor-memory loads. A reduction over the recipe's M alone is computed by a swapped
    kernel, in which it is one over the kernel's N; a recipe reducing over both M and N reduces over
    the kernel's M with CUTLASS's Sm90RowReduction (gemmgen's, row_reduction.hpp, is sm_90a's WGMMA
    layout), all but a log-sum-exp, whose two-word state that node spilled (docs/design/blackwell.md); a
    swapped kernel takes it over its N where the reductions over the other dim are no log-sum-exp."""
    reduced = [o for o in recipe.epilogue.outputs if o.dim is not None and o.blocks is None]
    dims = {o.dim: o for o in reduced}
    if len(dims) == 2:
        lse = [o.name for o in reduced if o.dim == 0 and o.reduce is Reduction.LSE]
        if lse:
            swap = "" if any(o.dim == 1 and o.reduce is Reduction.LSE for o in reduced) else \
                f"use swap_ab={not cfg.swap_ab}, "
            return [f"aux output {lse[0]!r}: a log-sum-exp over the kernel's M beside a reduction over its N "
                    f"spills on sm_100a; {swap}build it with arch=Arch.SM90A, or split the reductions into two "
                    "recipes"]
        return []
    if 0 in dims:
        dim, swap = (1, "False") if cfg.swap_ab else (0, "True")
        return [f"aux output {dims[0].name!r}: its reduction (dim={dim}) is over the kernel's M, and gemmgen's "
                f"sm_100a kernels reduce a recipe's one reduction over their N; use swap_ab={swap}"]
    return []


def row_block_rows_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """D's row blocks (row_blocks.hpp's Sm100RowBlocks) are reduced within a thread's row: tensor
    memory's 32-lane loads give each thread one row of a CTA's 128 rows over 4 x 1 warps, which a
    one-SM MMA of M = 128 or a pair's of M = 256 has (a 64-row CTA tile gives 16-lane loads, whose
    threads share rows). (Whole blocks per tile: `rules.row_block_violations`.)"""
    blocks = recipe.epilogue.row_blocks
    if blocks is None or (cfg.cta_tile[0] == 128 and tmem_warps(cfg) == (4, 1)):
        return []
    fix = "tile M = 256 with Schedule.TWO_SM" if cfg.schedule is Schedule.TWO_SM else "tile M = 128"
    return [f"tile M = {cfg.tile[0]} ({cfg.schedule.value}): gg.{blocks.op.value}'s blocks are reduced within a "
            f"thread's row of sm_100a's tensor-memory loads, which need 128 rows per CTA; use {fix}"]


def block_scaled_tile_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """CUTLASS's sm100 blockwise main loop scales each K tile's partial accumulator in registers; at
    a CTA tile N of 256 that spilled (fp8_block_scaled on a pair's 256x256x128: a 280-byte stack
    frame), where 128 did not (168 registers: docs/design/blackwell.md). So a block-scaled kernel takes a
    CTA tile N of at most 128. (The scales' blocks per tile: `rules.block_scale_violations`.)"""
    n = cfg.cta_tile[1]
    if recipe.gemm.block_scale is not None and n > 128:
        return [f"tile N = {cfg.tile[1]}: an sm_100a block-scaled kernel of CTA tile N {n} spills registers "
                "(measured at 256); use tile N = 128 or less"]
    return []


def k_grouped_block_scale_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """A K-grouped fp8 kernel's scales are per column of B ((1, 1, 128)): each thread of CUTLASS's
    sm100 blockwise main loop then holds a scale per column of its tile, which spilled at a CTA
    tile N of 128 (a 240-byte stack frame) and of 64 (8 bytes), and not at 32 (168 registers, 0
    stack; docs/design/training.md#moe-in-fp8)."""
    n = cfg.cta_tile[1]
    if recipe.gemm.k_grouped and recipe.gemm.block_scale is not None and n > 32:
        return [f"tile N = {cfg.tile[1]}: an sm_100a K-grouped fp8 kernel (scales per column of B) of CTA tile N {n} "
                "spills registers (measured at 64 and 128); use tile N = 32"]
    return []


def microscaled_tile_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """The block-scaled MMA (kind::mxf8f6f4, kind::mxf4nvf4) computes 128 rows per SM (one SM's
    M = 128, a pair's 256) and CUTLASS's block-scaled main loop takes a CTA tile N of 64, 128, 192
    or 256 and reads the scales of whole blocks of 4 vectors of K per K tile (tile K a multiple of
    128 for MXFP8; 256 for NVFP4, the one depth gemmgen has compiled)."""
    fmt = recipe.gemm.microscaling
    if fmt is None or cfg.schedule.arch is not cfg.arch:
        return []
    tm, tn, tk = cfg.tile
    out = []
    if cfg.cta_tile[0] != 128:
        fix = "use tile M = 256 with the 2sm schedule" if cfg.schedule is Schedule.TWO_SM else \
            "use tile M = 128 (swap_ab=True puts a small M along the tile's N)"
        out.append(f"tile M = {tm}: the block-scaled MMA of {fmt!r} computes 128 rows per SM; {fix}")
    if tn not in (64, 128, 192, 256):
        out.append(f"tile N = {tn}: CUTLASS's block-scaled main loop takes tile N = 64, 128, 192 or 256 for "
                   f"{fmt!r}; use one of those")
    if tk % (4 * fmt.vector):
        out.append(f"tile K = {tk}: a K tile of {fmt!r} reads whole blocks of 4 scales ({4 * fmt.vector} values of "
                   f"K); use tile K = {4 * fmt.vector}")
    elif fmt is Microscaling.NVFP4 and tk != 256:
        out.append(f"tile K = {tk}: gemmgen's NVFP4 kernels take tile K = 256 (128 bytes of packed fp4, the full "
                   "swizzle span: the depth compiled and checked against CUTLASS); use tile K = 256")
    return out


def stream_k_tile_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """CUTLASS's sm100 stream-K scheduler runs a CTA tile N of 192 data-parallel whatever it is
    asked (ForceDataParallel), so a split count would be ignored; and its kernels spilled registers
    at a CTA tile N of 256 (a 256-byte stack frame for gemm_bf16 and bias_gelu, 992 with D's row
    blocks: docs/design/blackwell.md), where 128 kept every tested recipe in registers. So stream-K takes
    a CTA tile N of at most 128. (Its arguments: `rules.tile_scheduler_violations`.)"""
    if cfg.tile_scheduler is not TileScheduler.STREAM_K:
        return []
    n = cfg.cta_tile[1]
    if n == 192:
        return ["tile scheduler stream_k: CUTLASS's sm100 stream-K scheduler runs tile N = 192 data-parallel "
                "(no split-K or stream-K); use tile N = 128, or TileScheduler.PERSISTENT"]
    if n > 128:
        return [f"tile scheduler stream_k: an sm_100a stream-K kernel of tile N = {n} spills registers (measured at "
                "256); use tile N = 128 or less, or TileScheduler.PERSISTENT"]
    return []


def column_block_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """gg.quantize_columns has an sm_90a node only (column_blocks.hpp stages a CTA's WGMMA fragments);
    tensor memory's loads give each thread a row, and its sm_100a node is not written."""
    if recipe.epilogue.column_blocks is None:
        return []
    return ["gg.quantize_columns: sm_100a kernels do not write a column-quantized copy yet (sm_90a only); build "
            "with --arch sm_90a (arch=Arch.SM90A), or quantize the copy after the GEMM"]


CONSTRAINTS = (column_block_violations, schedule_violations, tile_violations, tile_k_violations, cluster_violations,
               pair_cluster_violations,
               smem_violations, reduction_violations, block_scale_violations, block_scaled_tile_violations,
               tile_scheduler_violations, microscaled_tile_violations,
               stream_k_tile_violations, row_violations, row_block_violations, row_block_rows_violations,
               k_grouped_violations, k_grouped_block_scale_violations, direct_epilogue_violations)

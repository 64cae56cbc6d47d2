"""What CUTLASS's sm100 builders derive from a config: the CTAs one MMA spans, the warps that read
the accumulator out of tensor memory, the epilogue tile, the TMA multicast. Pure functions of
(config, kernel-side recipe), shared by the emitted types' model and the argument builder."""

from __future__ import annotations

from ...config import KernelConfig, Schedule
from ...ir import RecipeIR
from ...types import Layout


def mma_ctas(cfg: KernelConfig) -> int:
    """CTAs one tcgen05 MMA spans along M (CUTLASS's AtomThrShape M): 2 under the 2-SM schedule."""
    return 2 if cfg.schedule is Schedule.TWO_SM else 1


def tmem_warps(cfg: KernelConfig) -> tuple[int, int]:
    """(M, N) of the four epilogue warps over the CTA's accumulator (sm100_tmem_warps): 2 x 2 for
    a pair's 128-row MMA (64 rows per CTA), else 4 x 1."""
    return (2, 2) if cfg.schedule is Schedule.TWO_SM and cfg.tile[0] == 128 else (4, 1)


def epilogue_tile(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int]:
    """CUTLASS's EpilogueTileAuto for a dense sm100 kernel (sm100_dense_compute_tile_shape_or_override):
    32 rows per tensor-memory warp; a fixed amount of work per subtile without C, a width by C's
    and D's width with it; at least 16 bytes of each N-contiguous row of C and D per warp. Where D
    has row blocks, the kernel spells out that tile widened to the smallest multiple of the block
    that divides the tile's N (`epilogue_tile_override`)."""
    cta_m, cta_n, _ = cfg.cta_tile
    warps_m, warps_n = tmem_warps(cfg)
    epi = recipe.epilogue
    source = epi.operand(epi.source).dtype if epi.source else None
    d = recipe.gemm.d
    m = min(cta_m, 32 * warps_m)
    max_bits = max((source or d).bits, d.bits)
    if source is None:
        n_perf = 4096 // m
    elif max_bits == 32:
        n_perf = 16 if cta_m > 64 and cta_n <= 128 else 32
    elif max_bits == 16:
        n_perf = 32 if cta_n <= 128 else 64
    else:
        n_perf = 64
    m_major = recipe.gemm.layout_d is Layout.COL  # C and every M x N tensor share D's layout
    n_min_c = 8 * warps_n if source is None or m_major else 128 // source.bits * warps_n
    n_min_d = 8 * warps_n if m_major else 128 // d.bits * warps_n
    n = min(cta_n, max(n_perf, n_min_c, n_min_d))
    blocks = recipe.epilogue.row_blocks
    if blocks is not None:  # widened to whole row blocks, in whole subtiles of the tile (where it holds
        # whole blocks: `rules.row_block_violations` refuses a tile that does not)
        n = next((w for w in range(blocks.block, cta_n + 1, blocks.block) if w >= n and cta_n % w == 0),
                 max(n, blocks.block))
    return m, n


def epilogue_tile_override(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int] | None:
    """The epilogue tile a kernel spells out instead of EpilogueTileAuto: where D has row blocks
    (row_blocks.hpp's Sm100RowBlocks reduces a block within one thread's fragment of a subtile,
    `epilogue_tile`); None for the Auto tile."""
    return epilogue_tile(cfg, recipe) if recipe.epilogue.row_blocks else None


def epilogue_copy_tile(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int]:
    """The (M, N) one TMA copy of C, D or an aux tensor moves: the epilogue tile, whose N under 2 x 2
    tensor-memory warps is two strided halves (CUTLASS tiles N as (N/2, 2):(1, CTA N/2))."""
    m, n = epilogue_tile(cfg, recipe)
    return m, n // tmem_warps(cfg)[1]


def multicast(cfg: KernelConfig) -> tuple[int, int]:
    """CTAs each A and B tile is multicast to (make_tma_atom_{A,B}_sm100): A across the cluster's N,
    B across its M in units of the MMA's CTAs."""
    cm, cn, _ = cfg.cluster
    return cn, cm // mma_ctas(cfg)

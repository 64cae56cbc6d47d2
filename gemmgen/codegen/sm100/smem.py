"""What an sm100 kernel keeps on chip: shared memory per CTA (mainloop stages, epilogue buffers)
and the accumulator's tensor memory, modelled after CUTLASS 4.2's sm100 builders.

The stage count follows `sm100_compute_stage_count_or_override`: the stages of A and B that fit
beside the epilogue's buffers (two epilogue tiles, `geometry.epilogue_tile`, of each tensor it
moves through shared memory) and the kernel's barriers (KERNEL_CARVEOUT). The total adds what the
kernel's SharedStorage aligns and keeps besides (at most KERNEL_PADDING). The compiled kernel's
`SharedStorageSize` is the measured figure (the report's smem); tests hold the model above it and
within KERNEL_PADDING of it.
"""

from __future__ import annotations

from ...config import KernelConfig, Schedule
from ...ir import RecipeIR
from ...types import OperandKind
from .geometry import epilogue_tile

#: Dynamic shared memory one sm_100 block may use (cutlass::arch::sm100_smem_capacity_bytes).
SM100_SMEM_CAPACITY = 232448
#: Tensor memory per SM: 512 columns of 128 lanes x 32 bits.
TMEM_COLUMNS = 512
#: CUTLASS's Sm100DenseGemmTmaUmmaCarveout (the accumulator, scheduler and load-order barriers, the
#: cluster-launch-control responses, the tensor-memory address), rounded up.
KERNEL_CARVEOUT = 512
#: A grouped kernel's tensor maps in shared memory, which it rewrites per group: the builder's
#: carveout counts A's and B's (a microscaled kernel's also its scales'); the kernel's SharedStorage
#: also holds C's and D's.
MAP_BYTES = 128
#: SharedStorage's alignment padding and the epilogue's barriers: 896-1408 bytes in the kernels measured.
KERNEL_PADDING = 2048
_PIPELINE_BARRIERS = 16  # two mbarriers per mainloop stage
_EPILOGUE_BUFFERS = 2


def per_cta_ab(cfg: KernelConfig) -> tuple[int, int]:
    """Rows of A and of B one CTA holds per stage: a 2-SM MMA splits A along M and B along N."""
    tm, tn, _ = cfg.tile
    return (tm // 2, tn // 2) if cfg.schedule is Schedule.TWO_SM else (tm, tn)


def stage_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """A and B of one K step; a blockwise main loop's stage also holds the MMA tile's fp32 block
    scales and a second pipeline's barriers, rounded to 128 bytes
    (`sm100_compute_stage_count_or_override_blockwise`); a microscaled one's the UE8M0 scales of
    its 128-row blocks (`sm100_compute_stage_count_or_override_blockscaled`)."""
    rows_a, rows_b = per_cta_ab(cfg)
    tm, tn, tk = cfg.tile
    ab = (rows_a * recipe.gemm.a.bits + rows_b * recipe.gemm.b.bits) * tk // 8
    fmt = recipe.gemm.microscaling
    if fmt is not None:  # one byte per 128 rows (B's: of the MMA's N, rounded up) x 4 scales per 4 vectors of K
        k_blocks = tk // (fmt.vector * 4)
        scales = 512 * k_blocks * (-(-cfg.cta_tile[0] // 128) + -(-tn // 128))
        return ab + scales + _PIPELINE_BARRIERS
    g = recipe.gemm.block_scale
    if g is None:
        return ab + _PIPELINE_BARRIERS
    scales = 4 * (tm // g[0] + tn // g[1]) * (tk // g[2])
    return -(-(ab + scales) // 128) * 128 + 2 * _PIPELINE_BARRIERS


def epilogue_smem_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """D (the first output), C, every aux load and every aux store, double-buffered epilogue tiles."""
    epi = recipe.epilogue
    widths = [o.dtype.nbytes for o in epi.operands
              if o.kind is OperandKind.MATRIX and o.per_batch]  # a shared matrix is read into registers
    widths += [o.dtype.nbytes for o in epi.outputs if o.reduce is None]
    m, n = epilogue_tile(cfg, recipe)
    return _EPILOGUE_BUFFERS * m * n * sum(widths)


def mainloop_maps(recipe: RecipeIR) -> int:
    """The tensor maps a grouped kernel's main loop rewrites per group (A and B, and a microscaled
    kernel's two of scales); none for one GEMM."""
    if not recipe.gemm.grouped:
        return 0
    return 4 if recipe.gemm.microscaling is not None else 2


def carveout(recipe: RecipeIR) -> int:
    """What the builder keeps out of the stages besides the epilogue (Sm100DenseGemmTmaUmmaCarveout)."""
    return KERNEL_CARVEOUT + mainloop_maps(recipe) * MAP_BYTES


def stage_count(cfg: KernelConfig, recipe: RecipeIR) -> int:
    if cfg.stages is not None:
        return cfg.stages
    room = SM100_SMEM_CAPACITY - carveout(recipe) - epilogue_smem_bytes(cfg, recipe)
    return room // stage_bytes(cfg, recipe)


def smem_fit(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """What CUTLASS's builder counts against the capacity: the stages, the epilogue, the carveout."""
    return carveout(recipe) + stage_count(cfg, recipe) * stage_bytes(cfg, recipe) + epilogue_smem_bytes(cfg, recipe)


def smem_need(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """Shared memory the kernel takes (an upper bound: its SharedStorageSize, padding included)."""
    maps = (mainloop_maps(recipe) + 2) * MAP_BYTES if recipe.gemm.grouped else 0  # and C's and D's
    return stage_count(cfg, recipe) * stage_bytes(cfg, recipe) + epilogue_smem_bytes(cfg, recipe) + maps + \
        KERNEL_PADDING


def accumulator_stages(cfg: KernelConfig) -> int:
    """Accumulator buffers in tensor memory (CUTLASS: as many fp32 tiles as fit, at most 4). A CTA's
    tile takes N columns for 128 rows; a 64-row tile of one SM half the lanes."""
    cta_m, cta_n, _ = cfg.cta_tile
    if cfg.schedule is Schedule.ONE_SM and cta_m == 64:
        return min(4, TMEM_COLUMNS // cta_n * 2)
    return min(4, 128 * TMEM_COLUMNS // (cta_m * cta_n))

"""The sm_100a kernels the CPU suite compiles (NVRTC, 25-60 s each on 2 cores) and checks: one per
path the sm100 emitter has, shared by every test through the session cache (`sm100_kernels`)."""

from __future__ import annotations

import gemmgen as gg

TWO_SM = dict(cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM, arch=gg.Arch.SM100A)

#: example recipe name -> its sm_100a config; None: gemmgen's default for sm_100a (one SM's 128 x 128 MMA).
SM100_KERNELS: dict[str, gg.KernelConfig | None] = {
    "bias_gelu": None,  # bf16, a row broadcast, one SM
    # fp8 (UTCQMMA) on a pair of SMs: per-row and per-column scales broadcast over the CTA's half tile
    "scaled_mm_fp8": gg.KernelConfig(tile=(256, 128, 128), **TWO_SM),  # type: ignore[arg-type]
    # column-major A, an aux output through shared memory (sm100's aux store descriptor) and an amax
    "bias_gelu_aux": gg.KernelConfig(tile=(256, 128, 64), **TWO_SM),  # type: ignore[arg-type]
    # C read through TMA, fp32 reductions over N
    "residual_norm_stats": None,
}

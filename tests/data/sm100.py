"""The sm_100a kernels the CPU suite compiles (NVRTC, 25-60 s each on 2 cores) and checks: one per
path the sm100 emitter has, shared by every test through the session cache (`sm100_kernels`)."""

from __future__ import annotations

import gemmgen as gg

TWO_SM = dict(cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM, arch=gg.Arch.SM100A)

#: example recipe name -> its sm_100a config; None: gemmgen's default for sm_100a (one SM's 128 x 128 MMA).
SM100_KERNELS: dict[str, gg.KernelConfig | None] = {
    # bf16 with D's row blocks (an RMSNorm per 128 columns: each thread's 128-column row, the
    # factors written), the weight's row read in place from shared memory, a DAG epilogue, one SM
    "qk_norm": None,
    # fp8 (UTCQMMA) on a pair of SMs: per-row and per-column scales broadcast over the CTA's half tile
    "scaled_mm_fp8": gg.KernelConfig(tile=(256, 128, 128), **TWO_SM),  # type: ignore[arg-type]
    # column-major A, an aux output through shared memory (sm100's aux store descriptor) and an amax
    "bias_gelu_aux": gg.KernelConfig(tile=(256, 128, 64), **TWO_SM),  # type: ignore[arg-type]
    # C read through TMA, fp32 reductions over N, CUTLASS's sm100 stream-K scheduler (on a pair in a
    # 2 x 2 cluster by value: VALUE_CONFIGS), one SM
    "residual_norm_stats": gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM,
                                           tile_scheduler=gg.TileScheduler.STREAM_K, arch=gg.Arch.SM100A),
    # fp8 with DeepSeek's block scales (CUTLASS's blockwise main loop, scales read with cp.async), one SM
    "fp8_block_scaled": None,
    # MXFP8 (the block-scaled MMA, kind::mxf8f6f4): UE8M0 scales loaded with TMA and copied into
    # tensor memory (UTCCP), one SM
    "mxfp8_linear": None,
    # NVFP4 (kind::mxf4nvf4, UTCOMMA): packed fp4 A and B (16U4_ALIGN8B maps), e4m3 scales per 16
    # values, a 256-deep K tile, one SM
    "nvfp4_linear": None,
    # column pairs: D of N/2 columns written from the registers (a PairStore), the collective's own
    # store of D aimed at the module's sink (codegen.fields.sinks_d), one SM
    "swiglu": None,
    # grouped (pointer-array) on a pair of SMs: per-group maps rewritten on the GPU, the group scheduler
    "moe_up": gg.KernelConfig(tile=(256, 128, 64), **TWO_SM),  # type: ignore[arg-type]
    # grouped NVFP4 on a pair (UTCOMMA.2CTA): the block-scaled pointer-array collective, four maps
    # rewritten per group, each group's scale layouts written by the setup kernel
    "moe_nvfp4": gg.KernelConfig(tile=(256, 128, 256), **TWO_SM),  # type: ignore[arg-type]
}

SM100 = gg.Arch.SM100A
#: Configs checked by their values alone (no NVRTC compile: the oracle and gemmgen's builder only),
#: each for a geometry the compiled kernels lack: a pair's 128-row MMA (2 x 2 tensor-memory warps,
#: each epilogue copy half the tile's N) with A multicast; one SM's 128 x 256 tile with A and B
#: multicast; a 64-row tile of column-major A with an aux output, multicast along N; C and fp32
#: reductions over N on a pair (their workspace counts the CTAs' tiles) with B multicast; vectors and
#: a scalar per batch, a matrix shared by every batch and signed max and min over M and N on a pair
#: (row_extrema), swapped (swapped: its per-batch vectors trade places), DeepSeek's block scales
#: on a pair (each CTA reads its half's scales of A), MXFP8's scale maps, D's row blocks on a pair,
#: and the stream-K scheduler.
VALUE_CONFIGS = {
    "pair_128": ("bias_gelu", gg.KernelConfig(tile=(128, 128, 64), cluster=(2, 2, 1), schedule=gg.Schedule.TWO_SM,
                                              arch=SM100)),
    "wide_multicast": ("bias_gelu", gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 2, 1),
                                                    schedule=gg.Schedule.ONE_SM, arch=SM100)),
    "m64_aux": ("bias_gelu_aux", gg.KernelConfig(tile=(64, 64, 64), cluster=(1, 2, 1), schedule=gg.Schedule.ONE_SM,
                                                 arch=SM100)),
    "pair_reductions": ("residual_norm_stats", gg.KernelConfig(tile=(256, 128, 64), cluster=(4, 1, 1),
                                                               schedule=gg.Schedule.TWO_SM, arch=SM100)),
    "pair_extrema": ("row_extrema", gg.KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1),
                                                    schedule=gg.Schedule.TWO_SM, arch=SM100)),
    "swapped_per_batch": ("swapped", gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM,
                                                     swap_ab=True, arch=SM100)),
    "block_scaled_pair": ("fp8_block_scaled", gg.KernelConfig(tile=(256, 128, 128), **TWO_SM)),  # type: ignore[arg-type]
    # D's row blocks on a pair (a CTA's 128 rows of the 256-row MMA), the bias read in place, fp8 D
    "row_blocks_pair": ("fp8_quantized", gg.KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1),
                                                         schedule=gg.Schedule.TWO_SM, arch=SM100)),
    # MXFP8's scales on a pair in a 4 x 1 cluster (B's scale blocks split between the pair's CTAs
    # and multicast), swapped on the heuristic's small-M pair, and in a 2 x 2 cluster of one SM with a
    # 192-wide tile (two of B's scale blocks per K tile) swapped
    "mx_pair": ("mxfp8_linear", gg.KernelConfig(tile=(256, 256, 128), cluster=(4, 1, 1), schedule=gg.Schedule.TWO_SM,
                                                arch=SM100)),
    "mx_swapped_pair": ("mxfp8_linear", gg.KernelConfig(tile=(256, 64, 128), swap_ab=True, **TWO_SM)),  # type: ignore[arg-type]
    "mx_192_multicast": ("mxfp8_linear", gg.KernelConfig(tile=(128, 192, 128), cluster=(2, 2, 1), swap_ab=True,
                                                         schedule=gg.Schedule.ONE_SM, arch=SM100)),
    # MXFP8 with a 256-deep K tile: two K blocks of scales per box, which CuTe's map puts before the
    # row blocks (tma.ScaleBlockTemplate.order)
    "mx_k256": ("mxfp8_linear", gg.KernelConfig(tile=(128, 128, 256), schedule=gg.Schedule.ONE_SM, arch=SM100)),
    # NVFP4 on a pair in a 2 x 1 cluster (each CTA's half of packed A and B, B's scales split
    # between the pair), and swapped on one SM's 128 x 64 tile (the heuristic's small-M choice)
    "nv_pair": ("nvfp4_linear", gg.KernelConfig(tile=(256, 256, 256), **TWO_SM)),  # type: ignore[arg-type]
    "nv_swapped": ("nvfp4_linear", gg.KernelConfig(tile=(128, 64, 256), swap_ab=True, schedule=gg.Schedule.ONE_SM,
                                                   arch=SM100)),
    # every path of column pairs on a pair of SMs (an N/2-column operand and aux output, a TMA aux
    # store of an interleave, a sum over N of a half, D from the registers: pairs.hpp's probe under
    # the pair's tensor-memory partition), and a backward's D of 2N columns (a DoubleStore) on one
    # SM's 64-row tile (16-lane tensor-memory loads: the heuristic's choice for swiglu at small M)
    "pair_ops_pair": ("pair_ops", gg.KernelConfig(tile=(256, 128, 64), **TWO_SM)),  # type: ignore[arg-type]
    "double_d": ("swiglu_bwd", gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.ONE_SM, arch=SM100)),
    # reductions over M (CUTLASS's Sm90RowReduction: its partials and tile counters) and over N
    "both_reductions": ("row_col_amax", gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM, arch=SM100)),
    # CUTLASS's sm100 stream-K scheduler on pairs in a 2 x 2 cluster after C and two reductions'
    # workspace (STREAM_K_ORACLES: also split counts and both reduction orders)
    "stream_k_pair": ("residual_norm_stats", gg.KernelConfig(tile=(256, 128, 64), cluster=(2, 2, 1),
                                                             schedule=gg.Schedule.TWO_SM,
                                                             tile_scheduler=gg.TileScheduler.STREAM_K, arch=SM100)),
}
#: The sm100 oracles whose stream-K decompositions are checked: the compiled one SM's, and the pair.
STREAM_K_ORACLES = ("residual_norm_stats", "stream_k_pair")


def grouped_value_kernels() -> dict[str, tuple[gg.Recipe, gg.KernelConfig]]:
    """Grouped sm_100a kernels checked by their values alone (tests/runtime/test_sm100_grouped.py):
    one SM's, swapped (one SM's 128 x 32 MMA, B200's choice for few rows per group), the derived
    backward kernel of a GroupedLinear, which reads dL/dD per group as C, on a pair, and the
    block-scaled example (DeepSeek's scales, each group's scale layouts written by the setup
    kernel) on one SM (on a pair it is emulated: test_sm100_grouped.BLOCK_SCALED), the gated
    experts over column pairs (moe_swiglu: a PairStore writes each group's D, the collective's is
    void) on a pair, and microscaled experts: MXFP8 on a pair's 256-wide tile in a 4 x 1 cluster
    (B's scales split between the pair and multicast), NVFP4 swapped."""
    from gemmgen.testing.grouped import moe_mx_recipe, moe_recipe
    from tests.data.gpu_matrix import ROOT, derived_grouped_recipe, load_recipes

    examples = load_recipes(ROOT / "examples" / "recipes.py")
    moe_fp8_block, moe_swiglu = examples["moe_fp8_block"], examples["moe_swiglu"]

    one = gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM, arch=SM100)
    swapped = gg.KernelConfig(tile=(128, 32, 64), schedule=gg.Schedule.ONE_SM, swap_ab=True, arch=SM100)
    pair = gg.KernelConfig(tile=(256, 128, 64), **TWO_SM)  # type: ignore[arg-type]
    block_one = gg.KernelConfig(tile=(128, 128, 128), schedule=gg.Schedule.ONE_SM, arch=SM100)
    mx_pair = gg.KernelConfig(tile=(256, 256, 128), cluster=(4, 1, 1), schedule=gg.Schedule.TWO_SM, arch=SM100)
    nv_swapped = gg.KernelConfig(tile=(128, 64, 256), schedule=gg.Schedule.ONE_SM, swap_ab=True, arch=SM100)
    return {"one_sm": (moe_recipe(), one), "swapped": (moe_recipe(), swapped),
            "reads_c": (derived_grouped_recipe(), pair), "block_scaled": (moe_fp8_block, block_one),
            "gated": (moe_swiglu, pair), "mx_pair": (moe_mx_recipe(gg.MXFP8), mx_pair),
            "nv_swapped": (moe_mx_recipe(gg.NVFP4), nv_swapped)}


def mxfp8_training_kernels() -> dict[str, tuple[gg.Recipe, gg.KernelConfig]]:
    """An MXFP8 FusedMLP's training step (gemmgen.training.MXFP8) as nn launches it on a B200, by
    recipe name: fc1's forward saving its accumulator, fc2's fprop, fc2's dgrad carrying fc1's
    derived epilogue (gelu' of the saved accumulator, the bias gradient), fc1's dgrad, the fp32
    weight gradient (both operands along the tokens) and its main_grad accumulation; and a gated
    (SwiGLU, no biases) MLP's three of its own: fc1's forward and fc2's dgrad over column pairs (the
    dgrad writing dL/dgate and dL/dup), fc2's fprop without a bias; each under the config a step of
    300 tokens launches. Checked by value
    (tests/runtime/test_sm100_oracle.py) and emulated (tests/runtime/test_sm100_emulation.py); not
    compiled by the suite."""
    out: dict[str, tuple[gg.Recipe, gg.KernelConfig]] = {}
    for accumulate, activation in ((False, "gelu"), (True, "gelu"), (False, "swiglu")):
        mlp = gg.nn.FusedMLP(256, 512, 128, activation=activation, bias=activation == "gelu",
                             precision=gg.training.MXFP8(), accumulate_grad=accumulate, device="meta")
        for recipe, config in mlp.launches(300, training=True, arch=SM100) + mlp.backward_launches(300, arch=SM100):
            out.setdefault(recipe.name, (recipe, config))
    return out

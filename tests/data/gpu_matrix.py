"""The kernels the GPU checks run: every example recipe under both schedules and swapped (but a
recipe reducing over N, which no swapped kernel computes) and with the direct epilogue where it
computes the recipe, the reductions over M, and the stream-K scheduler.

Shared by tests/gpu/test_gpu.py and scripts/prepare_gpu_check.sh, which compiles them on the CPU
machine and ships them as one gemmgen bundle, so the GPU machine only loads cubins.

    python tests/data/gpu_matrix.py [--bundle DIR]
"""

from __future__ import annotations

from pathlib import Path

import gemmgen as gg
from gemmgen.aot import load_recipes
from gemmgen.integrations.grouped import grouped_weight_grad_recipe
from gemmgen.tuning.heuristic import GROUPED_SWAP_CONFIG

ROOT = Path(__file__).resolve().parents[2]


MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # the FusedLinear layers tests/gpu/test_gpu.py runs
#: (M, N, K) of the FusedLinear calls in tests/gpu/test_gpu.py and scripts/op_overhead.py: the runtime
#: picks each one's config by shape, so those configs are compiled here too.
MODULE_PROBLEMS = ((300, 1024, 512), (300, 264, 1024), (77, 264, 256), (64, 64, 64), (8, 1024, 512),
                   (8, 264, 1024))
#: (M, N, K) of the FusedLinear calls tests/gpu/test_gpu.py makes with gradients wanted (the kernels
#: that also store the pre-activation).
TRAINING_PROBLEMS = ((300, 1024, 512), (300, 264, 1024))
#: tests/gpu/test_training_gpu.py's FusedMLP (tokens, in, hidden, out), and its (activation,
#: recompute, accumulate_grad) cases; the op's backward test at (M, N, K).
TRAINING_MLP = (300, 512, 1024, 264)
TRAINING_MLP_CASES = (("gelu", False, False), ("gelu", True, False), ("silu", False, True), ("swiglu", True, False))
OP_BACKWARD_PROBLEM = (77, 264, 256)
#: tests/gpu/test_training_gpu.py's low-precision FusedMLPs (tokens, in, hidden, out: out a multiple
#: of 16, as fp8 rows need), gelu with biases and Llama's SwiGLU without.
TRAINING_FP8_MLP = (300, 512, 1024, 256)
#: scripts/gpu_bench.py's training-step table (tokens, in, hidden, out): an MLP block of 4096 tokens,
#: Llama-3 8B's sizes, with gelu (and biases) and with Llama's SwiGLU (no biases), its activation
#: saved or recomputed.
TRAINING_BENCH_MLP = (4096, 4096, 14336, 4096)
#: scripts/gpu_bench.py --training's experts layer: routed rows, experts, in, out (SwiGLU, no biases):
#: Mixtral 8x7B's gate and up projections for 4096 tokens, top-2, spread evenly
TRAINING_BENCH_EXPERTS = (8192, 8, 4096, 14336)
#: (M, N, K) of tests/gpu/test_gpu.py's BlockScaledLinear calls (silu, bias): a decode step and 300 tokens.
BLOCK_LINEAR_PROBLEMS = ((8, 384, 512), (300, 384, 512))
#: The swapped kernel each example recipe also runs under: the heuristic's pick for a decode step.
DECODE_PROBLEM = (8, 4096, 4096)
#: scripts/gpu_bench.py: bias_gelu at these (M, N, K) under the heuristic's config; where that is a
#: stream-K kernel, also under the persistent scheduler, and where it is swapped, also under the best
#: unswapped config, to show what each buys.
BENCH_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336), (8, 4096, 4096), (64, 4096, 14336))
#: scripts/gpu_bench.py: residual_norm_stats at these (M, N, K): an output projection of 4096 tokens
#: and an MLP's down projection of 16384 (Llama-3 8B's sizes).
STATS_BENCH_SHAPES = ((4096, 4096, 4096), (16384, 4096, 14336))
#: scripts/gpu_bench.py: scaled_mm_fp8 likewise.
FP8_BENCH_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16, 4096, 4096))


def bench_configs(recipe: gg.Recipe, m: int, n: int, k: int) -> list[gg.KernelConfig]:
    """The heuristic's config; for a stream-K pick the same tile under the persistent scheduler, the
    split counts autotune would time and each of these stream-K configs with the nondeterministic
    reduction (all the same binary); for a swapped pick the best unswapped config."""
    from dataclasses import replace

    from gemmgen.tuning.heuristic import choose, ranked, split_variants

    chosen = choose(recipe.ir, m, n, k).config
    out = [chosen]
    if chosen.tile_scheduler is gg.TileScheduler.STREAM_K:
        out.append(replace(chosen, tile_scheduler=gg.TileScheduler.PERSISTENT))
        stream_k = [chosen, *split_variants([chosen], m, n, k)]
        out += stream_k[1:] + [replace(c, deterministic=False) for c in stream_k]
    if chosen.swap_ab:
        out.append(next(c for _, c, _ in ranked(recipe.ir, m, n, k) if not c.swap_ab))
    # gemmgen's direct epilogue in place of the TMA one, where it computes the recipe: what it costs
    direct = replace(chosen, tile_scheduler=gg.TileScheduler.PERSISTENT, splits=1, deterministic=True,
                     epilogue=gg.EpilogueCollective.DIRECT)
    if gg.codegen.is_valid(direct, recipe.ir):
        out.append(direct)
    return out


#: tests/gpu/test_gpu.py's layout-copy test: bias_silu_residual at this (M, N, K), odd N and an
#: unpadded residual (the runtime picks the config by shape).
LAYOUT_PROBLEM = (77, 9, 64)
#: The autotune GPU test: bias_gelu at this problem, over the heuristic's best TUNE_CANDIDATES configs.
TUNE_PROBLEM, TUNE_CANDIDATES = (2048, 4096, 1024), 2
#: ...and the grouped tests': moe_up at (rows, N, K, groups), a decode step of 8 rows per
#: expert, over its best TUNE_CANDIDATES (the swapped kernel and the default).
GROUPED_TUNE_PROBLEM = (64, 48, 64, 8)


def fp8_out_recipe(d: gg.DType = gg.e4m3) -> gg.Recipe:
    """fp8 in and out, as a layer feeding another fp8 GEMM: D = fp8(acc * scale), saturating, and
    D's amax (tests/gpu/test_gpu.py runs the e4m3 one)."""
    return gg.Recipe(f"fp8_out_{d.value}", lambda acc, scale: {"d": acc * scale, "amax_d": gg.amax(acc * scale)},
                     a=gg.e4m3, b=gg.e4m3, d=d, operands={"scale": gg.Scalar()}, aux={"amax_d": gg.f32})


def moe_fp8_recipe() -> gg.Recipe:
    """fp8 experts, as fp8 MoE serving runs them: e4m3 tokens and weights, each token's scale, each
    expert's channel scales and bias, bf16 out (the grouped tests)."""
    return gg.Recipe("moe_fp8", lambda acc, scale_a, scale_b, bias: acc * scale_a * scale_b + bias, grouped=True,
                     a=gg.e4m3, b=gg.e4m3, d=gg.bf16,
                     operands={"scale_a": gg.ColVector(gg.f32), "scale_b": gg.RowVector(gg.f32),
                               "bias": gg.RowVector(gg.bf16)})


#: The grouped example's kernels on the GPU and against CUTLASS's host code (the grouped tests):
#: the default (cooperative, no cluster), a pingpong kernel with a 2 x 1 cluster, and the swapped
#: kernel for groups of few rows (tuning.heuristic.GROUPED_SWAP_CONFIG).
GROUPED_CONFIGS = (gg.KernelConfig(), gg.KernelConfig(cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG),
                   GROUPED_SWAP_CONFIG)
#: ...of which the CPU tests compile the default and the swapped one (the pingpong kernel with a
#: 2 x 1 cluster is emulated uncompiled there; its config's Params are checked against CUTLASS on
#: moe_fp8_block's and on the derived backward kernel's, `DERIVED_GROUPED_CONFIG`)
CHECKED_GROUPED_CONFIGS = (GROUPED_CONFIGS[0], GROUPED_CONFIGS[2])
#: GroupedLinear's derived backward kernel as the CPU tests compile it (a grouped kernel reading C:
#: dL/dD per group), pingpong with a 2 x 1 cluster
DERIVED_GROUPED_CONFIG = gg.KernelConfig(cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG)
#: the grouped tests' fp8 experts (moe_fp8_recipe): the default, and swapped (tile K 128).
FP8_GROUPED_CONFIGS = (gg.KernelConfig(tile=(128, 128, 128)), gg.KernelConfig(tile=(128, 32, 128), swap_ab=True))
#: ...and the block-scaled grouped example's (tile K 128, the scales' K): its default, a pingpong
#: kernel with a 2 x 1 cluster, and swapped (the grouped tests).
BLOCK_GROUPED_CONFIGS = (gg.KernelConfig(tile=(128, 128, 128)),
                         gg.KernelConfig(tile=(64, 128, 128), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG),
                         gg.KernelConfig(tile=(128, 32, 128), swap_ab=True))
#: scripts/gpu_bench.py's grouped shapes (groups, rows, N, K): Mixtral 8x7B's up projection for 4096
#: tokens (512 per expert), and 64 small experts with 128 tokens each (DeepSeek-V2-Lite's sizes);
#: then decode steps, 8 rows per expert, where `tuning.grouped_choice` swaps.
GROUPED_BENCH_SHAPES = ((8, 4096, 14336, 4096), (64, 8192, 1408, 2048),
                        (8, 64, 14336, 4096), (64, 512, 1408, 2048))
#: ...and the gated experts' (moe_swiglu): Mixtral 8x7B's gate and up projections interleaved (N =
#: 2 x 14336) for 4096 tokens, then a decode step of 8 rows per expert.
GATED_BENCH_SHAPES = ((8, 4096, 28672, 4096), (8, 64, 28672, 4096))


def gpu_matrix() -> list[tuple[gg.Recipe, gg.KernelConfig]]:
    from dataclasses import replace

    import torch

    from gemmgen.config import tile_k
    from gemmgen.nn import linear_recipe
    from gemmgen.tuning import candidates, config_for
    from gemmgen.tuning.heuristic import choose

    out = [(linear_recipe(act, True, torch.bfloat16), gg.KernelConfig()) for act in MLP_ACTIVATIONS]
    mlp = _load(ROOT / "examples" / "mlp.py")  # examples/mlp.py runs in scripts/gpu_check.sh
    out += gg.nn.model_launches(gg.nn.fuse(mlp.make_mlp(device="meta"))[0], mlp.TOKENS,
                                training_tokens=mlp.TOKENS[:1])
    for act in MLP_ACTIVATIONS:
        recipe = linear_recipe(act, True, torch.bfloat16)
        out += [(recipe, config_for(recipe, m, n, k)) for m, n, k in MODULE_PROBLEMS]  # what the runtime launches
        training = linear_recipe(act, True, torch.bfloat16, save_pre_activation=True)
        out += [(training, config_for(training, m, n, k)) for m, n, k in TRAINING_PROBLEMS]
    for recipe in load_recipes(ROOT / "examples" / "recipes.py").values():
        if recipe.ir.gemm.grouped:  # tests/gpu/test_grouped_gpu.py
            out += [(recipe, c) for c in (BLOCK_GROUPED_CONFIGS if recipe.ir.gemm.block_scale else GROUPED_CONFIGS)
                    if gg.codegen.is_valid(c, recipe.ir)]  # (moe_swiglu: not swapped, its pairs are columns)
            if recipe.name == "moe_up":
                out += [(recipe, c) for c in candidates(recipe.ir, *GROUPED_TUNE_PROBLEM, limit=TUNE_CANDIDATES)]
            continue
        if recipe.ir.gemm.microscaling is not None:  # sm_100a's block-scaled MMA: sm100_gpu_matrix
            continue
        default = recipe.default_config()
        other = gg.Schedule.PINGPONG if default.schedule is gg.Schedule.COOPERATIVE else gg.Schedule.COOPERATIVE
        out.append((recipe, default))
        out.append((recipe, next(c for c in (gg.KernelConfig(tile=(tm, 128, tile_k(recipe.ir)), schedule=other)
                                              for tm in (128, 64)) if gg.codegen.is_valid(c, recipe.ir))))
        decode = choose(recipe.ir, *DECODE_PROBLEM).config
        # swapped at a decode step, but where column pairs (row blocks) would be rows
        assert decode.swap_ab != recipe.ir.epilogue.along_rows, decode

        out.append((recipe, decode))
        direct = replace(default, epilogue=gg.EpilogueCollective.DIRECT)  # gemmgen's own epilogue collective
        if gg.codegen.is_valid(direct, recipe.ir):
            out.append((recipe, direct))
        if recipe.name == "bias_silu_residual":
            out.append((recipe, config_for(recipe, *LAYOUT_PROBLEM)))
        if recipe.name == "bias_gelu":
            out += [(recipe, c) for c in candidates(recipe.ir, *TUNE_PROBLEM, limit=TUNE_CANDIDATES,
                                                    declared=recipe.config)]
            out += [(recipe, c) for shape in BENCH_SHAPES for c in bench_configs(recipe, *shape)]
        if recipe.name == "residual_norm_stats":
            out += [(recipe, c) for shape in STATS_BENCH_SHAPES for c in bench_configs(recipe, *shape)]
        if recipe.name in ("scaled_mm_fp8", "fp8_block_scaled"):
            out += [(recipe, c) for shape in FP8_BENCH_SHAPES for c in bench_configs(recipe, *shape)]
    # reductions over M: gemmgen's over the kernel's M, and CUTLASS's over a swapped kernel's N
    columns = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["column_stats"]
    out += [(columns, columns.default_config()), (columns, gg.KernelConfig(swap_ab=True))]
    swapped_blocks = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["block_scaled_swapped"]
    out.append((swapped_blocks, swapped_blocks.default_config()))
    softmax = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["block_softmax"]  # gg.exp_minus_max
    out.append((softmax, softmax.default_config()))
    extrema = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["row_extrema"]  # max and min over N
    out.append((extrema, extrema.default_config()))
    swapped = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["swapped"]  # operands per batch, swapped
    out.append((swapped, swapped.default_config()))
    pairs = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["pair_ops"]  # column pairs' every path
    out.append((pairs, pairs.default_config()))
    stream_k = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["stream_k"]  # split-K and stream-K
    out.append((stream_k, stream_k.default_config()))
    out += training_launches()
    out.append((fp8_out_recipe(), fp8_out_recipe().default_config()))
    out += [(moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS]
    fp8_linear = gg.nn.block_scaled_linear_recipe("silu", True, torch.bfloat16)  # test_gpu's BlockScaledLinear
    out += [(fp8_linear, config_for(fp8_linear, m, n, k)) for m, n, k in BLOCK_LINEAR_PROBLEMS]
    experts = gg.nn.grouped_linear_recipe("silu", True, torch.bfloat16)  # tests/gpu/test_grouped_gpu.py's GroupedLinear
    out += [(experts, experts.default_config()), (experts, config_for(experts, 1, 128, 64, 1))]
    for gated in (gg.nn.grouped_linear_recipe("swiglu", True, torch.bfloat16),  # ...gated, over column pairs
                  gg.nn.grouped_linear_recipe("geglu", False, torch.bfloat16)):
        out.append((gated, gated.default_config()))
    for layer in grouped_linear_layers():  # ...and their backward's derived kernels
        out += layer.backward_launches(GROUPED_LINEAR_ROWS)
    out += grouped_experts_launches()
    out.append((derived_grouped_recipe(), DERIVED_GROUPED_CONFIG))  # test_grouped_gpu's pointer-array C
    wgrad = grouped_weight_grad_recipe(torch.bfloat16, accumulate=True)  # ...and its K-grouped weight gradient
    out.append((wgrad, wgrad.default_config()))
    for precision in GROUPED_PRECISIONS:  # ...its fp8 steps, and its K-grouped fp8 weight gradient alone
        float8 = float8_grouped_layer(precision=precision)
        out += [float8.launches(GROUPED_LINEAR_ROWS), *float8.backward_launches(GROUPED_LINEAR_ROWS)]
    fp8_wgrad = k_grouped_fp8_recipe()
    out.append((fp8_wgrad, fp8_wgrad.default_config()))
    fp8_experts = gg.nn.block_scaled_grouped_recipe("silu", True, torch.bfloat16)  # ...and its fp8 form
    out += [(fp8_experts, fp8_experts.default_config()), (fp8_experts, config_for(fp8_experts, 1, 256, 512, 1))]
    return list(dict.fromkeys(out))


def sm100_gpu_matrix() -> list[tuple[gg.Recipe, gg.KernelConfig]]:
    """The sm_100a kernels tests/gpu/test_sm100_gpu.py launches on a B200: the examples'
    (`sm100_example_kernels`) and an MXFP8 FusedMLP's training step, GELU and Llama's SwiGLU, at
    TRAINING_FP8_MLP."""
    out = sm100_example_kernels()
    tokens, n_in, hidden, n_out = TRAINING_FP8_MLP
    for activation in ("gelu", "swiglu"):
        mlp = gg.nn.FusedMLP(n_in, hidden, n_out, activation, bias=activation == "gelu",
                             precision=gg.training.MXFP8(), device="meta")
        out += mlp.launches(tokens, training=True, arch=gg.Arch.SM100A) + mlp.backward_launches(tokens,
                                                                                                arch=gg.Arch.SM100A)
    return list(dict.fromkeys(out))


def sm100_example_kernels() -> list[tuple[gg.Recipe, gg.KernelConfig]]:
    """Each example the sm100 emitter accepts at its sm_100a default, on a pair of SMs (256 x 128
    in a 2 x 1 cluster) and at a decode step (swapped); the grouped ones also swapped for groups of
    few rows."""
    from gemmgen.config import tile_k
    from gemmgen.tuning import config_for
    from gemmgen.tuning.heuristic import choose

    sm100 = gg.Arch.SM100A
    out = []
    for recipe in load_recipes(ROOT / "examples" / "recipes.py").values():  # sm100 builds every example
        pair = gg.KernelConfig(tile=(256, 128, tile_k(recipe.ir)), cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM,
                               arch=sm100)
        _, n, k = DECODE_PROBLEM
        # a decode step: 8 rows, or 8 groups of 8 rows
        decode = choose(recipe.ir, 64, n, k, 8, arch=sm100) if recipe.ir.gemm.grouped else \
            choose(recipe.ir, *DECODE_PROBLEM, arch=sm100)
        configs = (recipe.default_config(sm100), pair, decode.config)
        out += [(recipe, c) for c in configs if gg.codegen.is_valid(c, recipe.ir)]
        if recipe.name == "bias_gelu":  # what the op launches in test_sm100_gpu (the policy on 148 SMs)
            out.append((recipe, config_for(recipe, *SM100_OP_PROBLEM, arch=sm100)))
    return list(dict.fromkeys(out))


#: the problem tests/gpu/test_sm100_gpu.py calls bias_gelu's op on
SM100_OP_PROBLEM = (300, 264, 520)


#: the rows of tokens tests/gpu/test_grouped_gpu.py's GroupedLinear layers train on
GROUPED_LINEAR_ROWS = 300


def derived_grouped_recipe() -> gg.Recipe:
    """The derived backward kernel of a GroupedLinear with SiLU and a bias (bf16): the grouped GEMM
    again, reading dL/dD as C and writing dL/dacc."""
    import torch

    from gemmgen.integrations.grouped import GroupedOp

    derived = GroupedOp(gg.nn.grouped_linear_recipe("silu", True, torch.bfloat16)).derived
    assert derived is not None
    return derived.kernel


def grouped_linear_layers() -> list[gg.nn.GroupedLinear]:
    """tests/gpu/test_grouped_gpu.py's GroupedLinear layers (on the meta device): SiLU with a bias,
    SwiGLU with one and GEGLU without, 4 experts of 64 inputs."""
    return [gg.nn.GroupedLinear(4, 64, 128, activation="silu", device="meta"),
            gg.nn.GroupedLinear(4, 64, 96, activation="swiglu", device="meta"),
            gg.nn.GroupedLinear(4, 64, 96, bias=False, activation="geglu", device="meta")]


#: the precisions tests/gpu/test_grouped_gpu.py trains GroupedLinear in
GROUPED_PRECISIONS = (gg.training.Float8Blockwise(), gg.training.Float8Tensorwise())


def float8_grouped_layer(device: str = "meta", precision: gg.training.Precision = GROUPED_PRECISIONS[0]
                         ) -> gg.nn.GroupedLinear:
    """tests/gpu/test_grouped_gpu.py's GroupedLinear in fp8: 4 SwiGLU experts, 256 -> 128, no biases."""
    return gg.nn.GroupedLinear(4, 256, 128, bias=False, activation="swiglu", device=device, precision=precision)


def k_grouped_fp8_recipe() -> gg.Recipe:
    """The experts' fp8 weight gradient (K-grouped, (1, 1, 128) scales) into main_grad, as
    tests/gpu/test_grouped_gpu.py compiles it."""
    return gg.Recipe("k_grouped_fp8", lambda acc, main_grad: acc + main_grad, a=gg.e4m3, b=gg.e4m3, d=gg.f32,
                     layout_a=gg.RowMajor, layout_b=gg.ColMajor, grouped=gg.Grouping.K, block_scale=(1, 1, 128),
                     operands={"main_grad": gg.Matrix(gg.f32)})


#: tests/gpu/test_grouped_gpu.py's GroupedExperts: experts, hidden size, intermediate size (SwiGLU, biases)
GROUPED_EXPERTS = (4, 64, 96)


def grouped_experts_layer() -> gg.nn.GroupedExperts:
    """tests/gpu/test_grouped_gpu.py's GroupedExperts (transformers' 3-d experts), on the meta device."""
    from tests.data.gated import Experts

    return gg.nn.GroupedExperts.from_experts(Experts(*GROUPED_EXPERTS, bias=True, device="meta").bfloat16(),
                                             "swiglu")


def grouped_experts_launches() -> list[tuple[gg.Recipe, gg.KernelConfig]]:
    """What the GroupedExperts GPU test launches: model_launches' kernels for it, and each
    projection's forward and backward kernels for its routed rows (what the runtime picks for them)."""
    experts = grouped_experts_layer()
    out = gg.nn.model_launches(experts, (), training_tokens=(GROUPED_LINEAR_ROWS,))
    for projection in experts.projections():
        out += [projection.launches(GROUPED_LINEAR_ROWS), *projection.backward_launches(GROUPED_LINEAR_ROWS)]
    return list(dict.fromkeys(out))


def training_launches() -> list[tuple[gg.Recipe, gg.KernelConfig]]:
    """What tests/gpu/test_training_gpu.py and the training-step table launch: FusedMLP forward
    and backward (derived and weight-gradient kernels), the op's derived backward kernel, the
    saved-accumulator coverage kernel."""
    from gemmgen.integrations.dense import DenseOp
    from gemmgen.tuning import config_for

    tokens, n_in, hidden, n_out = TRAINING_MLP
    out = []
    for activation, recompute, accumulate in TRAINING_MLP_CASES:
        mlp = gg.nn.FusedMLP(n_in, hidden, n_out, activation, recompute=recompute, accumulate_grad=accumulate,
                             device="meta")
        out += gg.nn.model_launches(mlp, tokens=(tokens,), training_tokens=(tokens,))
    gated = gg.nn.FusedMLP(n_in, hidden, n_out, "swiglu", bias=False, device="meta")  # fc2's dgrad carries fc1's
    out += gg.nn.model_launches(gated, tokens=(tokens,), training_tokens=(tokens,))
    tokens, n_in, hidden, n_out = TRAINING_BENCH_MLP
    for recompute in (False, True):
        mlp = gg.nn.FusedMLP(n_in, hidden, n_out, "gelu", recompute=recompute, device="meta")
        out += gg.nn.model_launches(mlp, tokens=(), training_tokens=(tokens,))
        llama = gg.nn.FusedMLP(n_in, hidden, n_out, "swiglu", bias=False, recompute=recompute, device="meta")
        out += gg.nn.model_launches(llama, tokens=(), training_tokens=(tokens,))
    blockwise, tensorwise = gg.training.Float8Blockwise(), gg.training.Float8Tensorwise()
    delayed = gg.training.Float8Tensorwise(scaling="delayed")  # its GELU MLP quantizes h and dL/dacc1 in epilogues
    for shape, precisions in ((TRAINING_FP8_MLP, (blockwise, tensorwise, delayed)),
                              (TRAINING_BENCH_MLP, (blockwise,))):
        tokens, n_in, hidden, n_out = shape
        for precision in precisions:
            for activation, bias in (("gelu", True), ("swiglu", False)):
                low = gg.nn.FusedMLP(n_in, hidden, n_out, activation, bias=bias, precision=precision, device="meta")
                out += gg.nn.model_launches(low, tokens=(), training_tokens=(tokens,))
    rows, experts, n_in, n_out = TRAINING_BENCH_EXPERTS  # ...its experts layer, bf16 and both fp8 precisions
    for expert_precision in (None, *GROUPED_PRECISIONS):
        layer = gg.nn.GroupedLinear(experts, n_in, n_out, bias=False, activation="swiglu", device="meta",
                                    precision=expert_precision)
        out += [layer.launches(rows), *layer.backward_launches(rows)]
    residual = load_recipes(ROOT / "examples" / "recipes.py")["bias_silu_residual"]
    derived = DenseOp(residual).derived
    assert derived is not None
    out.append((derived.kernel, config_for(derived.kernel, *OP_BACKWARD_PROBLEM)))
    saved = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["bias_gelu_bwd"]
    out.append((saved, saved.default_config()))
    return out


def _load(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


#: The GPU checks' kernels by the arch of the GPU they run on.
MATRICES = {"sm_90a": gpu_matrix, "sm_100a": sm100_gpu_matrix}

#: The quantize kernels the GPU checks launch (a Float8Blockwise layer's X and dY copies, a current
#: scaling Float8Tensorwise layer's amax and per-tensor copies; the kernels' own test), each built for
#: every arch of the bundle.
def quantize_specs() -> list:
    from gemmgen.codegen.quantize import AmaxSpec, CastTransposeSpec

    return [CastTransposeSpec(gg.bf16, gg.e4m3), CastTransposeSpec(gg.bf16, gg.e4m3, power_of_two=True),
            CastTransposeSpec(gg.f16, gg.e5m2), CastTransposeSpec(gg.bf16, gg.e4m3, per_tensor=True),
            CastTransposeSpec(gg.bf16, gg.e5m2, per_tensor=True), AmaxSpec(gg.bf16)]


def quantize_kernels(arch: str) -> list:
    """`quantize_specs()` built for `arch` through the cache."""
    import dataclasses

    from gemmgen.codegen.quantize import render_cast_transpose
    from gemmgen.compile.quantize import build_quantize_kernel

    return [build_quantize_kernel(render_cast_transpose(dataclasses.replace(spec, arch=gg.Arch(arch))))
            for spec in quantize_specs()]


def build_all(jobs: int = 2, bundle: Path | None = None, arches: tuple[str, ...] = ("sm_90a",)) -> None:
    """Compile every kernel of the arches' matrices into the cache ($GEMMGEN_CACHE_DIR), `jobs` at a
    time; with `bundle`, also write exactly those kernels there as one bundle."""
    import concurrent.futures as cf
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_build_one, arch, i) for arch in arches for i in range(len(MATRICES[arch]()))]
        for f in cf.as_completed(futures):
            print(f.result(), flush=True)
    if bundle is not None:
        from gemmgen.aot import write_bundle
        from gemmgen.compile import default_cache

        kernels = [recipe.build(config) for arch in arches for recipe, config in MATRICES[arch]()]
        casts = [k for arch in arches for k in quantize_kernels(arch)]
        write_bundle(kernels, bundle, default_cache(), quantize_kernels=casts)
        print(f"bundle: {len({k.cache_key for k in kernels})} kernels and {len(casts)} quantize kernels in {bundle}")


def _build_one(arch: str, i: int) -> str:
    recipe, config = MATRICES[arch]()[i]
    k = recipe.build(config)
    return f"{recipe.name} {config.name}: {'cached' if k.report.cached else 'compiled'}"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", type=Path, help="also write the kernels as a bundle in this folder")
    parser.add_argument("--arch", action="append", choices=sorted(MATRICES),
                        help="the GPU checks of this arch (repeatable; default sm_90a)")
    args = parser.parse_args()
    build_all(bundle=args.bundle, arches=tuple(args.arch or ("sm_90a",)))

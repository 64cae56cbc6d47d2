"""Kernel configs: each constraint set rejects what it should, with a message, before any compile."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

import gemmgen as gg
from gemmgen.codegen import is_valid, validate, violations
from gemmgen.codegen.sm90 import epilogue_smem_bytes, stage_count
from gemmgen.codegen.sm90.smem import mainloop_stage_bytes
from gemmgen.config import KernelConfig, Schedule, default_config

COOP, PING = Schedule.COOPERATIVE, Schedule.PINGPONG


@pytest.fixture(scope="module")
def recipe():
    return gg.Recipe("r", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)}).ir


@pytest.mark.parametrize("cfg, match", [
    (KernelConfig(tile=(64, 128, 64), schedule=COOP), r"cooperative: tile M = 64 must be 128 or 256.*PINGPONG"),
    (KernelConfig(tile=(256, 128, 64), schedule=PING), r"pingpong: tile M = 256 must be 64 or 128"),
    (KernelConfig(tile=(96, 128, 64), schedule=PING), r"tile M = 96: must be 64, 128 or 256"),
    (KernelConfig(tile=(128, 300, 64)), r"tile N = 300: must be a multiple of 16"),
    (KernelConfig(tile=(128, 128, 40)), r"tile K = 40: must be a multiple of 16"),
    (KernelConfig(tile=(128, 128, 48)), r"tile K = 48: must divide or be a multiple of 64"),
    (KernelConfig(cluster=(3, 1, 1)), r"cluster M = 3: must be 1, 2 or 4"),
    (KernelConfig(cluster=(1, 1, 2)), r"cluster K = 2: must be 1"),
    (KernelConfig(cluster=(4, 4, 1)), r"at most 8 CTAs per cluster"),
    (KernelConfig(stages=9), r"shared memory: 9 stages .* more than the 232448"),
    (KernelConfig(tile=(256, 256, 128)), r"leaves room for 1 mainloop stage\(s\), need at least 2"),
    (KernelConfig(tile=(64, 128, 64), schedule=PING, tile_scheduler=gg.TileScheduler.STREAM_K),
     r"tile scheduler stream_k: needs the cooperative schedule.*use Schedule.COOPERATIVE or TileScheduler.PERSISTENT"),
    (KernelConfig(splits=4), r"splits 4: a split count is the stream-K scheduler's; use "
                             r"tile_scheduler=TileScheduler.STREAM_K, or splits=1"),
    (KernelConfig(deterministic=False), r"deterministic False: only the stream-K scheduler reduces partial sums; "
                                        r"use tile_scheduler=TileScheduler.STREAM_K, or deterministic=True"),
])
def test_invalid_configs_are_named(recipe, cfg, match):
    assert not is_valid(cfg, recipe)
    with pytest.raises(gg.ConfigError, match=match):
        validate(cfg, recipe)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile=(128, 128)), "tile: expected a tuple of three positive ints"),
    (dict(cluster=(0, 1, 1)), "cluster: expected a tuple of three positive ints"),
    (dict(schedule="coop"), "schedule: expected a gemmgen.Schedule"),
    (dict(stages=0), "stages: expected None"),
    (dict(tile_scheduler="stream_k"), "tile_scheduler: expected a gemmgen.TileScheduler"),
    (dict(splits=0), r"splits: expected a positive int \(1: CUTLASS's heuristic decomposition\), got 0"),
    (dict(splits=True), "splits: expected a positive int"),
    (dict(deterministic=0), "deterministic: expected True or False, got 0"),
])
def test_malformed_configs(kwargs, match):
    with pytest.raises(gg.ConfigError, match=match):
        KernelConfig(**kwargs)


def test_bad_config_fails_before_compile(recipe, monkeypatch):
    import gemmgen.compile.build as build

    def no_compile(*a, **k):
        raise AssertionError("NVRTC must not run for an invalid config")

    monkeypatch.setattr(build, "compile_cubin", no_compile)
    r = gg.Recipe("r", lambda acc: acc)
    with pytest.raises(gg.ConfigError):
        r.build(KernelConfig(tile=(64, 128, 64)))
    with pytest.raises(gg.ConfigError):
        gg.Recipe("r", lambda acc: acc, config=KernelConfig(cluster=(8, 1, 1)))


def test_one_function_validates_and_prunes(recipe):
    """The same constraint functions prune a search space: survivors validate, the rest raise."""
    space = [KernelConfig(tile=(m, n, k), cluster=(cm, 1, 1), schedule=s)
             for m, n, k, cm, s in itertools.product((64, 128, 256), (64, 128, 192, 256), (32, 64, 128), (1, 2),
                                                     (COOP, PING))]
    kept = [c for c in space if is_valid(c, recipe)]
    assert 0 < len(kept) < len(space)
    for c in space:
        if c in kept:
            validate(c, recipe)
        else:
            assert violations(c, recipe)
            with pytest.raises(gg.ConfigError):
                validate(c, recipe)


@pytest.fixture(scope="module")
def fp8_recipe():
    return gg.Recipe("r8", lambda acc, s: acc * s, a=gg.e4m3, b=gg.e4m3, operands={"s": gg.ColVector(gg.f32)}).ir


@pytest.mark.parametrize("fp8, cfg, match", [
    # measured with NVRTC 13.0: bf16 pingpong 128x192 spills 8 bytes, fp8 cooperative 128x256 256 bytes
    (False, KernelConfig(tile=(128, 192, 64), schedule=PING), r"registers: tile 128x192 under the pingpong schedule "
     r"keeps 192 fp32 accumulators per consumer thread, over the 128.*or the cooperative schedule"),
    (True, KernelConfig(tile=(128, 256, 128)), r"keeps 256 fp32 accumulators per consumer thread \(fp8 keeps two"),
    (True, KernelConfig(tile=(128, 128, 128), schedule=PING), r"keeps 256 fp32 accumulators"),
    (True, KernelConfig(tile=(128, 128, 16)), r"tile K = 16: must be a multiple of 32 for e4m3"),
    (True, KernelConfig(tile=(128, 128, 96)), r"tile K = 96: must divide or be a multiple of 128"),
])
def test_register_and_fp8_rules(recipe, fp8_recipe, fp8, cfg, match):
    with pytest.raises(gg.ConfigError, match=match):
        validate(cfg, fp8_recipe if fp8 else recipe)


def test_fp8_defaults_to_128_byte_k_steps(recipe, fp8_recipe):
    """tile K covers one 128-byte swizzle span of A and B: 64 16-bit or 128 fp8 elements."""
    assert gg.config.default_config(recipe).tile == (128, 128, 64)
    assert gg.config.default_config(fp8_recipe).tile == (128, 128, 128)
    for r in (recipe, fp8_recipe):
        validate(gg.config.default_config(r), r)
    # the largest tiles gemmgen's kernels use stay valid: 128 accumulators per thread
    validate(KernelConfig(tile=(128, 256, 64)), recipe)
    validate(KernelConfig(tile=(128, 128, 64), schedule=PING), recipe)
    validate(KernelConfig(tile=(128, 128, 128)), fp8_recipe)
    validate(KernelConfig(tile=(64, 128, 128), schedule=PING), fp8_recipe)


def test_auto_stages_fill_shared_memory(recipe):
    cfg = KernelConfig()
    s = stage_count(cfg, recipe)
    assert s >= 2
    used = s * mainloop_stage_bytes(cfg, recipe) + epilogue_smem_bytes(cfg, recipe)
    assert used <= 232448 < used + mainloop_stage_bytes(cfg, recipe)


def test_sm90_kernels_reduce_over_m_or_n_and_sm100_kernels_over_their_n():
    """sm_90a kernels reduce over their M (gemmgen's row_reduction.hpp) and their N, so a recipe
    reducing over M, over N or both runs unswapped or swapped; sm_100a kernels reduce over their N
    only (codegen.sm100.constraints.reduction_violations): a reduction over M needs a swapped
    kernel there, and one over both is refused by name."""
    over_m = gg.Recipe("r", lambda acc: {"d": acc, "s": gg.sum(acc, 0)}, aux={"s": gg.f32}).ir
    over_n = gg.Recipe("r", lambda acc: {"d": acc, "s": gg.amax(acc, 1)}, aux={"s": gg.f32}).ir
    both = gg.Recipe("r", lambda acc: {"d": acc, "s": gg.sum(acc, 0), "t": gg.amax(acc, 1)},
                     aux={"s": gg.f32, "t": gg.f32}).ir
    plain, swapped = KernelConfig(), KernelConfig(swap_ab=True)
    for recipe in (over_m, over_n, both):
        assert is_valid(plain, recipe) and is_valid(swapped, recipe)
        assert not default_config(recipe).swap_ab
    sm100, sm100_swapped = KernelConfig(schedule=gg.Schedule.ONE_SM, arch=gg.Arch.SM100A), \
        KernelConfig(schedule=gg.Schedule.ONE_SM, arch=gg.Arch.SM100A, swap_ab=True)
    assert violations(sm100, over_m) == [
        "aux output 's': its reduction (dim=0) is over the kernel's M, and gemmgen's sm_100a kernels reduce a "
        "recipe's one reduction over their N; use swap_ab=True"]
    assert violations(sm100_swapped, over_n) == [
        "aux output 's': its reduction (dim=1) is over the kernel's M, and gemmgen's sm_100a kernels reduce a "
        "recipe's one reduction over their N; use swap_ab=False"]
    assert is_valid(sm100_swapped, over_m) and is_valid(sm100, over_n)
    assert default_config(over_m, gg.Arch.SM100A).swap_ab and not default_config(over_n, gg.Arch.SM100A).swap_ab
    assert is_valid(sm100, both) and is_valid(sm100_swapped, both)  # over the kernel's M: CUTLASS's node
    lse = gg.Recipe("r", lambda acc: {"d": acc, "s": gg.logsumexp(acc, 0), "t": gg.amax(acc, 1)},
                    aux={"s": gg.f32, "t": gg.f32}).ir
    assert violations(sm100, lse) == [
        "aux output 's': a log-sum-exp over the kernel's M beside a reduction over its N spills on sm_100a; use "
        "swap_ab=True, build it with arch=Arch.SM90A, or split the reductions into two recipes"]
    assert is_valid(sm100_swapped, lse)  # the fix it names
    two = gg.Recipe("r", lambda acc: {"d": acc, "s": gg.logsumexp(acc, 0), "t": gg.logsumexp(acc, 1)},
                    aux={"s": gg.f32, "t": gg.f32}).ir
    assert violations(sm100, two) == [
        "aux output 's': a log-sum-exp over the kernel's M beside a reduction over its N spills on sm_100a; build it "
        "with arch=Arch.SM90A, or split the reductions into two recipes"]
    assert not is_valid(sm100_swapped, two)  # so swapping is not offered
    with pytest.raises(gg.ConfigError, match=r"use swap_ab=True"):
        gg.Recipe("r", lambda acc: {"d": acc, "s": gg.sum(acc, 0)}, aux={"s": gg.f32}, config=sm100)


def test_config_names_are_stable():
    assert KernelConfig().name == "128x128x64_c1x1x1_cooperative_auto"
    assert KernelConfig(tile=(64, 256, 64), schedule=PING, stages=4).name == "64x256x64_c1x1x1_pingpong_s4"
    assert KernelConfig(tile_scheduler=gg.TileScheduler.STREAM_K, swap_ab=True).name == \
        "128x128x64_c1x1x1_cooperative_auto_swapab_streamk"
    assert KernelConfig(tile_scheduler=gg.TileScheduler.STREAM_K, splits=4).name == \
        "128x128x64_c1x1x1_cooperative_auto_streamk_splits4"
    assert KernelConfig(tile_scheduler=gg.TileScheduler.STREAM_K, deterministic=False).name == \
        "128x128x64_c1x1x1_cooperative_auto_streamk_nondet"


def test_swap_ab_is_a_config_of_the_transposed_recipe(recipe):
    from gemmgen.config import kernel_recipe

    swapped = KernelConfig(tile=(128, 16, 64), cluster=(2, 1, 1), swap_ab=True)
    assert swapped.name == "128x16x64_c2x1x1_cooperative_auto_swapab"
    assert kernel_recipe(swapped, recipe) == recipe.transposed()
    assert kernel_recipe(KernelConfig(), recipe) is recipe
    # the constraints see the kernel's problem: the bias is a column vector there (tile M long)
    plain = KernelConfig(tile=(128, 16, 64), cluster=(2, 1, 1))
    assert epilogue_smem_bytes(plain, recipe.transposed()) != epilogue_smem_bytes(plain, recipe)
    assert violations(swapped, recipe) == violations(plain, recipe.transposed())
    with pytest.raises(gg.ConfigError, match=r"swap_ab: expected True or False, got 1"):
        KernelConfig(swap_ab=1)  # type: ignore[arg-type]


def test_canonical_round_trips_and_keeps_old_keys():
    stream_k = KernelConfig(tile_scheduler=gg.TileScheduler.STREAM_K)
    for cfg in (KernelConfig(), KernelConfig(tile=(64, 32, 64), schedule=PING, stages=5, swap_ab=True),
                stream_k, replace(stream_k, splits=3), replace(stream_k, splits=2, swap_ab=True),
                replace(stream_k, deterministic=False), replace(stream_k, splits=4, deterministic=False)):
        assert KernelConfig.from_canonical(cfg.canonical()) == cfg
    assert KernelConfig().canonical() == [[128, 128, 64], [1, 1, 1], "cooperative", None, "persistent"]
    assert replace(stream_k, swap_ab=True).canonical()[5:] == [True]
    assert replace(stream_k, splits=3).canonical()[5:] == [False, 3]  # as before `deterministic`
    assert replace(stream_k, deterministic=False).canonical()[5:] == [False, 1, False]
    for rest in (["x"], [True, 1], [False, True], [True, 4, 1], [False, 2, True], [False, 1, 0],
                 [False, 2, False, 1]):
        with pytest.raises(ValueError, match="trailing"):
            KernelConfig.from_canonical([[128, 128, 64], [1, 1, 1], "cooperative", None, "stream_k", *rest])


def test_a_split_count_is_a_launch_argument_not_a_new_binary(recipe):
    """Configs that differ only in `splits` or `deterministic` render the same source (same entry,
    same cache key): one compile serves every split count and reduction order; the GeneratedKernel
    keeps them for the launch."""
    from gemmgen.codegen import render_kernel
    from gemmgen.compile import cache_key

    heuristic = KernelConfig(tile_scheduler=gg.TileScheduler.STREAM_K)
    split = replace(heuristic, splits=4, deterministic=False)
    assert split.binary() == heuristic and heuristic.binary() is heuristic
    assert replace(heuristic, deterministic=False).binary() == heuristic
    one, four = render_kernel(recipe, heuristic), render_kernel(recipe, split)
    assert (four.source, four.entry, cache_key(four)) == (one.source, one.entry, cache_key(one))
    assert four.config == split

"""sm_100a as a target, without compiling: the arch in every kernel's identity, its constraints,
the source its emitter writes, the heuristic's choices for B200, and the refusals that come first."""

from __future__ import annotations

import pytest

import gemmgen as gg
from gemmgen.codegen import render_kernel, violations
from gemmgen.codegen.sm100 import accumulator_stages, stage_count
from gemmgen.config import Arch, KernelConfig, Schedule, default_config
from gemmgen.tuning import choose_launch
from gemmgen.tuning.heuristic import choose
from tests.data.sm100 import SM100_KERNELS

ONE, TWO = Schedule.ONE_SM, Schedule.TWO_SM
SM100 = Arch.SM100A


def sm100(**kw) -> KernelConfig:
    return KernelConfig(**{"schedule": ONE, "arch": SM100, **kw})


@pytest.fixture(scope="module")
def recipe():
    return gg.Recipe("r", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)}).ir


def test_arch_names_and_devices():
    assert [a.value for a in Arch] == ["sm_90a", "sm_100a"]
    assert Arch.parse("sm_100a") is SM100 and Arch.of_device((10, 0), "cuda:0") is SM100
    assert (Arch.SM90A.sm, SM100.sm, SM100.sm_count) == (90, 100, 148)
    with pytest.raises(gg.ConfigError, match=r"arch: 'sm_100' is the plain target.*kernel of traps\); use 'sm_100a'"):
        Arch.parse("sm_100")
    with pytest.raises(gg.ConfigError, match=r"arch: expected one of 'sm_90a', 'sm_100a', got 'sm_80'"):
        KernelConfig(arch="sm_80")  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidArgument, match=r"device cuda:1 has compute capability 12.0; gemmgen builds"):
        Arch.of_device((12, 0), "cuda:1")


def test_the_arch_is_part_of_a_configs_identity_and_sm90_keys_stay(recipe):
    two = sm100(tile=(256, 128, 64), cluster=(2, 1, 1), schedule=TWO)
    assert two.name == "256x128x64_c2x1x1_2sm_auto_sm_100a"
    assert two.canonical()[5:] == [False, 1, True, "sm_100a"]
    assert KernelConfig.from_canonical(two.canonical()) == two
    assert KernelConfig().canonical() == [[128, 128, 64], [1, 1, 1], "cooperative", None, "persistent"]
    assert KernelConfig(arch="sm_100a", schedule=ONE).arch is SM100  # type: ignore[arg-type]
    assert two.cta_tile == (128, 128, 64) and sm100().cta_tile == (128, 128, 64)
    same_math = render_kernel(recipe, default_config(recipe)), render_kernel(recipe, default_config(recipe, SM100))
    assert same_math[0].entry != same_math[1].entry and same_math[1].arch is SM100


@pytest.mark.parametrize("cfg, match", [
    (KernelConfig(arch=SM100), r"schedule cooperative: an sm_90a schedule, and the config targets sm_100a; use "
                               r"Schedule.ONE_SM or Schedule.TWO_SM"),
    (KernelConfig(schedule=TWO, tile=(256, 128, 64), cluster=(2, 1, 1)),
     r"schedule 2sm: an sm_100a schedule, and the config targets sm_90a; use Schedule.COOPERATIVE or "
     r"Schedule.PINGPONG"),
    (sm100(tile=(256, 128, 64)), r"tile M = 256: the 1sm MMA computes M = 64 or 128; .*Schedule.TWO_SM"),
    (sm100(tile=(64, 128, 64), schedule=TWO, cluster=(2, 1, 1)), r"tile M = 64: the 2sm MMA computes M = 128 or 256"),
    (sm100(tile=(128, 72, 64)), r"tile N = 72: the 1sm MMA with M = 128 needs N a multiple of 16 from 16 to 256"),
    (sm100(tile=(128, 48, 64), schedule=TWO, cluster=(2, 1, 1)), r"2sm MMA with M = 128 needs N a multiple of 32"),
    (sm100(tile=(64, 512, 64)), r"tile N = 512: .* from 8 to 256"),
    (sm100(tile=(128, 128, 40)), r"tile K = 40: must be a multiple of 16 for bf16 \(the MMA\'s 32-byte K step\)"),
    (sm100(tile=(256, 128, 64), schedule=TWO), r"cluster M = 1: the 2sm schedule pairs two CTAs along M"),
    (sm100(cluster=(3, 1, 1)), r"cluster M = 3: must be 1, 2 or 4"),
    (sm100(cluster=(4, 4, 1)), r"at most 8 CTAs per cluster"),
    (sm100(stages=12), r"shared memory: 12 stages .* more than the 232448 an sm_100 block can use"),
    (sm100(tile=(128, 256, 256)), r"tile \(128, 256, 256\) leaves room for 1 mainloop stage\(s\) per CTA, need at "
                                  r"least 2"),
    (sm100(tile=(128, 192, 64), tile_scheduler=gg.TileScheduler.STREAM_K),
     r"runs tile N = 192 data-parallel \(no split-K or stream-K\); use tile N = 128, or TileScheduler.PERSISTENT"),
    (sm100(tile=(256, 256, 64), schedule=TWO, cluster=(2, 1, 1), tile_scheduler=gg.TileScheduler.STREAM_K),
     r"an sm_100a stream-K kernel of tile N = 256 spills registers \(measured at 256\); use tile N = 128 or less, or "
     r"TileScheduler.PERSISTENT"),
    (sm100(splits=2), r"splits 2: a split count is the stream-K scheduler's"),
])
def test_sm100_constraints_name_the_fix(recipe, cfg, match):
    with pytest.raises(gg.ConfigError, match=match):
        render_kernel(recipe, cfg)


def test_every_tcgen05_shape_the_rules_accept_is_one_cutlass_builds(recipe):
    """The accepted (schedule, M, N) grid, against PTX's tcgen05.mma shape table."""
    accepted = {(s, m, n) for s in (ONE, TWO) for m in (64, 128, 256) for n in range(8, 264, 8)
                if not violations(sm100(tile=(m, n, 64), schedule=s, cluster=(2, 1, 1)), recipe)}
    table = {(ONE, 64, n) for n in range(8, 257, 8)} | {(ONE, 128, n) for n in range(16, 257, 16)} | \
        {(TWO, 128, n) for n in range(32, 257, 32)} | {(TWO, 256, n) for n in range(16, 257, 16)}
    assert accepted == table
    # N <= 256 leaves two accumulator buffers at least in the 512 tensor-memory columns
    assert min(accumulator_stages(sm100(tile=(m, n, 64), schedule=s)) for s, m, n in table) == 2
    assert stage_count(sm100(tile=(128, 256, 64)), recipe) >= 2


def test_every_family_is_emitted_for_sm100(examples):
    """Grouped, block-scaled and both at once; column pairs in one GEMM (D from the registers, the
    collective's store into the sink) and grouped (the pointer-array collective's void D)."""
    for name in ("moe_up", "fp8_block_scaled", "moe_fp8_block", "swiglu", "moe_swiglu"):
        ir = examples[name].ir
        assert violations(default_config(ir, SM100), ir) == [], name


def test_row_blocks_need_a_threads_whole_row_of_128_per_cta(examples):
    """D's row blocks are reduced within a thread (row_blocks.hpp's Sm100RowBlocks): 32-lane
    tensor-memory loads of a CTA's 128 rows over 4 x 1 warps, and whole blocks per tile (the rule
    both arches share); the epilogue tile is spelled out as wide as the block."""
    ir = examples["fp8_quantized"].ir  # blocks of 128
    for ok in (sm100(tile=(128, 128, 64)), sm100(tile=(256, 256, 64), schedule=TWO, cluster=(2, 1, 1))):
        assert violations(ok, ir) == [], ok.name
    rows = "which need 128 rows per CTA; use tile M = "
    assert any(f"tile M = 64 (1sm): gg.quantize's blocks are reduced within a thread's row of sm_100a's tensor-memory "
               f"loads, {rows}128" in v for v in violations(sm100(tile=(64, 128, 64)), ir))
    pair_128 = sm100(tile=(128, 128, 64), schedule=TWO, cluster=(2, 1, 1))  # 2 x 2 warps: half a row each
    assert any(f"{rows}256 with Schedule.TWO_SM" in v for v in violations(pair_128, ir))
    assert any("gg.quantize's blocks of 128 columns must fit whole in a tile" in v
               for v in violations(sm100(tile=(128, 192, 64)), ir))
    assert any("swap_ab=True: this recipe's epilogue works on blocks of columns of a row" in v
               for v in violations(sm100(tile=(128, 128, 64), swap_ab=True), ir))
    assert render_kernel(ir, sm100(tile=(128, 256, 64))).source.count("using EpilogueTile = Shape<_128, _128>;") == 1


def test_block_scales_need_whole_blocks_in_a_ctas_tile(examples):
    """The rule both arches share (`rules.block_scale_violations`): tile K is the scales' K, and a
    CTA's tile (half a pair's along M) holds whole blocks; DeepSeek's 128-column blocks of B on a
    swapped kernel's M need a CTA tile M of 128."""
    ir = examples["fp8_block_scaled"].ir
    assert any("tile K = 64: must equal the block scales' K granularity 128" in v
               for v in violations(sm100(tile=(128, 128, 64)), ir))
    swapped = sm100(tile=(256, 64, 128), schedule=TWO, cluster=(2, 1, 1), swap_ab=True)
    assert violations(swapped, ir) == []  # the kernel's M is the recipe's N: each CTA has 128 of it
    wide = sm100(tile=(256, 256, 128), schedule=TWO, cluster=(2, 1, 1))  # spilled: a 280-byte stack frame
    assert any("tile N = 256: an sm_100a block-scaled kernel of CTA tile N 256 spills registers (measured at 256); "
               "use tile N = 128 or less" in v for v in violations(wide, ir))
    assert all(choose(ir, m, 7168, 4096, arch=SM100).config.cta_tile[1] <= 128 for m in (1, 300, 8192))
    narrow = sm100(tile=(128, 64, 128), schedule=TWO, cluster=(2, 1, 1), swap_ab=True)
    assert any("tile M = 64 (a CTA's half of the pair's tile): must be a multiple of the block scales' granularity "
               "128" in v for v in violations(narrow, ir))


def test_sm100_source_uses_the_sm100_builders_and_the_ctas_tile(examples):
    cfg = SM100_KERNELS["bias_gelu_aux"]
    assert cfg is not None
    k = render_kernel(examples["bias_gelu_aux"].ir, cfg)
    src = k.source
    assert "#include <gemmgen/sm100.hpp>" in src
    assert "using MmaTileShape = Shape<_256, _128, _64>;" in src and "using TileShape = Shape<_128, _128, _64>;" in src
    assert "cutlass::gemm::KernelTmaWarpSpecialized2SmSm100" in src and "cutlass::arch::Sm100" in src
    assert "Sm100AuxStoreDescriptor<EpilogueDescriptor" in src and "detail::AuxStoreDescriptor" not in src
    assert "Sm90RowBroadcast<0, TileShape," in src  # the bias over the CTA's half of the MMA tile
    assert k.required_sass == (("UTCHMMA.2CTA", "UTCQMMA.2CTA"), ("UTMALDG",), ("LDTM",))
    names = [f.name for f in k.fields]
    assert "mainloop.tma_a_fallback" in names and "scheduler.divmod_swizzle_size" not in names
    assert "scheduler.swizzle_size.divisor" in names and "workspace" not in names
    sm90 = render_kernel(examples["bias_gelu_aux"].ir, examples["bias_gelu_aux"].default_config())
    assert "gemmgen/sm100.hpp" not in sm90.source and "detail::AuxStoreDescriptor<EpilogueDescriptor" in sm90.source


def test_every_example_blackwell_supports_has_a_valid_default(sm100_examples):
    supported = [r.name for r in sm100_examples.values() if not violations(r.default_config(SM100), r.ir)]
    assert supported == list(sm100_examples)
    assert {"mxfp8_linear", "swiglu", "moe_swiglu"} <= set(supported)
    # a recipe's own sm_90a config does not carry over: the sm_100a default does
    aux = sm100_examples["bias_gelu_aux"]
    assert aux.config is not None and aux.default_config(SM100) == default_config(aux.ir, SM100)


def test_the_heuristic_chooses_sm100_tiles_for_b200(examples):
    r = examples["gemm_bf16"]
    big = choose_launch(r, 8192, 8192, 8192, arch=SM100)
    assert big.config.arch is SM100 and big.config.schedule is TWO and "on 148 SMs" in big.why
    small = choose(r.ir, 8, 4096, 4096, arch=SM100)
    assert small.config.swap_ab and small.config.arch is SM100
    assert all(c.arch is SM100 for c in (choose(r.ir, m, 4096, 4096, arch=SM100).config for m in (1, 100, 3000)))
    # a 2-SM tile takes two SMs of a wave
    assert "128 tiles = 1.73 waves on 148 SMs" in choose(r.ir, 8192, 1024, 4096, arch=SM100).why
    # the recipe's own config is for sm_90a: on sm_100a the heuristic decides
    aux = examples["bias_gelu_aux"]
    assert choose_launch(aux, 512, 512, 512).source.value == "recipe"
    assert choose_launch(aux, 512, 512, 512, arch=SM100).source.value == "heuristic"


def test_the_op_on_a_b200_chooses_an_sm100_kernel_before_compiling(examples, monkeypatch):
    """A call on a compute capability 10.0 device asks the launch policy for sm_100a's config (the
    heuristic on 148 SMs) and compiles that; an sm_90a kernel is never built for it."""
    from types import SimpleNamespace

    import torch

    from gemmgen import tuning
    from gemmgen.integrations import ops
    from gemmgen.runtime import driver

    recipe = examples["gemm_bf16"]
    compiled: list = []
    monkeypatch.setattr(driver, "device_facts", lambda index: (148, (10, 0)))
    monkeypatch.setattr(tuning.Device, "current", staticmethod(lambda index=0: tuning.Device("B200", "13.0")))
    monkeypatch.setattr(type(recipe), "compile", lambda self, config=None, **kw: compiled.append(config))
    monkeypatch.setattr(ops, "_LAUNCHERS", {})
    monkeypatch.setattr(ops, "_DEVICES", {})
    cuda = torch.device("cuda", 0)
    a = SimpleNamespace(shape=torch.Size((8192, 4096)), device=cuda)
    b = SimpleNamespace(shape=torch.Size((4096, 8192)), device=cuda)
    ops.kernel_for(recipe, a, b)  # type: ignore[arg-type]  # stand-ins for CUDA tensors
    assert [c.arch for c in compiled] == [SM100] and compiled[0] == choose(recipe.ir, 8192, 8192, 4096, arch=SM100,
                                                                           sm_count=148).config


def test_model_launches_for_a_b200_are_what_the_op_launches_there(monkeypatch):
    """`model_launches(model, tokens, arch="sm_100a")`, what to warm up for B200s: sm_100a's kernels
    for 148 SMs, each the one the op compiles on a 10.0 device for that many tokens (a gated MLP
    over column pairs and gated experts included); without `arch`, on a machine without a GPU,
    sm_90a's as before."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from gemmgen import tuning
    from gemmgen.integrations import ops
    from gemmgen.runtime import driver

    mlp = gg.nn.FusedMLP(512, 1024, 512, activation="swiglu", device="meta")
    experts = gg.nn.GroupedLinear(8, 512, 256, activation="swiglu", device="meta")
    model = nn.Sequential(mlp, experts)
    got = gg.nn.model_launches(model, (8, 4096), training_tokens=(4096,), arch="sm_100a")
    assert got and {c.arch for _, c in got} == {SM100} and all(gg.codegen.is_valid(c, r.ir) for r, c in got)
    assert {c.arch for _, c in gg.nn.model_launches(model, (8, 4096), training_tokens=(4096,))} == {Arch.SM90A}

    compiled: list = []
    monkeypatch.setattr(driver, "device_facts", lambda index: (148, (10, 0)))
    monkeypatch.setattr(tuning.Device, "current", staticmethod(lambda index=0: tuning.Device("B200", "13.0")))
    monkeypatch.setattr(ops, "_LAUNCHERS", {})
    monkeypatch.setattr(ops, "_DEVICES", {})
    cuda = torch.device("cuda", 0)
    for layer in (mlp.fc1, mlp.fc2):
        monkeypatch.setattr(type(layer.recipe), "compile", lambda self, config=None, **kw: compiled.append(config))
        for tokens in (8, 4096):
            a = SimpleNamespace(shape=torch.Size((tokens, layer.in_features)), device=cuda)
            b = SimpleNamespace(shape=torch.Size((layer.in_features, layer.weight_rows)), device=cuda)
            ops.kernel_for(layer.recipe, a, b)  # type: ignore[arg-type]  # stand-ins for CUDA tensors
            assert (layer.recipe, compiled[-1]) == layer.launches(tokens, arch="sm_100a")
            assert (layer.recipe, compiled[-1]) in got

"""Generated source: deterministic, checked in under generated/, shaped as the IR says."""

from __future__ import annotations

import re

import pytest

import gemmgen as gg
from gemmgen.cli import main as cli_main
from gemmgen.codegen import render_kernel
from tests.data import EXAMPLES, ROOT


def test_generated_folder_is_up_to_date(tmp_path, capsys):
    assert cli_main(["generate", str(EXAMPLES), "--out", str(tmp_path)]) == 0
    fresh = sorted(p.name for p in tmp_path.glob("*.cu"))
    checked_in = sorted(p.name for p in (ROOT / "generated").glob("*.cu"))
    assert fresh == checked_in, "run: gemmgen generate examples/recipes.py --out generated/"
    for name in fresh:
        assert (tmp_path / name).read_text() == (ROOT / "generated" / name).read_text(), (
            f"generated/{name} is stale; run: gemmgen generate examples/recipes.py --out generated/")


def test_source_is_deterministic(examples):
    for r in examples.values():
        assert r.source() == r.source()


@pytest.mark.parametrize("name, layout", [
    ("gemm_bf16", "tree"), ("bias_gelu", "tree"), ("bias_silu_residual", "tree"),
    ("linear_combination", "tree"), ("bias_gelu_aux", "tree"), ("quick_gelu_scaled", "tree"),
    ("residual_norm_stats", "dag"),
])
def test_epilogue_shape(examples, name, layout):
    r = examples[name]
    k = render_kernel(r.ir, r.default_config())
    assert k.epilogue.layout == layout
    src = k.source
    assert 'extern "C" __global__ void\n__launch_bounds__' in src
    assert f"{k.entry}(CUTLASS_GRID_CONSTANT" in src
    assert f"{k.entry}_info[]" in src


def test_operand_kinds_map_to_cutlass_visitors(examples, extra):
    src = {n: r.source() for n, r in {**examples, **extra}.items()}
    assert "Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t" in src["bias_gelu"]
    assert "Sm90ColBroadcast<0, TileShape, float" in src["quick_gelu_scaled"]
    assert "Sm90ScalarBroadcast<float" in src["linear_combination"]
    assert "Sm90SrcFetch<cutlass::half_t>" in src["linear_combination"]
    assert "using ElementC = cutlass::half_t;" in src["linear_combination"]
    assert "using ElementC = void;" in src["gemm_bf16"]
    assert "Sm90AuxStore<" in src["bias_gelu_aux"]
    assert ("Sm90ScalarReduction<cutlass::maximum_absolute_value_reduction, cutlass::atomic_maximum, float, float"
            in src["bias_gelu_aux"])
    assert "Sm90AuxLoad<" in src["every_op"] and "Sm90SrcFetch<cutlass::bfloat16_t>" in src["every_op"]
    assert "KernelTmaWarpSpecializedPingpong" in src["bias_gelu_aux"]
    assert "cutlass::layout::ColumnMajor" in src["bias_gelu_aux"]
    assert "StageCount<4>" in src["every_op"]
    # fp8 A/B: the mainloop that promotes WGMMA's partial sums into fp32 (the builder's choice)
    assert "cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<MainloopStages" in src["scaled_mm_fp8"]
    assert "using ElementA = cutlass::float_e4m3_t;" in src["scaled_mm_fp8"]
    assert "cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<MainloopStages" in src["gemm_bf16"]
    # the compile-time constant 1.702 is baked as its fp32 bits
    assert "WithRhs<Mul, 0x3fd9db23u>{}(" in src["quick_gelu_scaled"]


def test_shared_value_without_sharing_stays_a_tree():
    r = gg.Recipe("r", lambda acc, bias: {"d": gg.relu(acc + bias), "pre": acc + bias},
                  operands={"bias": gg.RowVector(gg.bf16)}, aux={"pre": gg.bf16})
    assert render_kernel(r.ir, gg.KernelConfig()).epilogue.layout == "tree"
    side = gg.Recipe("r", lambda acc, bias: {"d": gg.relu(acc), "pre": acc + bias},
                     operands={"bias": gg.RowVector(gg.bf16)}, aux={"pre": gg.bf16})
    assert render_kernel(side.ir, gg.KernelConfig()).epilogue.layout == "dag"


def test_templates_hold_no_logic():
    """Templates bind types and constants: loops over declarations only, no conditionals."""
    from gemmgen.codegen import templates_dir

    paths = list(templates_dir().rglob("*.j2"))
    assert len(paths) >= 5
    for path in paths:
        text = path.read_text()
        assert not re.search(r"{%-?\s*(if|elif|macro|set)\b", text), path.name


def test_resolved_collectives_are_the_builders_types(type_checks):
    """gemmgen spells out the collectives CUTLASS's builders would resolve (it compiles faster);
    NVRTC checks, type for type, that every kernel family gets exactly the builder's types: every
    example recipe under every config the heuristic can choose, the extra recipes under a spread
    of configs (tests/data/type_checks.py). For each, gemmgen's stage count (its shared-memory
    model, which prunes configs) must be CUTLASS's, and the shared storage must fit an sm_90 block.
    One translation unit."""
    kernels, compiled = type_checks["examples"]
    assert len(kernels) >= 200
    compiled.result()

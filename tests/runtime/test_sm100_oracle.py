"""sm100 kernels' arguments against CUTLASS's own sm100 host code (the nvcc-built oracle, as for
sm90: tests/runtime/test_oracle.py): tensor maps (each CTA's half of A and B under the 2-SM
schedule, the fallback pair), the cluster-launch-control scheduler's Params and grid, the
epilogue's maps and workspace, over the same problems and B200's SM count and others. CPU only."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.codegen.sm100.geometry import mma_ctas
from gemmgen.ir.microscaling import blocked_shape
from gemmgen.runtime import scheduler
from gemmgen.runtime.arguments import ArgumentBuilder
from gemmgen.testing.oracle import OracleProgram, build_all, field_bits
from gemmgen.testing.recording import RecordingEncoder
from tests.data.sm100 import STREAM_K_ORACLES, VALUE_CONFIGS, mxfp8_training_kernels
from tests.runtime.test_oracle import PROBLEMS, STREAM_K_PROBLEMS, WORKSPACE, _check, kernel_problem

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="session")
def sm100_oracles(sm100_kernels, sm100_examples, extra, tmp_path_factory):
    """An nvcc-built oracle for every sm100 kernel and VALUE_CONFIGS (two programs, built at once)."""
    build = tmp_path_factory.mktemp("oracle100")
    programs = {name: OracleProgram(k.generated, build) for name, k in sm100_kernels.items()}
    recipes = {**sm100_examples, **extra}
    programs.update({name: OracleProgram(render_kernel(recipes[recipe].ir, config), build)
                     for name, (recipe, config) in VALUE_CONFIGS.items()})
    programs.update({name: OracleProgram(render_kernel(recipe.ir, config), build)
                     for name, (recipe, config) in MXFP8_TRAINING.items()})
    build_all(list(programs.values()), build)
    return programs


def _scales_wrap(recipe, shape) -> bool:
    """Whether a microscaled kernel's scales pass 2^31 - 1 bytes per batch at `shape`, where CUTLASS's
    int32 scale layout wraps (its host code asserts) and gemmgen refuses the call
    (test_microscaling.test_the_call_accepts_quantize_mx_and_refuses_scales_past_32_bits)."""
    fmt = recipe.gemm.microscaling
    m, n, k = shape[:3]
    return fmt is not None and any(math.prod(blocked_shape(rows, k, fmt)) > 2**31 - 1 for rows in (m, n))


@pytest.mark.parametrize("shape", PROBLEMS, ids=lambda s: "x".join(map(str, s)))
def test_sm100_arguments_match_cutlass(sm100_kernels, sm100_oracles, shape):
    """Every dense kernel (the grouped one's: test_sm100_grouped.py)."""
    for name, kernel in sm100_kernels.items():
        if not kernel.recipe.gemm.grouped and not _scales_wrap(kernel.recipe, shape):
            _check(kernel, sm100_oracles[name], kernel_problem(kernel, *shape, sm_count=148))


@pytest.mark.parametrize("sm_count, max_active_clusters", [(148, 0), (132, 0), (148, 74), (16, 0)])
def test_sm100_hardware_info_passes_through_and_the_grid_is_every_cta(sm100_kernels, sm100_oracles, sm_count,
                                                                      max_active_clusters):
    for name in ("qk_norm", "scaled_mm_fp8"):  # one SM, no cluster; a pair of SMs in a 2 x 1 cluster
        kernel = sm100_kernels[name]
        _check(kernel, sm100_oracles[name], kernel_problem(kernel, 4096, 2048, 512, 2, 0, sm_count=sm_count,
                                                           max_active_clusters=max_active_clusters))


def test_the_sm100_grid_follows_the_raster_order():
    """Cluster launch control walks the grid along M: along N (CUTLASS's choice when there are at
    least as many clusters along M) the grid is transposed, unless its Y would pass 65535."""
    along_m = scheduler.sm100_plan(128, 4096, 1, (128, 128, 64), (1, 1, 1), 1)
    assert along_m.fields["scheduler.raster_order"] == scheduler.RASTER_ALONG_M and along_m.grid == (1, 32, 1)
    pair = scheduler.sm100_plan(4096, 512, 2, (256, 128, 64), (2, 1, 1), 2)  # 32 CTAs (16 clusters) x 4
    assert pair.fields["scheduler.raster_order"] == scheduler.RASTER_ALONG_N and pair.grid == (8, 16, 2)
    tall = scheduler.sm100_plan(128 * 70_000, 128, 1, (128, 128, 64), (1, 1, 1), 1)
    assert tall.fields["scheduler.raster_order"] == scheduler.RASTER_ALONG_M and tall.grid == (70_000, 1, 1)


MXFP8_TRAINING = mxfp8_training_kernels()


@pytest.mark.parametrize("name", MXFP8_TRAINING)
def test_mxfp8_training_kernels_match_cutlass(sm100_oracles, name):
    """An MXFP8 FusedMLP step's kernels (issue 57) as nn launches them: every field, encode call and
    the grid against CUTLASS's host code, by value."""
    oracle = sm100_oracles[name]
    assert oracle.kernel.recipe.gemm.microscaling is gg.MXFP8
    for shape in PROBLEMS:
        if not _past_32_bits(oracle, shape):
            _check_values(oracle, kernel_problem(oracle.kernel, *shape, sm_count=148), f"{name} {shape}")


def _past_32_bits(oracle: OracleProgram, shape) -> bool:
    """Problems gemmgen refuses where CUTLASS's 32-bit arithmetic wraps: a reduction's partial values
    (test_oracle's case) or a microscaled kernel's scales (`_scales_wrap`)."""
    reductions = any(f.name.startswith(("epilogue.col_reduction", "epilogue.row_reduction"))
                     for f in oracle.kernel.fields)
    return (shape[3] == 2**28 and reductions) or _scales_wrap(oracle.kernel.recipe, shape)


@pytest.mark.parametrize("name", VALUE_CONFIGS)
def test_sm100_geometries_without_a_compiled_kernel_match_cutlass(sm100_oracles, name):
    """Every field gemmgen writes, every encode call and the grid, against CUTLASS's host code
    (values compared by name: with no compiled kernel there is no probed layout to pack into)."""
    oracle = sm100_oracles[name]
    for shape in PROBLEMS:
        if not _past_32_bits(oracle, shape):
            _check_values(oracle, kernel_problem(oracle.kernel, *shape, sm_count=148), f"{name} {shape}")


def _check_values(oracle: OracleProgram, p, where: str) -> None:
    """`oracle`'s kernel's fields, encode calls, grid and workspace for `p` against CUTLASS's."""
    kernel = oracle.kernel
    kinds = {f.name: f.kind for f in kernel.fields}
    builder = ArgumentBuilder(kernel.kernel_recipe, kernel.config)
    expected = oracle.run(p, WORKSPACE)
    enc = RecordingEncoder()
    values, grid = builder.values(p, enc, workspace=WORKSPACE)
    assert builder.workspace(p).size == expected.workspace_size, where
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {k: v for k, v in c.items() if k != "encode"} for c in expected.encodes}, where
    compared = 0
    for field, want in expected.fields.items():
        if field not in values or field.endswith((".buffer", ".counters")):
            continue  # a constant field (the probe's default), or a workspace region (test_oracle's rule)
        if kinds[field] == "desc":
            ours, theirs = enc.of(values[field]), expected.encodes[want["desc"] - 1]  # type: ignore[arg-type]
            assert ours is not None and ours.addr == theirs["addr"], (where, field)
        else:
            assert field_bits(kinds[field], values[field]) == want["bits"], (where, field)
        compared += 1
    assert compared >= 25 and list(grid) == expected.launch["grid"], where
    if kernel.kernel_recipe.epilogue.pairs:  # pairs.hpp's premise under this geometry's partition
        pairs = expected.pairs
        assert pairs is not None and pairs["pairs"] > 0 and pairs["broken"] == 0 and pairs["uncovered"] == 0, where


@pytest.mark.parametrize("sm_count, max_active_clusters", [(148, 0), (132, 0), (148, 37), (114, 0), (16, 0)])
@pytest.mark.parametrize("name", STREAM_K_ORACLES)
def test_sm100_stream_k_decompositions_match_cutlass(sm100_oracles, name, sm_count, max_active_clusters):
    """CUTLASS's sm100 stream-K scheduler (sm90's stream-K Params with a wave of every SM, beside
    sm100's): data-parallel, split-K and stream-K problems, their grid (waves of stream-K units, or
    every CTA tile per split) and their workspace, under the heuristic, split counts 3 and 1000
    (lowered to the SMs or K tiles) and the nondeterministic reduction: one oracle serves them all.
    The last problem is stream-K on 16 SMs in 2 x 2 clusters; 114 SMs leave 2 of a wave idle in
    2 x 2 clusters, so that the stream-K units do not divide the work."""
    base = sm100_oracles[name]
    cfg = base.kernel.config
    kinds = set()
    for splits, deterministic in ((1, True), (3, True), (1000, True), (1, False)):
        kernel = render_kernel(base.kernel.recipe, replace(cfg, splits=splits, deterministic=deterministic))
        oracle = OracleProgram(kernel, base.exe.parent)
        assert oracle.exe == base.exe  # the split count and the reduction mode are arguments
        for m, n, k, l in [*STREAM_K_PROBLEMS, (64, 64, 64, 1), (128, 1152, 4096, 1)]:  # noqa: E741
            p = kernel_problem(kernel, m, n, k, l, 0, sm_count=sm_count, max_active_clusters=max_active_clusters)
            cta = (cfg.tile[0] // mma_ctas(cfg), *cfg.tile[1:])
            d = scheduler.decompose(p.m, p.n, -(-p.k // cfg.tile[2]), p.l, cta, cfg.cluster, sm_count,
                                    max_active_clusters, splits, occupancy=False)
            kinds.add(d.kind)
            _check_values(oracle, p, f"{name} {(m, n, k, l)} splits={splits} deterministic={deterministic}")
    assert kinds == {"data-parallel", "split-K", "stream-K"}, kinds

"""Reductions over M in an unswapped sm_90a kernel, and over M and N in one recipe (issue 32 item
4): gemmgen's Sm90RowReduction (gemmgen/include/gemmgen/row_reduction.hpp), CUTLASS's Params and
workspace with its state in shared memory, beside CUTLASS's Sm90ColReduction. The reference
against torch written out, the emulated kernels (cooperative, ping-pong, 256-wide tiles, stream-K
and swapped, where the two reductions trade places) on odd shapes, M = 1, K tails and batches,
mistakes that must fail the check, what sm_100a refuses, and the shared memory the node takes."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen.sm90 import epilogue_smem_bytes
from gemmgen.runtime import arguments
from gemmgen.testing.calls import EMULATED_CONFIGS, emulated_shapes
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled
from gemmgen.testing.cpp_types import EpilogueSourceError
from tests.data import EXAMPLES


def _stats(acc, bias):
    """D with a bias, and statistics of it over M (per column) and over N (per row): a sum, a log-
    sum-exp, a min over the tokens and the batches; a max and a max |x| per row."""
    y = acc + bias
    return {"d": y, "colsum": gg.sum(y, dim=0), "collse": gg.logsumexp(acc, dim=0),
            "colmin": gg.reduce_min(acc, dim=0, over_batch=True), "rowmax": gg.reduce_max(y, dim=1),
            "rowamax": gg.amax(acc, dim=1)}


RECIPE = gg.Recipe("row_and_column_stats", _stats, batched=True, operands={"bias": gg.RowVector(gg.bf16)},
                   aux=dict.fromkeys(("colsum", "collse", "colmin", "rowmax", "rowamax"), gg.f32))
#: the sm_90a kernels of EMULATED_CONFIGS, a 256-wide tile (the node's widest state) and stream-K
CONFIGS = [c for c in EMULATED_CONFIGS if c.arch is gg.Arch.SM90A] + [
    gg.KernelConfig(tile=(128, 256, 64)), gg.KernelConfig(tile=(64, 256, 64), schedule=gg.Schedule.PINGPONG),
    gg.KernelConfig(tile=(128, 128, 64), cluster=(1, 2, 1), tile_scheduler=gg.TileScheduler.STREAM_K)]
OURS, CUTLASS_ROWS = "gemmgen::epi::Sm90RowReduction<", "cutlass::epilogue::fusion::Sm90RowReduction<"


def test_the_reference_is_torchs():
    a, b = torch.randn(3, 37, 40).bfloat16(), torch.randn(3, 40, 70).bfloat16()
    bias = torch.randn(70).bfloat16()
    acc = a.float() @ b.float()
    y = acc + bias.float()
    _, colsum, collse, colmin, rowmax, rowamax = RECIPE.reference(a, b, bias=bias)
    torch.testing.assert_close(colsum, y.sum(dim=1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(collse, torch.logsumexp(acc, dim=1), rtol=1e-6, atol=0)
    torch.testing.assert_close(colmin, acc.amin(dim=(0, 1)), rtol=0, atol=0)
    torch.testing.assert_close(rowmax, y.amax(dim=2), rtol=0, atol=0)
    torch.testing.assert_close(rowamax, acc.abs().amax(dim=2), rtol=0, atol=0)
    assert colsum.shape == (3, 70) and colmin.shape == (70,) and rowmax.shape == (3, 37)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_emulated_kernels_reduce_over_m_and_n(config):
    """Unswapped, the reductions over M are gemmgen's node and those over N CUTLASS's column
    reduction; swapped, the other way round. CUTLASS's own reduction over M (which spills) is
    never emitted."""
    assert gg.codegen.is_valid(config, RECIPE.ir)
    ck = uncompiled(RECIPE, config)
    source = ck.generated.source
    assert CUTLASS_ROWS not in source
    ours = [line for line in source.splitlines() if OURS in line]
    want = ("Colsum", "Collse", "Colmin") if not config.swap_ab else ("Rowmax", "Rowamax")
    names = [line.split("=")[0].split()[-1] for line in ours]  # using SumColsum = ...
    assert len(names) == len(want) and all(any(name.endswith(w) for name in names) for w in want), names
    for shape in [*emulated_shapes(RECIPE), (1, 300, 8, 2)]:
        assert_computes(ck, shape, config.name)


def test_sm100_reduces_over_both_with_cutlass_nodes_and_over_m_alone_swapped():
    """sm_100a: a recipe reducing over M and N reduces over the kernel's M with CUTLASS's own node
    (gemmgen's is sm_90a's WGMMA layout), emulated here; a log-sum-exp over the kernel's M is refused
    by name (RECIPE unswapped); one reduction over M is a swapped kernel's over its N."""
    sm100 = [c for c in EMULATED_CONFIGS if c.arch is gg.Arch.SM100A]
    assert any(c.swap_ab for c in sm100) and any(not c.swap_ab for c in sm100)
    for config in sm100:
        if not config.swap_ab:  # RECIPE's reductions over M include a log-sum-exp
            with pytest.raises(gg.ConfigError, match=r"'collse': a log-sum-exp over the kernel's M .* sm_100a"):
                RECIPE.source(config)
            continue
        ck = uncompiled(RECIPE, config)
        assert CUTLASS_ROWS in ck.generated.source and OURS not in ck.generated.source
        for shape in [*emulated_shapes(RECIPE), (1, 300, 8, 2)]:
            assert_computes(ck, shape, config.name)
    over_m = gg.Recipe("t", lambda acc: {"d": acc, "s": gg.sum(acc, dim=0)}, aux={"s": gg.f32})
    config = over_m.default_config(gg.Arch.SM100A)
    assert config.swap_ab and OURS not in over_m.source(config)


@pytest.mark.parametrize("mistake", ["the sum's identity", "per-batch stride over the batches",
                                     "another epilogue schedule"])
def test_mistakes_fail_the_check(mistake, monkeypatch):
    """Each reduction starts from its identity, one over the batches has batch stride 0, and the
    node's warps follow the kernel's epilogue schedule (8 cooperative, 4 ping-pong): each broken
    fails the emulated call of a shape the unchanged kernel passes."""
    config, shape = CONFIGS[0], (130, 200, 24, 2)
    assert_computes(uncompiled(RECIPE, config), shape, "unchanged")
    ck = uncompiled(RECIPE, config)
    real = arguments.ArgumentBuilder.shape_values

    def values(self, p):
        v, grid = real(self, p)
        if mistake == "the sum's identity":
            v["epilogue.row_reduction.colsum.identity"] = 1.0
        else:
            v["epilogue.row_reduction.colmin.batch_stride"] = p.n
        return v, grid
    if mistake == "another epilogue schedule":
        ck = uncompiled(RECIPE, config, source_replaced("TileShape, EpilogueSchedule, float",
                                                        "TileShape, cutlass::epilogue::TmaWarpSpecialized, float"))
    else:
        monkeypatch.setattr(arguments.ArgumentBuilder, "shape_values", values)
    with pytest.raises((AssertionError, EpilogueSourceError)):
        assert_computes(ck, shape, mistake)


def test_the_node_takes_a_slot_per_warp_and_column_in_shared_memory():
    """Each consumer warp's value of each column of the tile (8 warps cooperative, 4 ping-pong;
    8 bytes for a log-sum-exp's state), and the tile count: NVRTC checks the model against sizeof
    for every example and random recipe (tests/data/type_checks.py)."""
    over_m = gg.Recipe("t", lambda acc: {"d": acc, "s": gg.sum(acc, dim=0)}, aux={"s": gg.f32}).ir
    lse = gg.Recipe("t", lambda acc: {"d": acc, "s": gg.logsumexp(acc, dim=0)}, aux={"s": gg.f32}).ir
    plain = gg.Recipe("t", lambda acc: acc).ir
    for config, warps in ((gg.KernelConfig(tile=(128, 256, 64)), 8),
                          (gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.PINGPONG), 4)):
        slots = warps * config.tile[1]
        extra = epilogue_smem_bytes(config, over_m) - epilogue_smem_bytes(config, plain)
        extra_lse = epilogue_smem_bytes(config, lse) - epilogue_smem_bytes(config, plain)
        # the tile count and the alignment of the storage: within its padding (up to 1 KB)
        assert 4 * slots <= extra < 4 * slots + 1024 and 8 * slots <= extra_lse < 8 * slots + 1024, \
            (config.name, extra, extra_lse)


def test_a_reduction_over_m_of_half_columns_is_refused_naming_the_fix():
    with pytest.raises(gg.RecipeError, match=r"aux output 's': a reduction over M \(dim=0\) of a value of column "
                                             r"pairs \(at half columns\) is not supported; reduce it over N"):
        gg.Recipe("t", lambda acc: {"d": gg.pairs(acc)[0], "s": gg.sum(gg.pairs(acc)[1], dim=0)}, aux={"s": gg.f32})
    fixed = gg.Recipe("t", lambda acc: {"d": gg.pairs(acc)[0], "s": gg.sum(gg.pairs(acc)[1], dim=1),
                                        "t": gg.sum(acc, dim=0)}, aux={"s": gg.f32, "t": gg.f32})
    config = fixed.default_config()
    assert not config.swap_ab and OURS in fixed.source(config)
    for shape in emulated_shapes(fixed):
        assert_computes(uncompiled(fixed, config), shape, "pairs with a sum over M")


def test_a_binary_without_the_lanes_shuffles_is_refused():
    """A reduction's shuffles across lanes prove it is in the binary: a record of row_col_amax's
    kernel (counts written here, each marker it needs present) passes the binary check every
    source goes through, and fails it without SHFL, or with local memory."""
    from gemmgen.aot.recipes_file import load_recipes
    from gemmgen.codegen import render_kernel
    from gemmgen.compile.validate import sass_problem

    recipe = load_recipes(EXAMPLES)["row_col_amax"]
    gen = render_kernel(recipe.ir, recipe.default_config())
    problem = lambda meta: sass_problem(meta, gen.required_sass, gen.arch.value)  # noqa: E731
    assert ("SHFL",) in gen.required_sass
    sass = {"HGMMA": 8, "QGMMA": 0, "SHFL": 60, "SYNCS": 54, "USETMAXREG": 2, "UTMALDG": 2, "UTMASTG": 4}
    assert problem({"sass": sass, "local_bytes": 0}) is None
    assert "has no SHFL instruction" in str(problem({"sass": sass | {"SHFL": 0}, "local_bytes": 0}))
    assert problem({"sass": sass, "local_bytes": 480}) is not None

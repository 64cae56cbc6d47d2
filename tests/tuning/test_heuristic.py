"""The config heuristic: valid, deterministic, explained, and few kernels per weight (CPU only)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

import gemmgen as gg
from gemmgen.cli import main as cli_main
from gemmgen.codegen import validate
from gemmgen.config import default_config, tile_k
from gemmgen.testing.calls import dense
from gemmgen.tuning import load_shapes
from gemmgen.tuning.heuristic import (
    GROUPED_SWAP_CONFIG,
    GROUPED_SWAP_MAX_ROWS,
    M_BUCKETS,
    SWAP_MAX_M,
    candidate_configs,
    choose,
    m_bucket,
)
from gemmgen.tuning.policy import launches_for_shapes
from tests.data import EXAMPLES, ROOT

SWEEP_M = sorted({1, 2, 7, 16, 63, 64, 65, 100, 128, 129, 255, 512, 1000, 2047, 4096, 4097, 8192, 12000, 16384}
                 | {2**i for i in range(15)})
WEIGHTS = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (128256, 4096), (7, 129)]
#: Distinct kernels per weight (fixed N, K) over the whole M sweep: at most one per small-M bucket
#: (M <= SWAP_MAX_M, where swapped kernels compete) and at most 4 for every larger M together.
MAX_SMALL_M_KERNELS = sum(b <= SWAP_MAX_M for b in M_BUCKETS)
MAX_LARGE_M_KERNELS = 4


def test_every_choice_is_a_valid_config(examples, extra):
    for recipe in [*examples.values(), *extra.values()]:
        for n, k in WEIGHTS:
            for m in SWEEP_M:
                c = choose(recipe.ir, m, n, k)
                validate(c.config, recipe.ir)
                assert c.m_bucket >= m and c.config.name in c.why
                assert c.config.tile[2] == tile_k(recipe.ir), "K steps of 128 bytes: 64 16-bit or 128 fp8 elements"


def test_choices_are_deterministic_and_bounded_per_weight(examples):
    for recipe in examples.values():
        for n, k in WEIGHTS:
            picked = {m: choose(recipe.ir, m, n, k).config for m in SWEEP_M}
            assert picked == {m: choose(recipe.ir, m, n, k).config for m in SWEEP_M}
            small = {c for m, c in picked.items() if m <= SWAP_MAX_M}
            large = {c for m, c in picked.items() if m > SWAP_MAX_M}
            assert len(small) <= MAX_SMALL_M_KERNELS and len(large) <= MAX_LARGE_M_KERNELS, (recipe.name, n, k)
            assert not any(c.swap_ab for c in large), "swapped kernels are only for small M"


def test_small_m_swaps_a_and_b_for_a_narrow_tile(examples):
    """D^T = B^T A^T puts M in the tile's N, which can be 16 wide instead of 64 rows of padding
    (for a grouped GEMM: test_grouped_choice_follows_the_rows_per_group)."""
    for recipe in dense(examples).values():
        for n, k in WEIGHTS[:5]:
            c = choose(recipe.ir, 8, n, k)
            if recipe.ir.epilogue.along_rows:  # swapped, its column pairs (row blocks) would be rows
                assert not c.config.swap_ab and "_swapab" not in c.why, (recipe.name, c.why)
                continue
            assert c.config.swap_ab and c.config.tile[1] == 16, (recipe.name, n, k, c.why)
            assert "_swapab" in c.why.splitlines()[0]
    assert not choose(examples["gemm_bf16"].ir, 4096, 4096, 4096).config.swap_ab


def test_grouped_choice_follows_the_rows_per_group(examples):
    """A grouped recipe's kernel follows the rows per group on average (rows / groups, all the host
    knows): swapped at most GROUPED_SWAP_MAX_ROWS, the default above. Two kernels per recipe, each
    valid; one for a recipe over column pairs (gated experts), which a swapped kernel would take
    from rows."""
    grouped = {name: r for name, r in examples.items() if r.ir.gemm.grouped}
    assert {"moe_up", "moe_fp8_block", "moe_swiglu"} <= set(grouped)
    for name, recipe in grouped.items():
        picked = set()
        for rows in (1, 7, 64, 256, 1000, 4096, 16384):
            for groups in (1, 8, 64, 256):
                c = choose(recipe.ir, rows, 1408, 2048, groups)
                validate(c.config, recipe.ir)
                few = -(-rows // groups) <= GROUPED_SWAP_MAX_ROWS and not recipe.ir.epilogue.pairs
                assert c.config.swap_ab == few, (name, rows, groups, c.why)
                assert c.config == (replace(GROUPED_SWAP_CONFIG, tile=(128, 32, tile_k(recipe.ir))) if
                                    c.config.swap_ab else default_config(recipe.ir))
                assert f"{rows} rows in {groups} groups" in c.why and c.config.name in c.why
                picked.add(c.config)
        assert len(picked) == (1 if recipe.ir.epilogue.pairs else 2), name


def test_reductions_over_m_take_either_orientation_on_sm90_and_swapped_kernels_on_sm100(extra):
    """sm_90a kernels reduce over their M (row_reduction.hpp) and their N, so a recipe reducing over
    M gets the kernel any other recipe would: unswapped at large M, swapped at small M. sm_100a
    kernels reduce over their N only: the heuristic offers every tile transposed there, so large M
    gets large tiles too."""
    r = extra["column_stats"].ir
    assert not default_config(r).swap_ab
    assert not choose(r, 8192, 4096, 4096).config.swap_ab
    assert choose(r, 8, 4096, 4096).config.swap_ab
    assert default_config(r, gg.Arch.SM100A).swap_ab
    for m in (1, 64, 1000, 8192):
        c = choose(r, m, 4096, 4096, arch=gg.Arch.SM100A)
        assert c.config.swap_ab and "a reduction over M: swapped kernels only" in c.why, c.why
    big = choose(r, 8192, 8192, 8192, arch=gg.Arch.SM100A).config
    assert big.tile[0] * big.tile[1] >= 128 * 256, big.name


def test_stream_k_where_the_persistent_kernel_leaves_sms_idle(examples):
    """The stream-K twin wins where CUTLASS's stream-K scheduler would spread K over the SMs the
    persistent kernel leaves idle (a decode step's 32 tiles on 132 SMs, a last wave of 64 tiles),
    and loses its tie where the tiles fill the waves or K is short (it would run data-parallel);
    the explanation names the decomposition."""
    r = examples["bias_gelu"].ir
    decode = choose(r, 16, 4096, 4096)
    assert decode.config.tile_scheduler is gg.TileScheduler.STREAM_K and decode.config.swap_ab, decode.why
    assert "stream-K (32 tiles over 132 CTAs)" in decode.why.splitlines()[0], decode.why
    assert choose(r, 300, 4096, 4096).config.tile_scheduler is gg.TileScheduler.STREAM_K
    for shape in ((4096, 4096, 4096), (1000, 4096, 4096), (16, 4096, 256)):  # whole waves; 4 K tiles
        assert choose(r, *shape).config.tile_scheduler is gg.TileScheduler.PERSISTENT, shape
    twins = [c for c in candidate_configs(r, 16) if c.tile_scheduler is gg.TileScheduler.STREAM_K]
    assert twins and all(c.schedule is gg.Schedule.COOPERATIVE for c in twins)
    assert all(replace(c, tile_scheduler=gg.TileScheduler.PERSISTENT) in candidate_configs(r, 16) for c in twins)


def test_b200_stream_k_twins_spread_k_over_every_sm(examples):
    """On sm_100a every candidate of a CTA tile N up to 128 has a stream-K twin, decomposed as
    CUTLASS's sm100 stream-K scheduler would (over the CTA's tile, a wave of every SM: 148 CTAs),
    which wins for a decode step against large weights and loses where the tiles fill the waves."""
    r = examples["gemm_bf16"].ir
    decode = choose(r, 16, 8192, 8192, arch=gg.Arch.SM100A)
    assert decode.config.tile_scheduler is gg.TileScheduler.STREAM_K, decode.why
    assert "stream-K (64 tiles over 148 CTAs)" in decode.why.splitlines()[0], decode.why
    pair = choose(r, 300, 2048, 4096, arch=gg.Arch.SM100A)  # 4 x 16 CTA tiles: each SM computes a half
    assert pair.config.tile_scheduler is gg.TileScheduler.STREAM_K and pair.config.schedule is gg.Schedule.TWO_SM
    assert "stream-K (64 tiles over 148 CTAs)" in pair.why.splitlines()[0], pair.why
    assert choose(r, 8192, 8192, 8192, arch=gg.Arch.SM100A).config.tile_scheduler is gg.TileScheduler.PERSISTENT
    twins = {c.schedule for c in candidate_configs(r, 16, gg.Arch.SM100A)
             if c.tile_scheduler is gg.TileScheduler.STREAM_K}
    assert twins == {gg.Schedule.ONE_SM, gg.Schedule.TWO_SM}
    # a CTA tile N above 128 spilled under stream-K (codegen/sm100/constraints.py): never chosen
    assert all(choose(r, m, n, 4096, arch=gg.Arch.SM100A).config.cta_tile[1] <= 128
               for m in (1, 16, 300, 4096) for n in (2048, 8192)
               if choose(r, m, n, 4096, arch=gg.Arch.SM100A).config.tile_scheduler is gg.TileScheduler.STREAM_K)


def test_buckets():
    assert [m_bucket(m) for m in (1, 16, 17, 33, 64, 65, 8192, 8193, 20000)] == \
        [16, 16, 32, 64, 64, 128, 8192, 16384, 24576]
    assert list(M_BUCKETS) == sorted(M_BUCKETS)


def test_large_problems_get_large_tiles_and_small_ones_small_tiles(examples):
    r = examples["bias_gelu"].ir
    big = choose(r, 8192, 8192, 8192).config
    small = choose(r, 1, 4096, 4096).config
    assert big.tile[0] * big.tile[1] > small.tile[0] * small.tile[1]


def test_shapes_file_maps_to_configs(examples):
    shapes = json.loads((ROOT / "examples" / "llm_shapes.json").read_text())
    chosen = launches_for_shapes(examples, shapes)
    assert set(chosen) == {"gemm_bf16", "bias_gelu", "bias_silu_residual"}
    assert all(len(rows) == len(shapes[name]) for name, rows in chosen.items())
    with pytest.raises(gg.GemmgenError, match="no recipe named 'nope'"):
        launches_for_shapes(examples, {"nope": [[1, 2, 3]]})


def test_explain_cli(capsys):
    """explain prints the launch policy's answer: the heuristic's with its reasons, or the recipe's own
    config where it declares one."""
    assert cli_main(["explain", str(EXAMPLES), "--shape", "1000", "4096", "4096", "--recipe", "gemm_bf16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gemm_bf16: ") and " (heuristic): M=1000 -> bucket 1024; chose " in out
    assert "\n  best 5 of " in out  # the default --top
    assert cli_main(["explain", str(EXAMPLES), "--shape", "1000", "4096", "4096", "--recipe", "bias_gelu"]) == 0
    assert capsys.readouterr().out == ("bias_gelu: 128x256x64_c2x1x1_cooperative_auto (recipe): the recipe declares "
                                       "config=128x256x64_c2x1x1_cooperative_auto: used at every shape no autotune "
                                       "result covers\n")
    assert cli_main(["explain", str(EXAMPLES), "--shape", "64", "14336", "4096", "8", "--recipe", "moe_up"]) == 0
    assert capsys.readouterr().out.startswith("moe_up: 128x32x64_c1x1x1_cooperative_auto_swapab (heuristic): grouped: "
                                              "64 rows in 8 groups, 8 per group on average <= 32; "
                                              "chose 128x32x64_c1x1x1_cooperative_auto_swapab")



def test_explain_says_which_recipes_an_arch_does_not_build(capsys, sm100_examples):
    """Over a whole file, a recipe whose family an arch does not build (MXFP8 on sm_90a) gets a line
    saying why, as `build` leaves it out, and the others their launches; named by --recipe, or asked
    of the heuristic, it is a ConfigError naming the family, not an assertion. sm_100a builds every
    example."""
    shape = ["--shape", "64", "4096", "4096"]
    assert cli_main(["explain", str(EXAMPLES), *shape]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    refused = {line.split(":")[0] for line in lines if ": not built for sm_90a: block_scale=gemmgen.MXFP8" in line}
    assert refused == {"mxfp8_linear"}
    assert any(line.startswith("moe_up: ") and "(heuristic)" in line for line in lines)
    assert cli_main(["explain", str(EXAMPLES), *shape, "--recipe", "mxfp8_linear"]) == 2
    assert "on sm_100a (B200) only" in capsys.readouterr().err
    with pytest.raises(gg.ConfigError, match=r"block_scale=gemmgen.MXFP8: the MMA scales microscaled fp8 on sm_100a"):
        choose(sm100_examples["mxfp8_linear"].ir, 64, 4096, 4096, arch=gg.Arch.SM90A)
    assert cli_main(["explain", str(EXAMPLES), *shape, "--arch", "sm_100a"]) == 0
    assert "not built" not in capsys.readouterr().out


def test_explain_backward_shows_the_derived_recipes_and_their_launches(capsys):
    """`--backward`: what the derived backward kernel computes, and the launches of it and of the
    forward that saves for it (unswapped at this size: the bias gradient, a sum over M, is reduced
    over the kernel's M)."""
    assert cli_main(["explain", str(EXAMPLES), "--shape", "4096", "4096", "4096", "--recipe", "bias_gelu",
                     "--backward"]) == 0
    out = capsys.readouterr().out
    assert "\n  bias_gelu_bwd: bf16 x bf16 -> bf16, reads saved_acc, bias\n" in out
    assert "\n    grad_bias: dL/dbias (sum over M)\n" in out
    assert "\n  bias_gelu_train: 128x256x64_c2x1x1_cooperative_auto (recipe)" in out
    assert "\n  bias_gelu_bwd: 128x256x64" in out and "_swapab" not in out.split("bias_gelu_bwd: ")[1].split("\n")[0]
    assert cli_main(["explain", str(EXAMPLES), "--shape", "64", "64", "64", "--backward"]) == 0
    out = capsys.readouterr().out
    no_backward = ("fp8_quantized", "qk_norm")  # D per block of its rows: not differentiated
    assert len(re.findall(r"^  \w+_bwd(_recompute)?: ", out, re.M)) == 2 * 17
    assert [line.split(".backward()")[0].split()[-1] for line in out.splitlines() if "no backward" in line] == \
        list(no_backward)

def test_every_command_takes_one_recipe_by_name(tmp_path, capsys):
    """`--recipe NAME` narrows any command to one recipe of the file; a name the file does not
    declare is an error that lists the ones it does (explain printed nothing for it)."""
    assert cli_main(["generate", str(EXAMPLES), "--recipe", "bias_gelu", "--out", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.glob("*.cu")] == ["bias_gelu.cu"]
    for command in (["explain", str(EXAMPLES), "--shape", "8", "64", "64"], ["generate", str(EXAMPLES), "--out",
                    str(tmp_path)], ["inspect", str(EXAMPLES)], ["build", str(EXAMPLES)]):
        capsys.readouterr()
        assert cli_main([*command, "--recipe", "bias_gelU"]) == 2, command
        err = capsys.readouterr().err
        assert "--recipe 'bias_gelU': " in err and "declares no recipe of that name" in err and "'bias_gelu'" in err


@pytest.mark.parametrize("content, message", [
    (None, r"shapes file '.*missing\.json' does not exist"),
    ("{not json", r"is not valid JSON"),
    ('[[1, 2, 3]]', r"expected \{recipe name: \[\[M, N, K\], \.\.\.\], \.\.\.\}"),
    ('{"bias_gelu": [[1, 2]]}', r"'bias_gelu': shape \[1, 2\]; expected \[M, N, K\] or \[M, N, K, L\] of positive"),
    ('{"bias_gelu": [[0, 4096, 4096]]}', r"shape \[0, 4096, 4096\]"),
    ('{"bias_gelu": [[8, 4096, 4096.5]]}', r"shape \[8, 4096, 4096\.5\]"),
])
def test_bad_shapes_files_are_named_errors(tmp_path, capsys, content, message):
    """A shapes file's mistakes are gemmgen errors naming the file and the entry (they were Python
    tracebacks: FileNotFoundError, JSONDecodeError, TypeError from choose), for the CLI and the API."""
    path = tmp_path / ("missing.json" if content is None else "shapes.json")
    if content is not None:
        path.write_text(content)
    with pytest.raises(gg.GemmgenError, match=message):
        load_shapes(path)
    assert cli_main(["build", str(EXAMPLES), "--shapes", str(path)]) == 2
    assert "gemmgen: error: shapes file" in capsys.readouterr().err


def test_explain_refuses_shapes_that_are_not_positive(capsys):
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        cli_main(["explain", str(EXAMPLES), "--shape", "-1", "16", "16"])
    assert "argument --shape: -1 is not a positive integer" in capsys.readouterr().err
    assert cli_main(["explain", str(EXAMPLES), "--shape", "16", "16"]) == 2
    assert "--shape: shape [16, 16]; expected [M, N, K] or [M, N, K, L]" in capsys.readouterr().err
    with pytest.raises(gg.GemmgenError, match=r"shapes\['bias_gelu'\]: shape \[1, 2\]"):
        launches_for_shapes({"r": gg.Recipe("bias_gelu", lambda acc: acc)}, {"bias_gelu": [[1, 2]]})

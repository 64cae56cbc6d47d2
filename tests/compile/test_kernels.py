"""Compiled kernels (NVRTC on the CPU): Hopper features in the SASS, no spills, report, cache keys."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import gemmgen as gg
from gemmgen.aot import load_recipes
from gemmgen.codegen import render_kernel
from gemmgen.codegen.sm90 import smem_need
from gemmgen.compile import build_kernel, cache_key, key_material
from gemmgen.compile.nvrtc import compile_cubin
from gemmgen.compile.toolchain import toolchain
from gemmgen.config import DEFAULT_ARCH
from tests.data import EXAMPLES
from tests.data.session_kernels import COMPILED, compiled_grouped_pairs, grouped_pairs, keep_compiled_examples

pytestmark = pytest.mark.nvrtc


def test_every_kernel_is_on_the_hopper_path(compiled):
    assert set(compiled) == set(COMPILED)
    for name, k in compiled.items():
        r = k.report
        assert r.sass is not None, "cuobjdump missing: install nvidia-cuda-cuobjdump/nvdisasm"
        wgmma, other = ("QGMMA", "HGMMA") if k.recipe.gemm.fp8 else ("HGMMA", "QGMMA")
        assert r.sass[wgmma] > 0 and r.sass[other] == 0, (name, r.sass)  # WGMMA of the input type
        assert r.sass["UTMALDG"] > 0, name  # TMA loads
        # TMA stores, but where every output has N/2 columns (written from the registers: pairs.hpp)
        tma_stores = any(o.reduce is None and o.columns is gg.ir.Columns.FULL for o in k.recipe.outputs)
        assert (r.sass["UTMASTG"] > 0) == tma_stores, name
        assert r.sass["USETMAXREG"] > 0, name  # warp-specialized register reallocation
        assert r.sass["SYNCS"] > 0, name  # mbarriers
        assert r.local_bytes == 0, f"{name} spills {r.local_bytes} bytes"
        assert r.stack_bytes == 0, f"{name} has a {r.stack_bytes}-byte stack frame (spills)"
        assert 0 < r.registers <= 255
        assert 0 < k.info.smem_bytes <= 232448
        assert k.info.max_threads == 384  # producer + two consumer warpgroups
        assert k.info.cluster_size == k.config.cluster[0] * k.config.cluster[1]
        assert k.info.params_size > 0 and k.info.params_align in (8, 16, 32, 64, 128)
        assert r.phases["front_end"] > 0 and r.compile_seconds > 0
        # the compile's peak resident memory (Linux's high-water mark, reset before it): NVRTC takes GBs
        assert r.compile_peak_bytes is not None and 2**30 < r.compile_peak_bytes < 16 * 2**30, (name, r)
        assert k.cubin[:4] == b"\x7fELF"


def _named(recipe: gg.Recipe, config: gg.KernelConfig) -> set[str]:
    """The CUTLASS, CuTe and gemmgen names the source of `recipe`'s kernel under `config` spells, its
    tile, its cluster and its schedule."""
    source = render_kernel(recipe.ir, config).source
    # the functors a region's statements call, under its `using namespace gemmgen::epi`
    statements = [line for line in source.splitlines() if line.startswith(("    float const ", "    return "))]
    in_regions = {f"gemmgen::epi::{name}" for line in statements for name in re.findall(r"\b([A-Z]\w*)\b", line)}
    # a blockwise main loop's scale granularity (a granularity of 1 loads that operand's scales by
    # cp.async, not TMA) and, apart, its scale tensors' majors
    scales = set()
    for args in re.findall(r"BlockwiseScaleConfig<([^>]*)>", source):
        parts = [a.strip() for a in args.split(",")]
        scales |= {f"scale granularity ({', '.join(parts[:3])})", f"scale majors ({', '.join(parts[3:])})"}
    return set(re.findall(r"\b(?:cutlass|cute|gemmgen)::[\w:]+", source)) | in_regions | scales | \
        {f"tile {config.tile}", f"cluster {config.cluster}", f"{config.schedule.value} swap_ab={config.swap_ab}"}


def test_the_compiled_kernels_name_everything_the_test_kernels_sources_name(examples, extra):
    """The suite compiles the kernels of COMPILED and of the grouped families but UNCOMPILED_GROUPED
    only (tests/data/session_kernels.py): between them they must name every type, tile, cluster and
    schedule an example's, coverage recipe's or grouped test kernel's source names, so that each
    compiles in some kernel here (the others' arguments, data flow and types are checked without
    NVRTC). A recipe that brings a new one needs its kernel compiled."""
    recipes = {**examples, **extra}
    assert set(COMPILED) < set(recipes)
    grouped = [p for pairs in grouped_pairs(examples).values() for p in pairs]
    compiled = compiled_grouped_pairs(examples)
    assert 0 < len(compiled) < len(grouped)
    named = {(r.name, c): _named(r, c) for r, c in [*((r, r.default_config()) for r in recipes.values()), *grouped]}
    built = [(r.name, r.default_config()) for r in recipes.values() if r.name in COMPILED]
    built += [(r.name, c) for r, c in compiled]
    missing = set().union(*named.values()) - set().union(*(named[k] for k in built))
    assert not missing, f"no compiled kernel names {sorted(missing)}: add a recipe naming them to COMPILED"


def test_fp8_kernels_promote_into_fp32_every_four_mmas(compiled):
    """The fp8 mainloop's Params field is written by the host like every other (from the list in
    codegen/sm90/params.py: a field left out would be packed as 0); its value is NVRTC's default."""
    fp8 = [k for k in compiled.values() if k.recipe.gemm.fp8 and not k.recipe.gemm.block_scale]
    assert fp8
    for k in fp8:
        defaults = {f.name: default for f, _, default in k.params_layout.fields}
        assert defaults["mainloop.mma_promotion_interval"] == 4, k.recipe.name
        assert "MainloopSm90TmaGmmaWarpSpecializedFP8<" in k.source


def test_block_scaled_kernels_use_the_blockwise_main_loop(compiled):
    """The blockwise fp8 main loop promotes once per K tile times the tile's scales: no promotion
    interval to write, the scales' pointers and layouts instead. The coverage kernel is swapped: its
    A is the weight, whose 128 x 128 blocks' scales (one per tile) it reads with cp.async, its B the
    tokens, whose scales (one per row: 64 per 128 x 64 tile) it loads with TMA and counts in the
    stage's transaction bytes with B's and A's fp8 tiles."""
    k = compiled["block_scaled_swapped"]
    defaults = {f.name: default for f, _, default in k.params_layout.fields}
    assert "mainloop.mma_promotion_interval" not in defaults
    assert {"mainloop.ptr_sfa", "mainloop.ptr_sfb", "mainloop.tma_sfb", "mainloop.layout_sfa.k_stride",
            "mainloop.layout_sfb.batch_stride"} <= set(defaults)
    assert "mainloop.tma_sfa" not in defaults
    assert defaults["mainloop.tma_transaction_bytes"] == 128 * 128 + 64 * 128 + 64 * 4
    assert "MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8<" in k.source
    assert "KernelTmaWarpSpecializedCooperativeFP8Blockwise" in k.source
    assert k.report.sass["QGMMA"] > 0 and k.report.sass["UTMALDG"] >= 3  # A, B and B's scales


def test_smem_estimate_tracks_cutlass(compiled):
    """config.py's figure (used to validate before compiling) bounds CUTLASS's SharedStorageSize
    from above, by at most 1 KB; the constraint functions see the kernel-side recipe (transposed
    for a swapped kernel)."""
    for name, k in compiled.items():
        need = smem_need(k.config, k.generated.kernel_recipe)
        assert 0 <= need - k.info.smem_bytes <= 1024, (name, need, k.info.smem_bytes)


def test_second_build_is_a_cache_hit(compiled, session_cache, examples):
    r = examples["bias_gelu"]
    again = build_kernel(r.ir, r.default_config(), session_cache)
    assert again.report.cached and again.cubin == compiled["bias_gelu"].cubin


@pytest.fixture
def examples_file(tmp_path) -> tuple[Path, list[str]]:
    """A copy of examples/recipes.py cut to the examples the session compiles, and their names."""
    path = tmp_path / "recipes.py"
    shutil.copy(EXAMPLES, path)
    return path, keep_compiled_examples(path)


def test_inspect_json(compiled, session_cache, examples_file):
    path, names = examples_file
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "inspect", str(path), "--json", "-j", "1",
                           "--cache-dir", str(session_cache.root)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["name"] for r in rows] == names and len(names) >= 8
    for row in rows:
        assert {"name", "registers", "smem_bytes", "local_bytes", "stack_bytes", "sass", "compile_seconds"} <= set(row)
        assert set(row["sass"]) >= {"HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "SYNCS"}
        assert row["cached"] is True
        assert row["compile_seconds"] == compiled[row["name"]].report.compile_seconds


def test_build_cli_writes_a_bundle_that_loads_anywhere_without_nvrtc(compiled, session_cache, tmp_path,
                                                                      examples_file, monkeypatch):
    path, names = examples_file
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "build", str(path), "-j", "2", "--out",
                           str(tmp_path / "bundle"), "--cache-dir", str(session_cache.root)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote a bundle of {len(names)} kernel(s)" in proc.stderr and "qk_norm" in proc.stdout
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["arches"] == ["sm_90a"] and len(manifest["kernels"]) == len(names)
    assert {e["arch"] for e in manifest["kernels"]} == {"sm_90a"}
    assert not list((tmp_path / "bundle").rglob("*.lock"))
    assert str(tmp_path) not in (tmp_path / "bundle" / "manifest.json").read_text()

    moved = tmp_path / "elsewhere" / "shipped"
    shutil.move(str(tmp_path / "bundle"), str(moved))
    import gemmgen.compile.build as build
    from gemmgen.compile import bundles as bundle
    from gemmgen.compile import toolchain as tc
    from gemmgen.compile.cache import KernelCache

    def no_nvrtc(*a, **k):
        raise AssertionError("a bundle hit must not touch NVRTC or the headers")

    monkeypatch.setattr(build, "compile_cubin", no_nvrtc)
    monkeypatch.setattr(build, "cache_key", no_nvrtc)
    monkeypatch.setattr(tc, "toolchain", no_nvrtc)
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(moved))
    empty = KernelCache(tmp_path / "empty-cache")
    for r in load_recipes(path).values():
        k = build.build_kernel(r.ir, r.default_config(), empty)
        assert k.origin == "bundle" and k.cubin == compiled[r.name].cubin
        assert k.params_layout == compiled[r.name].params_layout
    assert not (tmp_path / "empty-cache").exists()
    bundle._FROM_ENV.clear()


def test_jit_off_names_the_missing_kernel_and_the_fix(tmp_path, monkeypatch, examples):
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)
    from gemmgen.compile.cache import KernelCache

    r = examples["gemm_bf16"]
    with pytest.raises(gg.KernelNotAvailable, match=r"recipe 'gemm_bf16' with config .* GEMMGEN_JIT=0 forbids.*"
                                                     r"gemmgen build RECIPES.py --out DIR"):
        build_kernel(r.ir, r.default_config(), KernelCache(tmp_path))


def test_a_lazy_compile_says_what_it_compiles_and_how_long_it_took(tmp_path, monkeypatch, capsys, compiled,
                                                                   session_cache, examples):
    """A first call that has to compile (no warmup, no bundle) says so on stderr before the half
    minute starts, with the fix, and when it is done (NVRTC stood in for by the session's build)."""
    from gemmgen.compile.cache import KernelCache

    monkeypatch.delenv("GEMMGEN_JIT", raising=False)
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)
    r = examples["gemm_bf16"]
    art = session_cache.get(compiled["gemm_bf16"].cache_key)
    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", lambda kernel: art)
    k = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path))
    assert k.origin == "compiled"
    err = capsys.readouterr().err
    name = f"gemm_bf16 ({r.default_config().name})"
    assert f"gemmgen: compiling {name} with NVRTC" in err and "gemmgen.warmup()" in err
    assert f"gemmgen: compiled {name} in {art.meta['compile_seconds']:.1f} s" in err
    build_kernel(r.ir, r.default_config(), KernelCache(tmp_path))  # a cache hit says nothing
    assert capsys.readouterr().err == ""


def test_build_bundle_ships_kernels_named_in_python_with_their_tuning(compiled, session_cache, examples, extra,
                                                                     tmp_path):
    """gemmgen.build_bundle, the ahead-of-time path for kernels a program names (a model's
    `model_launches`): the items, plus the tuning winners of their recipes and of no other, in a
    bundle that ships the table. (Nothing compiles here: every kernel it should build is cached.)"""
    from gemmgen import tuning
    from gemmgen.aot import with_tuned_winners

    h200 = tuning.Device("NVIDIA H200", "13.0")
    bias_gelu, gemm, moe = examples["bias_gelu"], examples["gemm_bf16"], examples["moe_up"]
    other = gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.PINGPONG)
    table = tuning.TuningTable()
    table.put(tuning.entry_key(h200, bias_gelu.key, (512, 4096, 4096, 1)), gemm.default_config(), {})
    table.put(tuning.entry_key(h200, moe.key, (16, 4096, 4096, 8)), other, {})
    pairs = [(bias_gelu, bias_gelu.default_config()), (gemm, gemm.default_config())]
    assert with_tuned_winners(pairs, table) == [*pairs, (bias_gelu, gemm.default_config())]
    assert with_tuned_winners(pairs, table, [moe]) == [*pairs, (moe, other)]
    assert with_tuned_winners(pairs, None) == pairs
    table.entries.pop(next(iter(table.entries)))  # bias_gelu's winner: compiled for gemm_bf16 only
    out = tmp_path / "bundle"
    stream_k = extra["row_extrema"]  # the suite's compiled stream-K kernel; with a split count: the same binary
    split = replace(stream_k.default_config(), splits=4)
    gg.build_bundle([bias_gelu, (gemm, gemm.default_config()), stream_k, (stream_k, split)], out, tuning=table,
                    cache=session_cache, quiet=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(e["recipe"], e["config"]) for e in manifest["kernels"]] == [(r.name, r.default_config().name)
                                                                         for r in (bias_gelu, gemm, stream_k)]
    assert tuning.TuningTable.load(out / "tuning.json").entries == table.entries


def test_a_bundle_holds_the_arches_its_manifest_names(tmp_path):
    from gemmgen.compile.bundles import Bundle

    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm_100a", "kernels": []}))
    assert Bundle(tmp_path).arches == [gg.Arch.SM100A]  # a format-1 manifest names one arch
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "arches": ["sm_90a", "sm_100a"], "kernels": []}))
    assert Bundle(tmp_path).arches == [gg.Arch.SM90A, gg.Arch.SM100A]
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "arches": ["sm_120a"], "kernels": []}))
    with pytest.raises(gg.GemmgenError, match=r"holds kernels for sm_120a, none of which this gemmgen builds "
                                              r"\(sm_90a, sm_100a\).*--arch ARCH"):
        Bundle(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "arches": "sm_90a", "kernels": []}))
    with pytest.raises(gg.GemmgenError, match=r"not a gemmgen bundle .*its arches are 'sm_90a', not a list"):
        Bundle(tmp_path)
    with pytest.raises(gg.GemmgenError, match="not a gemmgen bundle"):
        Bundle(tmp_path / "nothing")


def test_a_bundle_folder_that_cannot_be_made_is_a_named_error(tmp_path):
    from gemmgen.aot import write_bundle
    from gemmgen.compile.cache import KernelCache

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(gg.GemmgenError, match=r"bundle folder .*a-file: cannot create it \(a file is in the way\)"):
        write_bundle([], blocker, KernelCache(tmp_path / "cache"))


def test_compile_error_carries_log_and_source(tmp_path):
    src = '#include <cutlass/cutlass.h>\nextern "C" __global__ void k() { this_is_not_declared(); }\n'
    path = tmp_path / "bad.cu"
    path.write_text(src)
    with pytest.raises(gg.CompileError) as e:
        compile_cubin(src, "bad", DEFAULT_ARCH.value, toolchain().include_dirs, source_path=path)
    msg = str(e.value)
    assert "this_is_not_declared" in msg and "identifier" in msg and str(path) in msg


def test_cache_key_covers_config_and_has_no_paths(examples):
    r = examples["bias_gelu"]
    keys = {cache_key(render_kernel(r.ir, c)) for c in (
        gg.KernelConfig(), gg.KernelConfig(tile=(128, 256, 64)), gg.KernelConfig(tile=(128, 128, 128)),
        gg.KernelConfig(cluster=(2, 1, 1)), gg.KernelConfig(cluster=(1, 2, 1)), gg.KernelConfig(stages=4),
        gg.KernelConfig(schedule=gg.Schedule.PINGPONG))}
    assert len(keys) == 7
    material = json.dumps(key_material(render_kernel(r.ir, gg.KernelConfig())))
    for d in toolchain().include_dirs:
        assert str(d) not in material
    assert sys.prefix not in material

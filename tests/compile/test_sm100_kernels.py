"""sm_100a kernels compiled with NVRTC on the CPU (tests/data/sm100.py): the SASS that proves the
Blackwell path, no local memory, the Params layout probed, the cache and bundles keeping each arch
apart, and the one validation refusing what is not the arch's kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

import gemmgen as gg
from gemmgen.aot import write_bundle
from gemmgen.codegen.sm100 import smem_need
from gemmgen.codegen.sm100.smem import KERNEL_PADDING
from gemmgen.compile import KernelCache, bundles
from gemmgen.compile.build import build_kernel
from gemmgen.compile.validate import kernel_problem
from tests.data import EXAMPLES

SM100 = gg.Arch.SM100A
#: The example compiled for both arches under gemmgen's default one-SM config (tests/data/sm100.py).
BOTH = "qk_norm"


def test_each_sm100_kernel_shows_tcgen05_tma_and_tensor_memory_in_its_sass(sm100_kernels):
    for name, k in sm100_kernels.items():
        r = k.report
        two_sm = k.config.schedule is gg.Schedule.TWO_SM
        kind = "UTCOMMA" if k.recipe.gemm.a is gg.e2m1 else "UTCQMMA" if k.recipe.gemm.fp8 else "UTCHMMA"
        mma = kind + (".2CTA" if two_sm else "")
        assert r.arch == "sm_100a" and r.sass is not None, name
        assert r.sass[mma] > 0 and r.sass["UTMALDG"] > 0 and r.sass["LDTM"] > 0, (name, r.sass)
        # cluster launch control hands out the tiles; the group scheduler is persistent
        assert (r.sass["UGETNEXTWORKID"] > 0) != k.recipe.gemm.grouped, name
        assert (r.sass["UTCHMMA.2CTA"] + r.sass["UTCQMMA.2CTA"] + r.sass["UTCOMMA.2CTA"] > 0) == two_sm, name
        assert r.local_bytes == 0 and r.stack_bytes == 0, (name, r.local_bytes, r.stack_bytes)
        # a microscaled kernel copies its scales into tensor memory for the MMA; no other kernel does
        assert (r.sass["UTCCP"] > 0) == (k.recipe.gemm.microscaling is not None), (name, r.sass["UTCCP"])
        # the blockwise kernel has a sixth warp, which loads the scales (rounded up to 3 warp groups)
        threads = 384 if k.recipe.gemm.block_scale else 256
        assert k.info.max_threads == threads and k.info.cluster_size == k.config.cluster[0] * k.config.cluster[1]
        need = smem_need(k.config, k.generated.kernel_recipe)  # the model: above it, within its padding
        assert 0 <= need - r.smem_bytes <= KERNEL_PADDING, (name, need, r.smem_bytes)
    assert {k.config.schedule for k in sm100_kernels.values()} == {gg.Schedule.ONE_SM, gg.Schedule.TWO_SM}


def test_the_probed_params_layout_has_every_sm100_field(sm100_kernels):
    for name, k in sm100_kernels.items():
        layout = {f.name: (offset, f.size) for f, offset, _ in k.params_layout.fields}
        assert set(layout) == {f.name for f in k.generated.fields}, name
        maps = sorted(o for n, (o, size) in layout.items() if size == 128)
        assert all(o % 64 == 0 for o in maps) and len(set(maps)) == len(maps), name
        scheduler = ("scheduler.blocks_across_problem" if k.recipe.gemm.grouped else
                     "scheduler.clc.problem_tiles_m" if k.config.tile_scheduler is gg.TileScheduler.STREAM_K else
                     "scheduler.problem_tiles_m")
        assert {"mainloop.tma_a", "mainloop.tma_b", "mainloop.tma_a_fallback", "mainloop.tma_b_fallback",
                "epilogue.tma_d", scheduler, "hw_info.sm_count"} <= set(layout), name
        end = max(o + size for o, size in layout.values())
        assert end <= k.params_layout.size == k.info.params_size, name


def test_each_arch_has_its_folder_in_one_cache(sm100_kernels, compiled, session_cache):
    k = sm100_kernels[BOTH]
    assert session_cache.for_arch(SM100).entry_dir(k.cache_key).parent.parent.name == "sm_100a"
    assert session_cache.for_arch(SM100).get(k.cache_key) is not None
    assert session_cache.get(k.cache_key) is None  # not in sm_90a's folder
    assert compiled[BOTH].entry != k.entry and compiled[BOTH].cache_key != k.cache_key


def test_the_validation_refuses_what_is_not_the_arch_kernel(sm100_kernels, compiled, session_cache):
    k = sm100_kernels["scaled_mm_fp8"]
    art = session_cache.for_arch(SM100).get(k.cache_key)
    assert art is not None and kernel_problem(art.files, art.meta, k.generated) is None
    # what a plain-sm_100 build compiles to: no tcgen05 instruction (its MMA is a trap)
    traps = {**art.meta, "sass": {**art.meta["sass"], "UTCQMMA.2CTA": 0}}
    assert "its SASS has no UTCHMMA.2CTA or UTCQMMA.2CTA instruction: not the sm_100a path" in \
        str(kernel_problem(art.files, traps, k.generated))
    spilled = {**art.meta, "local_bytes": 16}
    assert "16 bytes of local memory" in str(kernel_problem(art.files, spilled, k.generated))
    stacked = {**art.meta, "stack_bytes": 216}  # spills on the stack frame (fp8_quantized's row held in fp32)
    assert "216-byte stack frame in local memory" in str(kernel_problem(art.files, stacked, k.generated))
    # an sm_90a cubin offered for the sm_100a kernel
    sm90 = session_cache.get(compiled["scaled_mm_fp8"].cache_key)
    assert sm90 is not None
    wrong = {**art.files, "kernel.cubin": sm90.files["kernel.cubin"]}
    assert "kernel.cubin was compiled for sm_90, not sm_100a" in str(kernel_problem(wrong, art.meta, k.generated))
    # a microscaled kernel without the scales' copy into tensor memory
    mx = sm100_kernels["mxfp8_linear"]
    mx_art = session_cache.for_arch(SM100).get(mx.cache_key)
    assert mx_art is not None and kernel_problem(mx_art.files, mx_art.meta, mx.generated) is None
    unscaled = {**mx_art.meta, "sass": {**mx_art.meta["sass"], "UTCCP": 0}}
    assert "its SASS has no UTCCP instruction" in str(kernel_problem(mx_art.files, unscaled, mx.generated))


def test_one_bundle_holds_both_arches_and_a_missing_arch_is_named(sm100_kernels, compiled, session_cache, tmp_path,
                                                                  monkeypatch, examples):
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)
    bundles._FROM_ENV.clear()
    both = tmp_path / "both"
    write_bundle([compiled[BOTH], sm100_kernels[BOTH]], both, session_cache)
    manifest = json.loads((both / "manifest.json").read_text())
    assert manifest["arches"] == ["sm_100a", "sm_90a"] and [e["arch"] for e in manifest["kernels"]] == \
        ["sm_90a", "sm_100a"]
    assert (both / "sm_100a").is_dir() and (both / "sm_90a").is_dir() and not list(both.rglob("*.lock"))
    r = examples[BOTH]
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(both))
    try:
        for config in (r.default_config(), r.default_config(SM100)):
            assert build_kernel(r.ir, config, KernelCache(tmp_path / "empty")).origin == "bundle"
        sm90_only = tmp_path / "sm90"
        write_bundle([compiled[BOTH]], sm90_only, session_cache)
        monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(sm90_only))
        other = replace(r.default_config(SM100), tile=(128, 256, 64))
        fix = r"`gemmgen build RECIPES.py --arch sm_100a --out DIR`"
        with pytest.raises(gg.KernelNotAvailable, match=rf"bundle {sm90_only} holds sm_90a kernels only, none for "
                                                        rf"sm_100a.*{fix}"):
            build_kernel(r.ir, other, KernelCache(tmp_path / "empty"))
    finally:
        bundles._FROM_ENV.clear()


def test_inspect_reports_sm100_kernels_and_every_example_generates_for_sm100(sm100_kernels, session_cache, tmp_path,
                                                                            sm100_examples):
    """inspect reports a kernel per arch; build names an arch a recipe needs (MXFP8: sm_100a), before
    any compile; generate writes every example for sm_100a."""
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "inspect", str(EXAMPLES), "--recipe", BOTH,
                           "--arch", "sm_100a", "--arch", "sm_90a", "--json", "--cache-dir", str(session_cache.root)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(row["arch"], row["cached"]) for row in rows] == [("sm_100a", True), ("sm_90a", True)]
    assert rows[0]["entry"] == sm100_kernels[BOTH].entry
    assert {"UTCHMMA", "UTCHMMA.2CTA", "UTMALDG", "LDTM"} <= set(rows[0]["sass"]) and "HGMMA" in rows[1]["sass"]
    assert gg.KernelConfig.from_canonical(sm100_kernels[BOTH].config.canonical()).arch is SM100
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "build", str(EXAMPLES), "--recipe", "mxfp8_linear",
                           "--arch", "sm_90a", "--cache-dir", str(session_cache.root)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "on sm_100a (B200) only" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "generate", str(EXAMPLES), "--arch", "sm_100a",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "not built" not in proc.stderr  # every example
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.sm_100a.cu" for n in sm100_examples)
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "inspect", str(EXAMPLES), "--arch", "sm_100"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "'sm_100' is the plain target" in proc.stderr and "use 'sm_100a'" in proc.stderr


def test_warmup_and_build_bundle_take_the_arch(sm100_kernels, compiled, session_cache, examples, tmp_path):
    r = examples[BOTH]
    warmed = gg.warmup([r], cache=session_cache, quiet=True, arch="sm_100a", distributed=False)
    assert [k.entry for k in warmed] == [sm100_kernels[BOTH].entry] and warmed[0].origin == "cache"
    here = gg.warmup([r], cache=session_cache, quiet=True, distributed=False)  # no GPU here: sm_90a
    assert [k.entry for k in here] == [compiled[BOTH].entry]
    kernels = gg.build_bundle([r], tmp_path / "b", cache=session_cache, quiet=True, arches=("sm_90a", "sm_100a"))
    assert [k.config.arch for k in kernels] == [gg.Arch.SM90A, SM100]
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["arches"] == ["sm_100a", "sm_90a"]
    with pytest.raises(gg.ConfigError, match=r"arches: 'sm_100' is the plain target"):
        gg.build_bundle([r], tmp_path / "c", cache=session_cache, quiet=True, arches=("sm_100",))


def test_one_report_table_shows_each_arch_with_its_own_markers(sm100_kernels, compiled):
    from gemmgen.compile import report_table

    lines = report_table([compiled[BOTH].report, sm100_kernels[BOTH].report]).splitlines()
    head = lines[0].split()
    sm90, sm100 = (dict(zip(head, line.split(), strict=False)) for line in lines[2:])
    assert {"HGMMA", "USETMAXREG", "UTCHMMA", "LDTM", "UGETNEXTWORKID"} <= set(head)
    assert sm90["HGMMA"] != "-" and sm90["LDTM"] == "-" and sm100["HGMMA"] == "-" and int(sm100["UTCHMMA"]) > 0
    assert int(sm100["LDTM"]) > 0 and sm90["UTMALDG"] != "-" and sm100["UTMALDG"] != "-"

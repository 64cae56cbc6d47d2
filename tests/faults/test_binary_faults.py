"""Binaries from any source pass one validation (`compile.validate`) before they are loaded; a
damaged one is reported once, by where it is and what is wrong, and never served. Bundles:
damaged entries, stale GEMMGEN_BUNDLE_PATH entries, and writes that fail. The session's real
kernels are damaged here; nothing compiles."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from pathlib import Path

import pytest

import gemmgen as gg
from gemmgen.aot import write_bundle
from gemmgen.codegen import render_kernel
from gemmgen.compile import bundles
from gemmgen.compile.build import build_kernel
from gemmgen.compile.cache import Artifact, KernelCache
from gemmgen.compile.validate import elf_problem, kernel_problem
from gemmgen.testing.faults import no_space_for, run_python, why_not
from tests.data import EXAMPLES

pytestmark = pytest.mark.faults
NAME = "gemm_bf16"


@pytest.fixture
def kernel(compiled, examples):
    """(the recipe, its generated kernel, the session's artifact of it)."""
    r = examples[NAME]
    return r, render_kernel(r.ir, r.default_config()), compiled[NAME]


@pytest.fixture
def art(kernel, session_cache):
    found = session_cache.get(kernel[2].cache_key)
    assert found is not None
    return found


@pytest.fixture(autouse=True)
def no_bundles(monkeypatch):
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)
    monkeypatch.delenv("GEMMGEN_JIT", raising=False)
    bundles._FROM_ENV.clear()
    yield
    bundles._FROM_ENV.clear()


def _patched(cubin: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(cubin)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_a_real_kernel_passes_and_each_kind_of_damage_is_named(kernel, art):
    _, gen, _ = kernel
    cubin = art.files["kernel.cubin"]
    assert kernel_problem(art.files, art.meta, gen) is None
    flags, = struct.unpack_from("<I", cubin, 0x30)
    assert elf_problem(cubin, "sm_100a", gen.entry) == "kernel.cubin was compiled for sm_90, not sm_100a"
    assert elf_problem(b"MZ" + cubin[2:], "sm_90a", gen.entry) == "kernel.cubin is not an ELF file"
    assert "not CUDA (190)" in str(elf_problem(_patched(cubin, 0x12, "<H", 62), "sm_90a", gen.entry))
    assert "compiled for sm_80" in str(elf_problem(_patched(cubin, 0x30, "<I", (flags & ~0xFF00) | (80 << 8)),
                                                   "sm_90a", gen.entry))
    assert "damaged" in str(elf_problem(cubin[: len(cubin) // 2], "sm_90a", gen.entry))
    renamed = cubin.replace(gen.entry.encode() + b"\0", gen.entry[:-1].encode() + b"X\0")
    assert elf_problem(renamed, "sm_90a", gen.entry) == f"kernel.cubin defines no function {gen.entry!r}"
    meta = dict(art.meta, entry="other")
    assert "holds entry 'other'" in str(kernel_problem(art.files, meta, gen))
    meta = dict(art.meta, layout=art.meta["layout"][1:])
    assert "Params layout lacks" in str(kernel_problem(art.files, meta, gen))
    meta = {k: v for k, v in art.meta.items() if k != "info"}
    assert "no valid 'info'" in str(kernel_problem(art.files, meta, gen))
    files = {k: v for k, v in art.files.items() if k != "kernel.cu"}
    assert kernel_problem(files, art.meta, gen) == "the entry has no kernel.cu"


def _rewrite_entry(cache: KernelCache, key: str, files: dict[str, bytes]) -> Path:
    """Replace an entry's files and rewrite its digests to match: what an integrity check alone passes."""
    d = cache.entry_dir(key)
    record = json.loads((d / "meta.json").read_text())
    for name, data in files.items():
        (d / name).write_bytes(data)
        record["files"][name] = hashlib.sha256(data).hexdigest()
    (d / "meta.json").write_text(json.dumps(record))
    return d


def _cache_with(root: Path, key: str, art: Artifact) -> KernelCache:
    cache = KernelCache(root)
    cache.put(key, art)
    return KernelCache(root)  # a fresh process's view: nothing in memory


def test_a_cache_entry_with_matching_digests_but_a_wrong_binary_is_not_served(kernel, art, tmp_path, monkeypatch):
    """Digests rewritten to match a non-CUDA ELF: reported once and recompiled (NVRTC stood in for by
    the real artifact); under GEMMGEN_JIT=0 the error says a damaged copy was found."""
    r, _, compiled = kernel
    key = compiled.cache_key
    cubin = art.files["kernel.cubin"]
    cache = _cache_with(tmp_path / "c", key, art)
    d = _rewrite_entry(cache, key, {"kernel.cubin": _patched(cubin, 0x12, "<H", 62)})
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    with pytest.warns(gg.GemmgenWarning, match=rf"kernel cache entry {d}: kernel.cubin is an ELF for machine 62"):
        with pytest.raises(gg.KernelNotAvailable, match=r"a damaged copy was not served \(kernel cache entry"):
            build_kernel(r.ir, r.default_config(), cache)
    monkeypatch.delenv("GEMMGEN_JIT")
    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", lambda k: art)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once per process: not again
        k = build_kernel(r.ir, r.default_config(), cache)
    assert k.origin == "compiled" and k.cubin == cubin
    replaced = KernelCache(tmp_path / "c").get(key)
    assert replaced is not None and replaced.files["kernel.cubin"] == cubin  # the entry was replaced


def _bundle(kernel, session_cache, out: Path) -> Path:
    write_bundle([kernel[2]], out, session_cache)
    return out


def _entry(bundle: Path, kernel) -> Path:
    return KernelCache(bundle, label="bundle").entry_dir(bundles.source_key(kernel[1]))


@pytest.mark.parametrize("damage", ["truncated_cubin", "altered_cubin_digests_rewritten", "bad_metadata",
                                    "missing_source"])
def test_a_damaged_bundle_entry_is_reported_and_not_served(kernel, session_cache, tmp_path, monkeypatch, damage):
    r, gen, compiled = kernel
    bundle = _bundle(kernel, session_cache, tmp_path / "bundle")
    d = _entry(bundle, kernel)
    cubin = (d / "kernel.cubin").read_bytes()
    if damage == "truncated_cubin":
        (d / "kernel.cubin").write_bytes(cubin[:1000])
        problem = "kernel.cubin does not match its recorded digest"
    elif damage == "altered_cubin_digests_rewritten":
        _rewrite_entry(KernelCache(bundle, label="bundle"), bundles.source_key(gen),
                       {"kernel.cubin": cubin.replace(gen.entry.encode(), gen.entry[::-1].encode())})
        problem = "kernel.cubin defines no function"
    elif damage == "bad_metadata":
        (d / "meta.json").write_text("{not json")
        problem = "meta.json is unreadable"
    else:
        (d / "kernel.cu").unlink()
        problem = "kernel.cu is missing"
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(bundle))
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    with pytest.warns(gg.GemmgenWarning, match=rf"bundle entry {d}: {problem}.*; not served") as seen:
        with pytest.raises(gg.KernelNotAvailable, match=rf"a damaged copy was not served \(bundle entry {d}: "
                                                        rf"{problem}"):
            build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "empty"))
        k = build_kernel(r.ir, r.default_config(), session_cache)  # the cache still serves it
    assert len(seen) == 1 and k.origin == "cache" and k.cubin == compiled.cubin


@pytest.mark.parametrize("stale", ["missing", "not_a_bundle", "other_arch", "unreadable_manifest"])
def test_a_stale_bundle_path_entry_is_a_warning_not_a_failure_of_other_loads(kernel, session_cache, tmp_path,
                                                                           monkeypatch, stale):
    r, _, compiled = kernel
    good = _bundle(kernel, session_cache, tmp_path / "good")
    bad = tmp_path / "bad"
    if stale == "not_a_bundle":
        bad.mkdir()
        (bad / "README").write_text("x")
    elif stale == "other_arch":
        bad.mkdir()
        (bad / "manifest.json").write_text(json.dumps({"format": 2, "arches": ["sm_120a"], "kernels": []}))
    elif stale == "unreadable_manifest":
        bad.mkdir()
        (bad / "manifest.json").write_bytes(b"\xff\xfe")
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", os.pathsep.join([str(bad), str(good)]))
    with pytest.warns(gg.GemmgenWarning, match=rf"GEMMGEN_BUNDLE_PATH entry skipped: .*{bad}") as seen:
        k = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "empty"))
        build_kernel(r.ir, r.default_config(), session_cache)
    assert len(seen) == 1 and k.origin == "bundle" and k.cubin == compiled.cubin
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(bad))
    with pytest.warns(gg.GemmgenWarning, match="GEMMGEN_BUNDLE_PATH entry skipped"):
        assert build_kernel(r.ir, r.default_config(), session_cache).origin == "cache"


def test_add_bundle_of_a_folder_that_is_no_bundle_is_an_error(tmp_path):
    with pytest.raises(gg.GemmgenError, match="not a gemmgen bundle"):
        gg.add_bundle(tmp_path / "nothing")


def test_a_bundle_that_cannot_be_written_leaves_nothing_and_the_earlier_bundle_intact(kernel, session_cache,
                                                                                     tmp_path, monkeypatch):
    out = _bundle(kernel, session_cache, tmp_path / "bundle")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for target in (out, tmp_path / "new"):
        refused = pytest.raises(gg.GemmgenError, match=r"cannot write it: No space left on device .*nothing was "
                                                       r"written.*--out DIR")
        with no_space_for("meta.json"), refused:
            write_bundle([kernel[2]], target, session_cache)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and bundles.Bundle(out).get(
        bundles.source_key(kernel[1]), gg.Arch.SM90A) is not None
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_a_bundle_is_not_written_over_a_folder_of_other_files(kernel, session_cache, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(gg.GemmgenError, match="holds files but no bundle"):
        write_bundle([kernel[2]], folder, session_cache)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


def test_gemmgen_build_on_a_full_disk_fails_cleanly(session_cache, tmp_path, compiled):
    """A real full file system (a 64 KiB tmpfs) under `gemmgen build --out`: exit status 2, one
    line naming the bundle and the OS error, nothing left there."""
    reason = why_not("full_disk")
    if reason:
        pytest.skip(reason)
    small = tmp_path / "small"
    small.mkdir()
    out = run_python(f"""
        import contextlib, io, json, os
        from gemmgen.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["build", {str(EXAMPLES)!r}, "--recipe", {NAME!r}, "--out", {str(small / "bundle")!r},
                       "--cache-dir", {str(session_cache.root)!r}, "-j", "1"])
        print(json.dumps({{"rc": rc, "err": err.getvalue(), "left": os.listdir({str(small)!r})}}))
    """, tmpfs=(small, 64 * 1024))
    assert out["rc"] == 2 and out["left"] == []
    assert f"gemmgen: error: bundle {small / 'bundle'}: cannot write it: No space left on device" in out["err"]
    assert "Traceback" not in out["err"]



@pytest.mark.parametrize("how", ["unwritable", "read_only_mount"])
def test_a_read_only_bundle_serves_its_kernels(kernel, session_cache, tmp_path, how):
    """A bundle in a read-only image layer (or owned by another user): loaded with no lock file and
    no write, under GEMMGEN_JIT=0, in a process that may not write there."""
    reason = why_not(how)
    if reason:
        pytest.skip(reason)
    from gemmgen.testing.faults import make_unwritable, make_writable

    bundle = _bundle(kernel, session_cache, tmp_path / "bundle")
    make_unwritable(bundle)
    try:
        kw = {"unprivileged": True} if how == "unwritable" else {"read_only_mount": bundle}
        out = run_python(f"""
            import json, warnings
            warnings.simplefilter("error")
            from gemmgen.aot import load_recipes
            from gemmgen.compile import KernelCache, build_kernel
            r = load_recipes({str(EXAMPLES)!r})[{NAME!r}]
            k = build_kernel(r.ir, r.default_config(), KernelCache({str(tmp_path / "empty")!r}))
            print(json.dumps({{"origin": k.origin, "size": len(k.cubin)}}))
        """, env={"GEMMGEN_BUNDLE_PATH": str(bundle), "GEMMGEN_JIT": "0"}, **kw)
    finally:
        make_writable(bundle)
    assert out["origin"] == "bundle" and out["size"] == len(kernel[2].cubin)


def test_a_worker_build_that_cannot_be_stored_reaches_the_caller(kernel, art, tmp_path, monkeypatch):
    """A warm-up whose cache disk is full: the kernel compiled (NVRTC stood in for) is kept in memory
    and returned, with one warning, instead of failing after the compile."""
    from gemmgen.compile import build_many

    r, _, _ = kernel
    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", lambda k: art)
    cache = KernelCache(tmp_path / "c")
    with no_space_for("kernel.cubin"), pytest.warns(gg.GemmgenWarning, match="could not store kernel .* keeping "
                                                                             "it in memory"):
        built, = build_many([(r.ir, r.default_config())], cache, jobs=1, quiet=True)
    assert built.origin == "compiled" and built.cubin == art.files["kernel.cubin"]
    assert not list((tmp_path / "c").rglob(".tmp-*"))


def test_the_compile_notice_estimates_from_this_machines_compiles(tmp_path):
    from gemmgen.compile.build import compile_estimate

    cache = KernelCache(tmp_path)
    assert compile_estimate(cache) == "which takes tens of seconds or more"  # no number it did not measure
    for i, seconds in enumerate((70.0, 95.5, 110.2)):
        cache.put(f"{i:02d}" + "0" * 62, Artifact({"kernel.cubin": b"x"}, {"compile_seconds": seconds}))
    assert compile_estimate(cache) == "about 70-110 s on this machine (past 3 compiles)"

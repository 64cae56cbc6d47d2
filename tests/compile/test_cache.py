"""The disk cache under concurrency, crashes and corruption, with a stand-in builder (no NVRTC)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from gemmgen.compile.cache import Artifact, KernelCache
from gemmgen.errors import GemmgenWarning

KEY = "ab" + "0" * 62


def _slow_build(counter: Path, seconds: float) -> Artifact:
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return Artifact({"kernel.cubin": b"\x7fELF" + os.urandom(4096)}, {"built_by": os.getpid()})


def _racer(root: str, counter: str, start_at: float, out: str) -> None:
    while time.time() < start_at:
        time.sleep(0.001)
    art, built = KernelCache(root).get_or_build(KEY, lambda: _slow_build(Path(counter), 1.0))
    Path(out).write_text(json.dumps({"built": built, "by": art.meta["built_by"],
                                     "size": len(art.files["kernel.cubin"])}))


def _ctx():
    return multiprocessing.get_context("spawn")


def test_eight_processes_build_a_cold_key_once(tmp_path):
    counter = tmp_path / "builds.txt"
    start_at = time.time() + 2.0
    procs = [_ctx().Process(target=_racer,
                            args=(str(tmp_path / "c"), str(counter), start_at, str(tmp_path / f"{i}.json")))
             for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(counter.read_text().splitlines()) == 1
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(8)]
    assert sum(r["built"] for r in results) == 1
    assert len({r["by"] for r in results}) == 1  # everyone got the one artifact


def _killed_builder(root: str, counter: str) -> None:
    KernelCache(root).get_or_build(KEY, lambda: _slow_build(Path(counter), 60.0))


def test_builder_killed_with_sigkill_leaves_nothing_served(tmp_path):
    root, counter = tmp_path / "c", tmp_path / "builds.txt"
    p = _ctx().Process(target=_killed_builder, args=(str(root), str(counter)))
    p.start()
    deadline = time.time() + 30
    while not counter.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert counter.exists(), "builder never started"
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    cache = KernelCache(root)
    assert cache.get(KEY) is None
    art, built = cache.get_or_build(KEY, lambda: _slow_build(counter, 0.0))
    assert built and len(counter.read_text().splitlines()) == 2
    assert not list(cache.entry_dir(KEY).parent.glob(".tmp-*"))
    again = KernelCache(root).get(KEY)
    assert again is not None and again.files == art.files


def _populate(root: Path) -> Artifact:
    art, built = KernelCache(root).get_or_build(KEY, lambda: Artifact({"kernel.cubin": os.urandom(1000)}, {"x": 1}))
    assert built
    return art


@pytest.mark.parametrize("damage", ["truncate_cubin", "garbage_meta", "empty_meta", "missing_cubin", "wrong_key"])
def test_damaged_entries_are_rebuilt(tmp_path, damage):
    root = tmp_path / "c"
    old = _populate(root)
    d = KernelCache(root).entry_dir(KEY)
    if damage == "truncate_cubin":
        (d / "kernel.cubin").write_bytes(old.files["kernel.cubin"][:100])
    elif damage == "garbage_meta":
        (d / "meta.json").write_bytes(os.urandom(64))
    elif damage == "empty_meta":
        (d / "meta.json").write_text("")
    elif damage == "missing_cubin":
        (d / "kernel.cubin").unlink()
    else:
        meta = json.loads((d / "meta.json").read_text())
        meta["key"] = "cd" + "0" * 62
        (d / "meta.json").write_text(json.dumps(meta))
    cache = KernelCache(root)
    with pytest.warns(GemmgenWarning, match=rf"kernel cache entry {d}: .*; not served") as seen:
        assert cache.get(KEY) is None
        fresh = Artifact({"kernel.cubin": b"rebuilt"}, {"x": 2})
        art, built = cache.get_or_build(KEY, lambda: fresh)
    assert len(seen) == 1  # reported once, though read twice (before and under the lock)
    assert built and art.files["kernel.cubin"] == b"rebuilt"
    again = KernelCache(root).get(KEY)
    assert again is not None and again.files["kernel.cubin"] == b"rebuilt"


def test_moved_cache_still_hits(tmp_path):
    art = _populate(tmp_path / "a")
    shutil.move(str(tmp_path / "a"), str(tmp_path / "elsewhere" / "b"))
    hit = KernelCache(tmp_path / "elsewhere" / "b").get(KEY)
    assert hit is not None and hit.files == art.files


def test_arches_are_separate(tmp_path):
    _populate(tmp_path)
    assert KernelCache(tmp_path, arch="sm_100a").get(KEY) is None
    assert (tmp_path / "sm_90a").is_dir()


def test_memory_layer_serves_without_disk(tmp_path):
    cache = KernelCache(tmp_path)
    art, _ = cache.get_or_build(KEY, lambda: Artifact({"kernel.cubin": b"x"}, {}))
    shutil.rmtree(tmp_path / "sm_90a")
    assert cache.get(KEY) is art
    cache.clear_memory()
    assert cache.get(KEY) is None


def test_env_var_sets_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(tmp_path / "env"))
    assert KernelCache().root == tmp_path / "env"


def test_an_unusable_cache_folder_is_a_named_error_before_any_build(tmp_path, monkeypatch):
    """GEMMGEN_CACHE_DIR naming a file (or anything mkdir refuses): a GemmgenError that names the
    folder and the fix, before the half-minute compile, not a bare NotADirectoryError."""
    import gemmgen as gg

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(blocker))
    builds: list[int] = []

    def build() -> Artifact:
        builds.append(1)
        return Artifact({"kernel.cubin": b"x"}, {})

    with pytest.raises(gg.GemmgenError, match=r"kernel cache .*a-file.*cannot create .* GEMMGEN_CACHE_DIR"):
        KernelCache().get_or_build(KEY, build)
    assert builds == []

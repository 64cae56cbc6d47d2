"""The cache under the faults of real deployments: a pre-warmed cache it cannot write to, a full
disk, a process killed at each stage of a store. Real faults in child processes (gemmgen.testing.faults);
the builder stands in for NVRTC, so nothing here compiles."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemmgen.compile.cache import Artifact, KernelCache
from gemmgen.errors import GemmgenError, GemmgenWarning
from gemmgen.testing.faults import make_unwritable, make_writable, no_space_for, run_python, why_not

pytestmark = pytest.mark.faults

KEY = "ab" + "1" * 62
OTHER = "cd" + "2" * 62

#: The child's side: a cache at `root`, one get_or_build of `key` with a builder that logs its runs.
CHILD = """
    import json, os, warnings
    from pathlib import Path
    from gemmgen.compile.cache import Artifact, KernelCache
    from gemmgen.errors import GemmgenError
    warnings.simplefilter("always")
    builds = []
    def build():
        builds.append(1)
        return Artifact({{"kernel.cubin": b"\\x7fELF" + bytes({size})}}, {{"by": os.getpid()}})
    out = {{"error": None, "warnings": []}}
    with warnings.catch_warnings(record=True) as seen:
        cache = KernelCache({root!r})
        out["hit_before"] = cache.get({key!r}) is not None
        try:
            art, built = cache.get_or_build({key!r}, build)
            out.update(built=built, size=len(art.files["kernel.cubin"]), again=cache.get({key!r}) is art,
                       unstored={key!r} in cache.unstored)
        except GemmgenError as e:
            out["error"] = str(e)
    out["builds"] = len(builds)
    out["staged"] = [str(p) for p in Path({root!r}).rglob(".tmp-*")]
    out["warnings"] = [str(w.message) for w in seen]
    print(json.dumps(out))
"""


def _child(root: Path, key: str = KEY, size: int = 1000, **kw) -> dict:
    return run_python(CHILD.format(root=str(root), key=key, size=size), **kw)


def _populate(root: Path, key: str = KEY) -> Artifact:
    art, built = KernelCache(root).get_or_build(key, lambda: Artifact({"kernel.cubin": b"\x7fELF" + bytes(99)}, {}))
    assert built
    return art


@pytest.fixture
def fallback(tmp_path, monkeypatch):
    """A private TMPDIR, so the per-user fallback folder is this test's."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp / f"gemmgen-cache-{os.getuid()}"


def _skip_unless(fault: str) -> None:
    reason = why_not(fault)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("how", ["unwritable", "read_only_mount"])
def test_a_prewarmed_cache_that_cannot_be_written_serves_what_it_holds(tmp_path, fallback, how):
    """Served with no lock file, no fallback folder, no warning (it used to be a raw PermissionError
    on the lock file)."""
    _skip_unless(how)
    root = tmp_path / "image-layer"
    _populate(root)
    (root / "sm_90a" / "locks" / f"{KEY}.lock").unlink()
    make_unwritable(root)
    try:
        kw = {"unprivileged": True} if how == "unwritable" else {"read_only_mount": root}
        out = _child(root, **kw)
    finally:
        make_writable(root)
    assert out["error"] is None and out["hit_before"] and not out["built"] and out["builds"] == 0
    assert out["warnings"] == []
    assert not (root / "sm_90a" / "locks" / f"{KEY}.lock").exists() and not fallback.exists()


@pytest.mark.parametrize("how", ["unwritable", "read_only_mount"])
def test_a_miss_in_an_unwritable_cache_is_built_into_the_fallback_folder_once(tmp_path, fallback, how):
    _skip_unless(how)
    root = tmp_path / "image-layer"
    _populate(root, OTHER)
    make_unwritable(root)
    try:
        kw = {"unprivileged": True} if how == "unwritable" else {"read_only_mount": root}
        first = _child(root, **kw)
        second = _child(root, **kw)  # a later process finds it in the fallback
    finally:
        make_writable(root)
    assert first["error"] is None and first["built"] and first["builds"] == 1 and not first["unstored"]
    assert len(first["warnings"]) == 1
    assert f"kernel cache {root} cannot be written to" in first["warnings"][0] and str(fallback) in first["warnings"][0]
    assert second["hit_before"] and second["builds"] == 0 and second["warnings"] == []
    assert KernelCache(fallback).get(KEY) is not None and KernelCache(root).get(KEY) is None
    assert os.stat(fallback).st_mode & 0o077 == 0  # private to the user


def test_with_no_writable_place_the_error_names_the_variable_before_building(tmp_path, fallback):
    _skip_unless("unwritable")
    root = tmp_path / "image-layer"
    _populate(root, OTHER)
    fallback.mkdir(mode=0o700)
    make_unwritable(root)
    make_unwritable(fallback)
    try:
        out = _child(root, unprivileged=True)
    finally:
        make_writable(root)
        make_writable(fallback)
    assert out["builds"] == 0
    assert "cannot be written to" in out["error"] and "GEMMGEN_CACHE_DIR" in out["error"]
    assert str(fallback) in out["error"]


def test_a_fallback_folder_another_user_could_write_is_not_used(tmp_path, fallback):
    """A folder in a shared /tmp that is writable by others could hold someone else's binaries."""
    _skip_unless("unwritable")
    root = tmp_path / "image-layer"
    (root / "sm_90a").mkdir(parents=True)
    fallback.mkdir()
    fallback.chmod(0o777)
    make_unwritable(root)
    try:
        out = _child(root, unprivileged=True)
    finally:
        make_writable(root)
    assert out["builds"] == 0 and "not private to this user" in out["error"]


def test_a_full_disk_keeps_the_finished_build_in_memory_and_leaves_no_staging(tmp_path):
    _skip_unless("full_disk")
    root = tmp_path / "small"
    root.mkdir()
    out = _child(root, size=256 * 1024, tmpfs=(root, 64 * 1024))
    assert out["error"] is None and out["built"] and out["builds"] == 1 and out["again"] and out["unstored"]
    assert len(out["warnings"]) == 1
    assert "could not store kernel" in out["warnings"][0] and "No space left on device" in out["warnings"][0]
    assert "keeping it in memory for this process only" in out["warnings"][0]
    assert out["staged"] == []


def test_a_store_that_fails_removes_its_staging_and_a_later_store_succeeds(tmp_path):
    """ENOSPC injected at each file of a store: the build is kept, nothing staged is left, the
    entry is absent (not partial), and once space returns the next process stores it."""
    for failing in ("kernel.cubin", "meta.json"):
        root = tmp_path / failing
        cache = KernelCache(root)
        art = Artifact({"kernel.cubin": b"\x7fELF" + bytes(500)}, {})
        with no_space_for(failing, partial=True) as written, \
                pytest.warns(GemmgenWarning, match=r"could not store kernel .*No space left on device.*in memory"):
            got, built = cache.get_or_build(KEY, functools.partial(_same, art))
        assert built and got is art and cache.get(KEY) is art and KEY in cache.unstored
        assert failing in written
        assert not list((root / "sm_90a").rglob(".tmp-*")) and not cache.entry_dir(KEY).exists()
        _, built = KernelCache(root).get_or_build(KEY, functools.partial(_same, art))
        stored = KernelCache(root).get(KEY)
        assert built and stored is not None and stored.files == art.files


def _same(art: Artifact) -> Artifact:
    return art


def test_no_room_even_for_a_lock_file_still_builds_and_keeps_the_result(tmp_path, monkeypatch):
    import errno

    cache = KernelCache(tmp_path / "c")

    def no_space(key: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(cache._lock_path(key)))

    monkeypatch.setattr(cache, "_open_lock", no_space)
    art = Artifact({"kernel.cubin": b"x"}, {})
    with pytest.warns(GemmgenWarning, match="could not store kernel"):
        got, built = cache.get_or_build(KEY, lambda: art)
    assert built and got is art and cache.get(KEY) is art


KILLED = """
    import os, sys, time
    from pathlib import Path
    import gemmgen.compile.cache as cache_mod
    stage, marker = {stage!r}, Path({marker!r})
    real_write, real_rename, real_fsync = cache_mod._write, os.rename, cache_mod._fsync_dir
    def hang():
        marker.write_text("at " + stage)
        time.sleep(60)
    def write(path, data):
        if stage == "staging" and path.name == "kernel.cubin":
            Path(path).write_bytes(data[:100])
            hang()
        if stage == "metadata" and path.name == "meta.json":
            Path(path).write_bytes(data[:10])
            hang()
        real_write(path, data)
    def rename(a, b):
        if stage == "rename" and ".tmp-" in str(a):
            hang()
        real_rename(a, b)
    def fsync_dir(path):
        if stage == "after_rename" and not path.name.startswith(".tmp-"):
            hang()
        real_fsync(path)
    cache_mod._write, cache_mod._fsync_dir = write, fsync_dir
    cache_mod.os.rename = rename
    cache_mod.KernelCache({root!r}).get_or_build({key!r}, lambda: cache_mod.Artifact(
        {{"kernel.cubin": b"\\x7fELF" + bytes(5000)}}, {{"by": "killed"}}))
"""


@pytest.mark.parametrize("stage", ["staging", "metadata", "rename", "after_rename"])
def test_a_store_killed_at_each_stage_serves_nothing_partial(tmp_path, stage):
    """SIGKILL while writing the cubin, while writing meta.json, before the rename and after it:
    the next process gets the complete entry (after the rename) or builds it once (before), and
    no staged folder is left behind once it has."""
    root, marker = tmp_path / "c", tmp_path / "marker"
    script = f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n" + \
        __import__("textwrap").dedent(KILLED.format(stage=stage, marker=str(marker), root=str(root), key=KEY))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert marker.exists(), proc.stderr.read().decode() if proc.stderr else "child never reached the stage"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    builds: list[int] = []

    def build() -> Artifact:
        builds.append(1)
        return Artifact({"kernel.cubin": b"\x7fELF" + bytes(7)}, {"by": "next"})

    art, built = KernelCache(root).get_or_build(KEY, build)
    if stage == "after_rename":
        assert not built and art.meta == {"by": "killed"} and len(art.files["kernel.cubin"]) == 5004
    else:
        assert built and builds == [1] and art.meta == {"by": "next"}
    assert not list((root / "sm_90a").rglob(".tmp-*"))
    again = KernelCache(root).get(KEY)
    assert again is not None and again.files == art.files


def test_reads_take_no_lock(tmp_path, monkeypatch):
    """A hit opens no lock file: an immutable entry that passes its digests needs none."""
    _populate(tmp_path)
    cache = KernelCache(tmp_path)

    def no_lock(key: str) -> int:
        raise AssertionError("a read took a lock")

    monkeypatch.setattr(cache, "_open_lock", no_lock)
    assert cache.get(KEY) is not None
    assert cache.get_or_build(KEY, lambda: Artifact({}, {}))[1] is False


def test_an_unusable_folder_is_still_an_error_not_a_fallback(tmp_path, fallback):
    """A file where the cache folder should be is a mistake to fix, not a read-only cache."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(GemmgenError, match=r"cannot create .*GEMMGEN_CACHE_DIR"):
        KernelCache(blocker).get_or_build(KEY, lambda: Artifact({}, {}))
    assert not fallback.exists()


def test_the_child_helper_reports_a_failing_child():
    with pytest.raises(AssertionError, match="child failed"):
        run_python("raise SystemExit(3)")

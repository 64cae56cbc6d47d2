"""The on-disk kernel cache: content-addressed, per-arch, safe under concurrent processes and faults.

Layout under the root (``$GEMMGEN_CACHE_DIR`` or the user cache dir)::

    sm_90a/ab/ab12...ef/        one entry: artifact files + meta.json (written last)
    sm_90a/ab/.tmp-ab12...-PID-N/   a staged entry being written (never read)
    sm_90a/locks/ab12...ef.lock     the per-key lock file (writers only)

An entry becomes visible only by an atomic rename of a fully written, fsynced folder and is never
changed after, so reading needs no lock: every load checks the files against the digests in
meta.json (and the caller's `check`), and a damaged entry is reported once and not served.
Writers take the key's `flock` and re-check after locking, so N processes asking for one cold key
build it once; a writer killed at any point leaves at most a staged folder, removed by the next
writer of that key (and by the writer itself on any failure it survives).

Faults of real deployments degrade, they do not fail the call:

- a root that cannot be written to (a pre-warmed cache in a read-only image or mount) serves what it
  holds; what it lacks is built into a per-user fallback folder (`env.fallback_cache_dir`), with
  one warning; if that cannot be written either, a GemmgenError before anything is built;
- a build that cannot be stored (a full disk, a quota) is kept in memory for the process, with one
  warning naming the folder and the OS error.

Keys are content digests chosen by the caller; nothing here depends on absolute paths or mtimes,
so a moved cache still hits.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import env
from ..config import DEFAULT_ARCH, Arch
from ..errors import GemmgenError, GemmgenWarning
from .validate import digest_problem, report_damaged

META = "meta.json"
_FORMAT = 1
#: errno values that mean "this folder is not ours to write": serve it, build elsewhere.
_READ_ONLY = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


@dataclass(frozen=True)
class Artifact:
    """What one cache entry holds: named files and a JSON-able metadata dict."""

    files: dict[str, bytes]
    meta: dict = field(default_factory=dict)


#: A check of an entry that passed its digests: None, or what makes it unfit (`validate.kernel_problem`).
Check = Callable[[Artifact], str | None]


def default_root() -> Path:
    return env.cache_dir()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SIBLINGS_LOCK = threading.Lock()


class KernelCache:
    """A disk cache of build artifacts for one arch, with an in-memory layer in front."""

    def __init__(self, root: Path | str | None = None, arch: Arch | str = DEFAULT_ARCH, read_only: bool = False,
                 label: str = "kernel cache") -> None:
        """`read_only` serves a folder nobody writes (a bundle, maybe inside a wheel); `label` names
        the store in reports ("kernel cache", "bundle")."""
        self.root = Path(root) if root is not None else default_root()
        self.arch = Arch.parse(arch)
        self.read_only = read_only
        self.label = label
        self.dir = self.root / self.arch.value
        self._siblings: dict[Arch, KernelCache] = {self.arch: self}
        self._memory: dict[str, Artifact] = {}
        self._mutex = threading.Lock()
        self._fallback: KernelCache | None = None  # set once the root proves unwritable
        #: key -> what was wrong, for each entry found damaged (and not served) by this process
        self.damaged: dict[str, str] = {}
        #: keys built here that could not be stored: held in memory only
        self.unstored: set[str] = set()

    def for_arch(self, arch: Arch) -> KernelCache:
        """The cache of `arch`'s kernels under the same root (its own folder, `sm_100a/` beside
        `sm_90a/`), with the same settings; one object per arch."""
        with _SIBLINGS_LOCK:  # siblings share one dict; each has its own memory layer and mutex
            if arch not in self._siblings:
                sibling = KernelCache(self.root, arch, self.read_only, self.label)
                sibling._siblings = self._siblings
                self._siblings[arch] = sibling
            return self._siblings[arch]

    # ---- paths

    def entry_dir(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def _lock_path(self, key: str) -> Path:
        return self.dir / "locks" / f"{key}.lock"

    # ---- reading

    def _load(self, key: str) -> tuple[Artifact | None, str | None]:
        """(the entry, None) if it is complete and intact; (None, what is wrong) if damaged; (None, None) if absent."""
        d = self.entry_dir(key)
        if not d.is_dir():
            return None, None
        try:
            meta = json.loads((d / META).read_text())
        except FileNotFoundError:
            return None, f"{META} is missing (an entry written by hand, or a damaged copy)"
        except (OSError, ValueError) as e:
            return None, f"{META} is unreadable ({e})"
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("files"), dict) \
                or not isinstance(meta.get("meta"), dict):
            return None, f"{META} is not a format-{_FORMAT} entry record"
        if meta.get("key") != key:
            return None, f"{META} records key {str(meta.get('key'))[:16]}..., not this entry's"
        files = {}
        for name in meta["files"]:
            try:
                files[name] = (d / str(name)).read_bytes()
            except FileNotFoundError:
                return None, f"{name} is missing"
            except OSError as e:
                return None, f"{name} is unreadable ({e.strerror})"
        problem = digest_problem(meta["files"], files)
        return (None, problem) if problem else (Artifact(files, meta["meta"]), None)

    def _read(self, key: str, check: Check | None) -> Artifact | None:
        art, problem = self._load(key)
        if art is not None and check is not None:
            problem = check(art)
            art = None if problem else art
        if problem is not None:
            self.damaged[key] = f"{self.label} entry {self.entry_dir(key)}: {problem}"
            report_damaged(f"{self.label} entry {self.entry_dir(key)}", problem, "not served")
        return art

    def get(self, key: str, check: Check | None = None) -> Artifact | None:
        """The intact entry for `key` (from memory, this root, or the fallback folder), else None."""
        with self._mutex:
            hit = self._memory.get(key)
        if hit is not None:
            return hit
        art = self._read(key, check)
        if art is None:
            fallback = self._fallback or self._existing_fallback()
            art = fallback.get(key, check) if fallback is not None else None
        if art is not None:
            self.keep(key, art)
        return art

    def _existing_fallback(self) -> KernelCache | None:
        """The fallback folder, if an earlier process of this user stored kernels there."""
        path = env.fallback_cache_dir()
        if self.read_only or path == self.root or not (path / self.arch.value).is_dir() or not _private(path):
            return None
        return KernelCache(path, self.arch)

    def keep(self, key: str, art: Artifact) -> None:
        """Hold `art` in memory for this process (a worker's build that could not be stored)."""
        with self._mutex:
            self._memory[key] = art

    # ---- writing

    def get_or_build(self, key: str, build: Callable[[], Artifact], on_wait: Callable[[], None] | None = None,
                     check: Check | None = None) -> tuple[Artifact, bool]:
        """Return (artifact, built_here). `build` runs at most once per key across processes."""
        if self.read_only:
            raise ValueError(f"{self.label} at {self.root} is read-only")
        art = self.get(key, check)
        if art is not None:
            return art, False
        if self._fallback is not None:
            return self._fallback_build(key, build, on_wait, check)
        try:
            lock_fd = self._open_lock(key)
        except OSError as e:
            if e.errno in _READ_ONLY:
                self._fallback = self._fallback_store(e)
                return self._fallback_build(key, build, on_wait, check)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # no room even for a lock: build, keep in memory
                return self._keep_unstored(key, build(), e), True
            raise self._unusable(e) from None
        try:
            if not _try_flock(lock_fd):
                if on_wait is not None:
                    on_wait()
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            art = self._read(key, check)  # someone may have built it while we waited
            built = art is None
            if art is None:
                art = build()
                try:
                    self._publish(key, art)
                except OSError as e:
                    self._keep_unstored(key, art, e)
        finally:
            os.close(lock_fd)  # closing releases the flock
        self.keep(key, art)
        return art, built

    def _fallback_build(self, key: str, build: Callable[[], Artifact], on_wait: Callable[[], None] | None,
                        check: Check | None) -> tuple[Artifact, bool]:
        assert self._fallback is not None
        art, built = self._fallback.get_or_build(key, build, on_wait, check)
        self.keep(key, art)
        if key in self._fallback.unstored:
            self.unstored.add(key)
        return art, built

    def _fallback_store(self, why: OSError) -> KernelCache:
        """The per-user folder this cache's new entries go to, or a GemmgenError if there is none."""
        fallback = env.fallback_cache_dir()
        if fallback == self.root:
            raise self._unusable(why)
        try:
            fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(fallback):
                raise GemmgenError(f"it is not private to this user (owner uid {fallback.stat().st_uid}, mode "
                                   f"{stat.S_IMODE(fallback.stat().st_mode):o}), so it is not used")
            store = KernelCache(fallback, self.arch, label="kernel cache")
            probe = store._open_lock("0" * 64)
            os.close(probe)
        except (OSError, GemmgenError) as e:
            raise GemmgenError(
                f"kernel cache {self.root} cannot be written to ({why.strerror}), nor can the fallback {fallback} "
                f"({e.strerror if isinstance(e, OSError) else e}); what they hold is served, but this kernel must be "
                "compiled: point GEMMGEN_CACHE_DIR at a writable folder, or ship the kernel in a bundle "
                "(GEMMGEN_BUNDLE_PATH)") from None
        warnings.warn(f"gemmgen: kernel cache {self.root} cannot be written to ({why.strerror}): serving what it "
                      f"holds, storing new kernels in {fallback} (set GEMMGEN_CACHE_DIR to choose the folder)",
                      GemmgenWarning, stacklevel=4)
        return store

    def _keep_unstored(self, key: str, art: Artifact, why: OSError) -> Artifact:
        self.unstored.add(key)
        warnings.warn(f"gemmgen: could not store kernel {key[:12]} in {self.label} {self.dir} "
                      f"({why.strerror or why}); keeping it in memory for this process only", GemmgenWarning,
                      stacklevel=4)
        self.keep(key, art)
        return art

    def _unusable(self, e: OSError) -> GemmgenError:
        return GemmgenError(f"{self.label} {self.root}: cannot create {e.filename or self.dir} ({e.strerror}); "
                            "point GEMMGEN_CACHE_DIR at a writable folder")

    def _open_lock(self, key: str) -> int:
        path = self._lock_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)

    def put(self, key: str, art: Artifact) -> None:
        """Store `art` under `key` (replacing a damaged entry); used to write bundles. OS errors propagate."""
        try:
            lock_fd = self._open_lock(key)
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.EEXIST):
                raise self._unusable(e) from None
            raise
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if self._load(key)[0] is None:
                self._publish(key, art)
        finally:
            os.close(lock_fd)

    def _publish(self, key: str, art: Artifact) -> None:
        """Stage, fsync and atomically rename into place; on any failure remove what was staged.
        Caller holds the exclusive lock."""
        final = self.entry_dir(key)
        parent = final.parent
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f".tmp-{key}-*"):  # left by a builder that died holding this lock
            shutil.rmtree(stale, ignore_errors=True)
        for name in art.files:
            if name == META or "/" in name:
                raise ValueError(f"invalid artifact file name {name!r}")
        staged = parent / f".tmp-{key}-{os.getpid()}-{threading.get_ident()}"
        try:
            staged.mkdir()
            for name, data in art.files.items():
                _write(staged / name, data)
            meta = {"format": _FORMAT, "key": key, "files": {n: _sha256(d) for n, d in art.files.items()},
                    "meta": art.meta}
            _write(staged / META, json.dumps(meta, indent=1, sort_keys=True).encode())
            _fsync_dir(staged)
            if final.exists():  # damaged: it failed _load under this same lock
                trash = parent / f".tmp-{key}-{os.getpid()}-old"
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(staged, final)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        _fsync_dir(parent)

    def clear_memory(self) -> None:
        with self._mutex:
            self._memory.clear()


def _private(path: Path) -> bool:
    """Owned by this user and writable by no one else: a folder in a shared /tmp that another user
    made could hold binaries of theirs."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

"""The on-disk kernel cache: content-addressed, per-arch, safe under concurrent processes.

Layout under the root (``$GEMMGEN_CACHE_DIR`` or the user cache dir)::

    sm_90a/ab/ab12...ef/        one entry: artifact files + meta.json (written last)
    sm_90a/ab/.tmp-ab12...-PID-N/   a staged entry being written (never read)
    sm_90a/locks/ab12...ef.lock     the per-key lock file

Readers take the key's lock shared, writers exclusive, and a writer re-checks after locking,
so N processes asking for one cold key build it once. An entry becomes visible only by an
atomic rename of a fully written, fsynced folder, and every load verifies the files against the
digests in meta.json: a truncated or corrupt entry is rebuilt, never served. Locks are
`flock`s, so a process killed while building releases its lock and leaves only a staged
folder, which the next builder removes. Keys are content digests chosen by the caller; nothing
here depends on absolute paths or mtimes, so a moved cache still hits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import env
from ..config import ARCH
from ..errors import GemmgenError

META = "meta.json"
_FORMAT = 1


@dataclass(frozen=True)
class Artifact:
    """What one cache entry holds: named files and a JSON-able metadata dict."""

    files: dict[str, bytes]
    meta: dict = field(default_factory=dict)


def default_root() -> Path:
    return env.cache_dir()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class KernelCache:
    """A disk cache of build artifacts for one arch, with an in-memory layer in front."""

    def __init__(self, root: Path | str | None = None, arch: str = ARCH, read_only: bool = False) -> None:
        """`read_only` serves a folder nobody writes (a bundle, maybe inside a wheel): no lock files."""
        self.root = Path(root) if root is not None else default_root()
        self.arch = arch
        self.read_only = read_only
        self.dir = self.root / arch
        self._memory: dict[str, Artifact] = {}
        self._mutex = threading.Lock()

    # ---- paths

    def entry_dir(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def _lock_path(self, key: str) -> Path:
        return self.dir / "locks" / f"{key}.lock"

    @contextlib.contextmanager
    def _locked(self, key: str, exclusive: bool) -> Iterator[None]:
        path = self._lock_path(key)
        self._make_dir(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # ---- reading

    def _load(self, key: str) -> Artifact | None:
        """The entry for `key` if it is complete and intact, else None."""
        d = self.entry_dir(key)
        try:
            meta = json.loads((d / META).read_text())
            if meta.get("format") != _FORMAT or meta.get("key") != key:
                return None
            files = {}
            for name, digest in meta["files"].items():
                data = (d / name).read_bytes()
                if hashlib.sha256(data).hexdigest() != digest:
                    return None
                files[name] = data
            return Artifact(files, meta["meta"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def get(self, key: str) -> Artifact | None:
        with self._mutex:
            hit = self._memory.get(key)
        if hit is not None:
            return hit
        if not self.entry_dir(key).is_dir():
            return None
        if self.read_only:
            art = self._load(key)
        else:
            with self._locked(key, exclusive=False):
                art = self._load(key)
        if art is not None:
            with self._mutex:
                self._memory[key] = art
        return art

    # ---- writing

    def get_or_build(self, key: str, build: Callable[[], Artifact],
                     on_wait: Callable[[], None] | None = None) -> tuple[Artifact, bool]:
        """Return (artifact, built_here). `build` runs at most once per key across processes."""
        if self.read_only:
            raise ValueError(f"cache at {self.root} is read-only")
        art = self.get(key)
        if art is not None:
            return art, False
        lock_fd = self._try_exclusive(key)
        if lock_fd is None:
            if on_wait is not None:
                on_wait()
            lock_fd = self._exclusive(key)
        try:
            art = self._load(key)  # someone may have built it while we waited
            if art is None:
                art = build()
                self._publish(key, art)
                built = True
            else:
                built = False
        finally:
            os.close(lock_fd)
        with self._mutex:
            self._memory[key] = art
        return art, built

    def _try_exclusive(self, key: str) -> int | None:
        path = self._lock_path(key)
        self._make_dir(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            return None

    def _exclusive(self, key: str) -> int:
        self._make_dir(self._lock_path(key).parent)
        fd = os.open(self._lock_path(key), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def put(self, key: str, art: Artifact) -> None:
        """Store `art` under `key` (replacing a damaged entry); used to write bundles."""
        lock_fd = self._exclusive(key)
        try:
            if self._load(key) is None:
                self._publish(key, art)
        finally:
            os.close(lock_fd)

    def _publish(self, key: str, art: Artifact) -> None:
        """Stage, fsync and atomically rename into place. Caller holds the exclusive lock."""
        final = self.entry_dir(key)
        parent = final.parent
        self._make_dir(parent)
        for stale in parent.glob(f".tmp-{key}-*"):  # left by a builder that died holding this lock
            shutil.rmtree(stale, ignore_errors=True)
        staged = parent / f".tmp-{key}-{os.getpid()}-{threading.get_ident()}"
        staged.mkdir()
        digests = {}
        for name, data in art.files.items():
            if name == META or "/" in name:
                raise ValueError(f"invalid artifact file name {name!r}")
            self._write(staged / name, data)
            digests[name] = hashlib.sha256(data).hexdigest()
        meta = {"format": _FORMAT, "key": key, "files": digests, "meta": art.meta}
        self._write(staged / META, json.dumps(meta, indent=1, sort_keys=True).encode())
        _fsync_dir(staged)
        if final.exists():  # corrupt or partial: it failed _load under this same lock
            trash = parent / f".tmp-{key}-{os.getpid()}-old"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(staged, final)
        _fsync_dir(parent)

    def _make_dir(self, path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GemmgenError(f"kernel cache {self.root}: cannot create {path} ({e.strerror}); point "
                               "GEMMGEN_CACHE_DIR at a writable folder") from None

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def clear_memory(self) -> None:
        with self._mutex:
            self._memory.clear()

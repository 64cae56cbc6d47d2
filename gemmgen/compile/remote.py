"""The remote cache tier: one store shared by many machines, between the local cache and compiling.

Kernel keys are content digests, so a stored kernel is an immutable blob (`blob.pack`) that needs
no cross-machine lock: the interface is `get(name) -> bytes | None` and `put(name, bytes)`, as in
Triton's and Inductor's remote caches. Two backends: Redis (`redis://`, `rediss://`, `unix://`)
and fsspec (`file://`, `s3://`, `gs://`, `memory://`, ...).

What the tier promises (docs/design/deployment.md):

- a hit is unpacked, checked against its key and digests, then validated as the kernel asked for
  (`validate.kernel_problem`); a value that fails is reported once, not served, and replaced by the
  next store of that key;
- a failing backend (down, timing out, full) never fails a call: the first failure warns once and
  turns the tier off for `RETRY_SECONDS`; meanwhile kernels are compiled locally;
- under the local cache's per-key lock (`KernelCache.get_or_build`), so the processes of one
  machine fetch or compile each kernel once between them.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Protocol

from .. import env
from ..errors import GemmgenError, GemmgenWarning, InvalidArgument
from .blob import pack, unpack
from .cache import Artifact, Check
from .validate import report_damaged

#: How long a tier that failed stays off before it is tried again.
RETRY_SECONDS = 60.0
_REDIS_SCHEMES = ("redis", "rediss", "unix")


class RemoteError(GemmgenError):
    """A backend request failed (connection, timeout, a full server): the tier degrades."""


class Backend(Protocol):
    url: str

    def get(self, name: str) -> bytes | None: ...

    def put(self, name: str, data: bytes) -> None: ...


class RedisBackend:
    """Values under `name` in one Redis database; an optional TTL refreshed by each put."""

    def __init__(self, url: str, timeout: float, ttl: int | None = None) -> None:
        try:
            import redis
        except ImportError:
            raise InvalidArgument(f"GEMMGEN_REMOTE_CACHE={url!r} needs the redis client package: "
                                  "pip install 'gemmgen[cluster]' (or pip install redis)") from None
        self.url = url
        self.ttl = ttl
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as e:
            raise InvalidArgument(f"GEMMGEN_REMOTE_CACHE={url!r}: {e}; expected redis://HOST:PORT/DB") from None

    def get(self, name: str) -> bytes | None:
        try:
            value = self._client.get(name)
        except self._errors as e:
            raise RemoteError(f"{type(e).__name__}: {e}") from None
        return value if value is None else bytes(value)  # type: ignore[arg-type]

    def put(self, name: str, data: bytes) -> None:
        try:
            self._client.set(name, data, ex=self.ttl)
        except self._errors as e:
            raise RemoteError(f"{type(e).__name__}: {e}") from None


class FsspecBackend:
    """One file per value under a folder of any fsspec filesystem, written to a temporary name and
    moved into place (atomic on a local or network filesystem; object stores put whole objects).
    Request timeouts are the filesystem's own (fsspec's options for it)."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise InvalidArgument(f"GEMMGEN_REMOTE_CACHE={url!r} needs the fsspec package: "
                                  "pip install 'gemmgen[cluster]' (or pip install fsspec)") from None
        self.url = url
        try:
            self._fs, self._root = fsspec.core.url_to_fs(url)
        except (ValueError, ImportError) as e:
            raise InvalidArgument(f"GEMMGEN_REMOTE_CACHE={url!r}: {e}; expected a URL fsspec knows, "
                                  "such as file:///shared/gemmgen") from None

    def _path(self, name: str) -> str:
        return f"{self._root.rstrip('/')}/{name}"

    def get(self, name: str) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None
        except Exception as e:  # fsspec backends raise their own types (botocore, aiohttp, ...)
            raise RemoteError(f"{type(e).__name__}: {e}") from None

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        staged = f"{path}.tmp-{time.time_ns()}"
        try:
            self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self._fs.pipe_file(staged, data)
            self._fs.mv(staged, path)
        except Exception as e:
            try:
                self._fs.rm_file(staged)
            except Exception:  # best effort: the failure reported is the put's
                pass
            raise RemoteError(f"{type(e).__name__}: {e}") from None


def backend_for(url: str, timeout: float, ttl: int | None = None) -> Backend:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if not scheme:
        raise InvalidArgument(f"GEMMGEN_REMOTE_CACHE={url!r}: expected a URL, such as redis://HOST:6379/0 or "
                              "file:///shared/gemmgen")
    if scheme in _REDIS_SCHEMES:
        return RedisBackend(url, timeout, ttl)
    return FsspecBackend(url)  # its own filesystem's timeouts apply


class RemoteTier:
    """Kernels of one arch in a backend, validated on the way in, failures degraded to a warning."""

    def __init__(self, backend: Backend, arch: str) -> None:
        self.backend = backend
        self.arch = arch
        self._off_until = 0.0
        #: keys whose stored value was refused (reported once each)
        self.refused: set[str] = set()

    def name(self, key: str) -> str:
        return f"gemmgen/{self.arch}/{key}"

    def available(self) -> bool:
        return time.monotonic() >= self._off_until

    def fetch(self, key: str, check: Check | None = None) -> Artifact | None:
        """The valid kernel stored for `key`, else None (a miss, a refused value, or the tier down)."""
        data = self._get(self.name(key), "compiling locally instead")
        if data is None:
            return None
        art, problem = unpack(data, key)
        if art is not None and check is not None:
            problem = check(art)
        if problem is not None:
            self.refused.add(key)
            report_damaged(f"remote cache {self.backend.url} value {self.name(key)}", problem,
                           "not served; it is compiled again and replaced")
            return None
        return art

    def store(self, key: str, art: Artifact) -> None:
        """Put `art` under `key`; a failure warns (once per outage) and never fails the caller."""
        self._put(self.name(key), pack(key, art), "the kernel is kept in the local cache only")

    def get_bytes(self, name: str) -> bytes | None:
        """A value other than a kernel (an autotune table) stored under `gemmgen/NAME`."""
        return self._get(f"gemmgen/{name}", "going on without it")

    def put_bytes(self, name: str, data: bytes) -> bool:
        return self._put(f"gemmgen/{name}", data, "it is not shared")

    def _get(self, name: str, instead: str) -> bytes | None:
        """The backend's value, or None on a miss, while the tier is off, or on a failure (warned)."""
        if not self.available():
            return None
        try:
            return self.backend.get(name)
        except RemoteError as e:
            self._failed("reading", e, instead)
            return None

    def _put(self, name: str, data: bytes, instead: str) -> bool:
        if not self.available():
            return False
        try:
            self.backend.put(name, data)
            return True
        except RemoteError as e:
            self._failed("storing", e, instead)
            return False

    def _failed(self, doing: str, error: RemoteError, instead: str) -> None:
        self._off_until = time.monotonic() + RETRY_SECONDS
        warnings.warn(f"gemmgen: remote cache {self.backend.url} failed {doing} ({error}); {instead}, and the tier "
                      f"is off for {RETRY_SECONDS:.0f} s", GemmgenWarning, stacklevel=4)


def remote_tier(arch: str) -> RemoteTier | None:
    """The tier GEMMGEN_REMOTE_CACHE names (one per setting and arch in a process), or None."""
    url = env.remote_cache_url()
    if url is None:
        return None
    return _tier(url, env.remote_cache_timeout(), env.remote_cache_ttl(), arch)


@functools.cache
def _tier(url: str, timeout: float, ttl: int | None, arch: str) -> RemoteTier:
    return RemoteTier(backend_for(url, timeout, ttl), arch)


class Filling:
    """The build step a local cache runs under its key's lock: the tier's valid copy, else
    `build` (a compile), whose result the tier then stores. `fetched` says which happened."""

    def __init__(self, tier: RemoteTier | None, key: str, build: Callable[[], Artifact],
                 check: Check | None) -> None:
        self.tier, self.key, self.build, self.check = tier, key, build, check
        self.fetched = False

    def __call__(self) -> Artifact:
        if self.tier is not None:
            art = self.tier.fetch(self.key, self.check)
            if art is not None:
                self.fetched = True
                return art
        art = self.build()
        if self.tier is not None:
            self.tier.store(self.key, art)
        return art

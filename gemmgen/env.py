"""Every `GEMMGEN_*` environment variable gemmgen reads, read here and nowhere else.

Each is read when it is used, not at import, so a process (or a test) that sets one later is
heard. `VARIABLES` documents them; docs/deployment.md's table and the CLI's help list it.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidArgument


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # how the default reads in the docs
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("GEMMGEN_CACHE_DIR", "$XDG_CACHE_HOME/gemmgen or ~/.cache/gemmgen",
             "the kernel cache's root (one folder per arch inside); if it cannot be written to, what it holds "
             "is served and new kernels go to $TMPDIR/gemmgen-cache-UID"),
    Variable("GEMMGEN_BUNDLE_PATH", "(none)",
             "ahead-of-time bundles to search before the cache, separated by ':'"),
    Variable("GEMMGEN_TUNING_PATH", "(none)",
             "autotune tables (`gemmgen tune` output) to register, separated by ':'; remote:NAME is a table "
             "in the remote cache tier"),
    Variable("GEMMGEN_JIT", "1",
             "1: a call whose kernel no bundle or cache holds waits for its compile; 0 (or false, no, off) "
             "forbids compiling at run time (lazy first calls, warm-up, autotune): such a kernel raises "
             "gemmgen.KernelNotAvailable; async: it compiles in a background process while the calls run the "
             "recipe unfused in torch (waiting instead under CUDA-graph capture and deterministic mode). "
             "`gemmgen build`, `gemmgen inspect` and gemmgen.build_bundle compile regardless"),
    Variable("GEMMGEN_REMOTE_CACHE", "(none)",
             "a remote cache tier between the local cache and compiling: redis://HOST:PORT/DB (rediss:// for TLS) "
             "or an fsspec URL (file:///shared/gemmgen, s3://bucket/prefix, ...); hits are validated, misses "
             "compiled and stored there"),
    Variable("GEMMGEN_REMOTE_CACHE_TTL", "(none: values are kept)",
             "seconds a kernel stored in a Redis tier lives (refreshed by each store)"),
    Variable("GEMMGEN_REMOTE_CACHE_TIMEOUT", "5",
             "seconds one remote-cache request may take before the tier is treated as down for a minute"),
    Variable("GEMMGEN_DISTRIBUTED", "1",
             "0 (or false, no, off) makes gemmgen.warmup ignore an initialised torch.distributed default group "
             "(each process then compiles what it lacks itself)"),
    Variable("GEMMGEN_WARMUP_TIMEOUT", "3600",
             "seconds a distributed warm-up waits for the slowest rank (its compiles included) before failing"),
    Variable("GEMMGEN_DEBUG_DIR", "the system's temporary folder",
             "where the source of a kernel NVRTC rejected is written (under gemmgen-failed/)"),
    Variable("GEMMGEN_NVTX", "0",
             "1 (or true, yes, on): each launch in an NVTX range naming its recipe, config and problem, for "
             "Nsight Systems and Nsight Compute (read at the process's first launch; "
             "gemmgen.runtime.nvtx.enable() switches it later); 0: no range, no cost"),
    Variable("GEMMGEN_LAUNCH_LOG", "(none)",
             "a file each launch appends one JSON line to (its kernel, config, problem and process; read at the "
             "process's first launch): what `gemmgen profile` pairs with Nsight Compute's measurements"),
)


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _paths(name: str) -> list[str]:
    return [p for p in (_get(name) or "").split(os.pathsep) if p]


def cache_dir() -> Path:
    """GEMMGEN_CACHE_DIR, else the user's cache folder."""
    explicit = _get("GEMMGEN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemmgen"


def fallback_cache_dir() -> Path:
    """Where a cache that cannot be written to stores what it compiles: a per-user folder under the
    system's temporary folder (TMPDIR)."""
    return Path(_tempdir()) / f"gemmgen-cache-{os.getuid()}"


def bundle_path_setting() -> str:
    """GEMMGEN_BUNDLE_PATH as set (bundles are cached by this string)."""
    return _get("GEMMGEN_BUNDLE_PATH") or ""


def bundle_paths() -> list[str]:
    return _paths("GEMMGEN_BUNDLE_PATH")


def tuning_paths() -> list[str]:
    """The entries of GEMMGEN_TUNING_PATH; `remote:NAME` (a table in the remote tier) is one entry
    although ':' separates them."""
    parts, out = _paths("GEMMGEN_TUNING_PATH"), []
    while parts:
        part = parts.pop(0)
        out.append(f"{part}:{parts.pop(0)}" if part == "remote" and parts else part)
    return out


class JitMode(enum.Enum):
    """What a call does when no bundle or cache holds its kernel (GEMMGEN_JIT)."""

    WAIT = "1"  # compile it, the call waiting
    OFF = "0"  # raise KernelNotAvailable
    ASYNC = "async"  # compile it in the background, running the recipe unfused meanwhile


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def jit_mode() -> JitMode:
    """GEMMGEN_JIT: 1 (the default), 0 or async."""
    value = (_get("GEMMGEN_JIT") or "1").strip().lower()
    if value in _OFF:
        return JitMode.OFF
    if value in _ON:
        return JitMode.WAIT
    if value == JitMode.ASYNC.value:
        return JitMode.ASYNC
    raise InvalidArgument(f"GEMMGEN_JIT={value!r}: expected 1 (compile on first use), 0 (never compile at run "
                          "time) or async (compile in the background, running unfused meanwhile)")


def jit_enabled() -> bool:
    """Whether a kernel may be compiled at run time (GEMMGEN_JIT is not 0): every kernel must
    otherwise come from a bundle, the cache or the remote tier."""
    return jit_mode() is not JitMode.OFF


def remote_cache_url() -> str | None:
    return _get("GEMMGEN_REMOTE_CACHE")


def remote_cache_ttl() -> int | None:
    if _get("GEMMGEN_REMOTE_CACHE_TTL") is None:
        return None
    return max(1, round(_seconds("GEMMGEN_REMOTE_CACHE_TTL", 0.0)))


def remote_cache_timeout() -> float:
    return _seconds("GEMMGEN_REMOTE_CACHE_TIMEOUT", 5.0)


def distributed_enabled() -> bool:
    return _flag("GEMMGEN_DISTRIBUTED")


def warmup_timeout() -> float:
    return _seconds("GEMMGEN_WARMUP_TIMEOUT", 3600.0)


def nvtx_enabled() -> bool:
    """GEMMGEN_NVTX: 0 (the default) or 1."""
    value = (_get("GEMMGEN_NVTX") or "0").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise InvalidArgument(f"GEMMGEN_NVTX={value!r}: expected 1 (name each launch in an NVTX range) or 0")


def launch_log() -> Path | None:
    """GEMMGEN_LAUNCH_LOG: the launch log's path, if any."""
    value = _get("GEMMGEN_LAUNCH_LOG")
    return Path(value) if value else None


def _flag(name: str) -> bool:
    return (_get(name) or "1").strip().lower() not in ("0", "false", "no", "off")


def _seconds(name: str, default: float) -> float:
    value = _get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InvalidArgument(f"{name}={value!r}: expected a positive number of seconds, e.g. {name}=30; "
                              f"unset it for the default")
    return seconds


def debug_dir() -> Path:
    return Path(_get("GEMMGEN_DEBUG_DIR") or _tempdir())


def _tempdir() -> str:
    import tempfile

    return tempfile.gettempdir()

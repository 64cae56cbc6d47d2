"""Ahead-of-time bundles, read side: compiled kernels shipped with a model, found before the cache.

A bundle is a folder (relocatable: nothing in it names a path) holding a manifest and, per
kernel, its cubin, generated source and metadata, laid out like a cache for one arch and keyed
by the kernel's *source key*: a digest of the generated source, the arch and gemmgen's version.
Computing that key needs no NVRTC and no headers, so a bundle hit compiles nothing and loads
nothing but the cubin. Bundles are found in $GEMMGEN_BUNDLE_PATH (os.pathsep-separated) and in
folders given to `add_bundle`. A bundle may ship autotune results (`TUNING`), which
`gemmgen.tuning` registers. `gemmgen.aot.bundle` writes them.

A `GEMMGEN_BUNDLE_PATH` entry that is not a readable bundle for this arch is a warning (once per
setting), not a failure of every load: the other bundles and the cache still serve. A bundle
named to `add_bundle` must be one (a GemmgenError otherwise). Entries are checked like the cache's
(digests, then the caller's check) and a damaged one is reported once and skipped.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

from .. import env
from .._version import __version__
from ..codegen import GeneratedKernel
from ..config import ARCH
from ..errors import GemmgenError, GemmgenWarning
from ..ir import content_key
from .cache import Artifact, Check, KernelCache

MANIFEST = "manifest.json"
TUNING = "tuning.json"  # autotune results shipped with the kernels (gemmgen.tuning)
FORMAT = 1


def source_key(kernel: GeneratedKernel, arch: str = ARCH) -> str:
    """What identifies a kernel binary without a toolchain: source, arch, gemmgen version."""
    return content_key({"source": kernel.source, "arch": arch, "gemmgen": __version__})


class Bundle:
    def __init__(self, path: Path | str, arch: str = ARCH) -> None:
        self.path = Path(path)
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise GemmgenError(f"{self.path} is not a gemmgen bundle (no readable {MANIFEST}): {e}") from None
        built_for = self.manifest.get("arch")
        if built_for != arch:
            raise GemmgenError(f"bundle {self.path} was built for {built_for}; this process runs {arch} kernels. "
                               f"Rebuild it with `gemmgen build RECIPES.py --arch {arch} --out DIR`")
        self._store = KernelCache(self.path, arch, read_only=True, label="bundle")

    @property
    def tuning(self) -> Path | None:
        """The autotune results the bundle ships, if any."""
        path = self.path / TUNING
        return path if path.is_file() else None

    def get(self, key: str, check: Check | None = None) -> Artifact | None:
        return self._store.get(key, check)

    def damaged(self, key: str) -> str | None:
        """What was wrong with this bundle's entry for `key`, if this process found it damaged."""
        return self._store.damaged.get(key)

    def __len__(self) -> int:
        return len(self.manifest.get("kernels", []))


_LOCK = threading.Lock()
_ADDED: list[Bundle] = []
_FROM_ENV: dict[str, list[Bundle]] = {}


def add_bundle(path: Path | str) -> Bundle:
    """Search this bundle (before the cache) for every kernel this process builds."""
    bundle = Bundle(path)
    with _LOCK:
        _ADDED.append(bundle)
    return bundle


def bundles() -> list[Bundle]:
    """Every bundle this process searches: those added, then $GEMMGEN_BUNDLE_PATH's."""
    setting = env.bundle_path_setting()
    with _LOCK:
        if setting not in _FROM_ENV:
            _FROM_ENV[setting] = _readable(env.bundle_paths())
        return [*_ADDED, *_FROM_ENV[setting]]


def _readable(paths: list[str]) -> list[Bundle]:
    found = []
    for path in paths:
        try:
            found.append(Bundle(path))
        except GemmgenError as e:
            warnings.warn(f"gemmgen: GEMMGEN_BUNDLE_PATH entry skipped: {e}", GemmgenWarning, stacklevel=4)
    return found


def find(key: str, check: Check | None = None) -> Artifact | None:
    for b in bundles():
        art = b.get(key, check)
        if art is not None:
            return art
    return None


def damaged(key: str) -> list[str]:
    """What was wrong with each bundle entry for `key` this process found damaged (and skipped)."""
    return [d for d in (b.damaged(key) for b in bundles()) if d is not None]

"""Ahead-of-time bundles, read side: compiled kernels shipped with a model, found before the cache.

A bundle is a folder (relocatable: nothing in it names a path) holding a manifest and, per
kernel, its cubin, generated source and metadata, laid out like a cache (a folder per arch: one
bundle may hold sm_90a and sm_100a kernels) and keyed by the kernel's *source key*: a digest of
the generated source, the arch and gemmgen's version.
Computing that key needs no NVRTC and no headers, so a bundle hit compiles nothing and loads
nothing but the cubin. Bundles are found in $GEMMGEN_BUNDLE_PATH (os.pathsep-separated) and in
folders given to `add_bundle`. A bundle may ship autotune results (`TUNING`), which
`gemmgen.tuning` registers. `gemmgen.aot.bundle` writes them.

A `GEMMGEN_BUNDLE_PATH` entry that is not a readable bundle is a warning (once per
setting), not a failure of every load: the other bundles and the cache still serve. A bundle
named to `add_bundle` must be one (a GemmgenError otherwise). Entries are checked like the cache's
(digests, then the caller's check) and a damaged one is reported once and skipped.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Protocol

from .. import env
from .._version import __version__
from ..config import Arch
from ..errors import GemmgenError, GemmgenWarning
from ..ir import content_key
from .cache import Artifact, Check, KernelCache

MANIFEST = "manifest.json"
TUNING = "tuning.json"  # autotune results shipped with the kernels (gemmgen.tuning)
FORMAT = 2  # 2: "arches" (a list) and each kernel's "arch"; 1: one "arch" for every kernel


class Source(Protocol):
    """A kernel's generated source and arch: a GEMM's (`GeneratedKernel`) or a cast-transpose's."""

    @property
    def source(self) -> str: ...
    @property
    def arch(self) -> Arch: ...


def source_key(kernel: Source) -> str:
    """What identifies a kernel binary without a toolchain: source, arch, gemmgen version."""
    return content_key({"source": kernel.source, "arch": kernel.arch.value, "gemmgen": __version__})


def manifest_arches(manifest: dict) -> list[str]:
    """The arches a manifest's kernels are built for (format 1 names one)."""
    arches = manifest.get("arches", [manifest.get("arch")] if "arch" in manifest else [])
    if not isinstance(arches, list) or not all(isinstance(a, str) for a in arches):
        raise ValueError(f"its arches are {arches!r}, not a list of names")
    return arches


class Bundle:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
            names = manifest_arches(self.manifest)
        except (OSError, ValueError) as e:
            raise GemmgenError(f"{self.path} is not a gemmgen bundle (no readable {MANIFEST}): {e}") from None
        self.arches = [a for a in Arch if a.value in names]
        if names and not self.arches:
            raise GemmgenError(f"bundle {self.path} holds kernels for {', '.join(names) or 'no arch'}, none of which "
                               f"this gemmgen builds ({', '.join(a.value for a in Arch)}); rebuild it with "
                               "`gemmgen build RECIPES.py --arch ARCH --out DIR`")
        self._stores = {a: KernelCache(self.path, a, read_only=True, label="bundle") for a in self.arches}

    @property
    def tuning(self) -> Path | None:
        """The autotune results the bundle ships, if any."""
        path = self.path / TUNING
        return path if path.is_file() else None

    def get(self, key: str, arch: Arch, check: Check | None = None) -> Artifact | None:
        store = self._stores.get(arch)
        return store.get(key, check) if store is not None else None

    def damaged(self, key: str) -> str | None:
        """What was wrong with this bundle's entry for `key`, if this process found it damaged."""
        return next((d for d in (s.damaged.get(key) for s in self._stores.values()) if d is not None), None)

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


def find(key: str, arch: Arch, check: Check | None = None) -> Artifact | None:
    for b in bundles():
        art = b.get(key, arch, check)
        if art is not None:
            return art
    return None


def other_arches(arch: Arch) -> list[tuple[Path, list[Arch]]]:
    """The bundles this process searches that hold no `arch` kernels, with the arches they hold:
    what a KernelNotAvailable names."""
    return [(b.path, b.arches) for b in bundles() if arch not in b.arches]


def damaged(key: str) -> list[str]:
    """What was wrong with each bundle entry for `key` this process found damaged (and skipped)."""
    return [d for d in (b.damaged(key) for b in bundles()) if d is not None]

"""Ahead-of-time bundles: compiled kernels shipped with a model, found before the cache.

A bundle is a folder (relocatable: nothing in it names a path) holding a manifest and, per
kernel, its cubin, generated source and metadata, laid out like a cache for one arch and keyed
by the kernel's *source key*: a digest of the generated source, the arch and gemmgen's version.
Computing that key needs no NVRTC and no headers, so a bundle hit compiles nothing and loads
nothing but the cubin. Bundles are found in $GEMMGEN_BUNDLE_PATH (os.pathsep-separated) and in
folders given to `gemmgen.add_bundle`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__
from .codegen import GeneratedKernel
from .compile.cache import Artifact, KernelCache
from .compile.toolchain import ARCH
from .errors import GemmgenError
from .ir import content_key

if TYPE_CHECKING:
    from .build import CompiledKernel
    from .tuning import TuningTable

MANIFEST = "manifest.json"
TUNING = "tuning.json"  # autotune results shipped with the kernels (gemmgen.tuning)
_FORMAT = 1


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
        self._store = KernelCache(self.path, arch, read_only=True)
        if (self.path / TUNING).is_file():
            from .tuning import add_tuning

            add_tuning(self.path / TUNING)

    def get(self, key: str) -> Artifact | None:
        return self._store.get(key)

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
    env = os.environ.get("GEMMGEN_BUNDLE_PATH", "")
    with _LOCK:
        if env not in _FROM_ENV:
            _FROM_ENV[env] = [Bundle(p) for p in env.split(os.pathsep) if p]
        return [*_ADDED, *_FROM_ENV[env]]


def find(key: str) -> Artifact | None:
    for b in bundles():
        art = b.get(key)
        if art is not None:
            return art
    return None


def write_bundle(kernels: list[CompiledKernel], out: Path | str, cache: KernelCache,
                 shapes: dict | None = None, tuning: TuningTable | None = None) -> Path:
    """Write `kernels` (already built through `cache`) as a bundle in `out`; `shapes` records
    which config serves which problem shape, per recipe; `tuning` (a gemmgen.tuning.TuningTable)
    ships autotune results, registered whenever the bundle is."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if out.exists() else e.strerror
        raise GemmgenError(f"bundle folder {out}: cannot create it ({why}); write the bundle to a writable "
                           "folder (gemmgen build --out DIR)") from None
    if tuning is not None:
        tuning.save(out / TUNING)
    store = KernelCache(out, ARCH)
    entries: dict[str, dict] = {}  # by kernel key: configs differing only in launch arguments share one
    for k in kernels:
        art = cache.get(k.cache_key) if k.origin != "bundle" else find(k.cache_key)
        if art is None:
            raise GemmgenError(f"{k.entry}: not in the cache it was built with; build it again")
        key = source_key(k.generated)
        if key in entries:
            continue
        store.put(key, art)
        entries[key] = {"recipe": k.recipe.name, "recipe_key": k.recipe.key, "config": k.config.binary().name,
                        "kernel_key": key, "entry": k.entry}
    manifest = {"format": _FORMAT, "arch": ARCH, "gemmgen": __version__, "kernels": list(entries.values()),
                "shapes": shapes or {}}
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    for lock in (out / ARCH / "locks").glob("*.lock"):  # a bundle is read-only: no lock files ship
        lock.unlink()
    (out / ARCH / "locks").rmdir()
    return out

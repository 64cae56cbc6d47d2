"""Writing ahead-of-time bundles (the read side is `compile.bundles`), and `add_bundle`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from .._version import __version__
from ..compile import Artifact, CompiledKernel, KernelCache
from ..compile.bundles import FORMAT, MANIFEST, TUNING, Bundle, find, source_key
from ..compile.bundles import add_bundle as _search_bundle
from ..compile.quantize import CompiledQuantizeKernel
from ..config import Arch
from ..errors import GemmgenError
from ..tuning import TuningTable, add_tuning


def add_bundle(path: Path | str) -> Bundle:
    """Search this bundle (before the cache) for every kernel this process builds, and register the
    autotune results it ships."""
    bundle = _search_bundle(path)
    if bundle.tuning is not None:
        add_tuning(bundle.tuning)
    return bundle


def write_bundle(kernels: list[CompiledKernel], out: Path | str, cache: KernelCache,
                 shapes: dict | None = None, tuning: TuningTable | None = None,
                 quantize_kernels: Sequence[CompiledQuantizeKernel] = ()) -> Path:
    """Write `kernels` (already built through `cache`) as a bundle in `out`; `shapes` records
    which config serves which problem shape, per recipe; `tuning` (a gemmgen.tuning.TuningTable)
    ships autotune results, registered whenever the bundle is; `quantize_kernels` are the
    quantize kernels (cast-transpose, amax) a low-precision training step launches, built
    through `cache` too.

    The bundle is written beside `out` and renamed into place, replacing a bundle (or an empty
    folder) there: a failure (a full disk) leaves no partial bundle and raises a GemmgenError."""
    out = Path(out)
    _check_replaceable(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GemmgenError(f"bundle folder {out}: cannot create {out.parent} ({e.strerror}); write the bundle to a "
                           "writable folder (gemmgen build --out DIR)") from None
    staged = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        _write_into(staged, kernels, cache, shapes, tuning, quantize_kernels)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(staged, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staged, out)
    except OSError as e:
        shutil.rmtree(staged, ignore_errors=True)
        where = f" ({e.filename})" if e.filename else ""
        raise GemmgenError(f"bundle {out}: cannot write it: {e.strerror or e}{where}; nothing was written. Free "
                           "space there or write the bundle elsewhere (gemmgen build --out DIR)") from None
    return out


def _check_replaceable(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise GemmgenError(f"bundle folder {out}: cannot create it (a file is in the way); write the bundle to a "
                           "folder (gemmgen build --out DIR)")
    if any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise GemmgenError(f"bundle folder {out} holds files but no bundle ({MANIFEST}); a bundle replaces its "
                           "folder whole, so name a new or empty folder, or an earlier bundle")


def _write_into(folder: Path, kernels: list[CompiledKernel], cache: KernelCache, shapes: dict | None,
                tuning: TuningTable | None, quantize_kernels: Sequence[CompiledQuantizeKernel]) -> None:
    if tuning is not None:
        tuning.save(folder / TUNING)
    store = KernelCache(folder, label="bundle")  # a folder per arch (`for_arch`)
    entries: dict[str, dict] = {}  # by kernel key: configs differing only in launch arguments share one
    for k in kernels:
        arch, key = k.config.arch, source_key(k.generated)
        if key not in entries:
            store.for_arch(arch).put(key, _built(cache, arch, k.cache_key, k.origin, k.entry))
            entries[key] = {"recipe": k.recipe.name, "recipe_key": k.recipe.key, "config": k.config.binary().name,
                            "arch": arch.value, "kernel_key": key, "entry": k.entry}
    for q in quantize_kernels:
        arch, key = q.kernel.arch, source_key(q.kernel)
        if key not in entries:
            store.for_arch(arch).put(key, _built(cache, arch, q.cache_key, q.origin, q.entry))
            entries[key] = {"kind": "quantize", "spec": q.kernel.spec.name, "arch": arch.value,
                            "kernel_key": key, "entry": q.entry}
    arches = sorted({e["arch"] for e in entries.values()})
    manifest = {"format": FORMAT, "arches": arches, "gemmgen": __version__, "kernels": list(entries.values()),
                "shapes": shapes or {}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for arch in arches:  # a bundle is read-only: no lock files ship
        locks = folder / arch / "locks"
        for lock in locks.glob("*.lock"):
            lock.unlink()
        locks.rmdir()


def _built(cache: KernelCache, arch: Arch, key: str, origin: str, entry: str) -> Artifact:
    """A built kernel's binary, from the cache it was built through (or the bundle it came from)."""
    art = cache.for_arch(arch).get(key) if origin != "bundle" else find(key, arch)
    if art is None:
        raise GemmgenError(f"{entry} ({arch.value}): not in the cache it was built with; build it again")
    return art

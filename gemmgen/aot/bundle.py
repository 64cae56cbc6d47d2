"""Writing ahead-of-time bundles (the read side is `compile.bundles`), and `add_bundle`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._version import __version__
from ..compile import CompiledKernel, KernelCache
from ..compile.bundles import FORMAT, MANIFEST, TUNING, Bundle, find, source_key
from ..compile.bundles import add_bundle as _search_bundle
from ..config import ARCH
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
    manifest = {"format": FORMAT, "arch": ARCH, "gemmgen": __version__, "kernels": list(entries.values()),
                "shapes": shapes or {}}
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    for lock in (out / ARCH / "locks").glob("*.lock"):  # a bundle is read-only: no lock files ship
        lock.unlink()
    (out / ARCH / "locks").rmdir()
    return out

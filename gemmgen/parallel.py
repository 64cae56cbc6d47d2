"""Compiling many kernels at once in worker processes, with progress on stderr."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from pathlib import Path

from .build import KernelReport, build_kernel
from .compile.cache import KernelCache

NVRTC_PEAK_BYTES = 3_600_000_000  # one NVRTC compile of a CUTLASS sm90 kernel peaks near 3.4 GB


def default_jobs() -> int:
    """Workers that fit both the cores and the available memory."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        by_memory = max(1, avail // NVRTC_PEAK_BYTES)
    except (OSError, StopIteration):
        by_memory = cores
    return max(1, min(cores, by_memory))


def _worker(recipes_path: str, attr: str, cache_root: str, arch: str) -> KernelReport:
    from .recipes_file import load_recipes

    recipe = load_recipes(recipes_path)[attr]
    return build_kernel(recipe, recipe.default_config(), KernelCache(cache_root, arch)).report


def build_file(recipes_path: str | Path, cache: KernelCache, jobs: int | None = None,
               quiet: bool = False) -> list[KernelReport]:
    """Build every recipe of a file in parallel; return reports in the file's order."""
    from .recipes_file import load_recipes

    recipes = load_recipes(recipes_path)
    jobs = max(1, min(jobs or default_jobs(), len(recipes)))
    out: dict[str, KernelReport] = {}
    start = time.perf_counter()

    def progress(attr: str, rep: KernelReport) -> None:
        if quiet:
            return
        done, total = len(out), len(recipes)
        bar = ("#" * (20 * done // total)).ljust(20)
        elapsed = time.perf_counter() - start
        eta = elapsed / done * (total - done)
        what = "cached" if rep.cached else f"compiled in {rep.compile_seconds:.1f}s"
        print(f"[{bar}] {done}/{total} {attr}: {what}  (elapsed {elapsed:.0f}s, eta {eta:.0f}s)",
              file=sys.stderr, flush=True)

    if not quiet:
        print(f"gemmgen: building {len(recipes)} kernel(s) from {Path(recipes_path).name} with {jobs} worker(s)",
              file=sys.stderr, flush=True)
    if jobs == 1:
        for attr, r in recipes.items():
            out[attr] = build_kernel(r, r.default_config(), cache).report
            progress(attr, out[attr])
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold torch/CUDA state
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_worker, str(Path(recipes_path).resolve()), attr, str(cache.root), cache.arch): attr
                       for attr in recipes}
            for fut in cf.as_completed(futures):
                attr = futures[fut]
                out[attr] = fut.result()
                progress(attr, out[attr])
    return [out[attr] for attr in recipes]

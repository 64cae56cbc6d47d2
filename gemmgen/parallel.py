"""Compiling many kernels at once: worker processes sized to cores and memory, progress on stderr.

Workers receive generated kernels (plain data) and compile them into the shared cache under its
per-key locks, so concurrent warm-ups in several processes compile each kernel once between
them, and an interrupted warm-up resumes where it stopped (what is cached is not compiled again).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .build import CompiledKernel, KernelReport, build_kernel, cache_key, default_cache, report_table
from .codegen import GeneratedKernel, render_kernel
from .compile.cache import KernelCache
from .config import KernelConfig
from .errors import InvalidArgument

if TYPE_CHECKING:
    from .dsl import Recipe
    from .tuning import TuningTable

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


def _compile_in_worker(kernel: GeneratedKernel, key: str, root: str, arch: str) -> bool:
    from .build import _compile_artifact

    def waiting() -> None:
        print(f"gemmgen: waiting for another process compiling {kernel.entry} ({key[:12]})", file=sys.stderr,
              flush=True)

    _, built = KernelCache(root, arch).get_or_build(key, lambda: _compile_artifact(kernel, key), on_wait=waiting)
    return built


def _pairs(items: Iterable[Recipe | tuple[Recipe, KernelConfig]]) -> list[tuple[Recipe, KernelConfig]]:
    from .dsl import Recipe

    out = []
    for item in items:
        recipe, config = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
        if not isinstance(recipe, Recipe):
            raise InvalidArgument(f"items: expected gemmgen.Recipe objects or (Recipe, KernelConfig) pairs, "
                                  f"got {item!r}")
        out.append((recipe, config or recipe.default_config()))
    return out


def build_many(items: Iterable[Recipe | tuple[Recipe, KernelConfig]], cache: KernelCache | None = None,
               jobs: int | None = None, quiet: bool = False) -> list[CompiledKernel]:
    """Build recipes (with their default config, or given (recipe, config) pairs) in parallel."""
    from . import bundle

    cache = cache or default_cache()
    pairs = _pairs(items)
    rendered = [render_kernel(r.ir, c) for r, c in pairs]  # every config error before any compile
    todo: dict[str, tuple[int, GeneratedKernel]] = {}
    for i, k in enumerate(rendered):
        if bundle.find(bundle.source_key(k)) is None:
            key = cache_key(k)
            if key not in todo and cache.get(key) is None:
                todo[key] = (i, k)
    compiled_here: set[str] = set()
    if todo:
        jobs = max(1, min(jobs or default_jobs(), len(todo)))
        start = time.perf_counter()
        if not quiet:
            print(f"gemmgen: compiling {len(todo)} of {len(pairs)} kernel(s) with {jobs} worker(s)",
                  file=sys.stderr, flush=True)

        def progress(n: int, key: str, built: bool) -> None:
            if built:
                compiled_here.add(key)
            if not quiet:
                i, k = todo[key]
                elapsed = time.perf_counter() - start
                bar = ("#" * (20 * n // len(todo))).ljust(20)
                what = "compiled" if built else "compiled elsewhere"
                eta = elapsed / n * (len(todo) - n)
                print(f"[{bar}] {n}/{len(todo)} {pairs[i][0].name} {k.config.name}: {what}  "
                      f"(elapsed {elapsed:.0f}s, eta {eta:.0f}s)", file=sys.stderr, flush=True)

        if jobs == 1:  # in this process: no worker start-up
            for n, (key, (_, k)) in enumerate(todo.items(), 1):
                progress(n, key, _compile_in_worker(k, key, str(cache.root), cache.arch))
        else:
            ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold torch/CUDA state
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                futures = {pool.submit(_compile_in_worker, k, key, str(cache.root), cache.arch): key
                           for key, (_, k) in todo.items()}
                for n, fut in enumerate(cf.as_completed(futures), 1):
                    progress(n, futures[fut], fut.result())
    out = []
    for recipe, config in pairs:
        built = build_kernel(recipe, config, cache)
        out.append(_as_compiled_here(built) if built.cache_key in compiled_here else built)
    return out


def _as_compiled_here(k: CompiledKernel) -> CompiledKernel:
    from dataclasses import replace

    return replace(k, origin="compiled", report=replace(k.report, cached=False, origin="compiled"))


def build_file(recipes_path: str | Path, cache: KernelCache, jobs: int | None = None,
               quiet: bool = False) -> list[KernelReport]:
    """Build every recipe of a file in parallel; return reports in the file's order."""
    from .recipes_file import load_recipes

    return [k.report for k in build_many(load_recipes(recipes_path).values(), cache, jobs, quiet)]


def warmup(items: Iterable[Recipe | tuple[Recipe, KernelConfig]], shapes: dict | None = None,
           jobs: int | None = None, cache: KernelCache | None = None, quiet: bool = False) -> list[CompiledKernel]:
    """Make every kernel loadable before the first call (at model load): compile what no bundle or
    cache holds, in parallel, and print a table of what was compiled and what was found.

    `shapes` ({recipe name: [[M, N, K], ...]}) builds, per recipe, the configs the heuristic picks
    for those problems (gemmgen.select) instead of each recipe's default config."""
    if shapes is not None:
        from .select import configs_for_shapes

        if not isinstance(shapes, dict):
            raise InvalidArgument(f"shapes: expected {{recipe name: [[M, N, K], ...]}}, got {type(shapes).__name__}")

        recipes = {r.name: r for r in items if not isinstance(r, tuple)}
        chosen = configs_for_shapes(recipes, shapes)
        items = list(dict.fromkeys((recipes[n], c.config) for n, rows in chosen.items() for _, c in rows))
    kernels = build_many(items, cache, jobs, quiet)
    if not quiet:
        print(report_table([k.report for k in kernels]), file=sys.stderr, flush=True)
    return kernels


def with_tuned_winners(pairs: list[tuple[Recipe, KernelConfig]], tuning: TuningTable | None,
                       recipes: Iterable[Recipe] | None = None) -> list[tuple[Recipe, KernelConfig]]:
    """`pairs` plus the binary of every config `tuning` records as a winner (on any device) for one
    of `recipes` (default: the pairs' recipes), each once: what a bundle shipping those results
    must hold."""
    if tuning is None:
        return pairs
    recipes = list(dict.fromkeys(recipes if recipes is not None else (r for r, _ in pairs)))
    return list(dict.fromkeys([*pairs, *((r, c.binary()) for r in recipes for c in tuning.configs(r.key))]))


def build_bundle(items: Iterable[Recipe | tuple[Recipe, KernelConfig]], out: str | Path,
                 tuning: str | Path | TuningTable | None = None, jobs: int | None = None,
                 cache: KernelCache | None = None, quiet: bool = False) -> list[CompiledKernel]:
    """Build `items` (recipes, or (recipe, config) pairs) and write them to `out` as a bundle: the
    ahead-of-time path for a model's kernels, as `gemmgen build --out` is for a recipes file, e.g.
    `gemmgen.build_bundle(gemmgen.nn.model_launches(model, (1, 16, 4096)), "dist/gemmgen")`.
    `tuning` (autotune results: a file or a table) ships in the bundle, with every winner it
    records for the items' recipes built in."""
    from .bundle import write_bundle
    from .tuning import TuningTable

    table = TuningTable.load(tuning) if isinstance(tuning, str | Path) else tuning
    cache = cache or default_cache()
    kernels = build_many(with_tuned_winners(_pairs(items), table), cache, jobs, quiet)
    where = write_bundle(kernels, out, cache, tuning=table)
    if not quiet:
        print(report_table([k.report for k in kernels]), file=sys.stderr)
        print(f"gemmgen: wrote a bundle of {len({k.cache_key for k in kernels})} kernel(s) to {where}; use it with "
              f"GEMMGEN_BUNDLE_PATH={where} or gemmgen.add_bundle()", file=sys.stderr, flush=True)
    return kernels

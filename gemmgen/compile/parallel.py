"""Compiling many kernels at once: worker processes sized to cores and memory, progress on stderr.

Workers receive generated kernels (plain data) and compile them into the shared cache under its
per-key locks, so concurrent warm-ups in several processes compile each kernel once between
them, and an interrupted warm-up resumes where it stopped (what is cached is not compiled again).
A kernel a worker could not store (a full disk) comes back to this process and is kept in memory.

`allow_compile=None` follows GEMMGEN_JIT (warm-up at model load, autotune); the explicit
ahead-of-time builds (`gemmgen build`, `gemmgen.build_bundle`) pass True: building is what they are.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import replace

from .. import env
from ..codegen import GeneratedKernel, render_kernel
from ..config import KernelConfig
from ..ir import RecipeIR
from . import build, bundles
from .artifact import CompiledKernel
from .build import build_kernel, cache_key, default_cache, kernel_check, not_available
from .cache import Artifact, KernelCache

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


def _compile_in_worker(kernel: GeneratedKernel, key: str, root: str, arch: str) -> tuple[bool, Artifact | None]:
    """(built here, the artifact if it could not be stored)."""
    def waiting() -> None:
        print(f"gemmgen: waiting for another process compiling {kernel.entry} ({key[:12]})", file=sys.stderr,
              flush=True)

    cache = KernelCache(root, arch)
    # build.compile_artifact is looked up per call: tests stand in for NVRTC there
    art, built = cache.get_or_build(key, lambda: build.compile_artifact(kernel), on_wait=waiting,
                                    check=kernel_check(kernel))
    return built, (art if key in cache.unstored else None)


def build_many(pairs: Iterable[tuple[RecipeIR, KernelConfig]], cache: KernelCache | None = None,
               jobs: int | None = None, quiet: bool = False, allow_compile: bool | None = None
               ) -> list[CompiledKernel]:
    """Build (recipe, config) pairs, compiling in parallel what no bundle or the cache holds."""
    cache = cache or default_cache()
    pairs = list(pairs)
    rendered = [render_kernel(r, c) for r, c in pairs]  # every config error before any compile
    todo: dict[str, tuple[int, GeneratedKernel]] = {}
    for i, k in enumerate(rendered):
        if bundles.find(bundles.source_key(k), kernel_check(k)) is None:
            key = cache_key(k)
            if key not in todo and cache.get(key, kernel_check(k)) is None:
                todo[key] = (i, k)
    if todo and not (env.jit_enabled() if allow_compile is None else allow_compile):
        damaged = [d for _, k in todo.values() for d in bundles.damaged(bundles.source_key(k))]
        damaged += [cache.damaged[key] for key in todo if key in cache.damaged]
        raise not_available([pairs[i] for i, _ in todo.values()], cache, damaged)
    compiled_here: set[str] = set()
    if todo:
        jobs = max(1, min(jobs or default_jobs(), len(todo)))
        start = time.perf_counter()
        if not quiet:
            print(f"gemmgen: compiling {len(todo)} of {len(pairs)} kernel(s) with {jobs} worker(s)",
                  file=sys.stderr, flush=True)

        def progress(n: int, key: str, result: tuple[bool, Artifact | None]) -> None:
            built, unstored = result
            if built:
                compiled_here.add(key)
            if unstored is not None:
                cache.keep(key, unstored)
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
    return replace(k, origin="compiled", report=replace(k.report, cached=False, origin="compiled"))

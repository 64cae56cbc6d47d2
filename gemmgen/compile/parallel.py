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
import warnings
from collections.abc import Iterable
from dataclasses import replace

from .. import env
from ..codegen import GeneratedKernel, render_kernel
from ..config import KernelConfig
from ..errors import GemmgenWarning
from ..ir import RecipeIR
from . import build, bundles
from .artifact import CompiledKernel
from .build import build_kernel, cache_key, default_cache, fetch_remote, kernel_check, not_available
from .cache import Artifact, KernelCache
from .remote import Filling, remote_tier

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


def expected_compile_seconds(kernel: GeneratedKernel) -> float:
    """A rough compile cost, to order and balance compiles: it grows with the epilogue, which the
    generated source's length tracks (docs/design/measurements.md: 21-42 s for the test kernels)."""
    return 12.0 + len(kernel.source) / 800.0


#: How a kernel a worker was asked for came to be in the cache.
COMPILED, FETCHED, ELSEWHERE = "compiled", "remote", "compiled elsewhere"


def _compile_in_worker(kernel: GeneratedKernel, key: str, root: str) -> tuple[str, Artifact | None]:
    """(how it came: COMPILED, FETCHED or ELSEWHERE, the artifact if it could not be stored), in
    the cache folder of the kernel's arch under `root`."""
    def waiting() -> None:
        print(f"gemmgen: waiting for another process compiling {kernel.entry} ({key[:12]})", file=sys.stderr,
              flush=True)

    cache = KernelCache(root, kernel.arch)
    # build.compile_artifact is looked up per call: tests stand in for NVRTC there
    fill = Filling(remote_tier(kernel.arch.value), key, lambda: build.compile_artifact(kernel), kernel_check(kernel))
    art, built = cache.get_or_build(key, fill, on_wait=waiting, check=kernel_check(kernel))
    how = FETCHED if fill.fetched else COMPILED if built else ELSEWHERE
    return how, (art if key in cache.unstored else None)


def _worker(kernel: GeneratedKernel, key: str, root: str) -> tuple[str, Artifact | None, list[str]]:
    """`_compile_in_worker` in a worker process, with its gemmgen warnings returned for the parent
    to show (once each, where the caller can see and filter them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GemmgenWarning)
        how, unstored = _compile_in_worker(kernel, key, root)
    return how, unstored, [str(w.message) for w in caught if issubclass(w.category, GemmgenWarning)]


def compile_kernels(todo: dict[str, GeneratedKernel], cache: KernelCache, jobs: int | None = None,
                    quiet: bool = False, names: dict[str, str] | None = None
                    ) -> tuple[dict[str, str], dict[str, BaseException]]:
    """Compile (or fetch from the remote tier) each kernel of `todo` ({cache key: kernel}) into
    `cache` (its arch's folder), the costliest first, in worker processes. Returns ({key: how},
    {key: the error})."""
    done: dict[str, str] = {}
    failed: dict[str, BaseException] = {}
    if not todo:
        return done, failed
    order = sorted(todo, key=lambda k: -expected_compile_seconds(todo[k]))
    jobs = max(1, min(jobs or default_jobs(), len(todo)))
    start = time.perf_counter()
    if not quiet:
        print(f"gemmgen: compiling {len(todo)} kernel(s) with {jobs} worker(s)", file=sys.stderr, flush=True)

    def progress(n: int, key: str, how: str, unstored: Artifact | None) -> None:
        done[key] = how
        if unstored is not None:
            cache.for_arch(todo[key].arch).keep(key, unstored)
        if not quiet:
            elapsed = time.perf_counter() - start
            bar = ("#" * (20 * n // len(todo))).ljust(20)
            eta = elapsed / n * (len(todo) - n)
            name = (names or {}).get(key, todo[key].entry)
            print(f"[{bar}] {n}/{len(todo)} {name} {todo[key].config.name}: {how}  "
                  f"(elapsed {elapsed:.0f}s, eta {eta:.0f}s)", file=sys.stderr, flush=True)

    if jobs == 1:  # in this process: no worker start-up
        for n, key in enumerate(order, 1):
            try:
                progress(n, key, *_compile_in_worker(todo[key], key, str(cache.root)))
            except Exception as e:
                failed[key] = e
        return done, failed
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold torch/CUDA state
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_worker, todo[key], key, str(cache.root)): key for key in order}
        for n, fut in enumerate(cf.as_completed(futures), 1):
            key = futures[fut]
            try:
                how, unstored, notes = fut.result()
            except Exception as e:
                failed[key] = e
                continue
            for note in notes:
                warnings.warn(note, GemmgenWarning, stacklevel=2)
            progress(n, key, how, unstored)
    return done, failed


def build_many(pairs: Iterable[tuple[RecipeIR, KernelConfig]], cache: KernelCache | None = None,
               jobs: int | None = None, quiet: bool = False, allow_compile: bool | None = None
               ) -> list[CompiledKernel]:
    """Build (recipe, config) pairs, compiling in parallel what no bundle, the cache or the remote
    tier holds."""
    cache = cache or default_cache()
    pairs = list(pairs)
    rendered = [render_kernel(r, c) for r, c in pairs]  # every config error before any compile
    todo, index = missing_kernels(rendered, cache)
    origins: dict[str, str] = {}
    if todo and not (env.jit_enabled() if allow_compile is None else allow_compile):
        fetched = [k for k, kernel in todo.items()
                   if fetch_remote(cache.for_arch(kernel.arch), k, kernel_check(kernel)) is not None]
        for key in fetched:
            origins[key] = FETCHED
            del todo[key]
        if todo:
            damaged = [d for k in todo.values() for d in bundles.damaged(bundles.source_key(k))]
            damaged += [cache.for_arch(k.arch).damaged[key] for key, k in todo.items()
                        if key in cache.for_arch(k.arch).damaged]
            raise not_available([pairs[index[key]] for key in todo], cache, damaged)
    done, failed = compile_kernels(todo, cache, jobs, quiet, {key: pairs[index[key]][0].name for key in todo})
    if failed:
        raise next(iter(failed.values()))
    origins.update(done)
    out = []
    for recipe, config in pairs:
        built = build_kernel(recipe, config, cache)
        how = origins.get(built.cache_key)
        out.append(with_origin(built, how) if how in (COMPILED, FETCHED) else built)  # ELSEWHERE: as found
    return out


def missing_kernels(rendered: list[GeneratedKernel], cache: KernelCache
                    ) -> tuple[dict[str, GeneratedKernel], dict[str, int]]:
    """({cache key: kernel} for each kernel no bundle and not `cache` holds, {key: its first index})."""
    todo: dict[str, GeneratedKernel] = {}
    index: dict[str, int] = {}
    for i, k in enumerate(rendered):
        if bundles.find(bundles.source_key(k), k.arch, kernel_check(k)) is None:
            key = cache_key(k)
            if key not in todo and cache.for_arch(k.arch).get(key, kernel_check(k)) is None:
                todo[key], index[key] = k, i
    return todo, index


def with_origin(k: CompiledKernel, origin: str) -> CompiledKernel:
    """`k` as reported by the step that brought it (compiled here, fetched, sent by a peer)."""
    return replace(k, origin=origin, report=replace(k.report, cached=origin != "compiled", origin=origin))

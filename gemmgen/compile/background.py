"""Builds that do not block the caller (GEMMGEN_JIT=async, docs/design/deployment.md).

A kernel that no bundle, the cache or the remote tier holds is compiled by a worker process while
the caller goes on (the op runs the recipe unfused meanwhile: `integrations.pending`); the caller
asks `PendingBuild.ready()` and loads the kernel from the cache once it is. One pool of workers
per process, started on the first request, each kernel requested once however many callers ask.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import multiprocessing
import threading
import time
import warnings
from dataclasses import dataclass, field

from ..codegen import render_kernel
from ..config import KernelConfig
from ..errors import GemmgenWarning
from ..ir import RecipeIR
from . import parallel
from .cache import KernelCache


@dataclass
class PendingBuild:
    """A kernel compiling in the background, and what its callers did while it compiled."""

    name: str  # the recipe's
    config: KernelConfig
    key: str  # its cache key
    future: cf.Future = field(repr=False)
    requested: float = field(default_factory=time.monotonic)
    finished: float | None = None
    unfused_calls: int = 0  # calls that ran the recipe unfused while it compiled

    def ready(self) -> bool:
        """Compiled and in the cache (a failed or abandoned build is not ready: `wait` raises why)."""
        return self.state == "ready"

    def wait(self) -> None:
        """Block until the build ends; raise its error if it failed."""
        self.future.result()

    @property
    def state(self) -> str:
        if not self.future.done():
            return "compiling"
        if self.future.cancelled():  # the pool was shut down before it started
            return "abandoned"
        return "failed" if self.future.exception() is not None else "ready"

    @property
    def unfused_seconds(self) -> float:
        """How long calls ran unfused: from the request until the kernel was ready (or until now)."""
        return (self.finished or time.monotonic()) - self.requested


class BackgroundBuilds:
    """The process's background compiles. `worker` is what a worker process runs per kernel
    (parallel._worker: compile into the cache under its lock); tests stand in a slow one."""

    def __init__(self, worker=parallel._worker, jobs: int | None = None) -> None:  # type: ignore[no-untyped-def]
        self._worker = worker
        self._jobs = jobs
        self._lock = threading.Lock()
        self._pool: cf.ProcessPoolExecutor | None = None
        self._builds: dict[str, PendingBuild] = {}

    def request(self, recipe: RecipeIR, config: KernelConfig, cache: KernelCache, name: str = ""
                ) -> PendingBuild | None:
        """The kernel's pending build, started on the first request; None where a bundle, the
        cache or the remote tier already holds it (load it now: a hit takes milliseconds)."""
        kernel = render_kernel(recipe, config)
        todo, _ = parallel.missing_kernels([kernel], cache)
        if not todo:
            return None
        key = next(iter(todo))
        with self._lock:
            build = self._builds.get(key)  # requested once: a failed build stays failed, and says why
            if build is None:
                future = self._executor().submit(self._worker, kernel, key, str(cache.root))
                build = self._builds[key] = PendingBuild(name or kernel.entry, config, key, future)
                future.add_done_callback(functools.partial(self._finished, build, cache.for_arch(kernel.arch)))
            return build

    def builds(self) -> list[PendingBuild]:
        """Every build requested in this process, in request order."""
        with self._lock:
            return list(self._builds.values())

    def shutdown(self) -> None:
        """Stop the workers (a build in flight is abandoned; its lock in the cache is released)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch/CUDA state
            self._pool = cf.ProcessPoolExecutor(max_workers=self._jobs or parallel.default_jobs(), mp_context=ctx)
        return self._pool

    @staticmethod
    def _finished(build: PendingBuild, cache: KernelCache, future: cf.Future) -> None:
        build.finished = time.monotonic()
        if future.cancelled() or future.exception() is not None:
            return
        _, unstored, notes = future.result()
        if unstored is not None:  # the worker could not store it (a full disk): keep it in this process
            cache.keep(build.key, unstored)
        for note in notes:
            warnings.warn(note, GemmgenWarning, stacklevel=2)


#: The process's background builds (`GEMMGEN_JIT=async`).
BACKGROUND = BackgroundBuilds()

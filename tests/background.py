"""The session's NVRTC work in one pool from the session's start: every kernel its tests ask for
(compiled into the session cache) and the two type checks, in two spawned worker processes, in the
order the tests first need them and the costliest first within that. The fixtures wait for their
share; tests/conftest.py runs the modules that need none of it first, so the session's own core
works while the pool's two do. (Each fixture building its own kernels when first asked left a core
idle at the end of each build and while the single-threaded tests ran.)"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gemmgen.compile.cache import KernelCache
from gemmgen.compile.parallel import compile_kernels


@dataclass(frozen=True)
class Job:
    """`fn(*args)` in a worker, named for the fixtures that wait for it; `cost` orders it."""

    name: str
    cost: float
    fn: Callable[..., Any]
    args: tuple[Any, ...]


class Background:
    """Jobs run by `workers` spawned processes (no fork of a process that holds torch's threads),
    shut down as soon as the last one ends, since an idle NVRTC process holds gigabytes."""

    def __init__(self, workers: int = 2) -> None:
        self._workers = workers
        self._pool: cf.ProcessPoolExecutor | None = None
        self._futures: dict[str, cf.Future] = {}
        self._phases: dict[str, list[str]] = {}
        self._left = 0
        self._lock = threading.Lock()

    def start(self, phases: dict[str, list[Job]]) -> None:
        """Submit each phase's jobs, the phases in the order given (the order the tests need them),
        the costliest first within a phase; a job named before is not run again."""
        jobs: dict[str, Job] = {}
        for phase, listed in phases.items():
            self._phases.setdefault(phase, []).extend(j.name for j in listed)
            for job in sorted(listed, key=lambda j: -j.cost):
                if job.name not in self._futures:
                    jobs.setdefault(job.name, job)
        if not jobs:
            return
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"))
        with self._lock:
            self._left += len(jobs)
        for job in jobs.values():
            future = self._pool.submit(job.fn, *job.args)
            future.add_done_callback(self._ended)
            self._futures[job.name] = future

    def _ended(self, _: cf.Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.close()

    @property
    def busy(self) -> bool:
        """Whether its workers are running (until the last job ends, or `close`)."""
        return self._pool is not None

    def future(self, name: str) -> cf.Future | None:
        return self._futures.get(name)

    def wait(self, names: Iterable[str]) -> None:
        """Until each named job has ended, however it ended: the caller's own build then finds the
        result in the cache, or meets the error itself."""
        cf.wait([f for n in names if (f := self._futures.get(n)) is not None])

    def wait_phase(self, phase: str) -> None:
        self.wait(self._phases.get(phase, []))

    def close(self) -> None:
        """No job starts after this, and the workers end now: at the session's end, a compile no
        test will read is not waited for (the cache publishes atomically, so a killed compile
        leaves nothing behind)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            processes = list((getattr(pool, "_processes", None) or {}).values())  # no public handle before 3.14
            pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()


def compile_into(root: str, key: str, kernel: Any) -> None:
    """One kernel compiled (or fetched) into the cache at `root`, in a worker; what fails is
    compiled again, and raised, by the fixture's own build."""
    compile_kernels({key: kernel}, KernelCache(root), jobs=1, quiet=True)

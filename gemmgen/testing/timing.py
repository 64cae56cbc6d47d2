"""Host-time measurement shared by the overhead scripts (scripts/host_overhead.py, op_overhead.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_us(fn: Callable[[], object], reps: int = 2000, rounds: int = 7) -> float:
    """Median over `rounds` of the mean microseconds per call of `reps` back-to-back calls."""
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(samples)

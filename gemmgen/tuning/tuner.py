"""Autotuning: time a bounded set of candidate configs per shape bucket on the GPU, keep the winner.

    table = gemmgen.autotune(recipe, [(4096, 4096, 4096), (1, 14336, 4096)], out="tuning.json")
    table = gemmgen.autotune(moe, [(64, 14336, 4096, 8), (4096, 14336, 4096, 8)])  # rows, N, K, groups

The candidates of a bucket are the recipe's own `config=` (if it declares one) and the heuristic's
best few (`candidates`); the winner goes into a `TuningTable`, which the launch policy
(`policy.choose_launch`) consults before anything else.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..compile import build_many
from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..dsl import Recipe
from ..errors import GemmgenError
from ..ir import RecipeIR
from .heuristic import grouped_candidates, ranked, split_variants
from .shapes import problem_shape
from .table import Device, TuningTable, add_tuning, entry_key, problem_bucket, registered

#: Candidates timed per shape bucket: the heuristic's best few (bounded, so tuning stays minutes).
DEFAULT_CANDIDATES = 4

Timer = Callable[[Recipe, KernelConfig, tuple[int, int, int, int]], float]  # (recipe, config, (m, n, k, l)) -> us


def candidates(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1, sm_count: int | None = None,  # noqa: E741
               limit: int = DEFAULT_CANDIDATES, declared: KernelConfig | None = None,
               arch: Arch = DEFAULT_ARCH) -> list[KernelConfig]:
    """The configs autotune times for a bucket: the recipe's `declared` config, the heuristic's
    `limit` best, then split counts of their stream-K kernels where the tiles leave SMs idle
    (`heuristic.split_variants`: no more to compile); for a grouped recipe, M the rows of A and L
    the groups, `heuristic.grouped_candidates`. Candidates are `arch`'s (a declared config of
    another arch is left out)."""
    first = [declared] if declared is not None and declared.arch is arch else []
    if recipe.gemm.grouped:
        grouped = grouped_candidates(recipe, m, l, arch)
        return list(dict.fromkeys([*first, *grouped[:limit]]))
    sms = sm_count or arch.sm_count
    best = [cfg for _, cfg, _ in ranked(recipe, m, n, k, l, sms, arch)[:limit]]
    return list(dict.fromkeys([*first, *best, *split_variants(best, m, n, k, l, sms)]))


def cuda_event_timer(reps: int = 30, buffers: int = 4) -> Timer:
    """Median device time of a call over `reps` timed replays (`device_ms`), rotating through
    `buffers` input sets (more than L2)."""
    from ..runtime.examples import example_call

    def time_us(recipe: Recipe, config: KernelConfig, problem: tuple[int, int, int, int]) -> float:
        kernel = recipe.compile(config)
        sets = [example_call(recipe.ir, *problem) for _ in range(buffers)]
        return device_ms([functools.partial(kernel, *args, **ops) for args, ops in sets], reps) * 1e3

    return time_us


def device_ms(calls: Sequence[Callable[[], Any]], reps: int) -> float:
    """Median device milliseconds per call of `calls`, run in order (consecutive calls should read
    different buffers). They run once eagerly (first-call loads and choices), are captured once in
    a CUDA graph, and each of `reps` replays is timed with CUDA events: no host cost is timed, so
    a short kernel is not measured as its launch overhead."""
    import torch

    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / len(calls))
    return statistics.median(samples)


def autotune(recipe: Recipe, shapes: Iterable[tuple[int, ...]], *, limit: int = DEFAULT_CANDIDATES,
             table: TuningTable | None = None, out: str | Path | None = None, timer: Timer | None = None,
             device: Device | None = None, sm_count: int | None = None, jobs: int | None = None,
             register: bool = True, arch: Arch | str | None = None) -> TuningTable:
    """Time the candidates of each shape's bucket (`candidates`), record the fastest. A grouped
    recipe's shapes are (rows of A, N, K, groups), timed with the rows split evenly, and kept by
    the rows per group on average (`table.grouped_bucket`), as the op chooses its kernel.

    Needs a CUDA GPU (timings from anywhere else would be meaningless); `timer` and `device`
    replace the GPU in tests (`arch` then names the kernels' arch; on a GPU it is the device's).
    Candidates are compiled first, in parallel."""
    if timer is None:
        import torch

        if not torch.cuda.is_available():
            raise GemmgenError("autotune needs a CUDA GPU: it times kernels. Without one, use the heuristic "
                               "(`gemmgen explain`) or ship results tuned elsewhere (`gemmgen build --tuning`)")
        from ..runtime.driver import device_arch

        arch, sms = device_arch(torch.cuda.current_device())  # before compiling candidates it could not run
        timer = cuda_event_timer()
        device = device or Device.current()
        sm_count = sm_count if sm_count is not None else sms
    else:
        arch = DEFAULT_ARCH if arch is None else Arch.parse(arch)
    if device is None:
        raise GemmgenError("autotune: pass `device` (a gemmgen.tuning.Device) together with a custom `timer`")
    table = table if table is not None else TuningTable()
    problems = [problem_shape(p, "autotune") for p in shapes]
    if not isinstance(limit, int) or limit < 1:
        raise GemmgenError(f"autotune: limit={limit!r}; expected the number of candidates to time per bucket (>= 1)")
    plan = {problem_bucket(recipe.ir, *p): (p, candidates(recipe.ir, *p, sm_count, limit, recipe.config, arch))
            for p in problems}
    build_many(dict.fromkeys((recipe.ir, c) for _, cands in plan.values() for c in cands), jobs=jobs, quiet=True)
    for shape_bucket, (problem, cands) in plan.items():
        timings = {c.name: timer(recipe, c, problem) for c in cands}
        best = min(cands, key=lambda c: timings[c.name])
        table.put(entry_key(device, recipe.ir.key, shape_bucket), best, timings)
    if out is not None:
        table.save(out)
    if register and not registered(table):
        add_tuning(table)
    return table

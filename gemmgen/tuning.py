"""Autotuning: time a bounded set of candidate configs per shape bucket on the GPU, keep the winner.

Results are a JSON table keyed by GPU name, driver version, gemmgen version, recipe key and shape
bucket (M bucket, N, K, L; for a grouped recipe the bucket of its rows per group on average, N, K
and the groups), so a result is only used where it was measured. The runtime consults every
registered table first, then (the grouped op: the recipe's own config, then) the heuristic
(gemmgen.select). Tables come from GEMMGEN_TUNING_PATH (files separated by os.pathsep),
`gemmgen.add_tuning(path)`, and a bundle's `tuning.json` (`gemmgen build --tuning FILE` ships one).

    table = gemmgen.autotune(recipe, [(4096, 4096, 4096), (1, 14336, 4096)], out="tuning.json")
    table = gemmgen.autotune(moe, [(64, 14336, 4096, 8), (4096, 14336, 4096, 8)])  # rows, N, K, groups
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .config import KernelConfig, is_valid
from .errors import GemmgenError, InvalidArgument
from .select import grouped_candidates, m_bucket, problem_shape, ranked, split_variants

if TYPE_CHECKING:
    from .dsl import Recipe
    from .ir import RecipeIR

FORMAT = 1
#: Candidates timed per shape bucket: the heuristic's best few (bounded, so tuning stays minutes).
DEFAULT_CANDIDATES = 4

Timer = Callable[[Any, KernelConfig, tuple[int, int, int, int]], float]  # (recipe, config, (m, n, k, l)) -> us


@dataclass(frozen=True)
class Device:
    """Where timings hold: the GPU's name and the driver version."""

    name: str
    driver: str

    @staticmethod
    def current(index: int | None = None) -> Device:
        import torch
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        ok = err == driver.CUresult.CUDA_SUCCESS
        return Device(torch.cuda.get_device_name(index), f"{version // 1000}.{version % 1000 // 10}" if ok else "?")


def bucket(m: int, n: int, k: int, l: int = 1) -> tuple[int, int, int, int]:  # noqa: E741
    return (m_bucket(max(m, 1)), n, k, l)


def grouped_bucket(rows: int, n: int, k: int, groups: int) -> tuple[int, int, int, int]:
    """A grouped problem's bucket: the rows per group on average, bucketed as M is (all the host
    knows of how the rows split, and what `select.grouped_choice` follows), N, K and the groups."""
    return (m_bucket(max(-(-rows // max(groups, 1)), 1)), n, k, groups)


def problem_bucket(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1) -> tuple[int, int, int, int]:  # noqa: E741
    """The bucket tuning results are kept by: `bucket`, or for a grouped recipe (M the rows of A,
    L the groups) `grouped_bucket`."""
    return grouped_bucket(m, n, k, l) if recipe.gemm.grouped else bucket(m, n, k, l)


def entry_key(device: Device, recipe_key: str, shape_bucket: tuple[int, int, int, int]) -> str:
    return "|".join((device.name, device.driver, __version__, recipe_key, "x".join(map(str, shape_bucket))))


def recipe_key_of(key: str) -> str:
    """The recipe key part of an `entry_key`."""
    return key.split("|")[3]


def _config_from_json(raw: Any, where: str) -> KernelConfig:
    try:
        return KernelConfig.from_canonical(raw)
    except (TypeError, ValueError) as e:
        raise GemmgenError(f"{where}: not a kernel config ({raw!r}): {e}") from e


class TuningTable:
    """Autotune results: entry key -> winning config and the timings that chose it."""

    def __init__(self, entries: dict[str, dict] | None = None) -> None:
        self.entries: dict[str, dict] = dict(entries or {})

    def get(self, key: str) -> KernelConfig | None:
        entry = self.entries.get(key)
        return None if entry is None else _config_from_json(entry["config"], f"tuning entry {key!r}")

    def put(self, key: str, config: KernelConfig, timings_us: dict[str, float]) -> None:
        self.entries[key] = {"config": config.canonical(), "name": config.name,
                             "timings_us": {k: round(v, 3) for k, v in timings_us.items()}}

    def configs(self, recipe_key: str) -> list[KernelConfig]:
        """Every winning config recorded for a recipe (on any device): what a bundle must hold."""
        return [c for k in self.entries if recipe_key_of(k) == recipe_key if (c := self.get(k)) is not None]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "entries": self.entries}, indent=1, sort_keys=True)

    @staticmethod
    def load(path: str | Path) -> TuningTable:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise GemmgenError(f"tuning file {path}: cannot be read as JSON ({e}); re-run `gemmgen tune`") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("entries"), dict):
            raise GemmgenError(f"tuning file {path}: expected {{'format': {FORMAT}, 'entries': {{...}}}}; "
                               "it was written by another gemmgen version: re-run `gemmgen tune`")
        for key, entry in raw["entries"].items():
            _config_from_json(entry.get("config") if isinstance(entry, dict) else None, f"{path}: entry {key!r}")
        return TuningTable(raw["entries"])

    def save(self, path: str | Path) -> None:
        """Written whole to a temporary file and renamed: readers never see a partial table."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tuning-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)


_LOCK = threading.Lock()
_TABLES: list[TuningTable] = []
_ENV_LOADED = False
_GENERATION = 0  # bumped by every add_tuning: callers that memoise a choice key it with generation()


def generation() -> int:
    return _GENERATION


def add_tuning(source: str | Path | TuningTable) -> TuningTable:
    """Register autotune results (a file or a table); later registrations take precedence."""
    global _GENERATION
    table = source if isinstance(source, TuningTable) else TuningTable.load(source)
    with _LOCK:
        _TABLES.insert(0, table)
        _GENERATION += 1
    return table


def _tables() -> list[TuningTable]:
    global _ENV_LOADED
    if not _ENV_LOADED:
        with _LOCK:
            if not _ENV_LOADED:
                paths = [p for p in os.environ.get("GEMMGEN_TUNING_PATH", "").split(os.pathsep) if p]
                _TABLES.extend(TuningTable.load(p) for p in paths)
                _ENV_LOADED = True
    return _TABLES


def _check_device(device: Any) -> None:
    if not isinstance(device, Device):
        raise InvalidArgument(f"device: expected a gemmgen.tuning.Device (gemmgen.tuning.Device.current() on the "
                              f"GPU that will run the kernels), got {device!r}")


def tuned_config(recipe: RecipeIR, device: Device, m: int, n: int, k: int, l: int = 1  # noqa: E741
                 ) -> KernelConfig | None:
    """The registered autotune winner for this problem's bucket on this device, if any."""
    _check_device(device)
    key = entry_key(device, recipe.key, problem_bucket(recipe, m, n, k, l))
    for table in _tables():
        config = table.get(key)
        if config is not None and is_valid(config, recipe):
            return config
    return None


def tuned_configs(recipe: RecipeIR, device: Device, n: int, k: int, l: int = 1) -> list[KernelConfig]:  # noqa: E741
    """Every registered autotune winner for the recipe on `device` at this N, K and L, whatever the
    M bucket: what a layer of these sizes may launch there besides the heuristic's picks (for a
    grouped layer, whose rows per expert only the routing decides)."""
    _check_device(device)
    head = entry_key(device, recipe.key, (0, n, k, l)).rsplit("|", 1)[0]
    found = []
    for table in _tables():
        for key in table.entries:
            where, _, shape = key.rpartition("|")
            if where == head and shape.split("x")[1:] == [str(n), str(k), str(l)]:
                config = table.get(key)
                if config is not None and is_valid(config, recipe):
                    found.append(config)
    return list(dict.fromkeys(found))


def config_for(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1,  # noqa: E741
               device: Device | None = None, sm_count: int = 132) -> KernelConfig:
    """What the runtime launches for a problem: the autotune winner for this device, else the
    heuristic's choice (for a grouped recipe, M is the rows of A and L the groups)."""
    from .select import choose

    tuned = tuned_config(recipe, device, m, n, k, l) if device is not None else None
    return tuned or choose(recipe, m, n, k, l, sm_count).config


def candidates(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1, sm_count: int = 132,  # noqa: E741
               limit: int = DEFAULT_CANDIDATES) -> list[KernelConfig]:
    """The configs autotune times for a bucket: the heuristic's `limit` best, then split counts of
    their stream-K kernels where the tiles leave SMs idle (`select.split_variants`: no more to
    compile); for a grouped recipe, M the rows of A and L the groups, `select.grouped_candidates`."""
    if recipe.gemm.grouped:
        return grouped_candidates(recipe, m, l)[:limit]
    best = [cfg for _, cfg, _ in ranked(recipe, m, n, k, l, sm_count)[:limit]]
    return best + split_variants(best, m, n, k, l, sm_count)


def example_call(recipe: Recipe, m: int, n: int, k: int, l: int = 1, device: str = "cuda",  # noqa: E741
                 seed: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random arguments of one call of the recipe's kernel, in its dtypes and layouts: (A, B) and
    the operands; for a grouped recipe (A, B, offsets), its `m` rows split as evenly as they go
    over `l` groups, B and row vectors per group."""
    import torch

    from .quantize import random_block_scale
    from .runtime.checks import tma_readable
    from .types import Layout, OperandKind

    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    gemm = recipe.ir.gemm
    lead = (l,) if gemm.batched else ()  # of every matrix and scale of a batched recipe
    groups = (l,) if gemm.grouped else ()  # of a grouped recipe's B, its scales and its row vectors

    def matrix(lead: tuple[int, ...], rows: int, cols: int, dtype: Any, layout: Layout) -> Any:
        """In `layout`, its rows or columns 16 bytes apart (padded where the extent is odd), as TMA reads them."""
        return tma_readable(torch.randn(*lead, rows, cols, generator=g, device=device).to(dtype), layout)

    args: tuple[Any, ...] = (matrix(lead, m, k, gemm.a.torch, gemm.layout_a),
                             matrix(groups or lead, k, n, gemm.b.torch, gemm.layout_b))
    if gemm.grouped:
        ends = [m * (i + 1) // l for i in range(l)]
        args += (torch.tensor(ends, dtype=torch.int32, device=device),)
    ops: dict[str, Any] = {}
    for o in recipe.operands:
        if o.kind.block_scale:
            ops[o.name] = random_block_scale(o.kind, gemm, m, n, k,
                                             (groups if o.kind is OperandKind.SCALE_B else ()) or lead, device)
        elif o.kind is OperandKind.SCALAR:
            ops[o.name] = 1.0
        elif o.kind is OperandKind.ROW:
            ops[o.name] = torch.randn(*groups, n, generator=g, device=device).to(o.dtype.torch)
        elif o.kind is OperandKind.COL:
            ops[o.name] = torch.randn(m, generator=g, device=device).to(o.dtype.torch)
        else:
            ops[o.name] = matrix(lead, m, n, o.dtype.torch, Layout.ROW)
    return args, ops


def cuda_event_timer(reps: int = 30, buffers: int = 4) -> Timer:
    """Median device time of a call over `reps` timed replays (`device_ms`), rotating through
    `buffers` input sets (more than L2)."""

    def time_us(recipe: Recipe, config: KernelConfig, problem: tuple[int, int, int, int]) -> float:
        kernel = recipe.compile(config)
        sets = [example_call(recipe, *problem) for _ in range(buffers)]
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
             register: bool = True) -> TuningTable:
    """Time the heuristic's `limit` best configs for each shape's bucket, record the fastest. A
    grouped recipe's shapes are (rows of A, N, K, groups), timed with the rows split evenly, and
    kept by the rows per group on average (`grouped_bucket`), as the op chooses its kernel.

    Needs a CUDA GPU (timings from anywhere else would be meaningless); `timer` and `device`
    replace the GPU in tests. Candidates are compiled first, in parallel (gemmgen.warmup)."""
    if timer is None:
        import torch

        if not torch.cuda.is_available():
            raise GemmgenError("autotune needs a CUDA GPU: it times kernels. Without one, use the heuristic "
                               "(`gemmgen explain`) or ship results tuned elsewhere (`gemmgen build --tuning`)")
        from .runtime.driver import require_sm90

        sms = require_sm90(torch.cuda.current_device())  # before compiling candidates it could not run
        timer = cuda_event_timer()
        device = device or Device.current()
        sm_count = sm_count if sm_count is not None else sms
    if device is None:
        raise GemmgenError("autotune: pass `device` (a gemmgen.tuning.Device) together with a custom `timer`")
    from .parallel import warmup

    table = table if table is not None else TuningTable()
    problems = [problem_shape(p, "autotune") for p in shapes]
    if not isinstance(limit, int) or limit < 1:
        raise GemmgenError(f"autotune: limit={limit!r}; expected the number of candidates to time per bucket (>= 1)")
    plan = {problem_bucket(recipe.ir, *p): (p, candidates(recipe.ir, *p, sm_count or 132, limit)) for p in problems}
    warmup(list(dict.fromkeys((recipe, c) for _, cands in plan.values() for c in cands)), jobs=jobs, quiet=True)
    for shape_bucket, (problem, cands) in plan.items():
        timings = {c.name: timer(recipe, c, problem) for c in cands}
        best = min(cands, key=lambda c: timings[c.name])
        table.put(entry_key(device, recipe.ir.key, shape_bucket), best, timings)
    if out is not None:
        table.save(out)
    if register and table not in _TABLES:
        add_tuning(table)
    return table

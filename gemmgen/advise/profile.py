"""`gemmgen profile`: Nsight Compute on gemmgen's launches inside a user's script, each measured
launch beside what `advise`'s time model predicts for it (docs/advise.md).

Three steps, each its own function so that the CPU tests can drive them from recorded output:
1. `check_metrics`: the metric set against `ncu --query-metrics --chip CHIP` (a name the chip lacks
   is refused before anything runs; a quantity with several spellings takes the first the chip has);
2. `ncu_command`: the script under `ncu` with gemmgen's kernel filter (the symbol's recipe and config,
   `codegen.kernel_entry`), launch skip and count, clock control, into a report file; the script runs
   with GEMMGEN_LAUNCH_LOG, so each launch's problem is logged (`runtime.nvtx.LaunchRecord`);
3. `measured_rows` reads the report back as CSV (`ncu --import R --csv --page raw`: no output of the
   script's mixed in) and `pair` matches each profiled launch with its logged record, in order.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import KernelConfig
from ..errors import GemmgenError, InvalidArgument, ToolchainError
from ..runtime.nvtx import LaunchRecord, read_log
from .analysis import timed
from .gpus import GPUS, Gpu
from .gpus import gpu as gpu_named

#: `profile`'s JSON format number: raised when a key changes meaning or goes.
PROFILE_FORMAT = 1

#: The chip `ncu --query-metrics --chip` takes, by the GPU's name in `advise.gpus`.
CHIPS = {"h100": "gh100", "h200": "gh100", "b200": "gb100"}


@dataclass(frozen=True)
class Quantity:
    """One measured quantity: its key in the JSON, the metric spellings that give it (the first the
    chip lists is taken: Hopper and Blackwell name the tensor pipe apart), whether a profile needs
    it, whether `--query-metrics` lists it (launch and device attributes it does not: ncu collects
    those with every kernel) and whether its value is a count (digits only)."""

    key: str
    spellings: tuple[str, ...]
    required: bool = True
    listed: bool = True
    count: bool = True


#: What `profile` measures of each launch; names as `ncu --query-metrics --chips gh100` (Nsight
#: Compute 2024.1) lists them, tests/data/ncu/ holding its output.
QUANTITIES = (
    Quantity("duration_ns", ("gpu__time_duration.sum",)),
    Quantity("dram_read_bytes", ("dram__bytes_read.sum",)),
    Quantity("dram_write_bytes", ("dram__bytes_write.sum",)),
    Quantity("tensor_pipe_pct", ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                                 "sm__pipe_tc_cycles_active.avg.pct_of_peak_sustained_active"),
             required=False, count=False),
    Quantity("grid_size", ("launch__grid_size",), listed=False),
    Quantity("sm_count", ("device__attribute_multiprocessor_count",), listed=False),
    Quantity("sm_hz", ("sm__cycles_elapsed.avg.per_second",), required=False, count=False),
)

#: What the raw page prints for a value it has not got.
MISSING = ("", "n/a", "no data")


def metric_base(metric: str) -> str:
    """The name `--query-metrics` lists: a metric without its rollup and submetric suffixes."""
    return metric.split(".", 1)[0]


def listed_metrics(query_output: str) -> set[str]:
    """The metric names `ncu --query-metrics` printed: the first word of each table row (a row's
    wrapped description continues on lines that start with spaces)."""
    found = set()
    for line in query_output.splitlines():
        word = line.split(None, 1)[0] if line[:1].strip() else ""
        if re.fullmatch(r"[a-z][a-z0-9]*__[a-z0-9_]+", word):
            found.add(word)
    return found


def check_metrics(listed: set[str], chip: str, quantities: Sequence[Quantity] = QUANTITIES) -> dict[str, str]:
    """{JSON key: metric} for the chip: each quantity's first spelling the chip lists; a required
    quantity the chip lacks raises ToolchainError naming it (before the script runs)."""
    chosen, missing = {}, []
    for q in quantities:
        spelling = next((m for m in q.spellings if not q.listed or metric_base(m) in listed), None)
        if spelling is not None:
            chosen[q.key] = spelling
        elif q.required:
            missing.append(" or ".join(q.spellings))
    if missing:
        raise ToolchainError(f"ncu --query-metrics --chips {chip} lists no {', '.join(missing)}; profile needs "
                             "them: run an Nsight Compute that knows the chip's metrics (--ncu PATH)")
    return chosen


def find_ncu(given: str | None) -> str:
    """`given`, or `ncu` on PATH, or CUDA's default install; ToolchainError with the fix if none."""
    for candidate in ([given] if given else ["ncu", "/usr/local/cuda/bin/ncu"]):
        path = shutil.which(candidate)
        if path:
            return path
    where = f"--ncu {given}: no such executable" if given else "ncu is not on PATH (nor /usr/local/cuda/bin)"
    raise ToolchainError(f"{where}; install Nsight Compute (it ships with the CUDA toolkit) and pass its path "
                         "with --ncu /path/to/ncu")


def kernel_filter(recipe: str | None) -> str:
    """ncu's `--kernel-name` for gemmgen's GEMM kernels (of one recipe): the symbol
    `gemmgen_<recipe>_<tile>_c<cluster>_..._<id>`, not a grouped call's `..._groups` setup kernel."""
    name = re.escape(recipe) if recipe else r"\w+?"
    return rf"regex:^gemmgen_{name}_[0-9]+x[0-9]+x[0-9]+_c[0-9]+x[0-9]+x[0-9]+_\w*_[0-9a-f]{{12}}$"


def symbol_matches(symbol: str, recipe: str | None) -> bool:
    """Whether the filter of `kernel_filter(recipe)` takes `symbol`."""
    return re.match(kernel_filter(recipe).removeprefix("regex:"), symbol) is not None


def ncu_command(ncu: str, command: Sequence[str], report: Path, metrics: Sequence[str], *, recipe: str | None,
                skip: int, count: int, clock_control: str) -> list[str]:
    """The script under ncu: gemmgen's kernels (of `recipe`) only, `skip` of them passed over and
    `count` profiled, kernel replay, clocks as `clock_control` says, into `report`."""
    if skip < 0 or count < 1:
        raise InvalidArgument(f"--launch-skip {skip} --launch-count {count}: expected skip >= 0 and count >= 1")
    if clock_control not in ("base", "none"):
        raise InvalidArgument(f"--clock-control {clock_control}: expected base (locked base clocks, "
                              "repeatable) or none (the GPU's own boost)")
    if not command:
        raise InvalidArgument("command: expected the script to profile after --, e.g. "
                              "gemmgen profile -- python train.py")
    return [ncu, "--kernel-name", kernel_filter(recipe), "--launch-skip", str(skip), "--launch-count", str(count),
            "--clock-control", clock_control, "--metrics", ",".join(metrics), "--target-processes", "all",
            "--export", str(report), "--force-overwrite", *command]


def import_command(ncu: str, report: Path, metrics: Sequence[str]) -> list[str]:
    """The report read back as one CSV row per profiled launch, in base units (`--csv` alone still
    scales them on import), each kernel by its function name (the symbol: gemmgen's are extern "C")."""
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base",
            "--print-kernel-base", "function", "--metrics", ",".join(metrics)]


def _c_locale() -> dict[str, str]:
    """The environment with LC_ALL=C: ncu groups digits as the locale does ("1.220" is 1220 in
    de_DE), so its numbers are read under C, where it prints none."""
    return {**os.environ, "LC_ALL": "C"}


def _number(text: str | None, metric: str, count: bool) -> float | None:
    """A raw-page cell as a number; None where ncu has none (MISSING, or no such column). A count
    must be digits alone, so that a page printed under another locale is refused, not misread."""
    cell = (text or "").strip()
    if cell.lower() in MISSING:
        return None
    if re.fullmatch(r"[0-9]+" if count else r"-?[0-9]+(\.[0-9]+)?", cell) is None:
        raise GemmgenError(f"ncu printed {cell!r} for {metric}: expected a plain number; gemmgen reads ncu under "
                           "LC_ALL=C, where it groups no digits (was the report read by another command?)")
    return float(cell)


def measured_rows(raw_csv: str) -> list[dict[str, str]]:
    """The raw page's launches: the header row (from `"ID"`), its units row dropped, one dict per
    launch by column name. Lines ncu prints before the table (==PROF==, warnings) are skipped."""
    lines = [line for line in raw_csv.splitlines() if not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        said = [line for line in raw_csv.splitlines() if line.startswith("==")][-2:]
        raise GemmgenError(f"ncu printed no table: no kernel was profiled (ncu said: {' '.join(said) or 'nothing'})")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    return [r for r in rows if (r.get("ID") or "").strip().isdigit()]  # the units row has no ID


def pair(rows: list[dict[str, str]], records: list[LaunchRecord], recipe: str | None, skip: int
         ) -> list[tuple[dict[str, str], LaunchRecord]]:
    """Each profiled launch with the launch log's record of it: per process, the logged launches
    the kernel filter takes, `skip` of them passed over (as ncu's --launch-skip counts), in order;
    the symbols must agree."""
    by_pid: dict[int, list[LaunchRecord]] = {}
    for r in records:
        if symbol_matches(r.symbol, recipe):
            by_pid.setdefault(r.pid, []).append(r)
    taken = {pid: iter(logged[skip:]) for pid, logged in by_pid.items()}
    out = []
    for row in sorted(rows, key=lambda r: int(r["ID"])):
        pid = int(row.get("Process ID") or -1)
        record = next(taken.get(pid, iter(())), None)
        symbol = row.get("Kernel Name", "")
        if record is None or record.symbol != symbol:
            raise GemmgenError(f"profile: ncu's launch {row['ID']} ({symbol} in process {pid}) has no record in the "
                               f"launch log{'' if record is None else ' (its next is ' + record.symbol + ')'}: was the "
                               "script's gemmgen the one this command runs, and GEMMGEN_LAUNCH_LOG left as set?")
        out.append((row, record))
    return out


def launch_json(row: dict[str, str], record: LaunchRecord, metrics: dict[str, str], gpu: Gpu) -> dict[str, Any]:
    """One launch: what ncu measured, what the time model predicts for its kernel and problem, and
    their ratios."""
    counts = {q.key: q.count for q in QUANTITIES}
    got = {key: _number(row.get(metric), metric, counts.get(key, False)) for key, metric in metrics.items()}
    m, n, k = record.problem[:3]
    l = record.problem[3] if len(record.problem) > 3 else 1  # noqa: E741
    cfg = KernelConfig.from_canonical(json.loads(record.canonical))
    t = timed(cfg, m, n, k, l if record.grouped else 1, record.k_grouped, record.a_bits, record.d_bits, gpu,
              batch=1 if record.grouped else l)
    waves = t.waves
    assert waves is not None  # `timed` models a kernel's waves
    kind = "bf16" if record.a_bits == 16 else "fp8"
    spec = gpu.spec_tflops[kind] * 1e6  # FLOPs per microsecond
    ns, read, written, hz = (got.get(key) for key in ("duration_ns", "dram_read_bytes", "dram_write_bytes", "sm_hz"))
    duration_us = ns / 1e3 if ns else None
    dram = None if read is None else read + (written or 0)
    return {
        "symbol": record.symbol, "recipe": record.recipe, "config": record.config, "problem": list(record.problem),
        "pid": record.pid, "ncu_id": int(row["ID"]),
        "measured": {"time_us": duration_us, "tflops": t.flops / duration_us / 1e6 if duration_us else None,
                     "tensor_pipe_pct": got.get("tensor_pipe_pct"), "dram_bytes": dram,
                     "grid_size": got.get("grid_size"), "sm_count": got.get("sm_count"),
                     "sm_mhz": hz / 1e6 if hz else None},
        "predicted": {"time_us": t.predicted_us, "tflops": t.flops / t.predicted_us / 1e6,
                      "tensor_pipe_pct": 100 * t.flops / (spec * t.predicted_us), "min_bytes": t.bytes,
                      "tiles": waves.tiles, "waves": waves.waves, "bound": t.bound},
        "ratio": {"time": duration_us / t.predicted_us if duration_us else None,
                  "dram_bytes": dram / t.bytes if dram is not None and t.bytes else None},
    }


def detect_gpu() -> str:
    """The `--gpu` name of this machine's CUDA device 0, read through torch."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidArgument("--gpu: no CUDA device here to read it from; give --gpu h100, h200 or b200")
    name = torch.cuda.get_device_name(0)
    found = next((key for key in GPUS if key in name.lower().replace(" ", "")), None)
    if found is None:
        raise InvalidArgument(f"--gpu: this machine's {name} is not one gemmgen models; give --gpu h100, h200 or b200 "
                              "for the nearest")
    return found


Run = Callable[..., "subprocess.CompletedProcess[str]"]


def profile(command: Sequence[str], workdir: Path, *, gpu: str, recipe: str | None = None, skip: int = 0,
            count: int = 1, clock_control: str = "base", ncu: str | None = None,
            run: Run = subprocess.run) -> dict[str, Any]:
    """`command` under Nsight Compute (see the module docstring); the JSON `gemmgen profile` writes.
    `run` replaces subprocess.run in the CPU tests."""
    model = gpu_named(gpu)
    chip = CHIPS[next(key for key, g in GPUS.items() if g is model)]
    exe = find_ncu(ncu)
    query = run([exe, "--query-metrics", "--chips", chip], capture_output=True, text=True, env=_c_locale())
    if query.returncode != 0:
        raise ToolchainError(f"{exe} --query-metrics --chips {chip} failed ({query.returncode}): "
                             f"{(query.stderr or query.stdout).strip()[-300:]}")
    metrics = check_metrics(listed_metrics(query.stdout), chip)
    workdir.mkdir(parents=True, exist_ok=True)
    log, report = workdir / "launches.jsonl", workdir / "profile.ncu-rep"
    for stale in (log, report):
        stale.unlink(missing_ok=True)
    argv = ncu_command(exe, command, report, list(metrics.values()), recipe=recipe, skip=skip, count=count,
                       clock_control=clock_control)
    env = {**os.environ, "GEMMGEN_LAUNCH_LOG": str(log), "GEMMGEN_NVTX": "1"}
    profiled = run(argv, env=env)  # the script's and ncu's output go to the user's terminal
    if not report.is_file():
        raise GemmgenError(f"profile: ncu wrote no report (exit status {profiled.returncode}): no launch of "
                           f"{recipe or 'a gemmgen kernel'} after {skip} skipped, or the script failed; "
                           "its output is above")
    table = run(import_command(exe, report, list(metrics.values())), capture_output=True, text=True, env=_c_locale())
    pairs = pair(measured_rows(table.stdout), read_log(log) if log.is_file() else [], recipe, skip)
    return {"format": PROFILE_FORMAT, "gpu": model.name, "chip": chip, "clock_control": clock_control,
            "metrics": metrics, "report": str(report), "ncu_command": argv,
            "model_of_time": "advise's roofline (docs/advise.md): a model, calibrated on published anchors",
            "launches": [launch_json(row, record, metrics, model) for row, record in pairs]}


def table(result: dict[str, Any]) -> str:
    """The launches measured against the model, one line each."""
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = ["recipe", "config", "problem", "us", "model us", "ratio", "TFLOP/s", "tensor%", "DRAM MB", "min MB"]
    rows = [head]
    for launch in result["launches"]:
        got, model = launch["measured"], launch["predicted"]
        rows.append([launch["recipe"], launch["config"], "x".join(map(str, launch["problem"])),
                     f(got["time_us"], ".1f"), f(model["time_us"], ".1f"), f(launch["ratio"]["time"], ".2f"),
                     f(got["tflops"], ".0f"), f(got["tensor_pipe_pct"], ".0f"),
                     f(None if got["dram_bytes"] is None else got["dram_bytes"] / 1e6, ".1f"),
                     f(model["min_bytes"] / 1e6, ".1f")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([f"{result['gpu']} ({result['chip']}), clocks {result['clock_control']}; "
                      "model us: advise's roofline, a model", *lines])

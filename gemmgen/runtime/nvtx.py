"""Launches named for profilers: NVTX ranges for Nsight Systems and Nsight Compute (`ncu --nvtx
--nvtx-include 'gemmgen/'`), each named `gemmgen <recipe> <config> <M>x<N>x<K>[x<L>]`, the config
as the kernel's symbol spells it (`gemmgen_<recipe>_<config>_<id>`), so a profile's kernel and its
range read alike; and a launch log, one JSON line per launch (`LaunchRecord`), which `gemmgen
profile` pairs with what Nsight Compute measured.

Off by default: a launch then reads one module attribute. GEMMGEN_NVTX=1 turns the ranges on and
GEMMGEN_LAUNCH_LOG=FILE the log (both read at the process's first launch); `enable()` switches the
ranges at any time."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import env

#: None until the first launch reads the variables; then whether launches take the named path.
enabled: bool | None = None
_ranges = False
_log: Path | None = None


@dataclass(frozen=True)
class LaunchRecord:
    """One launch as the log keeps it: the kernel's symbol, recipe and config (canonical, and as the
    symbol spells it), its problem (M, N, K[, L]: L a batch, or with `grouped` the groups), its
    arch, and what a time model needs of its operands (A's and D's bits, whether the groups split
    K); `pid` tells processes apart."""

    symbol: str
    recipe: str
    config: str
    canonical: str
    problem: tuple[int, ...]
    arch: str
    a_bits: int
    d_bits: int
    grouped: bool
    k_grouped: bool
    pid: int

    @property
    def range_name(self) -> str:
        return range_name(self.recipe, self.config, self.problem)

    def line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> LaunchRecord:
        raw = json.loads(line)
        return cls(**{**raw, "problem": tuple(raw["problem"])})


def read_log(path: str | Path) -> list[LaunchRecord]:
    """The launches a log holds, in launch order (a line cut short by a killed process is left out)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(LaunchRecord.from_line(line))
        except (ValueError, TypeError, KeyError):
            continue
    return out


def _read() -> None:
    global enabled, _ranges, _log
    _ranges = env.nvtx_enabled()
    _log = env.launch_log()
    enabled = _ranges or _log is not None


def enable(on: bool = True) -> None:
    """Name every launch from now on in an NVTX range (or stop, with `on=False`)."""
    global enabled, _ranges
    if enabled is None:
        _read()
    _ranges = bool(on)
    enabled = _ranges or _log is not None


def active() -> bool:
    """Whether launches take the named path (GEMMGEN_NVTX or GEMMGEN_LAUNCH_LOG, read at the first call)."""
    if enabled is None:
        _read()
    return bool(enabled)


def range_name(recipe: str, config: str, problem: tuple[int, ...]) -> str:
    """`gemmgen <recipe> <config> <M>x<N>x<K>[x<L>]`."""
    return f"gemmgen {recipe} {config} {'x'.join(map(str, problem))}"


@contextmanager
def launch_range(name: str, push: Callable[[str], Any] | None = None, pop: Callable[[], Any] | None = None
                 ) -> Iterator[None]:
    """An NVTX range named `name` around the block (torch.cuda.nvtx's push and pop)."""
    (push or torch.cuda.nvtx.range_push)(name)
    try:
        yield
    finally:
        (pop or torch.cuda.nvtx.range_pop)()


@contextmanager
def named_launch(record: Callable[[], LaunchRecord]) -> Iterator[None]:
    """The block (one launch) logged and in its range, as the variables say; `record` is built only then."""
    launch = record()
    if _log is not None:
        with _log.open("a") as f:  # one write of a whole line: processes sharing the log do not interleave
            f.write(launch.line() + "\n")
    if _ranges:
        with launch_range(launch.range_name):
            yield
    else:
        yield

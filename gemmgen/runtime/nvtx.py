"""NVTX ranges around gemmgen's launches, for Nsight Systems and Nsight Compute (`ncu --nvtx
--nvtx-include 'gemmgen/'`): each range is named `gemmgen <recipe> <config> <M>x<N>x<K>[x<L>]`, the
config as the kernel's symbol spells it (`gemmgen_<recipe>_<config>_<id>`), so a profile's kernel
and its range read alike.

Off by default: a launch then reads one module attribute. GEMMGEN_NVTX=1 turns it on (read at
the process's first launch), `enable()` at any time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import env

#: None until the first launch reads GEMMGEN_NVTX; then whether launches open a range.
enabled: bool | None = None


def enable(on: bool = True) -> None:
    """Name every launch from now on in an NVTX range (or stop, with `on=False`)."""
    global enabled
    enabled = bool(on)


def active() -> bool:
    """Whether launches open ranges (GEMMGEN_NVTX read at the first call)."""
    global enabled
    if enabled is None:
        enabled = env.nvtx_enabled()
    return enabled


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

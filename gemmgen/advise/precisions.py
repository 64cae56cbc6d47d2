"""The precisions `advise` takes by name, each the `gemmgen.training` object the layers take."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import Arch
from ..errors import InvalidArgument
from ..training import MXFP8, Float8Blockwise, Float8Tensorwise
from .gpus import Gpu

#: The precisions by the name `--precision` takes, each making its `gemmgen.training` object (bf16: None).
PRECISIONS: dict[str, Callable[[], Any]] = {
    "bf16": lambda: None,
    "fp8-blockwise": Float8Blockwise,
    "fp8-tensorwise": Float8Tensorwise,
    "mxfp8": MXFP8,
}


def precision(name: str, gpu: Gpu) -> Any:
    """The precision object named (None for bf16), refused where `gpu` cannot run it."""
    make = PRECISIONS.get(name)
    if make is None:
        raise InvalidArgument(f"precision: {name!r} is none of {', '.join(PRECISIONS)}")
    if name == "mxfp8" and gpu.arch is not Arch.SM100A:
        raise InvalidArgument(f"precision: mxfp8 runs on sm_100a (B200), not {gpu.name}; give --gpu b200")
    return make()

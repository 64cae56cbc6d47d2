"""Counting the ops a region dispatches: on a GPU each is at least one kernel launch, and the CPU
runs the same ops, so a backward's launches can be counted without one."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """The ops a region dispatches that compute (each at least one kernel on a GPU)."""

    PLUMBING = frozenset(getattr(torch.ops.aten, n) for n in (
        "detach", "transpose", "t", "view", "expand", "new_empty_strided", "copy_", "_to_copy", "ones_like",
        "zeros_like", "empty_like", "lift_fresh", "clone", "alias", "_unsafe_view", "reshape", "contiguous"))

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket not in self.PLUMBING:
            self.ops[str(func.overloadpacket).removeprefix("aten.")
                     if func.namespace == "aten" else func.namespace] += 1
        return func(*args, **(kwargs or {}))

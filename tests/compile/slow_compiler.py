"""A stand-in for NVRTC in background workers (tests/compile/test_async_jit.py): it takes
SLOW_COMPILER_SECONDS, then stores the kernel's binary from the cache at SLOW_COMPILER_SOURCE (the
session's, where NVRTC really compiled it). Module-level, so that a spawned worker imports it."""

from __future__ import annotations

import os
import time

from gemmgen.codegen import GeneratedKernel
from gemmgen.compile.build import kernel_check
from gemmgen.compile.cache import KernelCache


def slow_compile(kernel: GeneratedKernel, key: str, root: str) -> tuple[str, None, list[str]]:
    """What `compile.parallel._worker` returns: how the kernel came (compiled), no unstored
    artifact, no warnings."""
    time.sleep(float(os.environ["SLOW_COMPILER_SECONDS"]))
    art = KernelCache(os.environ["SLOW_COMPILER_SOURCE"], kernel.arch).get(key, kernel_check(kernel))
    if art is None:
        raise RuntimeError(f"the session cache has no {kernel.entry} ({key[:12]}) to stand in with")
    KernelCache(root, kernel.arch).put(key, art)
    return "compiled", None, []


def sleeping_compile(kernel: GeneratedKernel, key: str, root: str) -> tuple[str, None, list[str]]:
    """A compile of SLOW_COMPILER_SECONDS that stores nothing (tests/compile/async_step_child.py,
    where `Recipe.compile` stands in for loading what it would have stored)."""
    time.sleep(float(os.environ["SLOW_COMPILER_SECONDS"]))
    return "compiled", None, []

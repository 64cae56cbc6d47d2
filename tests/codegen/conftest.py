"""The two NVRTC type checks of this folder (every example under every config the heuristic can
choose, and random recipes): each is one translation unit that NVRTC compiles on one core for one
to two minutes, so both start together, in two processes, when the first test asks for either."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import random
import time
from collections.abc import Iterator

import pytest

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.testing.collectives import collectives_check_source
from gemmgen.testing.random_recipes import random_recipe
from gemmgen.tuning.heuristic import SWAP_MAX_M, candidate_configs


def _compile(source: str) -> None:
    from gemmgen.compile.nvrtc import compile_cubin
    from gemmgen.compile.toolchain import toolchain
    from gemmgen.config import DEFAULT_ARCH

    compile_cubin(source, "collectives_check", DEFAULT_ARCH.value, toolchain().include_dirs)


def example_kernels(examples: dict, extra: dict) -> list:
    """Every example recipe under every config the heuristic can choose; the extra recipes under
    their default and a spread of configs (test_codegen.test_resolved_collectives_are_the_builders_types)."""
    S = gg.Schedule
    configs = [None, gg.KernelConfig(tile=(128, 128, 64), schedule=S.PINGPONG),
               gg.KernelConfig(tile=(128, 128, 64), cluster=(1, 2, 1)),
               gg.KernelConfig(tile=(128, 128, 64), cluster=(2, 2, 1), stages=3),
               gg.KernelConfig(tile=(64, 128, 64), cluster=(1, 1, 1), schedule=S.PINGPONG),
               gg.KernelConfig(tile=(128, 32, 64), swap_ab=True),
               gg.KernelConfig(tile=(64, 16, 64), cluster=(2, 1, 1), schedule=S.PINGPONG, swap_ab=True)]
    kernels = [render_kernel(r.ir, c) for r in examples.values() for c in candidate_configs(r.ir, 16)
               if gg.codegen.is_valid(c, r.ir)]
    kernels += [render_kernel(r.ir, c or r.default_config()) for r in extra.values() for c in configs
                if c is None or gg.codegen.is_valid(c, r.ir)]
    return kernels


def random_kernels(seed: int) -> list:
    """30 random recipes, each under a random candidate config and a random swapped one
    (test_epilogue_source.test_random_epilogues_are_valid_kernel_types)."""
    rng = random.Random(seed)
    recipes: list[gg.Recipe] = []
    while len(recipes) < 30:
        try:
            recipes.append(random_recipe(rng, len(recipes)))
        except gg.RecipeError:
            continue
    kernels = []
    for r in recipes:
        listed = candidate_configs(r.ir, SWAP_MAX_M)
        plain = [c for c in listed if not c.swap_ab and gg.codegen.is_valid(c, r.ir)]
        swapped = [c for c in listed if c.swap_ab and gg.codegen.is_valid(c, r.ir)]
        kernels += [render_kernel(r.ir, rng.choice(options)) for options in (plain, swapped) if options]
    return kernels


class _Compiles:
    """NVRTC compiles of `sources`, each in a spawned process of its own (NVRTC holds the GIL),
    all started at once; each process exits when the results are read, since an idle one would
    hold NVRTC's 3-6 GB."""

    def __init__(self, *sources: str) -> None:
        self._pools = [cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) for _ in sources]
        self._futures = [pool.submit(_compile, source) for pool, source in zip(self._pools, sources, strict=True)]

    def result(self) -> None:
        try:
            for future in self._futures:
                future.result()
        finally:
            self.close()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="session")
def type_checks(examples, extra) -> Iterator[dict]:
    """{"examples": (kernels, compile), "random": (kernels, compile, seed)}: both translation units
    compiling at once, in two processes. (Halving the examples' 550 kernels into two more units
    made the whole slower: most of a unit's time is what every kernel shares.)"""
    seed = int(os.environ.get("GEMMGEN_TEST_SEED") or time.time_ns() % 2**32)
    ours, theirs = example_kernels(examples, extra), random_kernels(seed)
    compiles = [_Compiles(collectives_check_source(kernels)) for kernels in (ours, theirs)]
    yield {"examples": (ours, compiles[0]), "random": (theirs, compiles[1], seed)}
    for compile_ in compiles:
        compile_.close()

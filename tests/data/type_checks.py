"""The NVRTC type checks of tests/codegen: every example under every config the heuristic can
choose, and random recipes, in one translation unit that NVRTC compiles on one core for about two
minutes, in the session's background pool (tests/background.py) from the session's start. (One
unit, since most of a unit's time is what every kernel in it shares: docs/design/testing.md.)"""

from __future__ import annotations

import random

import gemmgen as gg
from gemmgen.codegen import GeneratedKernel, render_kernel
from gemmgen.testing.collectives import collectives_check_source
from gemmgen.testing.random_recipes import random_recipes
from gemmgen.tuning.heuristic import SWAP_MAX_M, candidate_configs


def compile_check(source: str) -> None:
    """NVRTC compiles one check's translation unit (raising what it reports); run in a worker."""
    from gemmgen.compile.nvrtc import compile_cubin
    from gemmgen.compile.toolchain import toolchain
    from gemmgen.config import DEFAULT_ARCH

    compile_cubin(source, "collectives_check", DEFAULT_ARCH.value, toolchain().include_dirs)


def example_kernels(examples: dict, extra: dict) -> list[GeneratedKernel]:
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
    # an explicit stage count on the blockwise builder, which takes it only as a carveout
    explicit = gg.KernelConfig(tile=(128, 128, 128), stages=3)
    block_scaled = sorted(n for n, r in extra.items() if r.ir.gemm.block_scale is not None)
    kernels += [render_kernel(extra[n].ir, explicit) for n in block_scaled[:2]]
    return kernels


def random_kernels(seed: int) -> list[GeneratedKernel]:
    """30 random recipes, each under a random candidate config and a random swapped one
    (test_epilogue_source.test_random_epilogues_are_valid_kernel_types)."""
    rng = random.Random(seed)
    recipes = random_recipes(rng, 30)
    kernels = []
    for r in recipes:
        listed = candidate_configs(r.ir, SWAP_MAX_M)
        plain = [c for c in listed if not c.swap_ab and gg.codegen.is_valid(c, r.ir)]
        swapped = [c for c in listed if c.swap_ab and gg.codegen.is_valid(c, r.ir)]
        kernels += [render_kernel(r.ir, rng.choice(options)) for options in (plain, swapped) if options]
    return kernels


def type_checks(examples: dict, extra: dict, seed: int) -> tuple[dict[str, list[GeneratedKernel]], str]:
    """({"examples" | "random": the kernels}, the translation unit checking them all)."""
    kernels = {"examples": example_kernels(examples, extra), "random": random_kernels(seed)}
    return kernels, collectives_check_source(kernels["examples"] + kernels["random"])

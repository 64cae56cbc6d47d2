"""The kernels the CPU suite compiles with NVRTC, by the session fixture that hands them out
(tests/conftest.py): one list of (recipe, config) pairs per family, which the session's background
pool (tests/background.py) compiles from the start and each fixture then builds from the cache."""

from __future__ import annotations

import gemmgen as gg
from gemmgen.config import Arch
from gemmgen.testing.grouped import moe_recipe
from tests.data.gpu_matrix import (
    BLOCK_GROUPED_CONFIGS,
    CHECKED_GROUPED_CONFIGS,
    DERIVED_GROUPED_CONFIG,
    FP8_GROUPED_CONFIGS,
    derived_grouped_recipe,
    moe_fp8_recipe,
)
from tests.data.sm100 import SM100_KERNELS

Pairs = list[tuple[gg.Recipe, gg.KernelConfig]]


def compiled_pairs(examples: dict, extra: dict) -> Pairs:
    """`compiled`: every example recipe and every extra-coverage recipe, each under its default."""
    return [(r, r.default_config()) for recipes in (examples, extra) for r in recipes.values()]


def sm100_pairs(examples: dict) -> Pairs:
    """`sm100_kernels`: tests/data/sm100.py's sm_100a kernels."""
    return [(examples[n], c or examples[n].default_config(Arch.SM100A)) for n, c in SM100_KERNELS.items()]


def grouped_pairs(examples: dict) -> dict[str, Pairs]:
    """`grouped_families`: the grouped test kernels of tests/data/gpu_matrix.py, by family:
    `moe_recipe()` under CHECKED_GROUPED_CONFIGS (its default is the example moe_up's kernel),
    moe_fp8 under FP8_GROUPED_CONFIGS, the example moe_fp8_block under BLOCK_GROUPED_CONFIGS, the
    example moe_swiglu (gated experts over column pairs), and GroupedLinear's derived backward
    kernel, which reads C."""
    swiglu = examples["moe_swiglu"]
    return {"grouped": [(moe_recipe(), c) for c in CHECKED_GROUPED_CONFIGS],
            "fp8": [(moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS],
            "block": [(examples["moe_fp8_block"], c) for c in BLOCK_GROUPED_CONFIGS],
            "gated": [(swiglu, swiglu.default_config())],
            "derived": [(derived_grouped_recipe(), DERIVED_GROUPED_CONFIG)]}

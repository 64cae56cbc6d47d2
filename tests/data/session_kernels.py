"""The kernels the CPU suite compiles with NVRTC, by the session fixture that hands them out
(tests/conftest.py): one list of (recipe, config) pairs per family, which the session's background
pool (tests/background.py) compiles from the start and each fixture then builds from the cache."""

from __future__ import annotations

from pathlib import Path

import torch

import gemmgen as gg
from gemmgen.aot import load_recipes
from gemmgen.config import Arch
from gemmgen.integrations.grouped import grouped_weight_grad_recipe
from gemmgen.testing.grouped import moe_recipe
from tests.data import EXAMPLES
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


#: The example and coverage recipes the suite compiles, each under its default: between them their
#: sources name every CUTLASS and gemmgen type, tile, cluster and schedule that any example's or
#: coverage recipe's source names (tests/compile/test_kernels.py keeps it so), so that each of those
#: compiles in some kernel. The others are checked without NVRTC: their arguments against CUTLASS's
#: host code, their data flow by emulation and their types by the type check (`recipe_kernels`);
#: `gemmgen build examples/recipes.py` compiles every example.
COMPILED = ("gemm_bf16", "bias_gelu", "scaled_mm_fp8", "qk_norm", "row_col_amax", "moe_up",
            "moe_swiglu", "moe_fp8_block", "every_op", "row_extrema", "block_scaled_swapped", "select_ops",
            "pair_ops", "swiglu_bwd", "block_softmax", "weight_grad_accumulate_fp8block_wgrad",
            "fc1_fp8block_fprop_train_q")


def keep_compiled_examples(recipes_file: Path) -> list[str]:
    """A copy of examples/recipes.py cut to the examples the session compiles (a `del` of the others
    at its end), so that a command building all of the file's kernels, the main job's `gemmgen build`,
    runs its whole path on the session's kernels instead of compiling the others; the names kept.
    (The names are the repository's file's: `load_recipes` keeps what it loaded of a path.)"""
    declared = load_recipes(EXAMPLES)
    assert all(name.isidentifier() for name in declared), "each example is a variable of its own name"
    cut = [name for name in declared if name not in COMPILED]
    with recipes_file.open("a") as f:
        f.write(f"\n# tests/data/session_kernels.py: what the test session does not compile\ndel {', '.join(cut)}\n")
    return [name for name in declared if name in COMPILED]


def recipe_pairs(examples: dict, extra: dict) -> Pairs:
    """Every example recipe and every coverage recipe, each under its default."""
    return [(r, r.default_config()) for recipes in (examples, extra) for r in recipes.values()]


def compiled_pairs(examples: dict, extra: dict) -> Pairs:
    """`compiled`: the recipes of COMPILED, each under its default."""
    return [(r, c) for r, c in recipe_pairs(examples, extra) if r.name in COMPILED]


def sm100_pairs(examples: dict) -> Pairs:
    """`sm100_kernels`: tests/data/sm100.py's sm_100a kernels."""
    return [(examples[n], c or examples[n].default_config(Arch.SM100A)) for n, c in SM100_KERNELS.items()]


#: The grouped test configs checked without NVRTC (`grouped_families` hands them out rendered, not
#: compiled), each naming nothing its family's compiled kernels do not: moe_fp8's default (its
#: swapped kernel compiles the same main loop) and moe_fp8_block swapped (the default compiles its
#: main loop, moe_fp8 swapped its tile).
UNCOMPILED_GROUPED = (("moe_fp8", FP8_GROUPED_CONFIGS[0]), ("moe_fp8_block", BLOCK_GROUPED_CONFIGS[2]))


def grouped_pairs(examples: dict) -> dict[str, Pairs]:
    """`grouped_families`: the grouped test kernels of tests/data/gpu_matrix.py, by family:
    `moe_recipe()` under CHECKED_GROUPED_CONFIGS (its default is the example moe_up's kernel),
    moe_fp8 under FP8_GROUPED_CONFIGS, the example moe_fp8_block under BLOCK_GROUPED_CONFIGS, the
    example moe_swiglu (gated experts over column pairs), GroupedLinear's derived backward
    kernel, which reads C, and the experts' K-grouped weight gradient into main_grad."""
    swiglu, wgrad = examples["moe_swiglu"], grouped_weight_grad_recipe(torch.bfloat16, accumulate=True)
    return {"grouped": [(moe_recipe(), c) for c in CHECKED_GROUPED_CONFIGS],
            "fp8": [(moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS],
            "block": [(examples["moe_fp8_block"], c) for c in BLOCK_GROUPED_CONFIGS],
            "gated": [(swiglu, swiglu.default_config())],
            "derived": [(derived_grouped_recipe(), DERIVED_GROUPED_CONFIG)],
            "k_grouped": [(wgrad, wgrad.default_config())]}


def is_compiled_grouped(recipe_name: str, config: gg.KernelConfig) -> bool:
    """Whether the session compiles this grouped test kernel (all but UNCOMPILED_GROUPED: keyed by
    recipe and config, since two families' configs may compare equal)."""
    return (recipe_name, config) not in UNCOMPILED_GROUPED


def compiled_grouped_pairs(examples: dict) -> Pairs:
    """The pairs of `grouped_pairs` the session compiles."""
    return [(r, c) for pairs in grouped_pairs(examples).values() for r, c in pairs if is_compiled_grouped(r.name, c)]

"""The kernels whose CUTLASS host code the oracle tests run (tests/runtime/test_*oracle.py), rendered
without NVRTC, in the order the tests need them: what tests/conftest.py has nvcc build in the
background from the session's start (`gemmgen.testing.oracle.start_all`), while the session's other
work leaves a core idle. Each oracle fixture still names its own kernels and waits for their build
(or builds what this list lacks)."""

from __future__ import annotations

from gemmgen.codegen import GeneratedKernel, render_kernel
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
from tests.data.sm100 import SM100_KERNELS, VALUE_CONFIGS


def oracle_kernels(examples: dict, extra: dict) -> list[list[GeneratedKernel]]:
    """Grouped (test_grouped_oracle), dense sm_90a (test_oracle), sm_100a (test_sm100_oracle)."""
    swiglu, block = examples["moe_swiglu"], examples["moe_fp8_block"]
    grouped = [(moe_recipe(), c) for c in CHECKED_GROUPED_CONFIGS] + [
        (swiglu, swiglu.default_config()), (derived_grouped_recipe(), DERIVED_GROUPED_CONFIG),
        *((moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS), *((block, c) for c in BLOCK_GROUPED_CONFIGS)]
    recipes = {**examples, **extra}
    dense = [(r, r.default_config()) for r in recipes.values() if not r.ir.gemm.grouped]
    sm100 = [(examples[n], c or examples[n].default_config(Arch.SM100A)) for n, c in SM100_KERNELS.items()]
    sm100 += [(recipes[name], config) for name, config in VALUE_CONFIGS.values()]
    return [[render_kernel(r.ir, c) for r, c in pairs] for pairs in (grouped, dense, sm100)]

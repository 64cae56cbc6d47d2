"""The kernels whose CUTLASS host code the oracle tests run (tests/runtime/test_*oracle.py), rendered
without NVRTC, in the order the tests need them: what tests/conftest.py has nvcc build in the
background from the session's start (`gemmgen.testing.oracle.start_all`), while the session's other
work leaves a core idle. Each oracle fixture still names its own kernels and waits for their build
(or builds what this list lacks)."""

from __future__ import annotations

from gemmgen.codegen import GeneratedKernel, render_kernel
from tests.data.session_kernels import grouped_pairs, recipe_pairs, sm100_pairs
from tests.data.sm100 import VALUE_CONFIGS, grouped_value_kernels, mxfp8_training_kernels


def oracle_kernels(examples: dict, extra: dict) -> list[list[GeneratedKernel]]:
    """For every example recipe (`examples`: the sm_100a tests' list, MXFP8's included): grouped
    (test_grouped_oracle: every grouped kernel the session compiles), dense sm_90a (test_oracle: every
    example and coverage recipe's default, compiled or not), sm_100a (test_sm100_oracle and
    test_sm100_grouped: the compiled ones, VALUE_CONFIGS and the grouped ones checked by value)."""
    recipes = {**examples, **extra}
    sm90 = {name: r for name, r in examples.items() if r.ir.gemm.microscaling is None}
    grouped = [p for pairs in grouped_pairs(sm90).values() for p in pairs]
    dense = [(r, c) for r, c in recipe_pairs(sm90, extra) if not r.ir.gemm.grouped]
    sm100 = sm100_pairs(examples) + [(recipes[name], config) for name, config in VALUE_CONFIGS.values()] + \
        list(grouped_value_kernels().values()) + list(mxfp8_training_kernels().values())
    return [[render_kernel(r.ir, c) for r, c in pairs] for pairs in (grouped, dense, sm100)]

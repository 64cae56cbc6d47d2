"""The K-grouped fp8 weight gradient (tests/data/gpu_matrix.py's `k_grouped_fp8_recipe`) against
CUTLASS's own host code, by hand: kept out of CI, whose 30 minutes its nvcc build does not fit
(docs/design/training.md#moe-in-fp8). Compiles the sm_90a kernel (or loads it from the cache),
builds the oracle program, prepares a call over gg.quantize_k_grouped's copies (experts of 0, 1,
127, 129, 0, 40 and 300 tokens) and checks every Params field, every tensor map, the grid and the
shared memory against the oracle's, then the compiled kernel's emulation against per-expert fp64.

    GEMMGEN_CACHE_DIR=... python scripts/k_grouped_fp8_oracle.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import gemmgen as gg
    from gemmgen.testing.emulate import emulate_grouped
    from gemmgen.testing.grouped import cpu_grouped_kernel, params_field
    from gemmgen.testing.oracle import oracle_by_hand
    from tests.data.gpu_matrix import k_grouped_fp8_recipe
    from tests.runtime.test_grouped_oracle import _matches_cutlass, _oracle_values
    from tests.runtime.test_k_grouped import FP8_SIZES, _fp8_inputs, zero_buffer

    recipe = k_grouped_fp8_recipe()
    ck = recipe.build(recipe.default_config(gg.Arch.SM90A))
    oracle = oracle_by_hand(ck, "k_grouped_fp8_oracle")
    kernel = cpu_grouped_kernel(ck, 132, 0)
    a, b, offsets, scale_a, scale_b, main_grad, want = _fp8_inputs()
    out = torch.full((len(FP8_SIZES), 136, 72), float("nan"))
    p = kernel.prepare(a, b, offsets, scale_a=scale_a, scale_b=scale_b, main_grad=main_grad, out=out)
    field = params_field(ck, p.params)
    values = {**_oracle_values(field, len(FP8_SIZES), 132, 0), "c.array": field("epilogue.ptr_c"),
              "c.strides": field("epilogue.stride_c"), "sfa.array": field("mainloop.ptr_sfa"), "sfa.layouts": 0,
              "sfb.array": field("mainloop.ptr_sfb"), "sfb.layouts": 0}
    expected = oracle.run_argv(oracle.grouped_argv(values))
    _matches_cutlass(ck, field, kernel._encode, p, expected)
    print(f"every Params field ({len(ck.params_layout.fields)}), tensor map, the grid and shared memory match "
          "CUTLASS's host code")
    emulate_grouped(ck, p.setup, p.params, kernel._encode,
                    [a, b, offsets, scale_a, scale_b, main_grad, out, p.buffer, zero_buffer(kernel, p)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    print("the compiled kernel's emulation matches each expert in fp64")
    return 0


if __name__ == "__main__":
    sys.exit(main())

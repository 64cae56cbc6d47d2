"""Float8Tensorwise's experts kernels against CUTLASS's own host code, by hand (as
scripts/k_grouped_fp8_oracle.py, and for the same reason: CI's 30 minutes do not fit the nvcc
builds). For a GroupedLinear (8 SwiGLU experts, 512 -> 256, no bias) under Float8Tensorwise, its
sm_90a fprop (per-tensor scales read as one fp32 per group: x's shared, each expert's weight its
own) and its K-grouped wgrad (over gg.k_grouped_copy's copies): compiles them (or loads them from
the cache), builds each oracle program, prepares a call over experts of 0, 1, 127, 129, 0, 40, 300
and 3 tokens and checks every Params field (the scalars' pointers and group strides among them),
every tensor map, the grid and the shared memory against the oracle's, then the compiled kernel's
emulation against the recipe's reference.

    GEMMGEN_CACHE_DIR=... python scripts/grouped_tensorwise_oracle.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SIZES = (0, 1, 127, 129, 0, 40, 300, 3)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import gemmgen as gg
    from gemmgen.ir.reference import reference
    from gemmgen.testing.emulate import emulate_grouped
    from gemmgen.testing.grouped import cpu_grouped_kernel, params_field
    from gemmgen.testing.oracle import oracle_by_hand
    from gemmgen.training import Gemm
    from tests.runtime.test_grouped_oracle import _matches_cutlass, _oracle_values
    from tests.runtime.test_k_grouped import zero_buffer

    torch.manual_seed(0)
    precision = gg.training.Float8Tensorwise()
    layer = gg.nn.GroupedLinear(len(SIZES), 512, 256, bias=False, activation="swiglu", precision=precision)
    with torch.no_grad():  # experts of unlike sizes: each one's scale differs
        layer.weight.mul_(torch.arange(1.0, len(SIZES) + 1).reshape(-1, 1, 1))
    gemms = layer.low_precision_gemms
    tokens = sum(SIZES)
    x, g = torch.randn(tokens, 512).bfloat16(), torch.randn(tokens, 512).bfloat16()
    offsets = torch.tensor(SIZES).cumsum(0).int()
    xq, qw = precision.tokens(x, Gemm.FPROP, len(SIZES)), precision.experts(layer.weight)
    ga, xb = precision.along_tokens(g, offsets, "a"), precision.along_tokens(x, offsets, "b")
    calls = [(gemms.fprop.recipe, (xq.data, qw.rows.data, offsets), {"scale_a": xq.scale, "scale_b": qw.rows.scale},
              torch.full((tokens, 256), float("nan")).bfloat16()),
             (gemms.wgrad.recipe, (ga.data, xb.data.t(), offsets), {"scale_a": ga.scale, "scale_b": xb.scale},
              torch.full((len(SIZES), 512, 512), float("nan")).bfloat16())]
    for recipe, (a, b, offs), scales, out in calls:
        ck = recipe.build(recipe.default_config(gg.Arch.SM90A))
        oracle = oracle_by_hand(ck, "grouped_tensorwise_oracle")
        kernel = cpu_grouped_kernel(ck, 132, 0)
        p = kernel.prepare(a, b, offs, **scales, out=out)
        field = params_field(ck, p.params)
        pairs = not recipe.gemm.k_grouped  # SwiGLU's fprop writes N/2 columns through a PairStore
        values = _oracle_values(field, len(SIZES), 132, 0, pair_d=pairs)
        for name in scales:
            values |= {f"operand.{name}.ptr": field(f"epilogue.scalar.{name}.ptr"),
                       f"operand.{name}.s2": field(f"epilogue.scalar.{name}.batch_stride")}
        assert values["operand.scale_b.s2"] == (1 if pairs else 0)  # the weights' one per expert; wgrad's shared
        expected = oracle.run_argv(oracle.grouped_argv(values))
        _matches_cutlass(ck, field, kernel._encode, p, expected)
        print(f"every Params field ({len(ck.params_layout.fields)}), tensor map, the grid and shared memory match "
              "CUTLASS's host code")
        extra = [zero_buffer(kernel, p)] if recipe.gemm.k_grouped else []
        emulate_grouped(ck, p.setup, p.params, kernel._encode, [a, b, offs, *scales.values(), out, p.buffer, *extra])
        (want,) = reference(recipe.ir, a, b, scales, offs)
        rows = out.shape[0] if recipe.gemm.k_grouped else tokens
        torch.testing.assert_close(out[:rows].float(), want[:rows].float(), rtol=2**-7, atol=1e-5, equal_nan=True)
        print("the compiled kernel's emulation matches the recipe's reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())

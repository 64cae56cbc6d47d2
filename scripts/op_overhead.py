"""Per-call cost of going through torch.ops.gemmgen.* instead of calling the implementation directly,
on the CPU: both run the same (tiny) CPU implementation, so the difference is the dispatcher's.

    python scripts/op_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch

import gemmgen as gg
from gemmgen.integrations.ops import implementation, op


def _median_us(fn, reps: int = 5000, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(samples)


def main() -> None:
    recipe = gg.Recipe("overhead_probe", lambda acc, bias: acc + bias, operands={"bias": gg.RowVector(gg.bf16)})
    a, b, bias = torch.zeros(1, 8).bfloat16(), torch.zeros(8, 8).bfloat16().t(), torch.zeros(8).bfloat16()
    f = op(recipe)
    t0 = time.perf_counter()
    op(gg.Recipe("overhead_probe2", lambda acc: acc))
    register_us = (time.perf_counter() - t0) * 1e6
    direct = implementation(recipe, "CPU")
    through_op = _median_us(lambda: f(a, b, bias))
    direct_call = _median_us(lambda: direct(a, b, bias))
    print(f"# torch {torch.__version__}, CPU, median of 7x5000 calls, 1x8x8 problem")
    print(f"registering a new op:            {register_us:.0f} us (once per recipe)")
    print(f"torch.ops.gemmgen call:          {through_op:.1f} us")
    print(f"same implementation, direct:     {direct_call:.1f} us")
    print(f"dispatcher overhead:             {through_op - direct_call:.1f} us per call")


if __name__ == "__main__":
    main()

"""Per-call host cost of the ways to call a gemmgen kernel from PyTorch.

    python scripts/op_overhead.py

On the CPU: torch.ops.gemmgen.* against the same (tiny) CPU implementation called directly, so
the difference is the dispatcher's (incl. the autograd wrapper register_autograd installs).
On a GPU, in addition: a raw cuLaunchKernelEx of prepared arguments, then Kernel.__call__, the
eager path modules use (OpCaller: kernel called directly) and the op, each as host microseconds
per call over a loop of 2000 launches of a 64x64x64 problem; the overheads are over the raw launch.
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
    if torch.cuda.is_available():
        gpu_overheads()


def _host_us(fn, calls: int = 2000, rounds: int = 7) -> float:
    """Host microseconds per call; the GPU drains between rounds so the launch queue never fills."""
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_overheads() -> None:
    from gemmgen.integrations.ops import caller, kernel_for
    from gemmgen.nn import linear_recipe
    from gemmgen.runtime import driver

    recipe = linear_recipe("silu", True, torch.bfloat16)
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16).t()
    bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    call, k = caller(recipe), kernel_for(recipe, a, w)
    out = k(a, w, bias=bias)
    prep = k.prepare(a, w, bias=bias, out=out)
    fn = k._function(prep.device_index)
    stream = torch.cuda.current_stream().cuda_stream
    info, cluster = k.compiled.info, k.compiled.config.cluster

    def raw() -> None:
        driver.launch(fn, prep.params, prep.grid, info.max_threads, cluster, info.smem_bytes, stream)

    with torch.no_grad():
        timings = {
            "raw cuLaunchKernelEx (prepared arguments)": _host_us(raw),
            "Kernel.__call__ (checks, arguments, output)": _host_us(lambda: k(a, w, bias=bias)),
            "module eager path (OpCaller, direct)": _host_us(lambda: call(a, w, bias)),
            "torch.ops.gemmgen op": _host_us(lambda: call.overload(a, w, bias)),
        }
    base = timings["raw cuLaunchKernelEx (prepared arguments)"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, host us per call, median of 7x2000 calls")
    for name, us in timings.items():
        print(f"{name:45s} {us:6.1f} us   over raw: {us - base:5.1f} us")


if __name__ == "__main__":
    main()

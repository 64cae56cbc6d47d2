"""Speed check on the GPU: gemmgen's fused bias + GELU kernel against cuBLAS through torch, side
by side in one process, on the same inputs:

- `torch.matmul` + bias + GELU (three kernels: what an unfused model runs),
- `torch.addmm` (bias in cuBLAS's epilogue) + GELU,
- `torch._addmm_activation(use_gelu=True)` (cuBLASLt's fused bias + GELU epilogue, where torch
  routes it there; its GELU is the tanh approximation, gemmgen's recipe the erf one),
- `torch.matmul` alone (no epilogue: the GEMM's own cost).

Buffers rotate through more than L2; each number is the median over CUDA-graph replays timed with
CUDA events (device time only). "vs best" divides the fastest torch way to compute the same
layer (the first three) by gemmgen's time. Each shape runs under the config the runtime picks for
it; where that is a swapped kernel (small M), a second row runs the best unswapped one.

    python scripts/gpu_bench.py [--reps N]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
L2_BYTES = 60 << 20  # H100/H200 L2 is 50 MB


def _unfused(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(torch.matmul(a, b) + bias)


def _addmm_gelu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(torch.addmm(bias, a, b))


def _cublaslt_gelu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch._addmm_activation(bias, a, b, use_gelu=True)


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


BASELINES = {"matmul+bias+gelu": _unfused, "addmm+gelu": _addmm_gelu, "cuBLASLt bias+gelu": _cublaslt_gelu,
             "matmul alone": _matmul}
SAME_LAYER = ("matmul+bias+gelu", "addmm+gelu", "cuBLASLt bias+gelu")


def _timed(fn, sets, reps: int) -> float | None:
    """device_ms of `fn` over the buffer sets; None where torch refuses the call."""
    from gemmgen.tuning import device_ms

    try:
        return device_ms([functools.partial(fn, a, b, bias) for a, b, bias, _ in sets], reps)
    except RuntimeError as refused:
        print(f"# {fn.__name__}: {str(refused).splitlines()[0]}")
        return None


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing measured")
        return 0
    sys.path.insert(0, str(ROOT))
    from gemmgen.recipes_file import load_recipes
    from gemmgen.tuning import device_ms
    from tests.data.gpu_matrix import BENCH_SHAPES, bench_configs

    recipe = load_recipes(ROOT / "examples" / "recipes.py")["bias_gelu"]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; bias_gelu; "
          f"median of {args.reps} CUDA-graph replays timed with CUDA events, buffers rotated")
    print(f"| M x N x K | config | gemmgen ms | {' ms | '.join(BASELINES)} ms | gemmgen TFLOP/s | vs best |")
    print("|---" * (5 + len(BASELINES)) + "|")
    for m, n, k in BENCH_SHAPES:
        per_set = (m * k + k * n + m * n) * 2
        count = max(2, -(-L2_BYTES // per_set) + 1)
        sets = []
        for _ in range(count):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            sets.append((a, b, bias, out))
        theirs = {name: _timed(fn, sets, args.reps) for name, fn in BASELINES.items()}
        best = min(t for name, t in theirs.items() if name in SAME_LAYER and t is not None)
        flops = 2 * m * n * k
        for config in bench_configs(recipe, m, n, k):
            kernel = recipe.compile(config)
            ours = device_ms([functools.partial(kernel, a, b, bias=bias, out=out) for a, b, bias, out in sets],
                             args.reps)
            print(f"| {m}x{n}x{k} | {config.name} | {ours:.3f} | {' | '.join(map(_ms, theirs.values()))} | "
                  f"{flops / ours / 1e9:.0f} | {best / ours:.2f}x |", flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

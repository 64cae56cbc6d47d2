"""A 2-layer MLP fused with gemmgen.nn.fuse.

On an sm_90 GPU: checks outputs and gradients of the fused model against the unfused one for a
prefill batch, checks a decode step (few tokens: swapped kernels), and times both models in eager
mode, as a user's loop runs them: forward at both sizes, forward+backward for the prefill batch
(CUDA events around each step after the GPU drained, median of 30: host launch costs count where
the GPU would wait for them). scripts/gpu_bench.py times the kernels alone. Elsewhere: builds the
kernels those calls would launch and prints their report.

    python examples/mlp.py
"""

from __future__ import annotations

import copy
import statistics

import torch
from torch import nn

import gemmgen as gg

TOKENS = (4096, 8)  # a prefill batch and a decode step


def make_mlp(d_model: int = 4096, d_ff: int = 14336, device: str = "cpu") -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, d_ff, dtype=torch.bfloat16, device=device), nn.SiLU(),
                         nn.Linear(d_ff, d_model, dtype=torch.bfloat16, device=device), nn.GELU(approximate="tanh"))


def _median_ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    ref = make_mlp(device="cuda" if on_gpu else "cpu")
    fused, report = gg.nn.fuse(copy.deepcopy(ref))
    print("\n".join(report))
    if not on_gpu:
        print(f"no sm_90 GPU: building the kernels this model launches for {TOKENS} tokens")
        gg.warmup(gg.nn.model_launches(fused, TOKENS, training_tokens=TOKENS[:1]))  # prints progress and the report
        return
    x = torch.randn(TOKENS[0], 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_ref, y = ref(x), fused(x)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    g = torch.randn_like(y)
    grads_ref = torch.autograd.grad(y_ref, [x, *ref.parameters()], g)
    grads = torch.autograd.grad(y, [x, *fused.parameters()], g)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * float(b.abs().max()))
    wrt_ref, wrt = [x, *ref.parameters()], [x, *fused.parameters()]
    t_ref = _median_ms(lambda: torch.autograd.grad(ref(x), wrt_ref, g))
    t_fused = _median_ms(lambda: torch.autograd.grad(fused(x), wrt, g))
    print(f"eager forward+backward {TOKENS[0]} tokens: unfused {t_ref:.3f} ms, fused {t_fused:.3f} ms "
          f"({t_ref / t_fused:.2f}x)")
    with torch.no_grad():
        for tokens in TOKENS:
            xt = x[:tokens].detach()
            torch.testing.assert_close(fused(xt).float(), ref(xt).float(), rtol=3e-2, atol=3e-2)
            t_ref = _median_ms(lambda: ref(xt))  # noqa: B023
            t_fused = _median_ms(lambda: fused(xt))  # noqa: B023
            print(f"eager forward {tokens} tokens: unfused {t_ref:.3f} ms, fused {t_fused:.3f} ms "
                  f"({t_ref / t_fused:.2f}x)")


if __name__ == "__main__":
    main()

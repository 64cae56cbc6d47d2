"""Loss parity of a low-precision recipe against bf16 on a small model, on the CPU references:
the third tier of the low-precision checks (tests/training/test_loss_parity.py,
scripts/loss_parity.py, docs/design/training.md#numerics).

The model is a stack of two FusedMLPs (128 -> 512 -> 128, twice; gated ones without biases)
with fp32 master weights under bf16 autocast, trained by AdamW on a classification over 128
classes whose labels are drawn from a fixed teacher's softmax: the best loss is the labels' own
entropy (about 3.1 nats), as a language model's is its text's, so a relative loss gap reads as it
does for an LLM (DeepSeek-V3 reports below 0.25% for this recipe). Both runs see the same initial
weights and the same batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..training import Precision

FEATURES, HIDDEN, CLASSES = 128, 512, 128


@dataclass(frozen=True)
class Run:
    """One training run: the loss of each step, and the final held-out loss."""

    curve: tuple[float, ...]
    held_out: float


def train(precision: Precision | None, steps: int = 300, seed: int = 0, activation: str = "gelu",
          batch: int = 256, lr: float = 1e-3, sampled: bool = True) -> Run:
    """Train the parity model under `precision` (None: bf16) and return its run. `sampled=False`
    takes the teacher's argmax as the label instead: a separable task whose loss falls towards 0,
    where the same absolute gap is a larger relative one."""
    import gemmgen as gg

    torch.manual_seed(seed)
    bias = activation not in ("swiglu", "geglu")  # gated: Llama's MLP, no biases
    model = torch.nn.Sequential(
        gg.nn.FusedMLP(FEATURES, HIDDEN, FEATURES, activation=activation, bias=bias, precision=precision).float(),
        gg.nn.FusedMLP(FEATURES, HIDDEN, CLASSES, activation=activation, bias=bias, precision=precision).float())
    data = torch.Generator().manual_seed(1234)
    teacher = torch.randn(FEATURES, CLASSES, generator=data) * 0.25

    def batch_of(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, FEATURES, generator=data)
        if not sampled:
            return x, (x @ teacher).argmax(-1)
        return x, torch.multinomial(torch.softmax(x @ teacher, -1), 1, generator=data).squeeze(1)

    x_held, y_held = batch_of(8192)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    curve = []
    for _ in range(steps):
        x, y = batch_of(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        held_out = torch.nn.functional.cross_entropy(model(x_held).float(), y_held).item()
    return Run(tuple(curve), held_out)


def relative_gap(run: Run, baseline: Run) -> float:
    """(loss - baseline's) / baseline's, on the held-out set."""
    return (run.held_out - baseline.held_out) / baseline.held_out


__all__ = ["Run", "relative_gap", "train"]

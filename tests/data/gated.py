"""Llama's MLP unfused, down(silu(gate(x)) * up(x)) (or GEGLU's, gelu for silu): the reference a
gated FusedMLP is checked against (tests/nn/test_mlp.py, tests/gpu/test_training_gpu.py,
scripts/gpu_bench.py --training)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import gemmgen as gg


class LlamaMLP(nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int, bias: bool = False,
                 act: Callable[[torch.Tensor], torch.Tensor] = nn.functional.silu) -> None:
        super().__init__()
        self.act = act
        self.gate, self.up = nn.Linear(n_in, hidden, bias=bias), nn.Linear(n_in, hidden, bias=bias)
        self.down = nn.Linear(hidden, n_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))

    def fc1(self) -> nn.Linear:
        """gate and up as one Linear of 2 x hidden rows, interleaved: a gated FusedMLP's fc1."""
        hidden, n_in = self.gate.weight.shape
        w = self.gate.weight
        fc1 = nn.Linear(n_in, 2 * hidden, bias=self.gate.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            fc1.weight.copy_(gg.nn.interleave_pairs(self.gate.weight, self.up.weight))
            if self.gate.bias is not None and self.up.bias is not None:
                fc1.bias.copy_(gg.nn.interleave_pairs(self.gate.bias, self.up.bias))
        return fc1

    def fused_order(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of `self.parameters()` (in that order) as a gated FusedMLP holds its
        parameters': fc1's (gate's and up's interleaved), then fc2's (down's)."""
        by_name = dict(zip([n for n, _ in self.named_parameters()], grads, strict=True))
        out = [gg.nn.interleave_pairs(by_name["gate.weight"], by_name["up.weight"])]
        if "gate.bias" in by_name:
            out.append(gg.nn.interleave_pairs(by_name["gate.bias"], by_name["up.bias"]))
        return [*out, *(g for n, g in by_name.items() if n.startswith("down."))]

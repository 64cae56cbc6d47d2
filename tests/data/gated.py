"""Llama's MLP unfused, down(silu(gate(x)) * up(x)) (or GEGLU's, gelu for silu): the reference a
gated FusedMLP is checked against (tests/nn/test_mlp.py, tests/gpu/test_training_gpu.py,
scripts/gpu_bench.py --training); and transformers 5's experts layout with an fp64 loop over each
routed token's experts, what GroupedExperts is checked against (tests/nn/test_grouped_experts.py,
tests/gpu/test_grouped_gpu.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
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


class Experts(nn.Module):
    """transformers 5's experts layout: gate and up the halves of gate_up_proj (E, 2I, H)."""

    def __init__(self, e: int, hidden: int, inter: int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * inter, hidden, device=device) / hidden ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(e, hidden, inter, device=device) / inter ** 0.5)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(e, 2 * inter, device=device) / 4)
            self.down_proj_bias = nn.Parameter(torch.randn(e, hidden, device=device) / 4)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # only its parameters are read


def experts_reference(m: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                      act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Each token's sum over its top-k experts e in range of w_e * down_e(act(gate_e(x)) * up_e(x)), fp64."""
    gate_up, down_proj = m.get_parameter("gate_up_proj"), m.get_parameter("down_proj")
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    gu, down = gate_up.double(), down_proj.double()
    b1 = getattr(m, "gate_up_proj_bias", None)
    b2 = getattr(m, "down_proj_bias", None)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(index.shape[1]):
            j = int(index[t, k])
            if not 0 <= j < e:
                continue
            pre = gu[j] @ x[t].double() + (b1[j].double() if b1 is not None else 0)
            h = act(pre[:i]) * pre[i:]
            y = down[j] @ h + (b2[j].double() if b2 is not None else 0)
            out[t] += float(weights[t, k]) * y
    return out


def routing(tokens: int, e: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return index, weights

"""The model of the first-step checks (GEMMGEN_JIT=async: tests/compile/test_async_jit.py and
scripts/first_step.py): a plain bf16 model as a checkpoint loads it, an MLP (GELU, biases) and a
projection, fused with `mlp=True, unpaired=True` into a FusedMLP and a FusedLinear, and one
training step of it."""

from __future__ import annotations

import torch

from ..nn import fuse

TOKENS = 200  # not a tile multiple: a K tail for the weight gradients


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Model(torch.nn.Module):
    """The plain model: 64 -> 128 -> 64 (GELU), then 64 -> 32."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.proj = _MLP(), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.mlp(x))


def fused_model(seed: int = 0) -> torch.nn.Module:
    """The model, its weights from `seed`, fused as a training script would."""
    torch.manual_seed(seed)
    fused, _ = fuse(Model().to(torch.bfloat16), mlp=True, unpaired=True)
    return fused


def training_step(model: torch.nn.Module, seed: int) -> dict:
    """One step on fresh inputs from `seed`: the loss and each parameter's gradient (fp32 lists,
    exact), the optimizer's step left out (the gradients are what the kernels compute)."""
    torch.manual_seed(100 + seed)
    x = torch.randn(TOKENS, 64, dtype=torch.bfloat16, device=next(model.parameters()).device)
    model.zero_grad(set_to_none=True)
    loss = model(x).float().square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), f"parameters without a gradient: {grads}"
    return {"loss": loss.item(), "grads": {n: g.float().flatten().tolist() for n, g in grads.items() if g is not None}}

"""gemmgen.nn.plan against what a step runs: every GEMM a FusedLinear's or a FusedMLP's training
step dispatches (gemmgen's kernels by recipe, torch's matmuls), with its (M, N, K), is the plan's,
in the plan's order, and nothing else is: the inventory `gemmgen advise` costs is the one the layers launch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gemmgen as gg
from gemmgen.nn.plan import Pass, grouped_plan, linear_plan, mlp_plan

_TORCH_GEMMS = {"mm", "addmm", "bmm", "matmul", "_grouped_mm"}


class Gemms(TorchDispatchMode):
    """The GEMMs a region dispatches: ("torch", m, n, k) or (recipe name, m, n, k)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).removeprefix("aten.")
        if func.namespace == "aten" and name in _TORCH_GEMMS:
            a, b = args[1:3] if name == "addmm" else args[:2]
            self.found.append(("torch", a.shape[-2], b.shape[-1], a.shape[-1]))
        elif func.namespace == "gemmgen":
            a, b = args[0], args[1]
            self.found.append((func._opname.rsplit("_", 1)[0], a.shape[-2], b.shape[-1], a.shape[-1]))
        return func(*args, **(kwargs or {}))


def _planned(plan) -> list[tuple]:
    return [("torch" if g.recipe is None else g.recipe.name, g.m, g.n, g.k) for g in plan]


def _step(module: torch.nn.Module, tokens: int, features: int = 256) -> list[tuple]:
    x = torch.randn(tokens, features, dtype=torch.bfloat16, requires_grad=True)
    with Gemms() as gemms:
        y = module(x)
        y.backward(torch.randn_like(y))
    return gemms.found


LINEARS = [dict(activation=None), dict(activation="gelu"), dict(activation="silu", recompute=True),
           dict(activation="gelu", accumulate_grad=True), dict(activation=None, precision="blockwise")]


@pytest.mark.parametrize("options", LINEARS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_linears_step_runs_its_plans_gemms(options):
    options = dict(options)
    if options.pop("precision", None):
        options["precision"] = gg.training.Float8Blockwise()
    layer = gg.nn.FusedLinear(256, 384, bias=True, dtype=torch.bfloat16, **options)
    plan = linear_plan(layer, 72)
    assert plan[0].pass_ is Pass.FPROP and {g.pass_ for g in plan[1:]} <= {Pass.DGRAD, Pass.WGRAD}
    assert _step(layer, 72) == _planned(plan)


MLPS = [dict(activation="gelu"), dict(activation="swiglu", bias=False), dict(activation="gelu", recompute=True),
        dict(activation="swiglu", bias=False, accumulate_grad=True),
        dict(activation="gelu", precision="blockwise"), dict(activation="swiglu", bias=False, precision="blockwise")]


@pytest.mark.parametrize("options", MLPS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_an_mlps_step_runs_its_plans_gemms(options):
    options = dict(options)
    if options.pop("precision", None):
        options["precision"] = gg.training.Float8Blockwise()
    mlp = gg.nn.FusedMLP(256, 384, 128, dtype=torch.bfloat16, **options)
    assert _step(mlp, 72) == _planned(mlp_plan(mlp, 72))


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_a_grouped_linears_step_runs_its_plans_gemms(activation):
    """The grouped kernel and its derived kernel, then dx and dW by torch._grouped_mm (issue 58 moves
    those two into gemmgen)."""
    experts = gg.nn.GroupedLinear(4, 256, 128, bias=False, activation=activation, dtype=torch.bfloat16)
    x = torch.randn(40, 256, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([8, 8, 30, 40], dtype=torch.int32)
    with Gemms() as gemms:
        y = experts(x, offsets)
        y.backward(torch.randn_like(y))
    planned = grouped_plan(experts, 40)
    assert gemms.found == _planned(planned)

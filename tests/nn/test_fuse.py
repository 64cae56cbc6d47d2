"""gemmgen.nn.fuse beyond nn.Sequential: pairs read from each module's traced forward, fused only
where the model provably computes the same function (CPU: the op evaluates the recipe there)."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gemmgen as gg
from gemmgen.nn.fuse import KEPT_UNPAIRED

BF16_TOL: dict[str, Any] = {"rtol": 2e-2, "atol": 2e-2}


def _fuse(model: nn.Module, **kw: Any) -> tuple[Any, list[str]]:
    """gg.nn.fuse, whose model's submodules these tests look up by name and index (untyped)."""
    return gg.nn.fuse(model, **kw)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _linear(i: int, o: int, bias: bool = True) -> nn.Linear:
    return nn.Linear(i, o, bias=bias, dtype=torch.bfloat16)


class GELUActivation(nn.Module):
    """As Hugging Face transformers writes it: a module wrapping the functional activation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.act, self.approximate = F.gelu, approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x, approximate=self.approximate)


class GatedMLP(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(64, 96, bias=False), _linear(64, 96, bias=False)
        self.down_proj, self.act_fn = _linear(96, 64, bias=False), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_gated_mlp_fuses_the_gate_with_its_activation_module(gen):
    """Inside a custom module: gate_proj absorbs act_fn (a wrapper module, recognised by what it
    computes), act_fn becomes Identity, and the model computes what it did, forward and backward."""
    ref = GatedMLP(GELUActivation("tanh"))
    fused, report = _fuse(copy.deepcopy(ref))
    assert report == [
        "gate_proj: Linear + GELUActivation -> FusedLinear(linear_gelu_tanh_bf16) (act_fn is now Identity)",
        f"up_proj: {KEPT_UNPAIRED}", f"down_proj: {KEPT_UNPAIRED}"]  # every Linear is named
    assert isinstance(fused.act_fn, nn.Identity) and fused.gate_proj.activation == "gelu_tanh"
    x = torch.randn(3, 5, 64, generator=gen).bfloat16().requires_grad_()
    with _Recording() as mode, torch.no_grad():
        fused(x)
    assert sum(op.startswith("gemmgen.") for op in mode.seen) == 1
    assert "aten.gelu" not in mode.seen, mode.seen
    y_ref, y = ref(x), fused(x)
    assert y_ref.float().abs().max() > 0
    torch.testing.assert_close(y, y_ref, **BF16_TOL)
    g = torch.randn(y.shape, generator=gen).bfloat16()
    grads_ref = torch.autograd.grad(y_ref, [x, *ref.parameters()], g)
    grads = torch.autograd.grad(y, [x, *fused.parameters()], g)
    for mine, theirs in zip(grads, grads_ref, strict=True):
        scale = theirs.float().abs().max().item()
        assert scale > 0
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=5e-2, atol=5e-2 * scale)


def test_sequential_pairs_fuse_and_positions_stay(gen):
    """In an nn.Sequential the absorbed activation becomes Identity: keys and positions (model[4])
    stay as they were, and the model computes what it did."""
    model = nn.Sequential(_linear(64, 128), nn.GELU(approximate="tanh"), _linear(128, 32), nn.SiLU(),
                          nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 8, dtype=torch.float16))
    fused, report = _fuse(copy.deepcopy(model))
    assert [type(m).__name__ for m in fused] == ["FusedLinear", "Identity", "FusedLinear", "Identity", "Linear",
                                                 "ReLU", "Linear"]
    assert [m.activation for m in fused if isinstance(m, gg.nn.FusedLinear)] == ["gelu_tanh", "silu"]
    assert list(fused.state_dict()) == list(model.state_dict())
    assert report == ["0: Linear + GELU -> FusedLinear(linear_gelu_tanh_bias_bf16) (1 is now Identity)",
                      "2: Linear + SiLU -> FusedLinear(linear_silu_bias_bf16) (3 is now Identity)",
                      "4: kept (weights are torch.float32; gemmgen computes in bf16/f16 (compute_dtype= casts "
                      "them per call))", f"6: {KEPT_UNPAIRED}"]
    x = torch.randn(5, 64, generator=gen).bfloat16()
    want = model[:4](x)
    assert want.float().abs().max() > 0
    torch.testing.assert_close(fused[:4](x), want, **BF16_TOL)
    fused, report = _fuse(copy.deepcopy(model), unpaired=True)
    assert [type(m).__name__ for m in fused][4:] == ["Linear", "ReLU", "FusedLinear"]
    assert report[-1] == "6: Linear -> FusedLinear(linear_none_bias_f16)"



def test_mlp_fuses_linear_activation_linear_into_one_fused_mlp(gen):
    """`mlp=True`: Linear -> GELU -> Linear becomes one FusedMLP in the first Linear's place (the
    activation Identity, the second Linear an MLPSecondLayer holding its parameters, so the
    state_dict keeps its keys, as the report says); a second Linear that starts a pair of its own,
    or is used twice, stays a layer of its own."""
    model = nn.Sequential(_linear(64, 128), nn.GELU(), _linear(128, 32), nn.Linear(32, 8).bfloat16())
    fused, report = _fuse(copy.deepcopy(model), mlp=True)
    assert [type(m).__name__ for m in fused] == ["FusedMLP", "Identity", "MLPSecondLayer", "Linear"]
    assert report == ["0: Linear + GELU + Linear (2) -> FusedMLP(linear_gelu_bias_bf16, linear_none_bias_bf16) (1 "
                      "is now Identity, 2 an MLPSecondLayer holding its parameters; state_dict unchanged)",
                      "2: the second layer of the FusedMLP at 0 (now an MLPSecondLayer holding its parameters)",
                      f"3: {KEPT_UNPAIRED}"]
    assert list(fused.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    x = torch.randn(5, 64, generator=gen).bfloat16().requires_grad_()
    want = model(x)
    assert want.float().abs().max() > 0
    torch.testing.assert_close(fused(x), want, **BF16_TOL)
    chained = nn.Sequential(_linear(64, 128), nn.GELU(), _linear(128, 32), nn.SiLU())
    fused, report = _fuse(chained, mlp=True)
    assert [type(m).__name__ for m in fused] == ["FusedLinear", "Identity", "FusedLinear", "Identity"]
    twice = _TwiceSecond()
    fused, report = _fuse(twice, mlp=True)
    assert isinstance(fused.fc1, gg.nn.FusedLinear) and isinstance(fused.fc2, nn.Linear), report
    with pytest.raises(gg.InvalidArgument, match="give one of mlp=True and quantize="):
        gg.nn.fuse(nn.Sequential(_linear(64, 64)), mlp=True, quantize="fp8_block")


class _ScaledGate(GatedMLP):
    """Not the gated MLP: the product is scaled before down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(2.0 * (self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


@pytest.mark.parametrize("act, activation", [(nn.SiLU(), "swiglu"), (GELUActivation(), "geglu")])
def test_mlp_fuses_a_gated_mlp_module_into_one_gated_fused_mlp(gen, act, activation):
    """`mlp=True` on Llama's MLP (inside a model): the module becomes one gated FusedMLP whose fc1
    is gate's and up's rows interleaved and fc2 down's, its children the module's (the state_dict
    unchanged), as the report says; forward and every gradient are the original module's."""
    mlp_ref = GatedMLP(act)
    ref = nn.Sequential(mlp_ref, nn.Linear(64, 8, dtype=torch.bfloat16))
    fused, report = _fuse(copy.deepcopy(ref), mlp=True)
    assert isinstance(fused[0], gg.nn.FusedMLP) and fused[0].activation == activation, report
    assert report == [f"0: down_proj(act_fn(gate_proj(x)) * up_proj(x)) -> FusedMLP(linear_{activation}_bf16, "
                      f"linear_none_bf16) (gate_proj, up_proj, down_proj and act_fn are its children, state_dict "
                      f"unchanged; gate_proj's and up_proj's rows interleaved at call time)", f"1: {KEPT_UNPAIRED}"]
    assert list(fused.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, 5, 64, generator=gen).bfloat16().requires_grad_()
    y_ref, y = ref(x), fused(x)
    assert y_ref.float().abs().max() > 0
    torch.testing.assert_close(y, y_ref, **BF16_TOL)
    g = torch.randn(y.shape, generator=gen).bfloat16()
    theirs = torch.autograd.grad(y_ref, [x, mlp_ref.gate_proj.weight, mlp_ref.up_proj.weight,
                                         mlp_ref.down_proj.weight], g)
    mlp: Any = fused[0]
    mine = torch.autograd.grad(y, [x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight], g)
    for got, want in zip(mine, theirs, strict=True):
        scale = want.float().abs().max().item()
        assert scale > 0
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2 * scale)


def test_mlp_leaves_a_module_that_only_looks_gated():
    """A gated MLP with another step in its forward, an activation without a gated form (tanh GELU)
    or a hook keeps its Linears; only the usual gate + activation pair fuses. The report says why
    of each module that has the gated form."""
    hooked = GatedMLP(nn.SiLU())
    hooked.register_forward_hook(lambda *args: None)
    for module, why in ((_ScaledGate(nn.SiLU()), None), (GatedMLP(GELUActivation("tanh")), "has no gated kernel"),
                        (hooked, "has hooks")):
        fused, report = _fuse(module, mlp=True)
        assert isinstance(fused, GatedMLP) and isinstance(fused.up_proj, nn.Linear), report
        assert all("-> FusedMLP(" not in line for line in report), report
        said = [line for line in report if line.startswith("(model): not a FusedMLP")]
        if why is None:
            assert not said, report
        else:
            assert len(said) == 1 and why in said[0], report


class _TwiceSecond(nn.Module):
    """Linear -> GELU -> Linear, the second Linear run once more: it cannot become Identity."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = _linear(64, 32), nn.GELU(), _linear(32, 32)

    def forward(self, x):
        return self.fc2(self.fc2(self.act(self.fc1(x))))


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _linear(16, 16)

    def forward(self, x):
        return F.gelu(self.fc(x))


class _SharedActivation(nn.Module):
    """One activation module for two Linears: both fuse, since it only ever runs on their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.act = _linear(16, 16), _linear(16, 16), nn.ReLU()

    def forward(self, x):
        return self.act(self.a(x)) + self.act(self.b(x))


class _ActivationAlsoOnInput(_SharedActivation):
    def forward(self, x):
        return self.act(self.a(x)) + self.act(x)


class _LinearRunTwice(_SharedActivation):
    """b runs twice, so it cannot fuse; then act has a run that is not fused, so a cannot either."""

    def forward(self, x):
        return self.act(self.a(x)) + self.act(self.b(x)) + self.b(x * 2)


class _ActivationAfterAnF32Linear(_SharedActivation):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.act(self.a(x)) + self.act(self.b(x.float())).bfloat16()


class _PreActivationReused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = _linear(16, 16), nn.SiLU()

    def forward(self, x):
        h = self.fc(x)
        return self.act(h) + h


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = _linear(16, 16), nn.SiLU()

    def forward(self, x):
        if x.sum() > 0:
            return self.act(self.fc(x))
        return self.fc(x)


class _SharedLinear(nn.Module):
    def __init__(self, fc: nn.Linear) -> None:
        super().__init__()
        self.fc, self.act = fc, nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class _LinearSubclass(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _tricky_model() -> nn.ModuleDict:
    shared = _linear(16, 16)
    return nn.ModuleDict({
        "functional": _Functional(), "shared_act": _SharedActivation(), "act_on_input": _ActivationAlsoOnInput(),
        "run_twice": _LinearRunTwice(), "f32": _ActivationAfterAnF32Linear(), "pre": _PreActivationReused(),
        "branchy": _DataDependent(), "s1": _SharedLinear(shared), "s2": _SharedLinear(shared),
        "sub": nn.Sequential(_LinearSubclass(16, 16, dtype=torch.bfloat16), nn.ReLU()),
    })


@pytest.mark.parametrize("unpaired", [False, True])
def test_pairs_that_would_change_the_model_are_not_fused(gen, unpaired):
    """Each case fusing would get wrong (or cannot check) is left unfused with the reason in the
    report, the one safe sharing (an activation module that only ever runs on fusable Linears'
    outputs) fuses, and every submodule still computes what it did. `unpaired` swaps the rest."""
    ref: Any = _tricky_model()  # submodules are looked up by name: untyped
    fused, report = _fuse(copy.deepcopy(ref), unpaired=unpaired)
    if not unpaired:
        assert report == [
            "functional.fc: not fused (_Functional.forward applies gelu to it in code; fuse swaps modules, so "
            "make the activation a module)",
            "shared_act.a: Linear + ReLU -> FusedLinear(linear_relu_bias_bf16) (shared_act.act is now Identity)",
            "shared_act.b: Linear + ReLU -> FusedLinear(linear_relu_bias_bf16) (shared_act.act is now Identity)",
            "act_on_input.a: not fused (act_on_input.act runs 2 times in traced forwards, 1 of them on other "
            "values)",
            f"act_on_input.b: {KEPT_UNPAIRED}",
            "run_twice.a: not fused (run_twice.act runs 2 times in traced forwards, 1 of them on other values)",
            "run_twice.b: not fused (it runs 2 times in traced forwards)",
            "f32.a: not fused (f32.act runs 2 times in traced forwards, 1 of them on other values)",
            "f32.b: kept (weights are torch.float32; gemmgen computes in bf16/f16 (compute_dtype= casts them per "
            "call))",
            "pre.fc: not fused (its output also feeds other ops than the activation)",
            "branchy: forward not traced by torch.fx (TraceError: symbolically traced variables cannot be used as "
            "inputs to control flow); activations in it stay separate",
            "branchy.fc: kept (branchy's forward was not traced; unpaired=True swaps it for a FusedLinear)",
            "s1.fc: not fused (it is registered under 2 names)",
            "sub.0: kept (_LinearSubclass subclasses nn.Linear; its forward may differ)",
        ]
        assert type(fused["pre"].fc) is nn.Linear
    else:
        assert report[0].endswith("; Linear -> FusedLinear(linear_none_bias_bf16)")
        assert "branchy.fc: Linear -> FusedLinear(linear_none_bias_bf16)" in report
        swapped = [m for m in fused.modules() if isinstance(m, nn.Linear)]
        assert [type(m) for m in swapped] == [nn.Linear, _LinearSubclass]  # f32.b and sub.0
        assert fused["s1"].fc is fused["s2"].fc and isinstance(fused["s1"].fc, gg.nn.FusedLinear)
    assert type(fused["sub"][0]) is _LinearSubclass and isinstance(fused["shared_act"].act, nn.Identity)
    x = torch.randn(4, 16, generator=gen).bfloat16()
    for name in ref:
        for sign in (1, -1):  # both branches of the data-dependent forward
            want = ref[name](sign * x.abs())
            assert want.float().abs().max() > 0
            torch.testing.assert_close(fused[name](sign * x.abs()), want, **BF16_TOL, msg=lambda s: f"{name}: {s}")  # noqa: B023


@pytest.mark.parametrize(("module", "expected"), [
    (nn.ReLU(inplace=True), "relu"), (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh"),
    (nn.SiLU(), "silu"), (GELUActivation(), "gelu"), (GELUActivation("tanh"), "gelu_tanh"),
    (nn.Tanh(), None), (nn.LeakyReLU(), None), (nn.Identity(), None), (nn.Sequential(nn.ReLU()), None),
])
def test_activation_modules_are_recognised_by_what_they_compute(module, expected):
    assert gg.nn.activation_of(module) == expected


class _SiLUByHand(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class _NewGELU(nn.Module):
    """transformers.activations.NewGELUActivation (GPT-2's gelu_new), as transformers writes it."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class _FastGELU(nn.Module):
    """transformers.activations.FastGELUActivation (gelu_fast)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class _QuickGELU(nn.Module):
    """transformers' quick_gelu: no gemmgen activation computes it."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class _AlmostGELU(_NewGELU):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.8 * (x + 0.044715 * torch.pow(x, 3.0))))


class _ScaledSiLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return x * torch.sigmoid(x) * self.scale


class _RowSum(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x) + 0 * x.sum(-1, keepdim=True)


@pytest.mark.parametrize(("module", "expected"), [
    (_NewGELU(), "gelu_tanh"), (_FastGELU(), "gelu_tanh"), (_SiLUByHand(), "silu"), (_QuickGELU(), None),
    (_AlmostGELU(), None), (_ScaledSiLU(), None), (_RowSum(), None)])
def test_a_formula_is_recognised_by_what_it_computes(module, expected):
    """transformers spells gelu_new and gelu_fast out; each is the tanh GELU, and fuses as one. A
    formula that is no gemmgen activation (quick_gelu, a constant off), holds a buffer, or is not
    elementwise (a row sum) is not taken for one."""
    assert gg.nn.activation_of(module) == expected


def test_a_gpt2_style_mlp_fuses_its_spelled_out_gelu(gen):
    model = nn.Sequential(_linear(64, 256), _NewGELU(), _linear(256, 64))
    fused, report = _fuse(copy.deepcopy(model))
    assert report[0] == "0: Linear + _NewGELU -> FusedLinear(linear_gelu_tanh_bias_bf16) (1 is now Identity)", report
    x = torch.randn(7, 64, generator=gen).bfloat16()
    torch.testing.assert_close(fused(x), model(x), **BF16_TOL)


def test_a_bare_linear_comes_back_as_a_fused_linear_when_unpaired(gen):
    linear = _linear(16, 8)
    assert gg.nn.fuse(linear) == (linear, [f"(model): {KEPT_UNPAIRED}"])
    fused, report = _fuse(linear, unpaired=True)
    assert isinstance(fused, gg.nn.FusedLinear) and fused.weight is linear.weight
    assert report == ["(model): Linear -> FusedLinear(linear_none_bias_bf16)"]
    x = torch.randn(3, 16, generator=gen).bfloat16()
    torch.testing.assert_close(fused(x), linear(x), **BF16_TOL)


def test_a_fused_custom_module_compiles_without_graph_breaks(gen):
    fused, _ = _fuse(GatedMLP(nn.SiLU()))
    x = torch.randn(4, 64, generator=gen).bfloat16()
    explained = torch._dynamo.explain(fused)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), fused(x))


def test_layers_gemmgen_cannot_run_are_refused_or_kept_with_the_reason():
    with pytest.raises(gg.InvalidArgument, match=r"FusedLinear: in_features 12 is not a multiple of 8 .*nn\.Linear"):
        gg.nn.FusedLinear(12, 16)
    with pytest.raises(gg.InvalidArgument,
                       match=r"dtype: expected torch\.bfloat16 or torch\.float16 .*got torch\.float32"):
        gg.nn.FusedLinear(16, 16, dtype=torch.float32)
    wrong: tuple[Any, ...] = (torch.float32, "bf16")
    for bad in wrong:
        with pytest.raises(gg.InvalidArgument, match=r"compute_dtype: expected torch\.bfloat16, torch\.float16"):
            gg.nn.fuse(nn.Sequential(_linear(16, 16), nn.ReLU()), compute_dtype=bad)
        with pytest.raises(gg.InvalidArgument, match=r"compute_dtype: expected"):
            gg.nn.FusedLinear.from_linear(_linear(16, 16), compute_dtype=bad)
    odd_view = _linear(16, 8)
    odd_view.weight = nn.Parameter(torch.randn(8 * 16 + 1).bfloat16()[1:].view(8, 16))  # 2 bytes off
    model = nn.Sequential(_linear(12, 16), nn.ReLU(), odd_view, nn.SiLU())
    fused, report = _fuse(model)
    assert [type(m) for m in fused] == [nn.Linear, nn.ReLU, nn.Linear, nn.SiLU]
    assert report == [
        "0: kept (in_features 12 is not a multiple of 8 (TMA reads x and W in 16-byte rows))",
        "2: kept (weight: not in 16-byte aligned rows (a view into other memory?); the op would copy it every call)",
    ]


def _fp32_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32), nn.SiLU())


def test_mixed_precision_training_with_fp32_master_weights(gen):
    """fuse(compute_dtype=bf16) on an fp32 model trained under autocast: each FusedLinear casts its
    fp32 weights per call (as autocast casts nn.Linear's) and runs the bf16 gemmgen op; outputs and
    the fp32 weights' gradients match the unfused model under the same autocast."""
    ref = _fp32_mlp()
    fused, report = _fuse(copy.deepcopy(ref), compute_dtype=torch.bfloat16)
    assert report == [
        "0: Linear + GELU -> FusedLinear(linear_gelu_bias_bf16, torch.float32 weights cast per call) "
        "(1 is now Identity)",
        "2: Linear + SiLU -> FusedLinear(linear_silu_bias_bf16, torch.float32 weights cast per call) "
        "(3 is now Identity)"]
    assert all(p.dtype == torch.float32 for p in fused.parameters())
    x = torch.randn(6, 64, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = ref(x)
        with _Recording() as mode:
            y = fused(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert sum(op.startswith("gemmgen.") for op in mode.seen) == 2 and "aten.gelu" not in mode.seen
    assert y_ref.float().abs().max() > 0
    torch.testing.assert_close(y, y_ref, **BF16_TOL)
    g = torch.randn(y.shape, generator=gen).bfloat16()
    for mine, theirs in zip(torch.autograd.grad(y, list(fused.parameters()), g),
                            torch.autograd.grad(y_ref, list(ref.parameters()), g), strict=True):
        assert mine.dtype == theirs.dtype == torch.float32
        scale = theirs.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(mine, theirs, rtol=5e-2, atol=5e-2 * scale)


def test_inputs_are_cast_only_where_nn_linear_would_cast_them(gen):
    """A bf16 FusedLinear given an fp32 input: autocast casts it, as it does for nn.Linear; without
    autocast it is an InvalidArgument in the module's terms, where nn.Linear raises too. So are
    inputs of the wrong width or layout."""
    layer = nn.Linear(64, 32, dtype=torch.bfloat16)
    fused = gg.nn.FusedLinear.from_linear(layer, activation="relu")
    x = torch.randn(5, 64, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.relu(layer(x))
        torch.testing.assert_close(fused(x), want, **BF16_TOL)
    with pytest.raises(RuntimeError):
        layer(x)
    with pytest.raises(gg.InvalidArgument, match=r"input: dtype torch\.float32, but this layer computes in "
                       r"torch\.bfloat16; cast the input .* or run under torch\.autocast"):
        fused(x)
    for wrong in (torch.randn(5, 32).bfloat16(), torch.randn(4, 32).bfloat16(), torch.tensor(1.0).bfloat16(),
                  torch.randn(5, 64).bfloat16().to_sparse()):  # (4, 32) would reshape to (2, 64) unchecked
        with pytest.raises(gg.InvalidArgument, match=r"input: expected a dense tensor of shape \(\.\.\., 64\)"):
            fused(wrong)


def test_autocast_training_compiles_without_graph_breaks(gen):
    fused, _ = _fuse(_fp32_mlp(), compute_dtype=torch.bfloat16)
    x = torch.randn(4, 64, generator=gen)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused(x)

    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch.testing.assert_close(torch.compile(step, fullgraph=True, backend="aot_eager")(x), step(x))


def test_modules_with_hooks_are_not_replaced(gen):
    """A hook (activation capture, checkpointing) on the Linear or the activation would be dropped
    by a replacement: the pair stays as it is, and the hooks keep firing."""
    seen = []
    hooked_linear = nn.Sequential(_linear(16, 16), nn.ReLU())
    hooked_linear[0].register_forward_hook(lambda m, i, o: seen.append("linear"))
    hooked_act = nn.Sequential(_linear(16, 16), nn.GELU())
    hooked_act[1].register_forward_pre_hook(lambda m, i: seen.append("act"))
    model: Any = nn.ModuleDict({"lin": hooked_linear, "act": hooked_act})
    fused, report = _fuse(model)
    assert report == ["lin.0: kept (it has hooks, which a replacement would drop)",
                      "act.0: not fused (act.1 has hooks, which Identity would drop)"]
    assert type(fused["lin"][0]) is nn.Linear and type(fused["act"][1]) is nn.GELU
    x = torch.randn(3, 16, generator=gen).bfloat16()
    fused["lin"](x), fused["act"](x)
    assert seen == ["linear", "act"]


def test_fused_models_pickle_and_deepcopy(gen):
    """torch.save(model), pickle and deepcopy work as for nn.Linear models: each FusedLinear
    rebuilds its recipes (shared, from the cache) instead of pickling their lambdas."""
    import io
    import pickle

    model: Any = nn.ModuleDict({"mlp": GatedMLP(nn.SiLU()), "amp": _fp32_mlp()})
    fused, _ = _fuse(model["mlp"])
    fused_amp, _ = _fuse(model["amp"], compute_dtype=torch.bfloat16)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    again = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    x = torch.randn(3, 64, generator=gen)
    copies: tuple[Any, ...] = (loaded, again, twin)  # submodules are looked up by attribute: untyped
    for other in copies:
        assert other["mlp"].gate_proj.recipe is fused.gate_proj.recipe
        assert other["amp"][0].compute_dtype == torch.bfloat16 and other["amp"][0].weight.dtype == torch.float32
        assert torch.equal(other["mlp"](x.bfloat16()), fused(x.bfloat16()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(other["amp"](x), fused_amp(x))


def test_model_launches_lists_each_kernel_a_fused_model_needs_once():
    """What to warm up for a model: every FusedLinear's forward kernel per token count and, for
    the training counts, the kernel that also stores the pre-activation; duplicates once."""
    twin = nn.Linear(4096, 4096, dtype=torch.bfloat16, device="meta")
    model: Any = nn.Sequential(nn.Linear(4096, 4096, dtype=torch.bfloat16, device="meta"), nn.SiLU(), twin,
                               nn.SiLU())
    fused, _ = _fuse(model)
    first, second = fused[0], fused[2]
    got = gg.nn.model_launches(fused, (8, 4096), training_tokens=(4096,))
    assert got == [first.launches(8), first.launches(4096), first.launches(4096, training=True)]  # same shapes
    assert got[0][1].swap_ab and not got[1][1].swap_ab and got[2][0] is first.training_recipe
    assert second.launches(8) == got[0]
    assert gg.nn.model_launches(nn.Sequential(nn.ReLU()), (8,)) == []


def test_training_options_apply_to_every_layer_fuse_makes(gen):
    """`fuse(recompute=True, accumulate_grad=True)`: each FusedLinear and FusedMLP it makes (a pair,
    an MLP chain, a gated MLP) has both; a step then leaves the fused weights' gradients in fp32
    `main_grad` (no `.grad`; the biases' stay `.grad`), equal to the unfused model's, and the
    output is the unfused one."""
    model = nn.ModuleDict({"pair": nn.Sequential(_linear(64, 96), nn.SiLU()),
                           "chain": nn.Sequential(_linear(64, 128), nn.GELU(), _linear(128, 64)),
                           "gated": GatedMLP(nn.SiLU())})
    fused, report = _fuse(copy.deepcopy(model), mlp=True, recompute=True, accumulate_grad=True)
    made = [m for m in fused.modules() if isinstance(m, gg.nn.FusedLinear | gg.nn.FusedMLP)
            and not any(m is c for p in fused.modules() if isinstance(p, gg.nn.FusedMLP) for c in (p.fc1, p.fc2))]
    assert sorted(type(m).__name__ for m in made) == ["FusedLinear", "FusedMLP", "FusedMLP"], report
    assert all(m.recompute and m.accumulate_grad for m in made)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    outs = [fused[k](x) for k in ("pair", "chain", "gated")]
    wants = [model[k](x) for k in ("pair", "chain", "gated")]
    for got, want in zip(outs, wants, strict=True):
        torch.testing.assert_close(got, want, **BF16_TOL)
    sum(o.float().sum() for o in outs).backward()
    sum(w.float().sum() for w in wants).backward()
    for (name, p), (_, q) in zip(fused.named_parameters(), model.named_parameters(), strict=True):
        assert q.grad is not None, name
        if name.endswith("weight"):  # weights into main_grad; a bias's gradient stays .grad
            assert p.grad is None and p.main_grad.dtype == torch.float32, name
            torch.testing.assert_close(p.main_grad, q.grad.float(), rtol=2e-2, atol=5e-2)
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=5e-2)


def test_training_options_are_refused_where_they_cannot_apply():
    seq = nn.Sequential(_linear(64, 64), nn.GELU())
    with pytest.raises(gg.InvalidArgument, match="recompute: a training option; quantize='fp8_block'"):
        gg.nn.fuse(copy.deepcopy(seq), quantize="fp8_block", recompute=True)
    with pytest.raises(gg.InvalidArgument, match=r"fuse: recompute=True with precision="):
        gg.nn.fuse(copy.deepcopy(seq), precision=gg.training.Float8Blockwise(), recompute=True)
    with pytest.raises(gg.InvalidArgument, match="accumulate_grad: expected True or False, got 1"):
        gg.nn.fuse(copy.deepcopy(seq), accumulate_grad=1)  # type: ignore[arg-type]

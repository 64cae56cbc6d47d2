"""FusedMLP and FusedLinear in training: gradients against the unfused model in float64, what a
backward launches, what a forward saves, fp32 weight-gradient accumulation (`main_grad`)."""

from __future__ import annotations

import collections
import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gemmgen as gg
from tests.data.gated import LlamaMLP
from tests.nn.dispatched import DispatchedOps

_TORCH_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU}


def _linears(model: nn.Sequential) -> tuple[nn.Linear, nn.Linear]:
    first, second = model[0], model[2]
    assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
    return first, second


def _pair(activation: str, bias: bool, recompute: bool = False, accumulate_grad: bool = False,
          sizes: tuple[int, int, int] = (40, 72, 24)) -> tuple[gg.nn.FusedMLP, nn.Sequential]:
    """A FusedMLP (bf16) and the unfused model with the same weights."""
    n_in, hidden, n_out = sizes
    unfused = nn.Sequential(nn.Linear(n_in, hidden, bias=bias), _TORCH_ACTIVATIONS[activation](),
                            nn.Linear(hidden, n_out, bias=bias)).bfloat16()
    fc1, fc2 = _linears(unfused)
    fused = gg.nn.FusedMLP.from_linears(copy.deepcopy(fc1), activation, copy.deepcopy(fc2), recompute=recompute,
                                        accumulate_grad=accumulate_grad)
    return fused, unfused


def _grads(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of x and of the parameters (or their `main_grad`) for dL/dy = g."""
    x = x.clone().requires_grad_()
    model(x).backward(g)
    params = [p.grad if p.grad is not None else p.main_grad for p in model.parameters()]  # type: ignore[attr-defined]
    assert x.grad is not None
    return [x.grad, *params]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert want.abs().max() > 0
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", sorted(_TORCH_ACTIVATIONS))
@pytest.mark.parametrize("lead", [(3, 7), (1,)], ids=["21rows", "1row"])
def test_fused_mlp_gradients_match_the_unfused_model(activation, bias, recompute, lead):
    """Every gradient (input, weights, biases) against the unfused model in float64 on fresh
    inputs: no further from it than the unfused model's own bf16 run is, plus a bf16 rounding.
    At ReLU's kink a pre-activation within rounding of 0 takes either side in any bf16 model, and
    one such row moves a weight gradient by a few percent: the float64 model takes the side the
    fused kernel's own pre-activation takes (the saved accumulator in bf16, or recomputed in
    fp32, plus the bias)."""
    fused, unfused = _pair(activation, bias, recompute)
    x = torch.randn(*lead, 40).bfloat16()
    g = torch.randn(*lead, 24).bfloat16()
    exact = copy.deepcopy(unfused).double()
    if activation == "relu":
        fc1, _ = _linears(unfused)
        acc = x.float() @ fc1.weight.float().t()
        b1 = fc1.bias if fc1.bias is not None else torch.zeros(())
        pre = (acc if recompute else acc.bfloat16().float()) + b1.float()
        exact[1] = _Mask(pre > 0)
        torch_bf16_exact = copy.deepcopy(exact)
        torch_bf16_exact[1] = _Mask(fc1(x) > 0)
    else:
        torch_bf16_exact = exact
    want, base_want = _grads(exact, x.double(), g.double()), _grads(torch_bf16_exact, x.double(), g.double())
    mine, torch_bf16 = _grads(fused, x, g), _grads(unfused, x, g)
    for i, (got, base, ref, base_ref) in enumerate(zip(mine, torch_bf16, want, base_want, strict=True)):
        bound = 2 * _relative(base, base_ref) + 2**-8
        assert _relative(got, ref) <= bound, (i, _relative(got, ref), _relative(base, base_ref))
    y, x64 = fused(x), x.double()
    assert _relative(y, exact(x64)) <= 2 * _relative(unfused(x), torch_bf16_exact(x64)) + 2**-8


class _Mask(nn.Module):
    """ReLU with its sides fixed: x where `mask`, else 0."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask.reshape(x.shape)


def _backward_ops(model: nn.Module) -> collections.Counter:
    model.zero_grad(set_to_none=True)  # no accumulation into earlier gradients
    x = torch.randn(21, 40).bfloat16().requires_grad_()
    y = model(x)
    g = torch.randn_like(y)
    with DispatchedOps() as ops:
        y.backward(g)
    return ops.ops


def test_the_backward_fuses_the_activation_and_bias_gradients_into_fc2s_dgrad():
    """At the layer boundary the unfused model runs fc2's dgrad GEMM, then the activation's
    backward and fc1's bias reduction; FusedMLP runs one gemmgen kernel for the three. The rest
    is the same: the other GEMMs and fc2's bias sum (counted with a dispatch mode: each op is a
    kernel on a GPU; the CPU runs the same ops)."""
    fused, unfused = _pair("gelu", bias=True)
    assert _backward_ops(unfused) == {"mm": 4, "gelu_backward": 1, "sum": 2}
    assert _backward_ops(fused) == {"gemmgen": 1, "mm": 3, "sum": 1}
    fused, _ = _pair("silu", bias=True, recompute=True)
    assert _backward_ops(fused) == {"gemmgen": 1, "mm": 4, "sum": 1}  # dL/dh as a GEMM, fc1's again fused


def _saved_shapes(model: nn.Module, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd keeps from a forward (parameters aside)."""
    shapes = []
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return shapes


def test_recompute_keeps_no_hidden_sized_tensor():
    x = torch.randn(21, 40).bfloat16().requires_grad_()
    saved, _ = _pair("gelu", bias=True)
    recomputing, _ = _pair("gelu", bias=True, recompute=True)
    assert sorted(_saved_shapes(saved, x)) == [(21, 40), (21, 72), (21, 72)]  # x, the accumulator, h
    assert _saved_shapes(recomputing, x) == [(21, 40)]  # x only
    layer = gg.nn.FusedLinear(40, 72, activation="silu", recompute=True)
    assert _saved_shapes(layer, x) == [(21, 40)]
    assert sorted(_saved_shapes(gg.nn.FusedLinear(40, 72, activation="silu"), x)) == [(21, 40), (21, 72)]


@pytest.mark.parametrize("activation", ["gelu", "silu"])  # smooth: no kink to decide differently
def test_fused_linear_recompute_launches_the_derived_kernel(activation):
    """FusedLinear(recompute=True): the same gradients as saving the pre-activation, with one
    gemmgen kernel (the GEMM again, dL/dpre and the bias gradient) for the activation's backward
    and the bias sum."""
    torch.manual_seed(0)
    saving = gg.nn.FusedLinear(40, 72, activation=activation)
    recomputing = copy.deepcopy(saving)
    recomputing.recompute = True
    recomputing._set_recipes()
    x, g = torch.randn(21, 40).bfloat16(), torch.randn(21, 72).bfloat16()
    linear = nn.Linear(40, 72).double()
    with torch.no_grad():
        assert saving.bias is not None
        linear.weight.copy_(saving.weight)
        linear.bias.copy_(saving.bias)
    exact = nn.Sequential(linear, _TORCH_ACTIVATIONS[activation]())
    want = _grads(exact, x.double(), g.double())
    for got_s, got_r, ref in zip(_grads(saving, x, g), _grads(recomputing, x, g), want, strict=True):
        assert _relative(got_r, ref) <= 2 * _relative(got_s, ref) + 2**-8
    assert _backward_ops(recomputing) == {"gemmgen": 1, "mm": 2}  # no activation backward, no bias sum
    assert _backward_ops(saving) == {"mm": 2, f"{'gelu' if activation == 'gelu' else 'silu'}_backward": 1, "sum": 1}


def test_accumulate_grad_adds_into_main_grad_in_fp32():
    """Two steps add into the weights' fp32 `main_grad` (made on first use, kept after), leaving
    `.grad` unset, as Megatron-LM's gradient-accumulation fusion does; the biases get `.grad`."""
    fused, unfused = _pair("gelu", bias=True, accumulate_grad=True)
    x, g = torch.randn(21, 40).bfloat16(), torch.randn(21, 24).bfloat16()
    exact = copy.deepcopy(unfused).double()
    for _ in range(2):
        fused(x).backward(g)
        exact(x.double()).backward(g.double())
    for mine, ref in zip((fused.fc1, fused.fc2), _linears(exact), strict=True):
        main_grad = mine.weight.main_grad  # type: ignore[attr-defined]
        assert mine.weight.grad is None and main_grad.dtype == torch.float32
        assert mine.bias is not None and mine.bias.grad is not None and ref.bias.grad is not None
        assert ref.weight.grad is not None
        assert _relative(main_grad, ref.weight.grad) <= 2**-7
        assert _relative(mine.bias.grad, ref.bias.grad) <= 2**-7
    buffer = fused.fc1.weight.main_grad  # type: ignore[attr-defined]
    fused(x).backward(g)
    assert fused.fc1.weight.main_grad is buffer  # type: ignore[attr-defined]  # the same buffer, added into
    fused.fc2.weight.main_grad = torch.zeros(3, 3)  # type: ignore[attr-defined]
    with pytest.raises(gg.InvalidArgument, match=r"main_grad: expected an fp32 tensor of the weight's shape"):
        fused(x).backward(g)


def test_fused_mlp_as_a_module():
    mlp = gg.nn.FusedMLP(40, 72, 24, activation="silu", recompute=True)
    assert "activation='silu', recompute=True" in repr(mlp)
    clone = pickle.loads(pickle.dumps(mlp))
    x = torch.randn(5, 40).bfloat16()
    torch.testing.assert_close(clone(x), mlp(x))
    with torch.no_grad():
        assert mlp(x.reshape(1, 5, 40)).shape == (1, 5, 24)
    launches = gg.nn.model_launches(nn.Sequential(mlp), tokens=(16,), training_tokens=(4096,))
    names = [r.name for r, _ in launches]  # for 16 rows; then a training step of 4096 (each its config)
    forward = ["linear_silu_bias_bf16", "linear_none_bias_bf16"]
    assert names == forward * 2 + ["linear_silu_bias_bf16_bwd_recompute"], names
    saving = gg.nn.FusedMLP(40, 72, 24, accumulate_grad=True)
    names = [r.name for r, _ in gg.nn.model_launches(saving, tokens=(), training_tokens=(64,))]
    assert names == ["linear_gelu_bias_bf16_train", "linear_none_bias_bf16", "linear_gelu_bias_bf16_bwd",
                     "weight_grad_accumulate_bf16", "weight_grad_accumulate_bf16"], names  # per weight's shape
    with pytest.raises(gg.InvalidArgument, match="a FusedMLP needs one of relu, gelu, gelu_tanh, silu"):
        gg.nn.FusedMLP(40, 72, 24, activation=None)  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidArgument, match="recompute: expected True or False"):
        gg.nn.FusedMLP(40, 72, 24, recompute="yes")  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidArgument, match="fc1's 72 outputs must feed fc2's 64 inputs"):
        gg.nn.FusedMLP.from_linears(nn.Linear(40, 72), "gelu", nn.Linear(64, 8))


_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"swiglu": torch.nn.functional.silu,
                                                              "geglu": torch.nn.functional.gelu}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", sorted(_GATED))
@pytest.mark.parametrize("lead", [(3, 7), (1,)], ids=["21rows", "1row"])
def test_gated_fused_mlp_gradients_match_the_unfused_model(activation, bias, lead):
    """SwiGLU / GEGLU: fc1's weight and bias are the gate's and up's interleaved
    (gemmgen.nn.interleave_pairs); every gradient against the unfused model in float64, no
    further than the unfused bf16 model's own plus a bf16 rounding (fc1's gradients interleaved
    the same way). Without biases fc2's dgrad GEMM carries fc1's derived epilogue; with them the
    layer recomputes."""
    unfused = LlamaMLP(40, 48, 24, bias, act=_GATED[activation]).bfloat16()
    fused = gg.nn.FusedMLP.from_linears(unfused.fc1(), activation, copy.deepcopy(unfused.down))
    assert fused.recompute == bias and fused.fc1.weight_rows == 96 and fused.fc1.out_features == 48
    x, g = torch.randn(*lead, 40).bfloat16(), torch.randn(*lead, 24).bfloat16()
    exact = copy.deepcopy(unfused).double()

    def gated_grads(model: LlamaMLP, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        gx, *params = _grads(model, x, g)
        return [gx, *model.fused_order(params)]

    want, base = gated_grads(exact, x.double(), g.double()), gated_grads(unfused, x, g)
    mine = _grads(fused, x, g)
    assert len(mine) == len(want)
    for i, (got, ref, torch_bf16) in enumerate(zip(mine, want, base, strict=True)):
        bound = 2 * _relative(torch_bf16, ref) + 2**-8
        assert _relative(got, ref) <= bound, (i, _relative(got, ref), _relative(torch_bf16, ref))
    assert _relative(fused(x), exact(x.double())) <= 2 * _relative(unfused(x), exact(x.double())) + 2**-8


def test_a_gated_fused_linear_trains_saving_or_recomputing():
    """FusedLinear(activation="swiglu"): out_features columns from a weight of twice the rows; its
    backward, from the saved pre-activation (aten's silu_backward on the gate) or recomputed (the
    derived kernel), gives the same gradients."""
    saving = gg.nn.FusedLinear(40, 48, activation="swiglu")
    recomputing = copy.deepcopy(saving)
    recomputing.recompute = True
    recomputing._set_recipes()
    assert saving.weight.shape == (96, 40) and saving.bias is not None and saving.bias.shape == (96,)
    x, g = torch.randn(21, 40).bfloat16(), torch.randn(21, 48).bfloat16()
    a, b = _grads(saving, x, g), _grads(recomputing, x, g)
    for got, ref in zip(b, a, strict=True):
        assert _relative(got, ref.double()) <= 2**-6
    assert _backward_ops(recomputing)["gemmgen"] == 1


def test_gated_activations_are_refused_where_pairs_are_not_built():
    with pytest.raises(gg.RecipeError, match=r"'swiglu' is a gated activation .* FusedLinear, FusedMLP and "
                       r"GroupedLinear take"):
        gg.nn.BlockScaledGroupedLinear.from_linears([nn.Linear(128, 128) for _ in range(2)], activation="swiglu")
    with pytest.raises(gg.InvalidArgument, match=r"71 output features; a gated activation"):
        gg.nn.FusedLinear.from_linear(nn.Linear(40, 71).bfloat16(), "swiglu")


def test_a_gated_mlps_backward_fuses_the_gated_derivative_into_one_kernel():
    """The unfused gated MLP's backward runs six GEMMs, SiLU's backward, two products, an add and
    three bias sums. The fused one without biases (Llama's): fc2's dgrad GEMM with fc1's derived
    epilogue (dL/dgate and dL/dup from the saved accumulator's pairs: one gemmgen kernel at the
    layer boundary), then the dgrad and two wgrad GEMMs. With biases it recomputes: dL/dh as a
    GEMM, fc1's GEMM again with the derived epilogue (one gemmgen kernel, also writing h), the
    dgrad and wgrad GEMMs and the two bias sums (fc1's a sum over the tokens, torch's)."""
    unfused = LlamaMLP(40, 48, 24, bias=True).bfloat16()
    assert _backward_ops(unfused) == {"mm": 6, "sum": 3, "mul": 2, "silu_backward": 1, "add": 1}
    saving = gg.nn.FusedMLP(40, 48, 24, activation="swiglu", bias=False)
    assert not saving.recompute and _backward_ops(saving) == {"mm": 3, "gemmgen": 1}
    recomputing = gg.nn.FusedMLP(40, 48, 24, activation="swiglu")
    assert recomputing.recompute and _backward_ops(recomputing) == {"mm": 4, "gemmgen": 1, "sum": 2}


class ChunkedGLU(nn.Module):
    """As transformers writes ModernBERT's MLP: gate and up the halves of one Linear's outputs."""

    def __init__(self, hidden: int, inter: int, bias: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.Wi = nn.Linear(hidden, 2 * inter, bias=bias)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.Wo = nn.Linear(inter, hidden, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_, gate = self.Wi(hidden_states).chunk(2, dim=-1)  # transformers names them input, gate
        return self.Wo(self.drop(self.act(input_) * gate))


@pytest.mark.parametrize(("bias", "recompute", "accumulate_grad"),
                         [(False, False, False), (True, False, False), (False, True, False), (False, False, True)])
def test_a_chunked_glu_fuses_and_trains_as_the_unfused_one(bias: bool, recompute: bool, accumulate_grad: bool) -> None:
    torch.manual_seed(7)
    unfused = ChunkedGLU(48, 40, bias).bfloat16()
    fused, report = gg.nn.fuse(copy.deepcopy(unfused), mlp=True, recompute=recompute, accumulate_grad=accumulate_grad)
    assert isinstance(fused, gg.nn.FusedMLP) and fused.activation == "geglu", report
    assert list(fused.state_dict()) == list(unfused.state_dict())
    x = torch.randn(2, 7, 48).bfloat16()
    exact = copy.deepcopy(unfused).double()
    xd = x.double().requires_grad_()
    want = exact(xd)
    xf = x.clone().requires_grad_()
    got = fused(xf)
    assert got.shape == (2, 7, 48) and got.dtype == torch.bfloat16 and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g.bfloat16())
    wi: Any = fused.get_submodule("Wi").weight
    got_wi = wi.main_grad if accumulate_grad else wi.grad
    assert got_wi is not None and got_wi.shape == (80, 48) and exact.Wi.weight.grad is not None
    assert xf.grad is not None and xd.grad is not None
    for mine, ref in ((got_wi, exact.Wi.weight.grad), (xf.grad, xd.grad)):
        assert (mine.double() - ref).norm() / ref.norm() < 2e-2


def test_a_chunked_glu_with_dropout_is_left_with_the_reason() -> None:
    _, report = gg.nn.fuse(ChunkedGLU(48, 40, False, dropout=0.1).bfloat16(), mlp=True)
    assert any(line.startswith("Wi: not fused") and "chunked GLU" in line for line in report), report

"""GroupedLinear under Float8Tensorwise (issue 58, the per-tensor recipe), checked on the CPU as
tests/training/test_grouped_float8.py checks Float8Blockwise's experts:

(a) forward and every gradient equal to the reference quantizer's values (test_float8_tensorwise's,
    written from the definition: one scale per tensor, and per expert for the weights) pushed
    through fp64 GEMMs, one expert at a time, at odd sizes (experts of 0, 1, 127 and 129 tokens);
(b) signal-to-noise against the experts in fp32, above floors derived from the formats (below);
and delayed scaling's histories (one per expert for the weights), advanced once per step.
The kernels' emulation through their tensor maps is in tests/training/test_grouped_float8.py.
"""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.training import Float8Tensorwise
from tests.nn.dispatched import DispatchedOps
from tests.training.test_float8_blockwise import _snr
from tests.training.test_float8_tensorwise import reference_tensorwise
from tests.training.test_grouped_float8 import SIZES, _act, _fp32_experts, _layer, _Outputs, _routed

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _dq(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t through the reference quantizer (one scale for all of t) and back, float64."""
    q, scale = reference_tensorwise(t, dtype)
    return q * scale


@pytest.mark.parametrize("activation", [None, "silu", "swiglu"])
def test_grouped_linear_computes_its_definition(activation):
    """y = e4m3(x) e4m3(W_e)^T + b_e per expert (x one scale, each W_e its own), dL/dacc from the
    derived kernel, dx = e5m2(dL/dacc) e4m3(W_e), dW_e = e5m2(dL/dacc)_e^T e4m3(x)_e (the same values
    as dgrad's and fprop's, laid out along each expert's tokens); rows in no expert not written and
    given no gradient."""
    layer, x, offsets = _layer(activation, precision=Float8Tensorwise())
    x.requires_grad_()
    with _Outputs() as seen:
        y = layer(x, offsets)
        g = torch.randn_like(y)
        y.backward(g)
    w = layer.weight.detach()
    b = layer.bias.detach() if layer.bias is not None else None
    xq = _dq(x.detach(), E4M3)
    wq = torch.stack([_dq(w[e], E4M3) for e in range(w.shape[0])])  # a scale per expert
    ys, want_g_acc, first = [], [], 0
    for e, end in enumerate(offsets.tolist()):
        pre = (xq[first:end] @ wq[e].t() + (b[e].double() if b is not None else 0)).requires_grad_()
        out = _act(activation, pre)
        (g_acc,) = torch.autograd.grad(out, pre, g[first:end].double()) if end > first else (pre.detach(),)
        ys.append(out.detach())
        want_g_acc.append(g_acc)
        first = end
    torch.testing.assert_close(y[:first].double(), torch.cat(ys), rtol=2**-7, atol=1e-5)  # one bf16 rounding
    derived = [v for k, v in seen.outputs.items() if "_dacc" in k]
    assert len(derived) == (activation is not None)
    g_acc = derived[0][:first] if derived else g[:first]
    torch.testing.assert_close(g_acc.double(), torch.cat(want_g_acc), rtol=2**-7, atol=1e-5)
    gq = _dq(g_acc, E5M2)  # the values the layer holds, quantized as one tensor
    dx, dw, start = [], [], 0
    for e, end in enumerate(offsets.tolist()):
        dx.append(gq[start:end] @ wq[e])
        dw.append(gq[start:end].t() @ xq[start:end])
        start = end
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad[:first].double(), torch.cat(dx), rtol=2**-7, atol=1e-5)
    assert not x.grad[first:].any()
    torch.testing.assert_close(layer.weight.grad.double(), torch.stack(dw), rtol=2**-7, atol=1e-5)
    assert not layer.weight.grad[[0, 4]].any()  # the empty experts


#: Floors from the formats (HYBRID: e4m3 forward, e5m2 gradients): one GEMM over e4m3 operands, as
#: the blockwise recipe's (27 dB); a gradient's GEMM reads an e5m2 operand, whose 2 mantissa bits
#: alone give 25.6 dB on normal data (measured: 31.5 dB for e4m3), so dX and dW take 22 dB, 3 dB
#: below it as the product of SwiGLU's two GEMMs takes 3 dB off its output's floor too.
FLOORS = (27, 22, 22)


EIGHT = (0, 1, 127, 129, 300, 211, 6, 250)


@pytest.mark.parametrize(("activation", "scaling", "sizes"), [
    (None, "current", EIGHT), ("swiglu", "current", EIGHT), ("swiglu", "delayed", EIGHT),
    ("swiglu", "current", _routed(64, 1024, 5))], ids=["8-None", "8-swiglu", "8-swiglu-delayed", "64-swiglu"])
def test_grouped_linear_signal_to_noise_is_above_the_formats_floors(activation, scaling, sizes):
    """1024 routed tokens over 8 experts (and 64, a skewed router's, some empty), 512 -> 256,
    against the experts in fp32 (delayed: the second step, its scales from the first's amaxes).
    Measured 28.7 / 24.7 / 24.6 dB (output / dX / dW) without an activation and 25.5-25.6 / 23.0 /
    23.0 with SwiGLU (8 or 64 experts)."""
    layer, _, offsets = _layer(activation, n_in=512, out=256, sizes=sizes, seed=2,
                               precision=Float8Tensorwise(scaling=scaling))
    x = torch.randn(1024, 512).bfloat16().requires_grad_()
    for _ in range(2 if scaling == "delayed" else 1):
        x.grad = None
        layer.zero_grad()
        y = layer(x, offsets)
        g = torch.randn_like(y, dtype=torch.float32)
        y.backward(g.bfloat16())
        with torch.no_grad():
            layer.weight.add_(0.0)  # an optimizer step: the histories advance
    want_y, want_dx, want_dw = _fp32_experts(layer, x.detach(), offsets, g)
    assert x.grad is not None and layer.weight.grad is not None
    out_floor, dx_floor, dw_floor = FLOORS
    assert _snr(y, want_y) >= out_floor - (3 if activation == "swiglu" else 0)
    assert _snr(x.grad, want_dx) >= dx_floor
    assert _snr(layer.weight.grad, want_dw) >= dw_floor


def test_its_step_launches_gemmgen_kernels_only_and_reads_each_experts_scale():
    """fprop, dL/dacc, dgrad and the K-grouped wgrad: gemmgen ops only; the weights' scales are one
    per expert (an expert 100 times larger keeps the others' precision)."""
    layer, x, offsets = _layer("swiglu", precision=Float8Tensorwise())
    with torch.no_grad():
        layer.weight[2] *= 100
    x.requires_grad_()
    with DispatchedOps() as seen:
        layer(x, offsets).float().square().sum().backward()
    assert seen.ops["gemmgen"] == 4
    assert not {"mm", "bmm", "matmul", "addmm", "_grouped_mm"} & set(seen.ops)
    held = layer._weights._held
    assert held is not None
    scales = held[1].rows.scale
    assert scales.shape == (len(SIZES),)
    want = layer.weight.detach().float().abs().amax(dim=(1, 2)) / 448
    torch.testing.assert_close(scales, want, rtol=0, atol=0)
    plan = [g.recipe.name for g in gg.nn.plan.grouped_plan(layer, 300) if g.recipe is not None]
    assert len(plan) == 4 and all("fp8tensor" in name for name in plan)


def test_delayed_scaling_keeps_a_history_per_expert_advanced_once_per_step():
    layer, x, offsets = _layer("silu", precision=Float8Tensorwise(scaling="delayed"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):  # micro-batches: the first step's scales stay 1
        layer(x, offsets).float().sum().backward()
    precision = layer.precision
    assert precision is not None
    weight = layer._weights.history("weight", precision)
    assert weight is not None and weight.amax is not None and weight.amaxes is not None
    assert weight.amax.shape == (len(SIZES),) and weight.amax.isnan().all()
    torch.testing.assert_close(weight.amaxes[0], layer.weight.detach().float().abs().amax(dim=(1, 2)))
    before = layer.weight.detach().float().abs().amax(dim=(1, 2))
    opt.step()
    layer(x, offsets).float().sum().backward()
    held = layer._weights._held
    assert held is not None and layer._weights.quantized == 2
    torch.testing.assert_close(held[1].rows.scale, before / 448, rtol=0, atol=0)  # last step's amaxes
    x_history = layer._weights.history("input", precision)
    assert x_history is not None and x_history.amax is not None
    assert x_history.amax.item() == x.float().abs().max().item()

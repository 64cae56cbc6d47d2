"""Float8Tensorwise training (issue 57), checked on the CPU as Float8Blockwise is
(tests/training/test_float8_blockwise.py): the quantizer bit-exact against one written here from
the recipe's definition (one scale per tensor, amax over the format's largest value; e4m3 for X
and W, e5m2 for gradients), the delayed scales against Transformer Engine's history rules, each
GEMM's operands, the layer against its definition in fp64, and signal-to-noise above torchao's
floors (its launches per step: tests/training/test_float8_blockwise.py). The loss-parity tier is
tests/training/test_loss_parity.py."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import InvalidArgument
from gemmgen.training import AmaxAlgorithm, AmaxHistory, Float8Tensorwise, Gemm
from tests.training.test_float8_blockwise import _awkward, _grads, _mlp_pair, _snr

#: each format's largest finite value and its codes of finite non-negative values
_FORMATS = {torch.float8_e4m3fn: (448.0, 0x7F), torch.float8_e5m2: (57344.0, 0x7C)}


def reference_fp8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to `dtype` as the recipe defines it, without torch's fp8 cast: the
    nearest value of the format's grid, a tie to the even code, saturating, NaN kept. float64."""
    top, end = _FORMATS[dtype]
    codes = torch.arange(0, end, dtype=torch.uint8)
    grid, even = codes.view(dtype).double(), codes % 2 == 0
    mag = v.double().abs().clamp(max=top).contiguous()
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    pick_hi = (grid[hi] - mag < mag - grid[lo]) | ((grid[hi] - mag == mag - grid[lo]) & even[hi])
    out = torch.where(pick_hi, grid[hi], grid[lo]) * v.double().sign()
    return torch.where(v.isnan(), torch.nan, out)


def reference_tensorwise(x: torch.Tensor, dtype: torch.dtype, scale: float | None = None
                         ) -> tuple[torch.Tensor, float]:
    """(values as float64, the fp32 scale): scale = amax / the format's largest value in fp32 (1
    for zeros), or the given one; value = fp8(fp32(x / scale))."""
    top = _FORMATS[dtype][0]
    if scale is None:
        amax = x.float().abs().max().item()
        scale = float(torch.tensor(amax / top, dtype=torch.float32)) if amax > 0 else 1.0
    return reference_fp8((x.double() / scale).float(), dtype), scale


def test_the_e5m2_reference_would_see_a_wrong_rounding():
    """The grid rounding above, for e5m2 (2 mantissa bits): 1.1 -> 1.0, the tie 1.125 -> 1.0 (even
    code), 1.375 -> 1.5 (tie to even), saturation at 57344; torch's cast agrees."""
    v = torch.tensor([1.1, 1.125, 1.375, 60000.0])
    want = torch.tensor([1.0, 1.0, 1.5, 57344.0], dtype=torch.float64)
    assert torch.equal(reference_fp8(v, torch.float8_e5m2), want)
    assert not torch.equal(reference_fp8(v, torch.float8_e4m3fn), want)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_quantizer_is_bit_exact_against_one_written_from_the_definition(dtype):
    x = _awkward(300, 272, seed=5)
    fmt = gg.DType.E4M3 if dtype == torch.float8_e4m3fn else gg.DType.E5M2
    q, scale = Float8Tensorwise().quantize(x, fmt)
    want_q, want_scale = reference_tensorwise(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape and scale.shape == (1,)
    assert scale.item() == want_scale and torch.equal(q.double(), want_q)
    q, scale = Float8Tensorwise().quantize(torch.zeros(3, 16).bfloat16(), fmt)
    assert scale.item() == 1.0 and not q.double().any()


def test_each_gemm_reads_its_operands_in_its_format():
    """fprop reads X and W in e4m3; dgrad and wgrad read the gradient in e5m2 (their A) with W
    and X in e4m3; one scale per tensor, so each transposed copy is the same values (K-major)."""
    from gemmgen.nn.low_precision import linear_gemms

    gemms = linear_gemms(Float8Tensorwise(), None, False, torch.bfloat16)
    assert (gemms.fprop.recipe.ir.gemm.a, gemms.fprop.recipe.ir.gemm.b) == (gg.e4m3, gg.e4m3)
    for caller in (gemms.dgrad, gemms.wgrad, gemms.wgrad_accumulate):
        assert (caller.recipe.ir.gemm.a, caller.recipe.ir.gemm.b) == (gg.e5m2, gg.e4m3)
        assert caller.recipe.ir.gemm.block_scale is None
    x, w, g = _awkward(200, 144, 1), _awkward(272, 144, 2), _awkward(200, 272, 3)
    a = gemms.operand(x, Gemm.FPROP, "a")
    want, scale = reference_tensorwise(x, torch.float8_e4m3fn)
    assert torch.equal(a.data.double(), want) and a.scale.item() == scale
    b = gemms.operand(x.t(), Gemm.WGRAD, "b")
    assert b.data.stride(0) == 1 and torch.equal(b.data.double(), want) and b.scale.item() == scale
    ga = gemms.operand(g, Gemm.DGRAD, "a")
    want, scale = reference_tensorwise(g, torch.float8_e5m2)
    assert ga.data.dtype == torch.float8_e5m2 and torch.equal(ga.data.double(), want) and ga.scale.item() == scale
    qw = gemms.weight(w)
    want, scale = reference_tensorwise(w, torch.float8_e4m3fn)
    assert torch.equal(qw.rows.data.t().double(), want) and torch.equal(qw.columns.data.double(), want)
    assert qw.columns.data.stride(0) == 1 and qw.rows.scale.item() == qw.columns.scale.item() == scale


def test_delayed_scales_follow_the_amax_history():
    """Transformer Engine's rules: scale 1 until a first step ends; then the history's max (or
    most recent) amax over the format's largest value, times 2^margin; a step of zeros (or inf)
    keeps the scale; amaxes older than the history's length drop out; values past the scale's
    range saturate."""
    e4m3 = gg.DType.E4M3

    def steps(history: AmaxHistory, amaxes: list[float]) -> list[float]:
        scales = []
        for amax in amaxes:
            scales.append(history.record(torch.tensor([amax, -amax / 2]), e4m3).item())
            history.advance()
        return scales

    one = torch.tensor(448.0, dtype=torch.float32)
    got = steps(AmaxHistory(3, AmaxAlgorithm.MAX, 0), [448.0, 896.0, 224.0, 0.0, 112.0, 112.0, 112.0])
    want = [1.0, 1.0, 2.0, 2.0, 2.0, float(torch.tensor(224.0) / one), float(torch.tensor(112.0) / one)]
    assert got == want
    got = steps(AmaxHistory(3, AmaxAlgorithm.MOST_RECENT, 1), [448.0, 896.0, 0.0, float("inf"), 224.0])
    assert got == [1.0, 2.0, 4.0, 4.0, 4.0]
    p = Float8Tensorwise(scaling="delayed", amax_history_len=4)
    history = p.history()
    q, scale = p.quantize(torch.tensor([1000.0, 1.0]), e4m3, history)
    assert scale.item() == 1.0 and q.float().tolist() == [448.0, 1.0]  # saturated: the scale came before


def test_a_delayed_layer_advances_its_histories_once_per_optimizer_step():
    layer = gg.nn.FusedLinear(128, 128, precision=Float8Tensorwise(scaling="delayed"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(32, 128).bfloat16() * 100
    for _ in range(2):  # two micro-batches: the first step's scales stay 1
        layer(x).float().sum().backward()
    precision = layer.precision
    assert precision is not None
    histories = {name: layer._weights.history(name, precision) for name in ("input", "weight", "grad")}
    assert all(h is not None and h.amax is not None and h.amax.isnan().all() for h in histories.values())
    amax_x = x.float().abs().max()
    assert histories["input"] is not None and histories["input"].amaxes is not None
    assert histories["input"].amaxes[0] == amax_x
    opt.step()
    layer(x).float().sum().backward()
    assert histories["input"].amax is not None and histories["input"].amax.item() == amax_x
    assert histories["grad"] is not None and histories["grad"].amax is not None
    assert histories["grad"].amax.item() == 1.0  # d(sum)/dy: ones


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_fused_linear_computes_its_definition(activation):
    """Forward and every gradient equal the reference quantizer's values through fp64 GEMMs at odd
    sizes: y = e4m3(X) e4m3(W)^T + b, dX = e5m2(dL/dpre) e4m3(W), dW = e5m2(dL/dpre)^T e4m3(X)."""
    torch.manual_seed(0)
    layer = gg.nn.FusedLinear(144, 272, activation=activation, precision=Float8Tensorwise())
    x = torch.randn(200, 144).bfloat16().requires_grad_()
    y = layer(x)
    assert layer.bias is not None
    w, b = layer.weight.detach(), layer.bias.detach()

    def dq(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q, scale = reference_tensorwise(t, dtype)
        return q * scale

    xq, wq = dq(x.detach(), torch.float8_e4m3fn), dq(w, torch.float8_e4m3fn)
    pre = xq @ wq.t() + b.double()
    torch.testing.assert_close(y.double(), torch.nn.functional.gelu(pre) if activation else pre,
                               rtol=2**-7, atol=1e-5)  # one bf16 rounding
    g = torch.randn_like(y)
    y.backward(g)
    saved = pre.bfloat16()  # the bf16 pre-activation the layer saves
    g_pre = torch.ops.aten.gelu_backward(g, saved) if activation else g
    gq = dq(g_pre, torch.float8_e5m2)
    for got, want in ((x.grad, gq @ wq), (layer.weight.grad, gq.t() @ xq), (layer.bias.grad, g_pre.double().sum(0))):
        assert got is not None
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_mlp_signal_to_noise_is_above_torchaos_floors(activation, scaling):
    """Output >= 18 dB and each gradient >= 17 dB against the fp32 MLP, from the second step on
    for delayed scaling (its first step quantizes with scale 1, as Transformer Engine's does, and
    its e5m2 gradients underflow). Measured here 20-26 dB."""
    low, ref = _mlp_pair(activation, Float8Tensorwise(scaling=scaling))
    x = torch.randn(300, 256).bfloat16()
    g = torch.randn(300, 128) * 1e-3
    if scaling == "delayed":
        _grads(low, x, g)
        for p in low.parameters():  # an optimizer step: the histories' scales
            p.data.add_(0.0)
    y, gx, grads = _grads(low, x, g)
    y_ref, gx_ref, grads_ref = _grads(ref, x, g)
    assert y.dtype == torch.bfloat16 and _snr(y, y_ref) >= 18
    assert _snr(gx, gx_ref) >= 17
    for name, got in grads.items():
        want = grads_ref[name if activation == "swiglu" else name.replace("fc1", "0").replace("fc2", "2")]
        assert _snr(got, want) >= 17, name


def test_what_it_cannot_take_is_refused_by_name(monkeypatch):
    with pytest.raises(InvalidArgument, match=r"scaling: expected one of \['current', 'delayed'\]"):
        Float8Tensorwise(scaling="dynamic")
    with pytest.raises(InvalidArgument, match="amax_compute_algo"):
        Float8Tensorwise(amax_compute_algo="mean")
    with pytest.raises(InvalidArgument, match="amax_history_len: expected an int >= 1"):
        Float8Tensorwise(amax_history_len=0)
    with pytest.raises(InvalidArgument, match="margin: expected an int >= 0"):
        Float8Tensorwise(margin=-1)
    assert repr(Float8Tensorwise(scaling="delayed")) == "Float8Tensorwise(scaling='delayed')"
    layer = gg.nn.FusedLinear(128, 128, precision=Float8Tensorwise(scaling="delayed"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with pytest.raises(InvalidArgument, match="use scaling='current' in a captured step"):
        layer._weights.get(layer.weight, layer._gemms)


@pytest.mark.parametrize(("scaling", "fewer"), [("delayed", 4), ("current", 4)])
def test_mlps_h_and_gradient_come_from_its_epilogues_with_their_amax(monkeypatch, scaling, fewer):
    """Float8Tensorwise's FusedMLP (issue 57 item 2): fc1's kernel writes h, and fc2's dgrad kernel
    dL/dacc1, rounded to bf16 with each tensor's amax. Delayed: divided by their delayed scales
    (from the histories) and stored in e4m3 and e5m2, the amaxes for the histories. Current: kept
    16-bit (the scale needs the whole tensor's amax first) and quantized by torch from the
    kernel's amax, one read of each fewer. Over three steps (the weights changed in place between
    them, so the histories advance and the scales leave 1), the outputs, every gradient and every
    history's amaxes are bit-equal to the steps whose torch ops quantize the bf16 h and dL/dacc1
    (fused equals unfused), at 200 tokens; each step runs 4 torch amax reductions fewer (h's and
    dL/dacc1's, two each)."""
    from gemmgen.nn import low_precision
    from tests.nn.dispatched import DispatchedOps

    precision = Float8Tensorwise(scaling=scaling)
    runs = []
    for fused in (True, False):
        low_precision.mlp_gemms.cache_clear()
        if not fused:
            monkeypatch.setattr(Float8Tensorwise, "quantizing", lambda self, recipe, gemm, name: None)
        low, _ = _mlp_pair("gelu", precision)
        gemms = low_precision.mlp_gemms(precision, "gelu", True, True, torch.bfloat16)
        assert (gemms.fc1_quantizing is not None) == fused and (gemms.bwd_quantizing is not None) == fused
        steps, amax_ops = [], []
        for step in range(3):
            x = torch.randn(200, 256, generator=torch.Generator().manual_seed(10 + step)).bfloat16() * (step + 1)
            g = torch.randn(200, 128, generator=torch.Generator().manual_seed(20 + step)) * 4.0**step
            with DispatchedOps() as ops:
                steps.append(_grads(low, x, g))
            amax_ops.append(ops.ops["amax"])
            with torch.no_grad():
                for p in low.parameters():
                    p.mul_(0.5 + step)  # an optimizer step: in place, so the histories advance
        histories = [(h.amaxes, h.amax) for c in low._weights for n in ("input", "weight", "grad")
                     if (h := c.history(n, precision)) is not None]
        runs.append((steps, amax_ops, histories))
    monkeypatch.undo()
    low_precision.mlp_gemms.cache_clear()
    (steps, fused_amax, fused_h), (steps0, unfused_amax, unfused_h) = runs
    for (y, gx, grads), (y0, gx0, grads0) in zip(steps, steps0, strict=True):
        assert torch.equal(y, y0) and torch.equal(gx, gx0)
        assert grads.keys() == grads0.keys() and all(torch.equal(grads[n], grads0[n]) for n in grads)
    assert len(fused_h) == (6 if scaling == "delayed" else 0)
    for (amaxes, amax), (amaxes0, amax0) in zip(fused_h, unfused_h, strict=True):
        assert torch.equal(amaxes, amaxes0) and torch.equal(amax, amax0)
        assert amax.isfinite().all(), "a history never advanced: the steps quantized with scale 1 only"
    assert [u - f for f, u in zip(fused_amax, unfused_amax, strict=True)] == [fewer] * 3, (fused_amax, unfused_amax)


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_the_quantizing_kernels_compute_their_recipes(scaling):
    """fc1's forward (e4m3 x e4m3 -> h, its amax and the saved accumulator) and fc2's dgrad (e5m2 x
    e4m3 -> dL/dacc1, its amax and the bias gradient), h and dL/dacc1 in e4m3 and e5m2 (delayed) or
    bf16 (current), emulated through the Params and tensor maps gemmgen builds against their
    recipes' references, on a partial last tile, M = 1 and a K tail."""
    from gemmgen.testing.checks import assert_computes, uncompiled

    fc1 = gg.Recipe("fc1", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    assert Float8Tensorwise(save_original_input=True).quantizing_backward(fc1) is None
    backward = Float8Tensorwise(scaling=scaling).quantizing_backward(fc1)
    assert backward is not None
    delayed = scaling == "delayed"
    types = (gg.e4m3, gg.e5m2) if delayed else (gg.bf16, gg.bf16)
    for recipe, d in zip((backward.forward, backward.kernel), types, strict=True):
        assert recipe.ir.gemm.d == d and "d_amax" in {o.name for o in recipe.outputs}
        ck = uncompiled(recipe, recipe.default_config())
        for shape in ((200, 272, 256, 1), (1, 128, 128, 1), (129, 136, 200, 1)):
            assert_computes(ck, shape, recipe.name)

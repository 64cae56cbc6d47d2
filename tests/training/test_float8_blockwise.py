"""Float8Blockwise training (issue 57), checked on the CPU in the three tiers of the issue:

(a) exactness: the recipe's quantizer bit-equal to one written here from the recipe's definition
    (each block's amax over 448, the values rounded to the nearest e4m3, ties to even, saturating),
    for every copy a step makes (X and dY along features and along tokens, W in 128 x 128 blocks and
    its transpose); and each layer's forward and gradients equal to that quantizer's values pushed
    through fp64 GEMMs and the layer's epilogue;
(b) signal-to-noise against the bf16 layer, above torchao's floors;
(c) loss parity (tests/training/test_loss_parity.py).

On the CPU the layers' gemmgen ops evaluate their recipes' references (the same definitions the
kernels are checked against by the oracle and the emulation), so these test the step's data flow:
what is quantized where, along which K, with which scales.
"""

from __future__ import annotations

import math

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import InvalidArgument
from gemmgen.training import MXFP8, Float8Blockwise, Float8Tensorwise, Gemm, Precision
from tests.nn.dispatched import DispatchedOps

_E4M3_MAX = 448.0


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3 value (float64, ascending) and whether its code is even."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    values = codes.view(torch.float8_e4m3fn).double()
    return values, codes % 2 == 0


def reference_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to e4m3 as the recipe defines it, written without torch's fp8 cast: the
    nearest value of the grid, a tie to the even code, saturating at 448, NaN kept. float64 out."""
    grid, even = _e4m3_grid()
    mag = v.double().abs().clamp(max=_E4M3_MAX).contiguous()
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[hi])
    out = torch.where(pick_hi, grid[hi], grid[lo]) * v.double().sign()
    return torch.where(v.isnan(), torch.nan, out)


def reference_blocks(x: torch.Tensor, block: tuple[int, int], power_of_two: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values as float64, fp32 scales) of x per block, block by block in Python: scale =
    amax / 448 in fp32 (1 for a block of zeros), rounded up to a power of two if asked; value =
    e4m3(fp32(x / scale))."""
    rows, cols = x.shape
    br, bc = block
    scales = torch.empty(-(-rows // br), -(-cols // bc), dtype=torch.float32)
    per_value = torch.empty(rows, cols, dtype=torch.float64)
    xf = x.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            amax = xf[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max().item()
            scale = float(torch.tensor(amax / _E4M3_MAX, dtype=torch.float32)) if amax > 0 else 1.0
            if power_of_two and amax > 0:
                mantissa, exponent = math.frexp(scale)
                scale = math.ldexp(1.0, exponent - (mantissa == 0.5))
            scales[i, j] = scale
            per_value[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = scale
    quotient = (xf.double() / per_value).float()  # one fp32 division each, correctly rounded
    return reference_e4m3(quotient), scales


def _awkward(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 values with outliers, a block of zeros, tiny values and exact ties of e4m3 rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols).roll(seed)
    x[:, 0] *= 1e3
    x[:128, 128:256] = 0
    x[-1, :] = 1e-30
    return x.bfloat16()


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1)])
def test_the_quantizer_is_bit_exact_against_one_written_from_the_definition(block, power_of_two):
    x = _awkward(300, 272, seed=block[0] + power_of_two)  # partial blocks on both edges
    q, scale = Float8Blockwise(power_of_two_scales=power_of_two).quantize(x, block)
    want_q, want_scale = reference_blocks(x, block, power_of_two)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.double(), want_q)
    if power_of_two:
        assert torch.equal(scale.log2(), scale.log2().round())


def test_the_reference_quantizer_would_see_a_wrong_rounding():
    """The check above fails where rounding differs: nearest with ties to even (1.1 -> 1.125; the
    tie 1.1875 -> 1.25, the even code), saturation (500 -> 448), NaN kept; truncation differs."""
    v = torch.tensor([1.1, 1.1875, -1.0625, 500.0, float("nan")])
    want = torch.tensor([1.125, 1.25, -1.0, 448.0], dtype=torch.float64)
    assert torch.equal(reference_e4m3(v)[:4], want) and reference_e4m3(v)[4].isnan()
    assert torch.equal(v[:4].clamp(-448, 448).to(torch.float8_e4m3fn).double(), want)  # torch agrees
    truncated = torch.tensor([1.0, 1.125, -1.0, 448.0], dtype=torch.float64)
    assert not torch.equal(reference_e4m3(v)[:4], truncated)


def _recipes(p: Float8Blockwise, activation: str | None = None, bias: bool = False):
    from gemmgen.nn.low_precision import linear_gemms

    return linear_gemms(p, activation, bias, torch.bfloat16)


def test_each_gemm_reads_its_operands_quantized_along_its_own_k():
    """fprop's A is X per token and 128 features; wgrad's B is X per feature and 128 tokens (its
    128 x 1 blocks), physically transposed so that K (the tokens) is contiguous; the weight's two
    copies are the same 128 x 128 blocks, one the exact transpose of the other."""
    p = Float8Blockwise()
    gemms = _recipes(p)
    x, w = _awkward(200, 144, 1), _awkward(272, 144, 2)
    a = gemms.operand(x, Gemm.FPROP, "a")
    want, want_scale = reference_blocks(x, (1, 128))
    assert torch.equal(a.data.double(), want) and torch.equal(a.scale, want_scale)
    b = gemms.operand(x.t(), Gemm.WGRAD, "b")  # B (K x N) = X (tokens x in), K-major
    want, want_scale = reference_blocks(x, (128, 1))
    assert b.data.shape == x.shape and b.data.stride(0) == 1
    assert torch.equal(b.data.double(), want) and torch.equal(b.scale, want_scale)
    qw = gemms.weight(w)
    want, want_scale = reference_blocks(w, (128, 128))
    assert torch.equal(qw.rows.data.t().double(), want) and torch.equal(qw.rows.scale.t(), want_scale)
    assert torch.equal(qw.columns.data.double(), want) and torch.equal(qw.columns.scale, want_scale)
    assert qw.columns.data.stride(0) == 1  # dgrad's B (K = out_features) is K-major: W^T in memory
    assert torch.equal(reference_blocks(w.t(), (128, 128))[0], want.t())  # the transposed copy is exact


def _dq(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """t through the reference quantizer and back, float64."""
    q, s = reference_blocks(t, block)
    return q * s.double().repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]


def _unfused_linear(x, w, b, activation, saved_pre):
    """The layer's definition in fp64 from the reference quantizer: y, and a backward that maps dY
    to (dX, dW, db), the activation's derivative taken at `saved_pre` (the bf16 pre-activation the
    layer saves: its rounding, not fp64's, decides dL/dpre)."""
    pre = _dq(x, (1, 128)) @ _dq(w, (128, 128)).t() + b.double()
    y = torch.nn.functional.gelu(pre) if activation == "gelu" else pre

    def backward(g: torch.Tensor):
        if activation == "gelu":
            g_pre = torch.ops.aten.gelu_backward(g, saved_pre)
        else:
            g_pre = g
        dx = _dq(g_pre, (1, 128)) @ _dq(w, (128, 128))
        dw = _dq(g_pre.t().contiguous(), (1, 128)) @ _dq(x.t().contiguous(), (1, 128)).t()
        return dx, dw, g_pre.double().sum(0)

    return y, backward


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_fused_linear_computes_its_definition(activation):
    """Forward and every gradient equal the reference quantizer's values through fp64 GEMMs, at
    odd sizes (partial blocks, a token count that is no multiple of 128: wgrad's K tail)."""
    torch.manual_seed(0)
    layer = gg.nn.FusedLinear(144, 272, activation=activation, precision=Float8Blockwise())
    x = torch.randn(200, 144).bfloat16().requires_grad_()
    y = layer(x)
    linear = torch.nn.Linear(144, 272).bfloat16()
    linear.load_state_dict(layer.state_dict())
    with torch.no_grad():  # the pre-activation the layer saves: the same kernel without the activation
        pre = gg.nn.FusedLinear.from_linear(linear, precision=Float8Blockwise())(x)
    assert layer.bias is not None
    want_y, backward = _unfused_linear(x.detach(), layer.weight.detach(), layer.bias.detach(), activation, pre)
    torch.testing.assert_close(y.double(), want_y, rtol=2**-7, atol=1e-5)  # one bf16 rounding
    g = torch.randn_like(y)
    y.backward(g)
    dx, dw, db = backward(g)
    for got, want in ((x.grad, dx), (layer.weight.grad, dw), (layer.bias.grad, db)):
        assert got is not None
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-4)


def _snr(got: torch.Tensor, want: torch.Tensor) -> float:
    """torchao's SQNR in dB: 20 log10(|want| / |want - got|)."""
    want, got = want.detach().double(), got.detach().double()
    return float(20 * torch.log10(want.norm() / (want - got).norm()))


_ACTIVATIONS = {"gelu": torch.nn.GELU, "relu": torch.nn.ReLU, "silu": torch.nn.SiLU}


class _GatedMLP(torch.nn.Module):
    """Llama's MLP, down(silu(gate(x)) * up(x)), from an interleaved fc1 weight (fp32, no biases)."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(fc1[0::2].float().clone())
        self.up = torch.nn.Parameter(fc1[1::2].float().clone())
        self.down = torch.nn.Parameter(fc2.float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.gate.t()) * (x @ self.up.t())) @ self.down.t()

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients as the FusedMLP's parameters hold them (fc1's rows interleaved)."""
        gate, up, down = self.gate.grad, self.up.grad, self.down.grad
        assert gate is not None and up is not None and down is not None
        return {"fc1.weight": gg.nn.interleave_pairs(gate, up), "fc2.weight": down}


def _mlp_pair(activation: str, precision: Precision, sizes: tuple[int, int, int] = (256, 512, 128)):
    """The low-precision FusedMLP and the unfused torch MLP in fp32 with its (bf16) weights."""
    torch.manual_seed(1)
    gated = activation == "swiglu"
    n_in, hidden, n_out = sizes
    low = gg.nn.FusedMLP(n_in, hidden, n_out, activation=activation, precision=precision, bias=not gated)
    if gated:
        return low, _GatedMLP(low.fc1.weight.detach(), low.fc2.weight.detach())
    ref = torch.nn.Sequential(torch.nn.Linear(*sizes[:2]), _ACTIVATIONS[activation](), torch.nn.Linear(*sizes[1:]))
    ref.load_state_dict({k.replace("fc1", "0").replace("fc2", "2"): v.float() for k, v in low.state_dict().items()})
    return low, ref


def _grads(model, x, g):
    model.zero_grad(set_to_none=True)
    x = x.detach().to(next(model.parameters()).dtype).requires_grad_()
    y = model(x)
    y.backward(g.to(y.dtype))
    grads = model.grads() if isinstance(model, _GatedMLP) else {n: p.grad for n, p in model.named_parameters()}
    return y, x.grad, grads


@pytest.mark.parametrize(("activation", "sizes", "tokens", "floor"), [
    ("gelu", (256, 512, 128), 300, 17), ("silu", (256, 512, 128), 300, 17), ("swiglu", (256, 512, 128), 300, 17),
    ("gelu", (1024, 2816, 1024), 1024, 20)])  # a quarter of Llama-3-8B's MLP: the LLM-shape floor
def test_fused_mlp_signal_to_noise_is_above_torchaos_floors(activation, sizes, tokens, floor):
    """Against the same MLP in fp32 (from the same bf16 weights and inputs): output >= 18 dB (20 at
    LLM shapes), each gradient >= 17 dB (20) (torchao's Float8Linear floors). Measured here 25-28 dB.
    ReLU is left out: its derivative is a mask taken at the quantized pre-activation, so near-zero
    elements flip and its dX and fc1 gradients measure 16 dB against fp32 whatever the GEMMs do
    (docs/design/training.md#numerics)."""
    low, ref = _mlp_pair(activation, Float8Blockwise(), sizes)
    x = torch.randn(tokens, sizes[0]).bfloat16()
    g = torch.randn(tokens, sizes[2])
    y, gx, grads = _grads(low, x, g)
    y_ref, gx_ref, grads_ref = _grads(ref, x, g)
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, sizes[2])
    assert _snr(y, y_ref) >= max(18, floor)
    assert _snr(gx, gx_ref) >= floor
    for name, got in grads.items():
        assert got.dtype == torch.bfloat16, name
        want = grads_ref[name if activation == "swiglu" else name.replace("fc1", "0").replace("fc2", "2")]
        assert _snr(got, want) >= floor, name


@pytest.mark.parametrize("precision", [Float8Blockwise(), Float8Tensorwise()], ids=repr)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_mlp_backward_launches_gemmgen_kernels_for_every_gemm(activation, precision):
    """fc2's dgrad carrying fc1's derivative (and bias gradient), fc1's dgrad, both wgrads: 4 gemmgen
    kernels and no torch GEMM. The rest are dY's quantizing copies and fc2's bias sum (and, but in
    Float8Blockwise's GELU MLP, whose dgrad kernel writes them, dL/dacc1's copies)."""
    low, _ = _mlp_pair(activation, precision)
    x = torch.randn(64, 256).bfloat16().requires_grad_()
    y = low(x)
    with DispatchedOps() as ops:
        y.backward(torch.randn_like(y))
    assert ops.ops["gemmgen"] == 4
    assert not {"mm", "addmm", "bmm", "matmul", "_grouped_mm", "silu_backward", "gelu_backward"} & set(ops.ops)


@pytest.mark.parametrize("activation, precision, amax", [
    ("gelu", Float8Blockwise(), (6, 10)), ("relu", Float8Blockwise(), (6, 10)), ("silu", Float8Blockwise(), (6, 10)),
    ("gelu", Float8Blockwise(power_of_two_scales=True), (6, 10)),
    ("gelu", Float8Blockwise(save_original_input=True), (7, 10))], ids=str)
def test_the_mlps_quantized_copies_come_from_its_epilogues(activation, precision, amax, monkeypatch):
    """Float8Blockwise's FusedMLP (issue 57 item 2): fc1's kernel writes h, and fc2's dgrad kernel
    dL/dacc1, rounded to bf16 and quantized both ways by the epilogue (per token and 128 features
    for the next fprop or dgrad, per feature and 128 tokens, transposed, for the wgrad). The
    output and every gradient are bit-equal to the step whose torch ops quantize the bf16 h and
    dL/dacc1 (fused equals unfused), at 200 tokens (a partial last block of tokens), and the step
    runs 4 torch quantizations fewer (each one amax; X's and dY's two each and the two weights'
    remain: 6). With power-of-two scales too (Transformer Engine's blockwise default), whose
    epilogues round their scales as the torch quantizer does; and with save_original_input, where
    fc1's epilogue writes h quantized per row beside h itself (kept, quantized again in the
    backward): 3 torch quantizations fewer."""
    from gemmgen.nn import low_precision

    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    g = torch.randn(200, 128, generator=torch.Generator().manual_seed(6))
    steps = []
    for fused in (True, False):
        low_precision.mlp_gemms.cache_clear()
        if not fused:
            monkeypatch.setattr(Float8Blockwise, "quantizing", lambda self, recipe, gemm, name: None)
        low, _ = _mlp_pair(activation, precision)
        gemms = low_precision.mlp_gemms(precision, activation, True, True, torch.bfloat16)
        assert (gemms.fc1_quantizing is not None) == fused and (gemms.bwd_quantizing is not None) == fused
        with DispatchedOps() as ops:
            y, gx, grads = _grads(low, x, g)
        steps.append((y, gx, grads, ops.ops["amax"]))
    low_precision.mlp_gemms.cache_clear()
    (y, gx, grads, fused_amax), (y0, gx0, grads0, unfused_amax) = steps
    assert torch.equal(y, y0) and torch.equal(gx, gx0)
    assert grads.keys() == grads0.keys() and all(torch.equal(grads[n], grads0[n]) for n in grads)
    assert (fused_amax, unfused_amax) == amax


@pytest.mark.parametrize("precision", [Float8Blockwise(), Float8Tensorwise()], ids=repr)
def test_a_low_precision_mlp_under_torch_compile_gives_eager_bits(precision):
    """torch.compile (AOTAutograd) of a FusedMLP step in a precision: the output and every gradient
    bit-equal to eager's. Not fullgraph: the step breaks the graph where it quantizes its weights once
    per optimizer step (`WeightCache`, Python state); docs/training.md says so."""
    torch.manual_seed(0)
    mlp = gg.nn.FusedMLP(256, 512, 128, activation="gelu", precision=precision)
    x, g = torch.randn(200, 256).bfloat16(), torch.randn(200, 128).bfloat16()
    steps = []
    for run in (mlp, torch.compile(mlp, backend="aot_eager")):
        mlp.zero_grad()
        xs = x.clone().requires_grad_(True)
        y = run(xs)
        y.backward(g)
        steps.append((y.detach(), xs.grad, *(p.grad for p in mlp.parameters())))
    assert all(torch.equal(a, b) for a, b in zip(*steps, strict=True))


def test_weights_are_quantized_once_per_optimizer_step():
    """Micro-batches between steps share the quantized weight; a step (in place) makes a new one."""
    layer = gg.nn.FusedLinear(128, 128, precision=Float8Blockwise())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):  # three micro-batches
        layer(torch.randn(32, 128).bfloat16()).float().sum().backward()
    assert layer._weights.quantized == 1
    opt.step()
    layer(torch.randn(32, 128).bfloat16()).float().sum().backward()
    assert layer._weights.quantized == 2
    with torch.no_grad():
        layer(torch.randn(32, 128).bfloat16())
    assert layer._weights.quantized == 2


def test_a_captured_cuda_graph_quantizes_the_weight_on_each_replay(monkeypatch):
    """Under CUDA-graph capture the weight is quantized inside the graph, not taken from the cache:
    a replay after an optimizer step must not use the values of before it. (CPU stand-in: the
    capture flag and the weight's device are faked; tests/gpu/test_training_gpu.py replays a graph.)"""
    layer = gg.nn.FusedLinear(128, 128, precision=Float8Blockwise())
    layer(torch.randn(8, 128).bfloat16())
    assert layer._weights.quantized == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    gemms = layer._gemms
    for expected in (2, 3):
        layer._weights.get(layer.weight, gemms)
        assert layer._weights.quantized == expected


def test_saving_the_original_input_gives_the_same_gradients():
    """save_original_input keeps bf16 X and quantizes it again in backward: the same bits."""
    grads = []
    for keep in (False, True):
        low, _ = _mlp_pair("gelu", Float8Blockwise(save_original_input=keep))
        _, gx, g = _grads(low, torch.randn(100, 256, generator=torch.Generator().manual_seed(3)).bfloat16(),
                          torch.randn(100, 128, generator=torch.Generator().manual_seed(4)))
        grads.append((gx, g))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(grads[0][1][n], grads[1][1][n]) for n in grads[0][1])


def test_fp32_master_weights_and_main_grad_accumulation():
    """fp32 master weights (the layer after .float(), run under bf16 autocast) are quantized as
    they are; accumulate_grad adds each step's fp32 wgrad into main_grad."""
    layer = gg.nn.FusedLinear(128, 256, activation="gelu", precision=Float8Blockwise(),
                              accumulate_grad=True).float()
    x = torch.randn(48, 128)
    totals = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        totals.append(getattr(layer.weight, "main_grad").clone())  # noqa: B009 (set by the layer)
    assert layer.weight.grad is None and totals[0].dtype == torch.float32
    torch.testing.assert_close(totals[1], 2 * totals[0])
    assert layer.bias is not None and layer.bias.grad is not None and layer.bias.grad.dtype == torch.float32


def test_shapes_of_a_drop_in_layer_single_token_and_batches():
    layer = gg.nn.FusedLinear(128, 144, precision=Float8Blockwise())
    for shape in ((1, 128), (2, 5, 128)):
        x = torch.randn(*shape).bfloat16().requires_grad_()
        y = layer(x)
        assert y.shape == (*shape[:-1], 144) and y.is_contiguous()
        y.float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


def test_what_a_precision_cannot_take_is_refused_by_name():
    p = Float8Blockwise()
    with pytest.raises(InvalidArgument, match=r"gated activation \(swiglu\) with biases"):
        gg.nn.FusedMLP(128, 256, 128, activation="swiglu", precision=p)
    with pytest.raises(InvalidArgument, match="in_features = 72 is not a multiple of 16"):
        gg.nn.FusedLinear(72, 128, precision=p)
    with pytest.raises(InvalidArgument, match="out_features = 100"):
        gg.nn.FusedLinear(128, 100, precision=p)
    with pytest.raises(InvalidArgument, match=r"Float8Blockwise\(\)"):
        gg.nn.FusedLinear(128, 128, precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="power_of_two_scales"):
        Float8Blockwise(power_of_two_scales=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="recompute=True with precision"):
        gg.nn.FusedMLP(128, 256, 128, precision=p, recompute=True)
    layer = gg.nn.FusedLinear(128, 128, precision=p)
    with pytest.raises(InvalidArgument, match="recompute=True with precision"):
        layer.recompute = True
    with pytest.raises(AttributeError, match="precision"):
        layer.precision = None
    assert repr(p) == "Float8Blockwise()" and "precision=Float8Blockwise()" in repr(layer)


def test_fuse_takes_a_precision():
    """fuse(precision=) trains the fused layers in it, keeps the state_dict, and keeps (saying why)
    a Linear whose features fp8 rows cannot take."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 100)).bfloat16()
    keys = list(model.state_dict())
    fused, report = gg.nn.fuse(model, mlp=True, unpaired=True, precision=Float8Blockwise())
    assert list(fused.state_dict()) == keys
    layers = [m for m in fused.modules() if isinstance(m, gg.nn.FusedLinear)]
    assert layers and all(m.precision == Float8Blockwise() for m in layers)
    assert any("out_features 100 not a multiple of 16" in line for line in report)
    fused(torch.randn(4, 128).bfloat16()).float().sum().backward()
    with pytest.raises(InvalidArgument, match="one of precision= and quantize="):
        gg.nn.fuse(model, precision=Float8Blockwise(), quantize="fp8_block")


class _LlamaMLP(torch.nn.Module):
    """Llama's MLP as Hugging Face writes it: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(128, 256, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(256, 128, bias=False), torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("precision", [Float8Blockwise(), MXFP8()], ids=repr)
def test_fuse_makes_a_gated_mlp_one_fused_mlp_in_the_precision(precision):
    """fuse(mlp=True, precision=) makes Llama's MLP one gated FusedMLP (the gate over column pairs),
    with gate_proj's, up_proj's and down_proj's own parameters (state_dict unchanged): its step is
    bit for bit a FusedMLP's built with the interleaved weights; its fc1 weight is quantized once per
    optimizer step (two micro-batches, one quantization) and again after a step that changes up_proj
    alone."""
    torch.manual_seed(3)
    module = _LlamaMLP()  # fp32 master weights, under bf16 autocast
    keys = list(module.state_dict())
    fused, report = gg.nn.fuse(torch.nn.Sequential(module), mlp=True, precision=precision,
                               compute_dtype=torch.bfloat16)
    mlp = fused.get_submodule("0")
    assert isinstance(mlp, gg.nn.FusedMLP) and mlp.precision == precision and "-> FusedMLP(" in report[0]
    assert list(mlp.state_dict()) == keys
    direct = gg.nn.FusedMLP(128, 256, 128, activation="swiglu", bias=False, precision=precision).float()
    with torch.no_grad():
        direct.fc1.weight.copy_(gg.nn.interleave_pairs(module.gate_proj.weight, module.up_proj.weight))
        direct.fc2.weight.copy_(module.down_proj.weight)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(7), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().sum().backward()
        assert x.grad is not None
        return y, x.grad

    def grad(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None
        return p.grad

    for _ in range(2):  # two micro-batches
        got, want = step(mlp), step(direct)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert mlp._weights[0].quantized == 1
    fc1_grad = gg.nn.interleave_pairs(grad(module.gate_proj.weight), grad(module.up_proj.weight))
    assert torch.equal(fc1_grad, grad(direct.fc1.weight))
    assert torch.equal(grad(module.down_proj.weight), grad(direct.fc2.weight))
    with torch.no_grad():  # an optimizer step that changes up_proj only
        module.up_proj.weight.mul_(0.5)
        direct.fc1.weight[1::2].mul_(0.5)
    got, want = step(mlp), step(direct)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert mlp._weights[0].quantized == 2


@pytest.mark.parametrize("precision", [Float8Blockwise(power_of_two_scales=True),
                                       Float8Blockwise(save_original_input=True)], ids=repr)
def test_the_quantizing_kernels_of_each_variant_compute_their_recipes(precision):
    """fc1's forward and fc2's dgrad kernels as the variant quantizes (power-of-two scales in both
    nodes; h kept beside its row copy), emulated through the Params and tensor maps gemmgen builds
    against their recipes' references, on a partial last block of tokens and of features, M = 1 and
    a K tail; the compiled kernels' checks are the plain variant's (tests/data/extra_recipes.py)."""
    from gemmgen.testing.checks import assert_computes, uncompiled

    fc1 = gg.Recipe("fc1", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    backward = precision.quantizing_backward(fc1)
    assert backward is not None
    for recipe in (backward.forward, backward.kernel):
        ck = uncompiled(recipe, recipe.default_config())
        assert ("true>" in ck.generated.source) == precision.power_of_two_scales
        for shape in ((200, 272, 256, 1), (1, 128, 128, 1), (129, 136, 200, 1)):
            assert_computes(ck, shape, recipe.name)
    names = {o.name for o in backward.forward.outputs}
    assert ("d_original" in names, "d_t" in names) == (precision.save_original_input, not precision.save_original_input)

"""GroupedLinear and BlockScaledGroupedLinear against the experts' nn.Linears."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import InvalidArgument, RecipeError
from gemmgen.ir.reference import group_bounds
from gemmgen.testing.grouped import experts_loop, gated_experts, gated_experts_loop, generator
from gemmgen.tuning.heuristic import choose


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _absolute(linear: torch.nn.Linear) -> torch.nn.Linear:
    """The Linear with |W| and |b|: applied to |x|, the scale of its output's rounding errors."""
    out = copy.deepcopy(linear)
    with torch.no_grad():
        out.weight.abs_()
        if out.bias is not None:
            out.bias.abs_()
    return out


@pytest.mark.parametrize("activation, bias", [("silu", True), (None, False), ("relu", True), ("gelu", True),
                                              ("gelu_tanh", False)])
def test_grouped_linear_is_the_experts_linears(activation, bias):
    """Forward and gradients (input, weights, biases) of GroupedLinear against the experts'
    nn.Linear layers run one by one in float64, an empty expert and odd sizes included; rows after
    the last expert's end are not part of the output's contract."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    linears = [torch.nn.Linear(24, 40, bias=bias, dtype=torch.bfloat16) for _ in range(4)]
    layer = gg.nn.GroupedLinear.from_linears(linears, activation=activation)
    assert layer.weight.shape == (4, 40, 24) and (layer.bias is not None) == bias
    x = torch.randn(37, 24).bfloat16()
    offsets = torch.tensor([5, 5, 20, 33], dtype=torch.int32)
    xs = x.clone().requires_grad_(True)
    y = layer(xs, offsets)
    assert y.shape == (37, 40) and y.dtype == torch.bfloat16
    ref_linears = [torch.nn.Linear(24, 40, bias=bias, dtype=torch.float64) for _ in range(4)]
    with torch.no_grad():
        for mine, ref in zip(linears, ref_linears, strict=True):
            ref.weight.copy_(mine.weight)
            if bias:
                ref.bias.copy_(mine.bias)
    xr = x.double().requires_grad_(True)
    want = experts_loop(ref_linears, xr, offsets, activation)
    assert want.abs().max() > 0
    torch.testing.assert_close(y[:33].double(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.detach().abs().max()))
    grad = torch.randn(33, 40)
    if activation == "relu":
        # ReLU's derivative jumps at 0, and the op recomputes the pre-activation from a bf16
        # accumulator (as the unfused bf16 layer would have saved it): where the exact one is
        # within that rounding (2^-9 of |x| |W|^T, doubled) of 0, either side is right. No
        # gradient flows from those elements on either side, so the check stays exact elsewhere.
        magnitude = experts_loop([_absolute(m) for m in ref_linears], x.double().abs(), offsets, None)
        pre = experts_loop(ref_linears, x.double(), offsets, None)
        grad[(pre.abs() <= 2.0**-8 * magnitude)] = 0.0
    y[:33].float().backward(grad)
    want.backward(grad.double())

    def grad_of(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None and t.grad is not None
        return t.grad

    got = {"input": grad_of(xs), "weight": grad_of(layer.weight)}
    ref_grads = {"input": grad_of(xr), "weight": torch.stack([grad_of(m.weight) for m in ref_linears])}
    if bias:
        got["bias"] = grad_of(layer.bias)
        ref_grads["bias"] = torch.stack([grad_of(m.bias) for m in ref_linears])
    for name, want_grad in ref_grads.items():
        assert want_grad.norm() > 0, name
        error = (got[name].double() - want_grad).norm() / want_grad.norm()
        assert error < 1e-2, (name, float(error))


@pytest.mark.parametrize("activation, bias", [("swiglu", True), ("geglu", False)])
def test_gated_experts_are_each_experts_gate_and_up(activation, bias):
    """Gated experts (Mixtral's, DeepSeek's, Qwen's: act(gate(x)) * up(x) per expert) in one grouped
    kernel over column pairs: forward and gradients (input, interleaved weights and biases) against
    each expert's own gate and up Linears in float64, an empty expert, odd sizes (20 outputs, 37
    rows) and rows after the last expert included; decode-sized calls keep the unswapped kernel."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    gates, ups, fc1s = gated_experts(4, 24, 20, bias)
    layer = gg.nn.GroupedLinear.from_linears(fc1s, activation=activation)
    assert layer.out_features == 20 and layer.weight.shape == (4, 40, 24) and layer.weight_rows == 40
    recipe, config = layer.launches(4 * 8)  # a few rows per expert: still the kernel over pairs, unswapped
    assert recipe.ir.epilogue.pairs and not config.swap_ab
    x = torch.randn(37, 24).bfloat16()
    offsets = torch.tensor([5, 5, 20, 33], dtype=torch.int32)
    xs = x.clone().requires_grad_(True)
    y = layer(xs, offsets)
    assert y.shape == (37, 20) and y.dtype == torch.bfloat16
    xr = x.double().requires_grad_(True)
    want = gated_experts_loop(gates, ups, xr, offsets, activation)
    assert want.abs().max() > 0
    torch.testing.assert_close(y[:33].double(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.detach().abs().max()))
    grad = torch.randn(33, 20)
    y[:33].float().backward(grad)
    want.backward(grad.double())
    assert xs.grad is not None and xr.grad is not None and layer.weight.grad is not None
    got = {"input": xs.grad, "weight": layer.weight.grad}
    ref = {"input": xr.grad, "weight": torch.stack([gg.nn.interleave_pairs(_grad(g.weight), _grad(u.weight))
                                                     for g, u in zip(gates, ups, strict=True)])}
    if bias:
        assert layer.bias is not None
        got["bias"] = _grad(layer.bias)
        ref["bias"] = torch.stack([gg.nn.interleave_pairs(_grad(g.bias), _grad(u.bias))
                                   for g, u in zip(gates, ups, strict=True)])
    for name, want_grad in ref.items():
        assert want_grad.norm() > 0, name
        error = (got[name].double() - want_grad).norm() / want_grad.norm()
        assert error < 1e-2, (name, float(error))


#: what finding each row's group costs (`runtime.grouped.row_groups`, on the GPU without a sync)
_ROW_GROUPS = {"clamp": 2, "cummax": 1, "arange": 1, "searchsorted": 1, "lt": 1}


@pytest.mark.parametrize("activation, bias", [("silu", True), ("swiglu", True), ("gelu", False)])
def test_grouped_linear_backward_launches_the_derived_kernel(activation, bias):
    """The backward of GroupedLinear launches gemmgen kernels only (issue 58 item 2): the derived one
    (the grouped GEMM again, its epilogue turning dL/dD into dL/dacc) in place of the accumulator's
    recomputation and the activation's backward, then dA (a grouped GEMM) and dB (a K-grouped one,
    no token padded), no torch._grouped_mm; the bias gradient is a per-expert sum of dL/dacc. Ops
    counted with a dispatch mode (each a kernel on a GPU; the CPU runs the same ops). Made to fail
    once: with dB through torch._grouped_mm again it counts 2 gemmgen ops and one _grouped_mm."""
    from tests.nn.dispatched import DispatchedOps

    layer = gg.nn.GroupedLinear(3, 16, 24, bias=bias, activation=activation)
    x = torch.randn(10, 16).bfloat16().requires_grad_()
    y = layer(x, torch.tensor([4, 4, 9], dtype=torch.int32))  # an empty expert, a row in none
    g = torch.randn_like(y)
    with DispatchedOps() as ops:
        y.backward(g)
    bias_sum = {"new_zeros": 1, "index_add_": 1} if bias else {}
    # where: dL/dacc's and dA's rows in no expert set to 0; a scalar_tensor each for where's 0
    assert ops.ops == {**_ROW_GROUPS, "gemmgen": 3, "where": 2, "unsqueeze": 2, "scalar_tensor": 2, **bias_sum}


def test_grouped_linear_trains_under_torch_compile():
    """A training step of a gated GroupedLinear under torch.compile (AOTAutograd traces the backward,
    the derived kernel's op included, with fake tensors) gives eager's output and gradients."""
    torch.manual_seed(0)
    layer = gg.nn.GroupedLinear(3, 16, 12, activation="swiglu")
    x, offsets = torch.randn(10, 16).bfloat16(), torch.tensor([4, 4, 10], dtype=torch.int32)
    g = torch.randn(10, 12).bfloat16()
    bias = layer.bias
    assert bias is not None
    grads = []
    for run in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        layer.zero_grad()
        xs = x.clone().requires_grad_(True)
        y = run(xs, offsets)
        y.backward(g)
        grads.append([y.detach(), _grad(xs), _grad(layer.weight), _grad(bias)])
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager)


def test_a_routing_weights_gradient_takes_the_unfused_path():
    """moe_up's routing weight: its gradient (dL/dD times silu(acc + bias), summed per row) needs
    the accumulator, which a grouped kernel cannot write beside D, so its backward is the unfused
    model's: torch._grouped_mm recomputes the accumulator, autograd the epilogue; without the
    weight's gradient the derived kernel serves."""
    from gemmgen.integrations.grouped import GroupedOp
    from gemmgen.testing.grouped import moe_recipe

    kind = GroupedOp(moe_recipe())
    assert kind.derived is not None
    assert not kind.sums_of_dacc({"bias": True, "weight": True})
    assert not kind.sums_of_dacc({"bias": False, "weight": True})
    assert kind.sums_of_dacc({"bias": True, "weight": False})


def test_grouped_linear_pads_odd_bias_rows_itself(monkeypatch):
    """out_features 12 (24-byte bias rows): the module hands the op 16-byte aligned rows, so the op
    never refuses the layout and copies after the fact; gradients reach the bias, and the input's
    and weight's are computed (torch._grouped_mm wants 16-byte strides: the op pads dD's rows)."""
    from gemmgen.integrations import ops

    def refused(*args, **kw):
        raise AssertionError("the op had to realign an argument")

    monkeypatch.setattr(ops, "_realigned", refused)
    layer = gg.nn.GroupedLinear(2, 16, 12)
    x, offsets = torch.randn(10, 16).bfloat16(), torch.tensor([4, 10], dtype=torch.int32)
    y = layer(x, offsets)
    b = layer.bias
    assert b is not None
    w, bf = layer.weight.detach().float(), b.detach().float()
    want = torch.cat([x[:4].float() @ w[0].T + bf[0], x[4:].float() @ w[1].T + bf[1]])
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
    xs = x.clone().requires_grad_(True)
    layer(xs, offsets).float().sum().backward()
    assert b.grad is not None and xs.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(b.grad.float(), torch.tensor([[4.0] * 12, [6.0] * 12]))
    torch.testing.assert_close(xs.grad.float(), torch.cat([w[0].sum(0).expand(4, 16), w[1].sum(0).expand(6, 16)]),
                               rtol=1.6e-2, atol=1e-2)
    want_w = torch.stack([x[:4].float().sum(0).expand(12, 16), x[4:].float().sum(0).expand(12, 16)])
    torch.testing.assert_close(layer.weight.grad.float(), want_w, rtol=1.6e-2, atol=1e-2)


def test_grouped_linear_mistakes_and_trace():
    """Wrong inputs raise InvalidArgument naming them; the offsets are checked by the op; the layer
    traces without graph breaks; `launches` names the kernel a number of rows uses, whatever their
    split, and model_launches both of the layer's."""
    layer = gg.nn.GroupedLinear(3, 16, 24, activation="silu")
    x, offsets = torch.randn(10, 16).bfloat16(), torch.tensor([3, 3, 10], dtype=torch.int32)
    with pytest.raises(InvalidArgument, match=r"input: expected \(tokens, 16\) rows sorted by expert, got \(10, 8\)"):
        layer(torch.randn(10, 8).bfloat16(), offsets)
    with pytest.raises(InvalidArgument, match=r"input: dtype torch.float32, but this layer computes in torch.bfloat16"):
        layer(x.float(), offsets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x.float(), offsets).dtype == torch.bfloat16
    with pytest.raises(InvalidArgument, match=r"offsets"):
        layer(x, offsets.long())
    with pytest.raises(InvalidArgument, match=r"num_experts: expected a positive int, got 0"):
        gg.nn.GroupedLinear(0, 16, 24)
    with pytest.raises(InvalidArgument, match=r"in_features 12 is not a multiple of 8"):
        gg.nn.GroupedLinear(2, 12, 24)
    with pytest.raises(InvalidArgument, match=r"the experts differ"):
        gg.nn.GroupedLinear.from_linears([torch.nn.Linear(16, 24), torch.nn.Linear(16, 32)])
    with pytest.raises(RecipeError, match=r"activation: expected one of"):
        gg.nn.GroupedLinear(2, 16, 24, activation="tanh")
    with pytest.raises(InvalidArgument, match=r"linears: 25 output features; a gated activation \(swiglu\) takes its "
                       r"rows in pairs.*interleave_pairs"):
        gg.nn.GroupedLinear.from_linears([torch.nn.Linear(16, 25, dtype=torch.bfloat16)], activation="swiglu")
    gated = gg.nn.GroupedLinear(2, 16, 24, activation="swiglu")
    gated.weight = torch.nn.Parameter(torch.zeros(2, 24, 16, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match=r"weight: expected shape \(2, 48, 16\) = \(num_experts, 2 x "
                       r"out_features: gate and up interleaved, in_features\)"):
        gated(x, torch.tensor([3, 10], dtype=torch.int32))
    explained = torch._dynamo.explain(lambda a, o: layer(a, o).relu())(x, offsets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    recipe, config = layer.launches()
    assert recipe.gemm.grouped and recipe is gg.nn.grouped_linear_recipe("silu", True, torch.bfloat16)
    assert config == recipe.default_config() == layer.launches(3 * 33)[1]
    decode = layer.launches(3 * 32)
    assert decode == (recipe, choose(recipe.ir, 96, 24, 16, 3).config) and decode[1].swap_ab
    assert gg.nn.model_launches(torch.nn.Sequential(layer), tokens=(1,)) == [(recipe, config), decode]
    assert "num_experts=3, in_features=16, out_features=24, bias=True, activation='silu'" in repr(layer)
    again = copy.deepcopy(layer)  # pickles without the recipe's lambda, rebuilt on load
    torch.testing.assert_close(again(x, offsets)[:10], layer(x, offsets)[:10])


@pytest.mark.parametrize("activation, bias", [("silu", True), (None, False)])
def test_block_scaled_grouped_linear_is_the_quantized_experts(activation, bias):
    """fp8 experts (CPU: the op's reference) against the quantized math in float64 (tokens quantized
    per row and 128 features, each expert's weight per 128 x 128 block), and within fp8's precision
    of the bf16 experts' Linears; from_quantized and pickling give the same layer."""
    gen = generator()
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    linears = [torch.nn.Linear(272, 136, bias=bias).bfloat16() for _ in range(3)]
    layer = gg.nn.BlockScaledGroupedLinear.from_linears(linears, activation=activation)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (3, 2, 3)
    x = torch.randn(50, 272, generator=gen).bfloat16()
    offsets = torch.tensor([9, 9, 44], dtype=torch.int32)
    y = layer(x, offsets)
    assert y.shape == (50, 136) and y.dtype == torch.bfloat16
    xq, sx = gg.quantize_blockwise(x, (1, 128), compact=True)
    act = {None: lambda t: t, "silu": torch.nn.functional.silu}[activation]
    for e, (start, end) in enumerate(group_bounds(offsets.tolist(), 50)):
        if start == end:
            continue
        xs = xq[start:end].double() * sx[start:end].double().repeat_interleave(128, 1)[:, :272]
        ws = layer.weight[e].double() * layer.weight_scale[e].double().repeat_interleave(128, 0).repeat_interleave(
            128, 1)[:136, :272]
        acc = xs @ ws.T + (layer.bias[e].double() if layer.bias is not None else 0)
        torch.testing.assert_close(y[start:end].double(), act(acc), rtol=1.6e-2, atol=1e-2)
        unquantized = act(linears[e].double()(x[start:end].double()))
        assert (y[start:end].double() - unquantized).norm() / unquantized.norm() < 0.06
    again = gg.nn.BlockScaledGroupedLinear.from_quantized(layer.weight, layer.weight_scale, layer.bias, activation)
    assert torch.equal(again(x, offsets)[:44], y[:44])
    copied = copy.deepcopy(layer)
    assert torch.equal(copied(x, offsets)[:44], y[:44])
    assert gg.nn.model_launches(torch.nn.Sequential(layer), tokens=(1, 64)) == [layer.launches(), layer.launches(8)]
    assert layer.launches()[0].gemm.block_scale == gg.DEEPSEEK_BLOCK_SCALE and layer.launches(8)[1].swap_ab


def test_block_scaled_grouped_linear_mistakes_and_trace():
    layer = gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(256, 128) for _ in range(2)])
    x, offsets = torch.randn(20, 256), torch.tensor([7, 20], dtype=torch.int32)
    explained = torch._dynamo.explain(lambda a, o: layer(a, o).relu())(x, offsets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    with pytest.raises(InvalidArgument, match=r"input: expected \(tokens, 256\) rows sorted by expert"):
        layer(x[None], offsets)
    with pytest.raises(InvalidArgument, match=r"in_features 24 is not a multiple of 16"):
        gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(24, 128)])
    with pytest.raises(InvalidArgument, match=r"out_features 12 is not a multiple of 8"):
        gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(256, 12)])
    with pytest.raises(InvalidArgument, match=r"weight_scale: expected an fp32 tensor of shape \(2, 1, 2\)"):
        gg.nn.BlockScaledGroupedLinear.from_quantized(layer.weight, layer.weight_scale[:, :, :1])
    with pytest.raises(InvalidArgument, match=r"weight: expected torch.float8_e4m3fn"):
        gg.nn.BlockScaledGroupedLinear.from_quantized(layer.weight.float(), layer.weight_scale)
    assert "num_experts=2, in_features=256, out_features=128, bias=True" in repr(layer)


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_grouped_linear_takes_the_masked_layout(activation):
    """`layer(x, masked_m=...)` on x (experts, max_m, in): each expert's first masked_m rows as the
    same tokens sorted by expert would give (offsets), forward and gradients; the rows past them
    neither read (NaN there reaches nothing) nor given a gradient. Refusals name the argument."""
    torch.manual_seed(0)
    layer = gg.nn.GroupedLinear(4, 64, 24, activation=activation)
    x = torch.randn(4, 9, 64).bfloat16()
    masked = torch.tensor([2, 9, 0, 5], dtype=torch.int32)
    keep = torch.arange(9)[None, :] < masked[:, None]
    x[~keep] = float("nan")
    tokens = x[keep].clone().requires_grad_(True)
    y_rows = layer(tokens, torch.cumsum(masked, 0).int())
    grad = torch.randn_like(y_rows.float())
    y_rows.float().backward(grad)
    assert layer.weight.grad is not None and layer.bias is not None and layer.bias.grad is not None
    want_w, want_b = layer.weight.grad.clone(), layer.bias.grad.clone()
    layer.zero_grad()
    xm = x.clone().requires_grad_(True)
    y = layer(xm, masked_m=masked)
    assert y.shape == (4, 9, 24) and y.dtype == torch.bfloat16 and y.is_contiguous()
    torch.testing.assert_close(y[keep], y_rows, rtol=0, atol=0)
    full = torch.zeros(4, 9, 24)
    full[keep] = grad
    y.float().backward(full)
    assert xm.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    torch.testing.assert_close(xm.grad[keep], tokens.grad, rtol=0, atol=0)
    assert (xm.grad[~keep] == 0).all()
    torch.testing.assert_close(layer.weight.grad.float(), want_w.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(layer.bias.grad.float(), want_b.float(), rtol=1e-2, atol=1e-2)
    ref = layer.reference(x, masked_m=masked)
    assert ref.shape == (4, 9, 24) and (ref[~keep] == 0).all()
    torch.testing.assert_close(y[keep].float(), ref[keep].float(), rtol=1.6e-2, atol=1e-2)
    with pytest.raises(gg.InvalidArgument, match="offsets/masked_m: pass one"):
        layer(x, masked, masked_m=masked)
    with pytest.raises(gg.InvalidArgument, match=r"input: expected \(4, max_m, 64\) with masked_m, got \(9, 64\)"):
        layer(x[0], masked_m=masked)
    with pytest.raises(gg.InvalidArgument, match=r"input: expected \(tokens, 64\) rows sorted by expert"):
        layer(x, torch.cumsum(masked, 0).int())
    fp8 = gg.nn.GroupedLinear(4, 128, 128, precision=gg.training.Float8Blockwise())
    with pytest.raises(gg.InvalidArgument, match=r"masked_m: precision=Float8Blockwise\(\) takes x \(tokens"):
        fp8(torch.randn(4, 9, 128).bfloat16(), masked_m=masked)

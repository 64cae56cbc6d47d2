"""Grouped kernels, their op and modules on an sm_90 GPU (skipped elsewhere, with the reason), and
the check that the GPU bundle holds every grouped kernel these tests launch."""

from __future__ import annotations

import copy

import pytest
import torch

import gemmgen as gg
from gemmgen.ir.reference import group_bounds
from gemmgen.runtime.grouped import GroupedKernel
from gemmgen.testing.grouped import (
    assert_gradients,
    block_grouped_inputs,
    experts_loop,
    fp8_grouped_inputs,
    gated_experts,
    gated_experts_loop,
    grouped_inputs,
    moe_recipe,
    moe_swiglu_recipe,
    unfused_grouped,
)
from gemmgen.tuning.heuristic import choose
from tests.data.gated import Experts, experts_reference, routing
from tests.data.gpu_matrix import (
    BLOCK_GROUPED_CONFIGS,
    FP8_GROUPED_CONFIGS,
    GROUPED_CONFIGS,
    GROUPED_EXPERTS,
    GROUPED_LINEAR_ROWS,
    GROUPED_PRECISIONS,
    GROUPED_TUNE_PROBLEM,
    TUNE_CANDIDATES,
    float8_grouped_layer,
    grouped_experts_launches,
    grouped_linear_layers,
    k_grouped_fp8_recipe,
    moe_fp8_recipe,
)


def test_the_gpu_bundle_holds_every_grouped_kernel_the_gpu_checks_launch(examples):
    """The GPU run loads every kernel from the bundle (GEMMGEN_JIT=0: a missing one fails there, after
    the device minutes are spent): each grouped kernel the GPU tests pick by shape is in the matrix."""
    from tests.data.gpu_matrix import gpu_matrix

    matrix = {(r.key, c) for r, c in gpu_matrix()}
    experts = gg.nn.GroupedLinear(4, 64, 128, activation="silu", device="meta")
    fp8_experts = gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(512, 256) for _ in range(2)],
                                                              activation="silu")
    wanted = [(moe_recipe(), choose(moe_recipe().ir, 37, 48, 64, groups).config) for groups in (1, 4)]
    gated = gg.nn.GroupedLinear(4, 64, 96, activation="swiglu", device="meta")
    geglu = gg.nn.GroupedLinear(4, 64, 96, bias=False, activation="geglu", device="meta")
    wanted += [layer.launches(rows) for layer in (experts, fp8_experts, gated, geglu) for rows in (12, 300)]
    wanted.append((moe_swiglu_recipe(), moe_swiglu_recipe().default_config()))
    wanted += [k for layer in grouped_linear_layers() for k in layer.backward_launches(GROUPED_LINEAR_ROWS)]
    wanted += grouped_experts_launches()
    for precision in GROUPED_PRECISIONS:
        float8 = float8_grouped_layer(precision=precision)
        wanted += [float8.launches(GROUPED_LINEAR_ROWS), *float8.backward_launches(GROUPED_LINEAR_ROWS)]
    wanted.append((k_grouped_fp8_recipe(), k_grouped_fp8_recipe().default_config()))
    wanted += [(examples["moe_fp8_block"], c) for c in BLOCK_GROUPED_CONFIGS]
    wanted += [(moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS] + [(moe_recipe(), c) for c in GROUPED_CONFIGS]
    wanted += [(moe_recipe(), c) for c in gg.tuning.candidates(moe_recipe().ir, *GROUPED_TUNE_PROBLEM,
                                                               limit=TUNE_CANDIDATES)]
    missing = [(r.name, c.name) for r, c in wanted if (r.key, c) not in matrix]
    assert not missing and {c.swap_ab for _, c in wanted} == {True, False}, missing


@pytest.mark.gpu
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=[c.name for c in GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [
    ((37, 64, 48, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((37, 64, 48, 4), (0, 37, 37, 37)),  # all rows in one group
    ((37, 64, 48, 4), (40, 3, 50, 60)),  # out of range and decreasing: clamped
    ((1000, 264, 136, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # tiles per group, K and N tails, M = 1
], ids=["gaps", "one", "bad", "large"])
def test_grouped_on_gpu(session_cache, config, shape, offsets):
    """Against the reference (fp32 on the CPU), output pre-filled with NaN: rows after the last group
    stay NaN; then a CUDA graph of the call replayed after the offsets changed on the GPU."""
    kernel = GroupedKernel(moe_recipe().build(config, cache=session_cache))
    rows, k, n, groups = shape
    a, b, offs, bias, weight = (t.cuda() for t in grouped_inputs(rows, k, n, groups, offsets))
    want = moe_recipe().reference(a, b, offs, bias=bias, weight=weight).float()
    assert want.nan_to_num().abs().sum() > 0
    out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
    kernel(a, b, offs, bias=bias, weight=weight, out=out)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    graph = torch.cuda.CUDAGraph()
    again = torch.full_like(out, float("nan"))
    with torch.cuda.graph(graph):
        kernel(a, b, offs, bias=bias, weight=weight, out=again)
    new = sorted(torch.randint(0, rows + 1, (groups,)).tolist())
    offs.copy_(torch.tensor(new, dtype=torch.int32))  # the replay reads the offsets on the GPU
    graph.replay()
    torch.cuda.synchronize()
    want = moe_recipe().reference(a, b, offs, bias=bias, weight=weight).float()
    covered = new[-1]
    torch.testing.assert_close(again[:covered].float().cpu(), want[:covered], rtol=1.6e-2, atol=1e-2,
                               msg=f"replay with offsets {new}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=[c.name for c in GROUPED_CONFIGS])
def test_masked_layout_on_gpu(session_cache, config):
    """The masked layout (a (groups, max_m, K), masked_m on the GPU) against the reference, D
    pre-filled with NaN and NaN in every row past a group's count (the kernel reads none); then a CUDA
    graph of the call replayed after masked_m changed on the GPU (decode's use of it)."""
    kernel = GroupedKernel(moe_recipe().build(config, cache=session_cache))
    groups, max_m, k, n = 6, 40, 264, 136
    a = torch.randn(groups, max_m, k, device="cuda").bfloat16()
    b = torch.randn(groups, n, k, device="cuda").bfloat16().transpose(1, 2)
    bias, weight = torch.randn(groups, n, device="cuda").bfloat16(), torch.rand(groups, max_m, device="cuda")
    counts = torch.tensor([0, 1, 17, 40, 55, -3], dtype=torch.int32, device="cuda")  # clamped to [0, 40]
    past = torch.arange(max_m, device="cuda")[None, :] >= counts.clamp(0, max_m)[:, None]
    a[past], weight[past] = float("nan"), float("nan")
    out = torch.full((groups, max_m, n), float("nan"), device="cuda").bfloat16()
    kernel(a, b, counts, bias=bias, weight=weight, out=out)
    want = moe_recipe().reference(a, b, counts, bias=bias, weight=weight).float()
    assert want.nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    graph = torch.cuda.CUDAGraph()
    again = torch.full_like(out, float("nan"))
    with torch.cuda.graph(graph):
        kernel(a, b, counts, bias=bias, weight=weight, out=again)
    counts.copy_(torch.tensor([3, 0, 40, 9, 1, 22], dtype=torch.int32))
    a.nan_to_num_(0.5)  # rows now counted must hold numbers
    weight.nan_to_num_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    want = moe_recipe().reference(a, b, counts, bias=bias, weight=weight).float()
    kept = ~(torch.arange(max_m)[None, :] >= counts.cpu()[:, None])
    torch.testing.assert_close(again.float().cpu()[kept], want[kept], rtol=1.6e-2, atol=1e-2,
                               msg="replay with new masked_m")


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(FP8_GROUPED_CONFIGS)), ids=[c.name for c in FP8_GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [((37, 128, 48, 4), (5, 5, 20, 30)),
                                            ((1000, 272, 136, 8), (90, 90, 333, 334, 600, 700, 999, 1000))])
def test_fp8_groups_on_gpu(session_cache, index, shape, offsets):
    """moe_fp8 against the reference on the GPU, output pre-filled with NaN, unswapped and swapped."""
    rows, k, n, groups = shape
    a, b, offs, ops = fp8_grouped_inputs(rows, k, n, groups, offsets)
    a, b, offs = a.cuda(), b.cuda(), offs.cuda()
    ops = {name: v.cuda() for name, v in ops.items()}
    want = moe_fp8_recipe().reference(a, b, offs, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
    GroupedKernel(moe_fp8_recipe().build(FP8_GROUPED_CONFIGS[index], cache=session_cache))(a, b, offs, out=out, **ops)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.gpu
def test_grouped_op_on_gpu(grouped_kernel):
    """The op on CUDA tensors (the kernel: swapped for 37 rows in 4 groups, the default for 37 in
    one), its gradients (torch._grouped_mm) and torch.compile."""
    op = gg.op(moe_recipe())
    one = [t.cuda() for t in grouped_inputs(groups=1, offsets=(37,))]
    assert not choose(moe_recipe().ir, 37, 48, 64, 1).config.swap_ab
    torch.testing.assert_close(op(*one).double().cpu(), unfused_grouped(*(t.cpu() for t in one)), rtol=1.6e-2,
                               atol=1e-2)
    a, b, offsets, bias, weight = (t.cuda() for t in grouped_inputs(offsets=(5, 5, 20, 37)))
    assert choose(moe_recipe().ir, 37, 48, 64, 4).config.swap_ab
    want = unfused_grouped(a.cpu(), b.cpu(), offsets.cpu(), bias.cpu(), weight.cpu())
    torch.testing.assert_close(op(a, b, offsets, bias, weight).double().cpu(), want, rtol=1.6e-2, atol=1e-2)
    compiled = torch.compile(lambda *x: op(*x), fullgraph=True)
    torch.testing.assert_close(compiled(a, b, offsets, bias, weight).double().cpu(), want, rtol=1.6e-2, atol=1e-2)
    leaves = [t.clone().requires_grad_(True) for t in (a, b, bias, weight)]
    grad = torch.randn(37, 48, device="cuda")
    op(leaves[0], leaves[1], offsets, leaves[2], leaves[3]).float().backward(grad)
    ref = [t.detach().cpu().double().requires_grad_(True) for t in (a, b, bias, weight)]
    unfused_grouped(ref[0], ref[1], offsets.cpu(), ref[2], ref[3]).backward(grad.cpu().double())
    assert_gradients(leaves, ref)


@pytest.mark.gpu
def test_grouped_autotune_on_gpu(tmp_path, monkeypatch):
    """A grouped autotune on the GPU: the swapped kernel and the default timed at a decode step;
    then the op launches the winner, which computes the layer (output checked against fp64)."""
    from gemmgen import tuning

    monkeypatch.setattr("gemmgen.tuning.table._TABLES", [])
    recipe = moe_recipe()
    table = gg.autotune(recipe, [GROUPED_TUNE_PROBLEM], limit=TUNE_CANDIDATES, out=tmp_path / "t.json")
    (entry,) = table.entries.values()
    assert len(entry["timings_us"]) == TUNE_CANDIDATES and all(t > 0 for t in entry["timings_us"].values())
    rows, n, k, groups = GROUPED_TUNE_PROBLEM
    assert tuning.config_for(recipe, rows, n, k, groups, device=tuning.Device.current()).name == entry["name"]
    ends = (3, 20, 20, 30, 41, 50, 60, 64)
    a, b, offsets, bias, weight = (t.cuda() for t in grouped_inputs(rows, k, n, groups, ends))
    want = unfused_grouped(a.cpu(), b.cpu(), offsets.cpu(), bias.cpu(), weight.cpu())
    assert want.abs().sum() > 0
    torch.testing.assert_close(gg.op(recipe)(a, b, offsets, bias, weight).double().cpu(), want, rtol=1.6e-2,
                               atol=1e-2)


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


@pytest.mark.gpu
def test_k_grouped_weight_gradient_on_gpu():
    """The experts' K-grouped weight gradient into main_grad on CUDA (issue 58 item 1): experts of 0,
    1, 127, 129 and 4096 tokens, none padded, against per-expert fp64 torch; D pre-filled with NaN,
    so an expert the kernel skipped shows."""
    from gemmgen.integrations.grouped import grouped_weight_grad_recipe

    sizes = (0, 1, 127, 129, 0, 4096)
    m, n = 136, 72
    dy = torch.randn(sum(sizes), m, device="cuda").bfloat16()
    x = torch.randn(sum(sizes), n, device="cuda").bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).int()
    main_grad = torch.randn(len(sizes), m, n, device="cuda")
    kernel = grouped_weight_grad_recipe(torch.bfloat16, accumulate=True).compile()
    out = torch.full_like(main_grad, float("nan"))
    kernel(dy.t(), x, offsets, main_grad=main_grad, out=out)
    torch.cuda.synchronize()
    start = 0
    for g, size in enumerate(sizes):
        want = dy[start:start + size].double().t() @ x[start:start + size].double() + main_grad[g].double()
        torch.testing.assert_close(out[g].double(), want, rtol=1e-5, atol=1e-3)
        start += size


@pytest.mark.gpu
def test_k_grouped_fp8_weight_gradient_on_gpu():
    """The K-grouped fp8 weight gradient into main_grad on CUDA: experts of 0, 1, 127, 129 and 4096
    tokens over gg.quantize_k_grouped's copies (each expert 16-token aligned, its scales from its
    own first token), against per-expert fp64 of the values the copies stand for; D pre-filled
    with NaN."""
    from tests.data.gpu_matrix import k_grouped_fp8_recipe
    from tests.runtime.test_k_grouped import dequantized

    sizes = (0, 1, 127, 129, 0, 4096)
    dy = torch.randn(sum(sizes), 136, device="cuda").bfloat16()
    x = torch.randn(sum(sizes), 80, device="cuda").bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).int()
    (a, scale_a), (b, scale_b) = gg.quantize_k_grouped(dy, offsets), gg.quantize_k_grouped(x, offsets)
    main_grad = torch.randn(len(sizes), 136, 80, device="cuda")
    out = torch.full_like(main_grad, float("nan"))
    k_grouped_fp8_recipe().compile()(a, b.t(), offsets, scale_a=scale_a, scale_b=scale_b, main_grad=main_grad,
                                     out=out)
    torch.cuda.synchronize()
    dy64 = dequantized(a.cpu(), scale_a.cpu(), sizes)
    x64 = dequantized(b.cpu(), scale_b.cpu(), sizes)
    start = 0
    for g, size in enumerate(sizes):
        want = dy64[start:start + size].t() @ x64[start:start + size] + main_grad[g].double().cpu()
        torch.testing.assert_close(out[g].double().cpu(), want, rtol=1e-5, atol=1e-3)
        start += size


@pytest.mark.gpu
@pytest.mark.parametrize("precision", GROUPED_PRECISIONS, ids=repr)
def test_float8_grouped_linear_matches_its_cpu_reference_on_gpu(precision):
    """GroupedLinear in fp8 on CUDA (its fprop, derived dL/dacc, dgrad and K-grouped wgrad kernels,
    from the bundle; Float8Tensorwise's scales read per group) against the same layer's step on
    the CPU (the recipes' references over the same quantized operands, which
    tests/training/test_grouped_float8*.py check against the recipe's definition): output and both
    gradients >= 40 dB. Experts of 1, 127, 0 and 169 tokens, 3 rows in none."""
    torch.manual_seed(0)
    gpu = float8_grouped_layer("cuda", precision)
    cpu = copy.deepcopy(gpu).cpu()
    sizes = (1, 127, 0, 169)
    x = torch.randn(GROUPED_LINEAR_ROWS, 256).bfloat16()
    g = torch.randn(GROUPED_LINEAR_ROWS, 128).bfloat16()
    offsets = torch.tensor(sizes).cumsum(0).int()
    results = []
    for layer, device in ((gpu, "cuda"), (cpu, "cpu")):
        xi = x.to(device).requires_grad_()
        y = layer(xi, offsets.to(device))
        y.backward(g.to(device))
        assert xi.grad is not None and layer.weight.grad is not None
        results.append([y[:297].detach(), xi.grad[:297], layer.weight.grad])
    for got, want in zip(*results, strict=True):
        want = want.double()
        assert not got.isnan().any()
        snr = float(20 * torch.log10(want.norm() / (got.cpu().double() - want).norm()))
        assert snr >= 40, snr  # the same quantized operands: only the fp32 sums' order differs


@pytest.mark.gpu
def test_grouped_linear_on_gpu():
    """The module on CUDA (the grouped kernel), forward against the experts' Linears in float64,
    eager and under torch.compile; gradients (through the derived backward kernel) against theirs."""
    linears = [torch.nn.Linear(64, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    layer = gg.nn.GroupedLinear.from_linears(linears, activation="silu")
    x = torch.randn(300, 64, device="cuda").bfloat16().requires_grad_(True)
    offsets = torch.tensor([40, 40, 200, 300], dtype=torch.int32, device="cuda")
    exact = [copy.deepcopy(m).cpu().double() for m in linears]
    x64 = x.detach().cpu().double().requires_grad_(True)
    want = experts_loop(exact, x64, offsets.cpu(), "silu")
    y = layer(x, offsets)
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(y.double().cpu(), want.detach(), rtol=1.6e-2, atol=1.6e-2 * scale)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets).double().cpu(), want.detach(), rtol=1.6e-2, atol=1.6e-2 * scale)
    grad = torch.randn(300, 128)
    y.float().backward(grad.cuda())
    want.backward(grad.double())
    assert x.grad is not None and layer.weight.grad is not None and layer.bias is not None
    assert layer.bias.grad is not None and x64.grad is not None
    for got, ref in ((x.grad, x64.grad), (layer.weight.grad, torch.stack([_grad(m.weight) for m in exact])),
                     (layer.bias.grad, torch.stack([_grad(m.bias) for m in exact]))):
        assert ref.norm() > 0
        assert (got.double().cpu() - ref).norm() / ref.norm() < 1e-2
    x, offsets = x[:12].detach(), torch.tensor([3, 3, 10, 12], dtype=torch.int32, device="cuda")  # decode: swapped
    assert layer.launches(12)[1].swap_ab
    want = experts_loop([m.cpu() for m in linears], x.cpu(), offsets.cpu(), "silu")
    torch.testing.assert_close(layer(x, offsets).double().cpu(), want, rtol=1.6e-2,
                               atol=1.6e-2 * float(want.abs().max()))
    masked = x.new_full((4, 3, 64), float("nan"))  # the masked layout, 4 x 3 rows: the 12 rows' kernel
    ends = [3, 3, 6, 8]
    for e, (start, end) in enumerate(group_bounds(ends, 8)):
        masked[e, :end - start] = x[start:end]
    got = layer(masked, masked_m=torch.tensor([3, 0, 3, 2], dtype=torch.int32, device="cuda"))
    want = experts_loop([m.cpu() for m in linears], x[:8].cpu(), torch.tensor(ends), "silu")
    for e, (start, end) in enumerate(group_bounds(ends, 8)):
        torch.testing.assert_close(got[e, :end - start].double().cpu(), want[start:end], rtol=1.6e-2,
                                   atol=1.6e-2 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("activation, bias", [("swiglu", True), ("geglu", False)])
def test_gated_grouped_linear_on_gpu(activation, bias):
    """Gated experts on CUDA (the grouped kernel over column pairs), forward against each expert's
    gate and up Linears in float64, eager and under torch.compile, prefill and decode sizes (both
    unswapped); gradients (through the derived backward kernel) against theirs."""
    gates, ups, fc1s = gated_experts(4, 64, 96, bias, device="cuda")
    layer = gg.nn.GroupedLinear.from_linears(fc1s, activation=activation)
    x = torch.randn(300, 64, device="cuda").bfloat16().requires_grad_(True)
    offsets = torch.tensor([40, 40, 200, 300], dtype=torch.int32, device="cuda")
    want = gated_experts_loop(gates, ups, x.detach().cpu(), offsets.cpu(), activation)
    y = layer(x, offsets)
    assert y.shape == (300, 96)
    torch.testing.assert_close(y.double().cpu(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets).double().cpu(), want, rtol=1.6e-2,
                               atol=1.6e-2 * float(want.abs().max()))
    grad = torch.randn(300, 96)
    y.float().backward(grad.cuda())
    x64 = x.detach().cpu().double().requires_grad_(True)
    gated_experts_loop(gates, ups, x64, offsets.cpu(), activation).backward(grad.double())
    assert x.grad is not None and layer.weight.grad is not None and x64.grad is not None
    weight = torch.stack([gg.nn.interleave_pairs(_grad(g.weight), _grad(u.weight))
                          for g, u in zip(gates, ups, strict=True)])
    pairs = [(x.grad, x64.grad), (layer.weight.grad, weight)]
    if bias:
        assert layer.bias is not None and layer.bias.grad is not None
        pairs.append((layer.bias.grad, torch.stack([gg.nn.interleave_pairs(_grad(g.bias), _grad(u.bias))
                                                    for g, u in zip(gates, ups, strict=True)])))
    for got, ref in pairs:
        assert ref.norm() > 0
        assert (got.double().cpu() - ref).norm() / ref.norm() < 1e-2
    x, offsets = x[:12].detach(), torch.tensor([3, 3, 10, 12], dtype=torch.int32, device="cuda")
    assert not layer.launches(12)[1].swap_ab
    want = gated_experts_loop(gates, ups, x.cpu(), offsets.cpu(), activation)
    torch.testing.assert_close(layer(x, offsets).double().cpu(), want, rtol=1.6e-2,
                               atol=1.6e-2 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, offsets", [
    ((37, 64, 48, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((1000, 264, 136, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # tiles per group, K and N tails, M = 1
], ids=["gaps", "large"])
def test_gated_groups_on_gpu(gated_grouped_kernel, shape, offsets):
    """moe_swiglu's kernel (the PairStore writing each group's N/2 columns) against its reference;
    rows in no group keep what the caller's D held."""
    rows, k, n, groups = shape
    a, b, offs, bias, weight = (t.cuda() for t in grouped_inputs(rows, k, n, groups, offsets))
    out = torch.full((rows, n // 2), float("nan"), device="cuda").bfloat16()
    GroupedKernel(gated_grouped_kernel)(a, b, offs, bias=bias, weight=weight, out=out)
    want = moe_swiglu_recipe().reference(a.cpu(), b.cpu(), offs.cpu(), bias=bias.cpu(), weight=weight.cpu())
    assert want.float().nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float().cpu(), want.float(), rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(BLOCK_GROUPED_CONFIGS)), ids=[c.name for c in BLOCK_GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [
    ((37, 304, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last; K and N tails
    ((1000, 528, 264, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # tiles per group, M = 1
], ids=["gaps", "large"])
def test_block_scaled_groups_on_gpu(examples, index, shape, offsets):
    """moe_fp8_block on the GPU against the reference (fp32 on the CPU), output pre-filled with NaN,
    then a CUDA graph of the call replayed after the offsets changed on the GPU."""
    recipe = examples["moe_fp8_block"]
    kernel = recipe.compile(BLOCK_GROUPED_CONFIGS[index])
    rows, k, n, groups = shape
    a, b, offs, ops, _, _ = block_grouped_inputs(rows, k, n, groups, offsets)
    a, b, offs = a.cuda(), b.cuda(), offs.cuda()
    ops = {name: v.cuda() for name, v in ops.items()}
    want = recipe.reference(a, b, offs, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
    kernel(a, b, offs, **ops, out=out)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    graph = torch.cuda.CUDAGraph()
    again = torch.full_like(out, float("nan"))
    with torch.cuda.graph(graph):
        kernel(a, b, offs, **ops, out=again)
    new = sorted(torch.randint(0, rows + 1, (groups,)).tolist())
    offs.copy_(torch.tensor(new, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = recipe.reference(a, b, offs, **ops).float()
    torch.testing.assert_close(again[:new[-1]].float().cpu(), want[:new[-1]], rtol=1.6e-2, atol=1e-2,
                               msg=f"replay with offsets {new}")


@pytest.mark.gpu
def test_block_scaled_grouped_linear_on_gpu():
    """The fp8 experts on CUDA (the kernel) against the same layer on the CPU (the op's reference on
    the same quantized values), eager and replayed in a CUDA graph; and a decode step (swapped)."""
    linears = [torch.nn.Linear(512, 256, dtype=torch.bfloat16) for _ in range(4)]
    cpu = gg.nn.BlockScaledGroupedLinear.from_linears(linears, activation="silu")
    layer = copy.deepcopy(cpu).cuda()
    x = torch.randn(300, 512).bfloat16()
    offsets = torch.tensor([40, 40, 200, 300], dtype=torch.int32)
    want = cpu(x, offsets).float()
    assert want.abs().sum() > 0
    xc, oc = x.cuda(), offsets.cuda()
    torch.testing.assert_close(layer(xc, oc).float().cpu(), want, rtol=1.6e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(xc, oc)
    xc.copy_(torch.randn(300, 512).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float().cpu(), cpu(xc.cpu(), offsets).float(), rtol=1.6e-2, atol=1e-2)
    x, offsets = x[:12], torch.tensor([3, 3, 10, 12], dtype=torch.int32)  # a decode step: the swapped kernel
    assert layer.launches(12)[1].swap_ab
    torch.testing.assert_close(layer(x.cuda(), offsets.cuda()).float().cpu(), cpu(x, offsets).float(), rtol=1.6e-2,
                               atol=1e-2)


@pytest.mark.gpu
def test_grouped_experts_on_gpu():
    """transformers' 3-d experts as GroupedExperts on CUDA (issue 59): the routed pairs sorted and
    counted on the device, an expert with no tokens, both grouped kernels; forward eager and under
    torch.compile(fullgraph=True), and every gradient, against an fp64 loop over each token's
    experts."""
    torch.manual_seed(0)
    e, hidden, inter = GROUPED_EXPERTS
    ref = Experts(e, hidden, inter, bias=True).bfloat16()
    layer = gg.nn.GroupedExperts.from_experts(copy.deepcopy(ref).cuda(), "swiglu")
    tokens = GROUPED_LINEAR_ROWS // 2
    index, weights = routing(tokens, e - 1, 2, 1)  # the last expert gets nothing
    x = torch.randn(tokens, hidden).bfloat16()
    exact = copy.deepcopy(ref).double()
    x64 = x.double().requires_grad_(True)
    want = experts_reference(exact, x64, index, weights)
    xc = x.cuda().requires_grad_(True)
    got = layer(xc, index.cuda(), weights.cuda())
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=1.6e-2, atol=1.6e-2 * scale)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(xc.detach(), index.cuda(), weights.cuda()).double().cpu(), want.detach(),
                               rtol=1.6e-2, atol=1.6e-2 * scale)
    grad = torch.randn(tokens, hidden)
    got.float().backward(grad.cuda())
    want.backward(grad.double())
    pairs = [(getattr(layer, n).grad, getattr(exact, n).grad)
             for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")]
    for mine, theirs in [(xc.grad, x64.grad), *pairs]:
        assert mine is not None and theirs is not None and theirs.norm() > 0
        assert (mine.double().cpu() - theirs).norm() / theirs.norm() < 1e-2

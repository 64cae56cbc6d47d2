"""Training on an sm_90 GPU (marker `gpu`; skipped with a reason elsewhere): the derived backward
kernels (`Recipe.backward`) as FusedMLP, FusedLinear and the op launch them, against the unfused
model in float64 on the CPU; fp32 weight-gradient accumulation (`main_grad`). Every kernel comes
from the prepared bundle (tests/data/gpu_matrix.py: TRAINING_MLP, OP_BACKWARD_PROBLEM)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gemmgen as gg
from tests.data.gated import LlamaMLP
from tests.data.gpu_matrix import OP_BACKWARD_PROBLEM, TRAINING_MLP

pytestmark = pytest.mark.gpu

_ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double().cpu()
    assert want.abs().max() > 0
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


def _grads(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    model(x).backward(g)
    assert x.grad is not None
    return [x.grad, *[p.grad if p.grad is not None else p.main_grad for p in model.parameters()]]  # type: ignore


@pytest.mark.parametrize(("activation", "recompute", "accumulate_grad"),
                         [("gelu", False, False), ("gelu", True, False), ("silu", False, True)])
def test_fused_mlp_trains_like_the_unfused_model(activation, recompute, accumulate_grad):
    """Forward and every gradient against the unfused model in float64 (CPU), no further from it
    than the unfused bf16 model on the GPU is, plus a bf16 rounding; 300 tokens (not a tile
    multiple)."""
    tokens, n_in, hidden, n_out = TRAINING_MLP
    torch.manual_seed(0)
    unfused = nn.Sequential(nn.Linear(n_in, hidden), _ACTIVATIONS[activation](), nn.Linear(hidden, n_out))
    unfused = unfused.to("cuda", torch.bfloat16)
    first, second = unfused[0], unfused[2]
    assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
    fused = gg.nn.FusedMLP.from_linears(copy.deepcopy(first), activation, copy.deepcopy(second), recompute=recompute,
                                        accumulate_grad=accumulate_grad)
    x = torch.randn(tokens, n_in, device="cuda").bfloat16()
    g = torch.randn(tokens, n_out, device="cuda").bfloat16()
    exact = copy.deepcopy(unfused).cpu().double()
    want = _grads(exact, x.cpu().double(), g.cpu().double())
    for got, base, ref in zip(_grads(fused, x, g), _grads(unfused, x, g), want, strict=True):
        assert not got.isnan().any()
        assert _relative(got, ref) <= 2 * _relative(base, ref) + 2**-8
    with torch.no_grad():
        want_y = exact(x.cpu().double())
        assert _relative(fused(x), want_y) <= 2 * _relative(unfused(x), want_y) + 2**-8


def test_the_ops_backward_launches_its_derived_kernel():
    """gg.op(recipe) with gradients wanted: the recomputing backward kernel (dL/dacc, the bias and
    residual gradients in one launch), then the dgrad and wgrad GEMMs; against float64 autograd."""
    from gemmgen.aot import load_recipes
    from tests.data import EXAMPLES

    recipe = load_recipes(EXAMPLES)["bias_silu_residual"]
    m, n, k = OP_BACKWARD_PROBLEM
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()  # B row-major, as the recipe declares
    bias, residual = torch.randn(n, device="cuda").bfloat16(), torch.randn(m, n, device="cuda").bfloat16()
    leaves = [t.clone().requires_grad_() for t in (a, b, bias, residual)]
    y = gg.op(recipe)(*leaves)
    g = torch.randn_like(y)
    y.backward(g)
    ref = [t.cpu().double().requires_grad_() for t in (a, b, bias, residual)]
    (torch.nn.functional.silu(ref[0] @ ref[1] + ref[2]) + ref[3]).backward(g.cpu().double())
    for mine, theirs in zip(leaves, ref, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert _relative(mine.grad, theirs.grad) <= 2**-6


def test_a_saved_accumulator_backward_kernel_matches_its_reference():
    """The derived kernel for the next layer's dgrad GEMM (the coverage kernel `bias_gelu_bwd`:
    dL/dacc from the saved accumulator and the bias gradient as a sum over M, swapped) on the GPU
    against its own fp32 reference, NaN-prefilled outputs, odd sizes."""
    from gemmgen.aot import load_recipes
    from gemmgen.testing.tensors import assert_output_close
    from tests.data import EXTRA

    recipe = load_recipes(EXTRA)["bias_gelu_bwd"]
    kernel = recipe.compile()
    m, n, k = 300, 264, 1000
    dy, w = torch.randn(m, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16()
    saved, bias = torch.randn(m, n, device="cuda").bfloat16(), torch.randn(n, device="cuda").bfloat16()
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grad_bias = torch.zeros(n, device="cuda")
    kernel(dy, w, saved_acc=saved, bias=bias, out=(d, grad_bias))
    want = recipe.reference(dy.cpu(), w.cpu(), saved_acc=saved.cpu(), bias=bias.cpu())
    from gemmgen.ir.reference import reference

    scale = reference(recipe.ir, dy.cpu(), w.cpu(), {"saved_acc": saved.cpu(), "bias": bias.cpu()}, magnitudes=True)
    for o, got, ref, mag in zip(recipe.outputs, (d, grad_bias), want, scale, strict=True):
        assert not got.isnan().any()
        assert_output_close(o, got.cpu(), ref, mag, (m, n), 1.6e-2, 1.6e-2, "bias_gelu_bwd")


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "bias"])
def test_gated_fused_mlp_trains_like_llamas_mlp(bias):
    """SwiGLU (gemmgen's fc1 over column pairs: gate and up interleaved) against Llama's unfused
    down(silu(gate(x)) * up(x)): forward and every gradient against it in float64 (CPU), no
    further than the unfused bf16 model on the GPU, plus a bf16 rounding; 300 tokens. Without
    biases fc2's dgrad GEMM carries fc1's derived epilogue; with them fc1 recomputes."""
    tokens, n_in, hidden, n_out = TRAINING_MLP
    torch.manual_seed(0)
    unfused = LlamaMLP(n_in, hidden, n_out, bias).to("cuda", torch.bfloat16)
    fused = gg.nn.FusedMLP.from_linears(unfused.fc1(), "swiglu", copy.deepcopy(unfused.down))
    assert fused.recompute == bias
    x = torch.randn(tokens, n_in, device="cuda").bfloat16()
    g = torch.randn(tokens, n_out, device="cuda").bfloat16()
    exact = copy.deepcopy(unfused).cpu().double()

    def llama_grads(model: LlamaMLP, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        x = x.clone().requires_grad_()
        gx, *params = torch.autograd.grad(model(x), [x, *model.parameters()], g)
        return [gx, *model.fused_order(params)]

    want, base = llama_grads(exact, x.cpu().double(), g.cpu().double()), llama_grads(unfused, x, g)
    for got, b, ref in zip(_grads(fused, x, g), base, want, strict=True):
        assert not got.isnan().any()
        assert _relative(got, ref) <= 2 * _relative(b, ref) + 2**-8
    with torch.no_grad():
        want_y = exact(x.cpu().double())
        assert _relative(fused(x), want_y) <= 2 * _relative(unfused(x), want_y) + 2**-8


@pytest.mark.parametrize("precision", ["Float8Blockwise", "Float8Tensorwise"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_float8_mlp_matches_its_cpu_reference(activation, precision):
    """A FusedMLP in Float8Blockwise or Float8Tensorwise (current scaling) on the GPU (its 6 fp8
    kernels, from the bundle) against the same module's step on the CPU (the kernels' recipes
    evaluated by their references, which tests/training checks bit-exactly against the recipe's
    definition). 300 tokens: a K tail in both weight gradients."""
    from tests.data.gpu_matrix import TRAINING_FP8_MLP

    tokens, n_in, hidden, n_out = TRAINING_FP8_MLP
    torch.manual_seed(0)
    gated = activation == "swiglu"
    low = getattr(gg.training, precision)()
    gpu = gg.nn.FusedMLP(n_in, hidden, n_out, activation, bias=not gated, precision=low).cuda()
    cpu = copy.deepcopy(gpu).cpu()
    x = torch.randn(tokens, n_in).bfloat16()
    g = torch.randn(tokens, n_out).bfloat16()
    got = _grads(gpu, x.cuda(), g.cuda())
    want = _grads(cpu, x, g)
    for a, b in zip(got, want, strict=True):
        assert not a.isnan().any()
        b = b.double()
        snr = float(20 * torch.log10(b.norm() / (a.cpu().double() - b).norm()))
        assert snr >= 40, snr  # the same quantized operands: only the fp32 sums' order differs


def test_a_delayed_float8_mlp_matches_its_cpu_reference_once_its_scales_move():
    """A GELU FusedMLP in Float8Tensorwise(scaling="delayed") on the GPU (fc1's and fc2's dgrad
    kernels write h and dL/dacc1 in fp8 with their amaxes) against the same module's steps on the
    CPU: two steps, the weights changed in place between them (an optimizer step), so the second
    step quantizes with scales from the first step's amaxes; 300 tokens."""
    from tests.data.gpu_matrix import TRAINING_FP8_MLP

    tokens, n_in, hidden, n_out = TRAINING_FP8_MLP
    torch.manual_seed(0)
    low = gg.training.Float8Tensorwise(scaling="delayed")
    gpu = gg.nn.FusedMLP(n_in, hidden, n_out, "gelu", precision=low).cuda()
    cpu = copy.deepcopy(gpu).cpu()
    for step in range(2):
        x = torch.randn(tokens, n_in).bfloat16() * (step + 1)
        g = torch.randn(tokens, n_out).bfloat16()
        got, want = _grads(gpu, x.cuda(), g.cuda()), _grads(cpu, x, g)
        with torch.no_grad():
            for module in (gpu, cpu):
                for p in module.parameters():
                    p.mul_(0.75)
    for a, b in zip(got, want, strict=True):
        assert not a.isnan().any()
        b = b.double()
        snr = float(20 * torch.log10(b.norm() / (a.cpu().double() - b).norm()))
        assert snr >= 40, snr  # the same quantized operands: only the fp32 sums' order differs


def test_a_cuda_graph_of_a_float8_layer_follows_its_weight():
    """A captured forward of a Float8Blockwise FusedLinear, replayed after the weight changed in
    place (an optimizer step), gives what an eager call gives: the quantization is in the graph."""
    from gemmgen.training import Float8Blockwise

    layer = gg.nn.FusedLinear(512, 256, precision=Float8Blockwise()).cuda()
    x = torch.randn(64, 512, device="cuda").bfloat16()
    layer(x)  # the kernels loaded, the weight quantized (and held) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-0.5)  # in place, as an optimizer step
        graph.replay()
        torch.testing.assert_close(y, layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(300, 512), (1, 128), (129, 264)], ids=lambda s: "x".join(map(str, s)))
def test_the_quantize_kernels_give_the_torch_quantizers_bits(shape):
    """Each quantize kernel of the bundle on the GPU against its torch ops on the CPU (which
    tests/runtime/test_cast_transpose.py checks against the kernels' host builds): the amax, both
    copies and their scales bit for bit (NaN's sign aside); per tensor over the amax kernel's amax;
    a partial last tile of rows and of columns included."""
    from gemmgen.codegen.quantize import AmaxSpec
    from gemmgen.runtime.cast_transpose import CastTranspose, TensorAmax
    from tests.data.gpu_matrix import quantize_specs

    torch.manual_seed(1)
    for spec in quantize_specs():
        if isinstance(spec, AmaxSpec):
            continue
        kernel = CastTranspose(spec)
        x = (torch.randn(shape) * torch.exp2(torch.randint(-12, 12, (shape[0], 1)))).to(spec.source.torch)
        if not spec.per_tensor:
            x[0, 0] = float("nan")
        got_amax = want_amax = None
        if spec.per_tensor:
            amax = TensorAmax(AmaxSpec(spec.source))
            got_amax, want_amax = amax(x.cuda()), amax(x)
            assert torch.equal(got_amax.cpu(), want_amax)
        got, want = kernel(x.cuda(), amax=got_amax), kernel(x, amax=want_amax)
        for g, w in ((got.q, want.q), (got.q_t, want.q_t)):
            assert g is not None and w is not None
            g = g.cpu()
            same = (g.view(torch.uint8) == w.view(torch.uint8)) | (g.float().isnan() & w.float().isnan())
            assert same.all(), f"{spec.name} {shape}: {int((~same).sum())} values differ"
        for g, w in ((got.scale, want.scale), (got.scale_t, want.scale_t)):
            assert g is not None and w is not None and torch.equal(g.cpu(), w)


@pytest.mark.parametrize("precision", ["Float8Blockwise", "Float8Tensorwise"])
def test_a_float8_step_with_the_quantize_kernels_is_the_torch_quantizers_step(precision):
    """A GELU FusedMLP's step on the GPU quantizes X and dY by the quantize kernels (both copies in
    one pass each, the scales written in the layouts the GEMMs read; current scaling: the amax
    kernel first, and h and dL/dacc1 from their epilogues' amax too); the same step with torch's
    quantizers instead gives the same output and gradients, bit for bit."""
    from unittest import mock

    from gemmgen.runtime import cast_transpose
    from tests.data.gpu_matrix import TRAINING_FP8_MLP

    tokens, n_in, hidden, n_out = TRAINING_FP8_MLP
    torch.manual_seed(0)
    mlp = gg.nn.FusedMLP(n_in, hidden, n_out, "gelu", precision=getattr(gg.training, precision)()).cuda()
    x = torch.randn(tokens, n_in, device="cuda").bfloat16()
    g = torch.randn(tokens, n_out, device="cuda").bfloat16()
    with mock.patch.object(cast_transpose.CastTranspose, "__call__", autospec=True,
                           side_effect=cast_transpose.CastTranspose.__call__) as launched:
        fused = _grads(mlp, x, g)
    # X and dY; per tensor h and dL/dacc1 too (from their epilogues' amax)
    assert launched.call_count == (2 if precision == "Float8Blockwise" else 4)
    mlp.zero_grad(set_to_none=True)
    with mock.patch("gemmgen.training.precision.cast_transposable", return_value=False), \
            mock.patch("gemmgen.training.tensorwise.cast_transposable", return_value=False):
        by_torch = _grads(mlp, x, g)
    for a, b in zip(fused, by_torch, strict=True):
        assert torch.equal(a, b)

"""PyTorch integration on the CPU: custom ops with fake implementations, torch.compile without
graph breaks, autograd, FusedLinear and fused models. (fuse() itself: tests/nn/test_fuse.py; GPU runs:
tests/gpu/test_gpu.py.)"""

from __future__ import annotations

import collections
import copy
import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gemmgen as gg
from gemmgen.integrations.ops import op, schema
from gemmgen.testing.tensors import strided_matrix


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _recipe():
    return gg.Recipe("torch_silu_res", lambda acc, bias, res, s: gg.silu(acc * s + bias) + res, a=gg.f16, b=gg.f16,
                     operands={"bias": gg.RowVector(gg.f16), "res": gg.Matrix(gg.f16), "s": gg.Scalar()})


def _args(gen, m=7, n=9, k=32):
    """Odd M and N; the residual's rows padded to 16 bytes, as TMA (and so the op) requires."""
    a = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, k, generator=gen).half().t()
    res = strided_matrix(lambda *shape: torch.randn(*shape, generator=gen), m, n, torch.half, gg.RowMajor)
    return a, b, torch.randn(n, generator=gen).half(), res, 0.5


def test_schema_and_cpu_impl_match_the_reference(gen):
    r = _recipe()
    assert schema(r).endswith("(Tensor a, Tensor b, Tensor bias, Tensor res, float s) -> Tensor")
    a, b, bias, res, s = _args(gen)
    out = op(r)(a, b, bias, res, s)
    assert out.shape == (7, 9) and out.stride() == (16, 1)  # rows padded to 16 bytes, as on the GPU
    torch.testing.assert_close(out, r.reference(a, b, bias=bias, res=res, s=s))


def test_op_takes_any_layout_like_a_torch_op(gen):
    """The op accepts what torch ops accept (here: an unpadded odd-width residual, as torch.compile
    materialises intermediates, a row-major B for a column-major recipe, A sliced at an odd
    offset); the kernel itself would refuse each (tests/runtime/test_runtime.py), so the op copies them."""
    a, b, bias, _, s = _args(gen)
    res = torch.randn(7, 9, generator=gen).half()
    a_odd = torch.randn(7 * 32 + 1, generator=gen).half()[1:].view(7, 32)
    for args in ((a, b, bias, res, s), (a, b.contiguous(), bias, res, s), (a_odd, b, bias, res, s)):
        want = _recipe().reference(args[0], args[1], bias=bias, res=res, s=s)
        assert want.abs().max() > 0
        torch.testing.assert_close(op(_recipe())(*args), want)
    torch.library.opcheck(op(_recipe()), (a, b, bias, res, s))  # AOT tracing re-creates inputs unpadded
    with pytest.raises(gg.InvalidArgument, match=r"bias: expected dtype torch\.float16"):
        op(_recipe())(a, b, bias.float(), res, s)  # a mistake a copy cannot fix still raises


def test_fake_implementation_and_opcheck(gen):
    f = op(_recipe())
    torch.library.opcheck(f, _args(gen))  # fake vs real shapes/strides, schema, autograd registration
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = f(torch.empty(3, 40, dtype=torch.float16), torch.empty(40, 24, dtype=torch.float16),
                torch.empty(24, dtype=torch.float16), torch.empty(3, 24, dtype=torch.float16), 1.0)
        assert out.shape == (3, 24) and out.stride() == (24, 1) and out.dtype == torch.float16
        one = f(torch.empty(3, 40, dtype=torch.float16), torch.empty(40, 1, dtype=torch.float16),
                torch.empty(1, dtype=torch.float16), torch.empty(3, 1, dtype=torch.float16), 1.0)
        assert one.shape == (3, 1) and one.stride() == (8, 1)  # one column: a row is still 16 bytes for TMA


def test_autograd_matches_torch(gen):
    f = op(_recipe())
    a, b, bias, res, s = _args(gen)
    leaves = [t.detach().clone().requires_grad_() for t in (a, b, bias, res)]
    f(*leaves, s).float().sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (a, b, bias, res)]
    (F.silu(ref[0] @ ref[1] * s + ref[2]) + ref[3]).sum().backward()
    for mine, theirs in zip(leaves, ref, strict=True):
        assert theirs.grad.abs().max() > 0
        torch.testing.assert_close(mine.grad.float(), theirs.grad, rtol=2e-3, atol=2e-3 * theirs.grad.abs().max())


def test_backward_computes_only_the_gradients_asked_for(gen):
    """A frozen weight costs no weight-gradient GEMM (nor a frozen input its data-gradient GEMM):
    the backward launches the recipe's derived backward kernel (the accumulator recomputed, dL/dacc
    and the bias and residual gradients from it in one launch) and one GEMM per operand needing a
    gradient, and no elementwise or reduction kernel (torch's autograd of the epilogue ran 11)."""
    recipe = _recipe()
    f = op(recipe)
    backward = op(recipe.backward(recompute=True, saved=gg.f16, wrt=["bias", "res"]).kernel)
    a, b, bias, res, s = _args(gen)
    bias.requires_grad_()
    for wants, gemms in (((True, True), 2), ((True, False), 1), ((False, True), 1)):
        a_, b_ = a.clone().requires_grad_(wants[0]), b.clone().requires_grad_(wants[1])
        bias.grad = None
        out = f(a_, b_, bias, res, s)
        with _Counting() as counted:
            out.backward(torch.ones_like(out))
        assert counted.matmuls == gemms, wants
        assert counted.compute() == {backward.default: 1, torch.ops.aten.mm.default: gemms}, counted.ops
        assert (a_.grad is not None, b_.grad is not None) == wants



def test_batched_op_gradients_through_the_derived_kernel(gen):
    """A batched recipe with a row vector shared by the batch (its gradient summed over M in the
    kernel, then over the batch), a column vector (its gradient left to torch: the kernel sums over
    M) and a matrix: every gradient against float64 autograd, the derived kernel launched once."""
    recipe = gg.Recipe("torch_batched_bwd", lambda acc, bias, scale, res: gg.gelu(acc * scale + bias) + res,
                       batched=True, operands={"bias": gg.RowVector(gg.bf16), "scale": gg.ColVector(gg.f32),
                                               "res": gg.Matrix(gg.bf16)})
    a = torch.randn(3, 9, 40, generator=gen).bfloat16()
    b = torch.randn(40, 24, generator=gen).bfloat16().t().contiguous().t().expand(3, 40, 24).contiguous()
    bias, scale = torch.randn(24, generator=gen).bfloat16(), torch.rand(9, generator=gen) + 0.5
    res = torch.randn(3, 9, 24, generator=gen).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (a, b, bias, scale, res)]
    y = op(recipe)(*leaves)
    g = torch.randn(y.shape, generator=gen).bfloat16()
    with _Counting() as counted:
        y.backward(g)
    assert sum(n for f_, n in counted.compute().items() if f_.namespace == "gemmgen") == 1
    ref = [t.double().requires_grad_() for t in (a, b, bias, scale, res)]
    (F.gelu(ref[0] @ ref[1] * ref[3][:, None] + ref[2]) + ref[4]).backward(g.double())
    for name, mine, theirs in zip(("a", "b", "bias", "scale", "res"), leaves, ref, strict=True):
        assert theirs.grad is not None and mine.grad is not None and mine.grad.shape == theirs.grad.shape, name
        assert theirs.grad.abs().max() > 0
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=0, atol=2e-2 * theirs.grad.abs().max().item(),
                                   msg=name)

def _fp8_args(gen, m=7, n=24, k=48):
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=gen).to(torch.float8_e5m2).t()  # N x K weight: B column-major
    return a, b, torch.rand(m, generator=gen) + 0.5, torch.rand(n, generator=gen) + 0.5


def test_fp8_op_evaluates_traces_and_differentiates_its_scales(gen):
    """fp8 A/B: the CPU implementation, the fake one, and gradients for the epilogue's operands
    (torch has no plain fp8 GEMM: the accumulator is recomputed from the fp8 values in fp32)."""
    r = gg.Recipe("torch_fp8", lambda acc, sa, sb: acc * sa * sb, a=gg.e4m3, b=gg.e5m2,
                  operands={"sa": gg.ColVector(gg.f32), "sb": gg.RowVector(gg.f32)})
    a, b, sa, sb = _fp8_args(gen)
    want = (a.float() @ b.float()) * sa[:, None] * sb
    assert want.abs().max() > 0
    out = op(r)(a, b, sa, sb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want.bfloat16())
    torch.library.opcheck(op(r), (a, b, sa, sb), test_utils="test_faketensor")  # test_schema: torch has no fp8 mul
    sa_, sb_ = sa.clone().requires_grad_(), sb.clone().requires_grad_()
    op(r)(a, b, sa_, sb_).float().sum().backward()
    ref = [sa.clone().requires_grad_(), sb.clone().requires_grad_()]
    ((a.float() @ b.float()) * ref[0][:, None] * ref[1]).sum().backward()
    for mine, theirs in zip((sa_, sb_), ref, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)
    a_ = a.clone().requires_grad_()
    out = op(r)(a_, b, sa, sb)
    with pytest.raises(gg.InvalidArgument, match=r"a: gemmgen has no gradient for fp8 or fp4 A or B"):
        out.float().sum().backward()


def test_fp8_op_compiles_without_graph_breaks(gen):
    """torch.compile traces the fp8 op in one graph (fake fp8 tensors) and AOTAutograd runs it."""
    r = gg.Recipe("torch_fp8_compile", lambda acc, sa, sb: {"d": acc * sa * sb, "amax": gg.amax(acc * sa * sb)},
                  a=gg.e4m3, b=gg.e5m2, d=gg.e4m3, operands={"sa": gg.ColVector(gg.f32), "sb": gg.RowVector(gg.f32)},
                  aux={"amax": gg.f32})
    f = op(r)

    def layer(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        d, amax = f(a, b, sa, sb)
        return d.float() / amax

    a, b, sa, sb = _fp8_args(gen)
    explained = torch._dynamo.explain(layer)(a, b, sa, sb)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    want = layer(a, b, sa, sb)
    assert want.abs().max() > 0
    torch.testing.assert_close(compiled(a, b, sa, sb), want)


def test_amax_output_through_the_op(gen):
    """A reduced output through the op: the CPU implementation, fake shapes ((L,) beside the L x M x N
    outputs), opcheck, and gradients through it as through torch's amax."""
    r = gg.Recipe("torch_amax", lambda acc, bias: {"d": gg.relu(acc + bias), "amax": gg.amax(acc + bias)},
                  operands={"bias": gg.RowVector(gg.bf16)}, aux={"amax": gg.f32}, batched=True)
    a = torch.randn(3, 5, 16, generator=gen).bfloat16()
    b = torch.randn(3, 8, 16, generator=gen).bfloat16().transpose(1, 2)
    bias = torch.randn(8, generator=gen).bfloat16()
    d, amax = op(r)(a, b, bias)
    pre = a.float() @ b.float() + bias.float()
    assert amax.shape == (3,) and amax.dtype == torch.float32
    torch.testing.assert_close(amax, pre.abs().amax(dim=(1, 2)))
    torch.testing.assert_close(d, torch.relu(pre).bfloat16())
    torch.library.opcheck(op(r), (a, b, bias))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fd, fa = op(r)(torch.empty(2, 7, 16, dtype=torch.bfloat16), torch.empty(2, 16, 8, dtype=torch.bfloat16),
                       torch.empty(8, dtype=torch.bfloat16))
        assert fd.shape == (2, 7, 8) and fa.shape == (2,) and fa.dtype == torch.float32
    bias_ = bias.clone().requires_grad_()
    op(r)(a, b, bias_)[1].sum().backward()
    ref = bias.float().requires_grad_()
    # the unfused bf16 model's gradient: its accumulator is the bf16 matmul (which the op recomputes),
    # so where two entries of the fp32 product are within bf16 rounding, the max picks as it does
    ((a @ b).float() + ref).abs().amax(dim=(1, 2)).sum().backward()
    assert ref.grad is not None and bias_.grad is not None and ref.grad.abs().max() > 0
    torch.testing.assert_close(bias_.grad.float(), ref.grad)


def test_vector_reductions_through_the_op(gen):
    """Per-row and per-column reductions through the op: the CPU implementation, fake shapes ((L, M)
    and (L, N) beside the L x M x N D), opcheck, a torch.compile trace, and gradients through the
    sums as through torch's."""
    rows = gg.Recipe("torch_row_sums", lambda acc, res: {"d": acc + res, "ss": gg.sum((acc + res) * (acc + res), 1),
                                                         "am": gg.amax(acc + res, 1)},
                     operands={"res": gg.Matrix(gg.bf16)}, aux={"ss": gg.f32, "am": gg.f32}, batched=True)
    cols = gg.Recipe("torch_col_sums", lambda acc, s: {"d": acc * s, "cs": gg.sum(acc * s, 0)},
                     operands={"s": gg.ColVector(gg.f32)}, aux={"cs": gg.f32}, batched=True)
    a = torch.randn(3, 5, 16, generator=gen).bfloat16()
    b = torch.randn(3, 16, 8, generator=gen).bfloat16()
    res = torch.randn(3, 5, 8, generator=gen).bfloat16()
    s = torch.randn(5, generator=gen)
    h = a.float() @ b.float() + res.float()
    d, ss, am = op(rows)(a, b, res)
    assert ss.shape == am.shape == (3, 5) and ss.dtype == torch.float32
    torch.testing.assert_close(d, h.bfloat16())
    torch.testing.assert_close(ss, (h * h).sum(-1))
    torch.testing.assert_close(am, h.abs().amax(-1))
    _, cs = op(cols)(a, b, s)
    assert cs.shape == (3, 8)
    torch.testing.assert_close(cs, ((a.float() @ b.float()) * s[:, None]).sum(-2))
    torch.library.opcheck(op(rows), (a, b, res))
    torch.library.opcheck(op(cols), (a, b, s))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = op(cols)(torch.empty(2, 7, 16, dtype=torch.bfloat16), torch.empty(2, 16, 9, dtype=torch.bfloat16),
                        torch.empty(7))
        assert [tuple(t.shape) for t in fake] == [(2, 7, 9), (2, 9)]
    explained = torch._dynamo.explain(lambda x, y, z: op(rows)(x, y, z)[1].sqrt())(a, b, res)
    assert explained.graph_break_count == 0
    b_ = b.clone().requires_grad_()
    s_ = s.clone().requires_grad_()
    op(cols)(a, b_, s_)[1].square().sum().backward()
    b_ref, s_ref = b.float().requires_grad_(), s.clone().requires_grad_()
    ((a.float() @ b_ref) * s_ref[:, None]).sum(-2).square().sum().backward()
    assert b_.grad is not None and s_.grad is not None and b_ref.grad is not None and s_ref.grad is not None
    assert b_ref.grad.abs().max() > 0 and s_ref.grad.abs().max() > 0
    torch.testing.assert_close(b_.grad.float(), b_ref.grad, rtol=2**-7, atol=2**-7 * float(b_ref.grad.abs().max()))
    torch.testing.assert_close(s_.grad, s_ref.grad, rtol=1e-2, atol=1e-2 * float(s_ref.grad.abs().max()))


class _Counting(TorchDispatchMode):
    """The ops a region dispatches (each at least one kernel on a GPU), and its matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
            self.matmuls += 1
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    #: What moves or converts data without computing: views, allocations, copies and casts.
    PLUMBING = frozenset(getattr(torch.ops.aten, n) for n in ("detach", "transpose", "t", "view", "expand",
                                                              "new_empty_strided", "copy_", "_to_copy", "ones_like",
                                                              "zeros_like", "empty_like", "lift_fresh"))

    def compute(self) -> dict:
        """The ops that compute: kernels doing math on a GPU."""
        return {f: n for f, n in self.ops.items() if f.overloadpacket not in self.PLUMBING}


def _mlp(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, dtype=dtype), nn.GELU(approximate="tanh"), nn.Linear(128, 32, dtype=dtype),
                         nn.SiLU())


def test_fused_mlp_forward_and_backward_match_the_unfused_model(gen):
    ref = _mlp()
    fused, _ = gg.nn.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 5, 64, generator=gen).bfloat16()
    y_ref, y = ref(x), fused(x)
    assert y.shape == y_ref.shape == (2, 5, 32)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    y_ref.float().sum().backward()
    y.float().sum().backward()
    for (name, p_ref), p in zip(ref.named_parameters(), fused.parameters(), strict=True):
        assert p.grad is not None and p_ref.grad is not None, name
        scale = p_ref.grad.float().abs().max()
        torch.testing.assert_close(p.grad.float(), p_ref.grad.float(), rtol=5e-2, atol=5e-2 * scale,
                                   msg=lambda s: f"{name}: {s}")  # noqa: B023


def test_fused_linear_training_stores_the_pre_activation_instead_of_recomputing(gen):
    """With gradients wanted, forward runs the kernel that also stores `pre` (x W^T + b) and backward
    runs only the dgrad and wgrad GEMMs it needs, as the unfused Linear + activation would; without,
    forward runs the plain kernel."""
    layer = gg.nn.FusedLinear(64, 48, activation="gelu_tanh")
    x = torch.randn(5, 64, generator=gen).bfloat16()
    with _Recording() as mode:
        with torch.no_grad():
            layer(x)
        y = layer(x)
    assert layer.training_recipe is not None
    assert [f._opname for f in mode.seen] == [gg.integrations.ops.op_name(layer.recipe),
                                              gg.integrations.ops.op_name(layer.training_recipe)]
    for x_grad, gemms in ((False, 1), (True, 2)):
        x_ = x.clone().requires_grad_(x_grad)
        y = layer(x_)
        with _Counting() as counted:
            y.float().sum().backward()
        assert counted.matmuls == gemms, x_grad


TORCH_ACTIVATIONS: dict[str | None, Callable[[], nn.Module]] = {
    None: nn.Identity, "relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh"), "silu": nn.SiLU}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS), ids=str)
def test_fused_linear_gradients_match_linear_and_activation(gen, activation, bias):
    layer = gg.nn.FusedLinear(64, 48, bias=bias, activation=activation)
    ref = nn.Sequential(nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16), TORCH_ACTIVATIONS[activation]())
    linear: Any = ref[0]
    linear.weight, linear.bias = layer.weight, layer.bias  # shared parameters
    x = torch.randn(2, 5, 64, generator=gen).bfloat16()
    got: list[Any] = []
    want: list[Any] = []
    for model, out in ((layer, got), (ref, want)):
        layer.zero_grad()
        x_ = x.clone().requires_grad_()
        model(x_).float().square().sum().backward()
        out += [x_.grad, *(p.grad.clone() for p in layer.parameters() if p.grad is not None)]
    for mine, theirs in zip(got, want, strict=True):
        assert theirs.abs().max() > 0
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2e-2, atol=2e-2 * theirs.abs().max())


@pytest.mark.parametrize("activation", [a for a in TORCH_ACTIVATIONS if a])
def test_activation_backward_is_the_torch_modules(gen, activation):
    """FusedLinear's backward runs the same aten kernel as the activation module's: equal bits."""
    from gemmgen.nn.activations import activation_backward as _activation_backward

    pre, g = torch.randn(256, generator=gen) * 3, torch.randn(256, generator=gen)
    x = pre.clone().requires_grad_()
    TORCH_ACTIVATIONS[activation]()(x).backward(g)
    assert x.grad is not None and torch.equal(_activation_backward(activation, g, pre), x.grad)


def test_torch_compile_fullgraph_traces_without_breaks(gen):
    fused, _ = gg.nn.fuse(_mlp())
    x = torch.randn(4, 64, generator=gen).bfloat16()
    explained = torch._dynamo.explain(fused)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), fused(x))


def test_torch_compile_trains_the_fused_mlp(gen):
    """AOTAutograd traces forward and backward of the fused MLP (fullgraph, aot_eager): the same
    outputs and gradients as eager, bit for bit."""
    fused, _ = gg.nn.fuse(_mlp())
    x = torch.randn(4, 64, generator=gen).bfloat16().requires_grad_()

    def grads(model):
        for t in (x, *fused.parameters()):
            t.grad = None
        y = model(x)
        y.float().sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in fused.parameters())]

    compiled = grads(torch.compile(fused, fullgraph=True, backend="aot_eager"))
    eager = grads(fused)
    assert all(g is not None for g in eager)
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c, e)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_compiles_a_training_step(gen):
    """torch.compile with inductor (the default backend; C++ kernels on the CPU): the generated
    forward calls the gemmgen ops, and outputs and gradients match the unfused model."""
    from torch._inductor.utils import run_and_get_code

    ref = _mlp()
    fused, report = gg.nn.fuse(copy.deepcopy(ref))
    x = torch.randn(30, 64, generator=gen).bfloat16().requires_grad_()
    y, code = run_and_get_code(torch.compile(fused, fullgraph=True), x)
    assert sum(c.count("torch.ops.gemmgen.") for c in code) >= len(report), code
    y_ref = ref(x)
    assert y_ref.abs().max() > 0
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    g = torch.randn(y.shape, generator=gen).to(y.dtype)
    for a, b in zip(torch.autograd.grad(y, [x, *fused.parameters()], g),
                    torch.autograd.grad(y_ref, [x, *ref.parameters()], g), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * float(b.abs().max()))


def test_export_keeps_the_gemmgen_ops(gen):
    """torch.export of the fused MLP: one gemmgen op per fused layer in the graph, same results."""
    fused, report = gg.nn.fuse(_mlp())
    x = torch.randn(4, 64, generator=gen).bfloat16()
    with torch.no_grad():
        exported = torch.export.export(fused, (x,))
        targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
        assert sum(t.startswith("gemmgen.") for t in targets) == len(report), targets
        assert not any(t.startswith("aten.") and ("linear" in t or "mm" in t) for t in targets), targets
        torch.testing.assert_close(exported.module()(x), fused(x))


def test_a_dynamic_batch_compiles_once_and_exports(gen):
    """Serving sees another M at every step: torch.compile(dynamic=True) traces the fused MLP once
    for all of them (the fake kernel's shapes and strides are symbolic in M), and export with a
    dynamic M keeps the gemmgen ops and runs any M."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.export import Dim

    fused, report = gg.nn.fuse(_mlp())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fused, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():
        for m in (4, 7, 33, 100):
            x = torch.randn(m, 64, generator=gen).bfloat16()
            torch.testing.assert_close(compiled(x), fused(x))
        assert counter.frame_count == 1
        exported = torch.export.export(fused, (torch.randn(8, 64, generator=gen).bfloat16(),),
                                       dynamic_shapes=({0: Dim("m")},))
        targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
        assert sum(t.startswith("gemmgen.") for t in targets) == len(report), targets
        for m in (3, 17):
            x = torch.randn(m, 64, generator=gen).bfloat16()
            torch.testing.assert_close(exported.module()(x), fused(x))


def test_every_route_through_the_autograd_kernel(gen):
    """The op's Autograd kernel calls the backend at once only when torch would go straight there:
    a dispatch mode (profilers, FLOP counters, functionalization) still sees the op, fake tensors
    still get the fake kernel, inference mode skips autograd, and inputs that need grad record it."""
    r = _recipe()
    f = op(r).default
    args = _args(gen)
    want = r.reference(args[0], args[1], bias=args[2], res=args[3], s=args[4])
    torch.testing.assert_close(f(*args), want)  # the direct route
    with torch.inference_mode():
        torch.testing.assert_close(f(*args), want)
    with _Recording() as mode:
        torch.testing.assert_close(f(*args), want)
    assert mode.seen == [f]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fake:
        out = f(*[fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args])
        assert out.shape == want.shape and out.stride() == (16, 1)
    a = args[0].clone().requires_grad_()
    assert f(a, *args[1:]).grad_fn is not None
    with torch.no_grad():
        assert f(a, *args[1:]).grad_fn is None


def test_ops_without_the_autograd_shortcut(gen, monkeypatch):
    """Where torch lacks the internals of the Autograd shortcut, ops take register_autograd's own
    kernel: the same results, gradients, and gradients skipped when not asked for. (A smooth
    activation: at a ReLU's kink, the accumulator recomputed in f16 may take the other side.)"""
    from gemmgen.integrations import ops

    monkeypatch.setattr(ops, "_shortcut_supported", lambda: False)
    r = gg.Recipe("torch_no_shortcut", lambda acc, bias: gg.silu(acc + bias), a=gg.f16, b=gg.f16,
                  operands={"bias": gg.RowVector(gg.f16)})
    f = op(r)
    a, b, bias, _, _ = _args(gen)
    torch.testing.assert_close(f(a, b, bias), r.reference(a, b, bias=bias))
    a_ = a.clone().requires_grad_()
    with _Counting() as counted:
        f(a_, b, bias).float().sum().backward()
    assert counted.matmuls == 1  # dA; no dB
    gemmgen_ops = sum(n for f_, n in counted.compute().items() if f_.namespace == "gemmgen")
    assert gemmgen_ops == 2  # the forward and the derived backward kernel
    ref = a.float().requires_grad_()
    F.silu(ref @ b.float() + bias.float()).sum().backward()
    assert ref.grad.abs().max() > 0
    torch.testing.assert_close(a_.grad.float(), ref.grad, rtol=2e-3, atol=2e-3 * ref.grad.abs().max())


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gemmgen":
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_fused_linear_rejects_unknown_activation():
    with pytest.raises(gg.RecipeError, match="activation: expected one of"):
        gg.nn.FusedLinear(8, 8, activation="swish")


def test_direct_kernel_call_only_where_torch_would_not_notice():
    """Modules skip the dispatcher only in plain eager code; the decision is checked here on the
    CPU by asking it about CPU tensors (the direct path itself is exercised in tests/gpu/test_gpu.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gemmgen.integrations.ops import direct_call_allowed

    a, b = torch.zeros(2, 8), torch.zeros(8, 4)
    assert direct_call_allowed((a, b, 1.0), device_type="cpu")
    assert not direct_call_allowed((a, b), device_type="cuda")  # a CPU tensor never takes the CUDA kernel
    w = torch.zeros(8, 4, requires_grad=True)
    assert not direct_call_allowed((a, w), device_type="cpu")
    with torch.no_grad():
        assert direct_call_allowed((a, w), device_type="cpu")
    with FakeTensorMode() as mode:
        fa = mode.from_tensor(a)
        assert not direct_call_allowed((fa, b), device_type="cpu")
    with _Passthrough():
        assert not direct_call_allowed((a, b), device_type="cpu")
    assert direct_call_allowed((a, b), device_type="cpu")


class _Passthrough(TorchDispatchMode):
    """A dispatch mode (profilers, FLOP counters) that would not see a direct kernel call."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_launches_is_what_forward_launches(monkeypatch):
    """FusedLinear.launches(tokens, training) names the kernel the runtime picks for that many rows
    (what to warm up ahead of time); a decode-sized batch gets a swapped kernel."""
    from gemmgen.integrations import ops

    layer = gg.nn.FusedLinear(4096, 14336, activation="silu")
    picked = []

    def record_compile(self, config=None, **kw):
        picked.append(config)
        return config

    monkeypatch.setattr(type(layer.recipe), "compile", record_compile)
    monkeypatch.setattr(ops, "_LAUNCHERS", {})
    w = layer.weight.detach().t()
    for tokens in (8, 4096):
        x = torch.empty(tokens, 4096, dtype=torch.bfloat16)
        ops.kernel_for(layer.recipe, x, w)
        assert picked[-1] == layer.config_for(tokens)
    assert picked[0].swap_ab and not picked[1].swap_ab
    for tokens in (5, 7, 8):  # one bucket: one kernel, whatever the exact M
        ops.kernel_for(layer.recipe, torch.empty(tokens, 4096, dtype=torch.bfloat16), w)
    assert len(picked) == 2
    assert layer.training_recipe is not None
    ops.kernel_for(layer.training_recipe, torch.empty(4096, 4096, dtype=torch.bfloat16), w)
    assert (layer.training_recipe, picked[-1]) == layer.launches(4096, training=True)
    assert layer.launches(4096) == (layer.recipe, layer.config_for(4096))


def test_a_gpu_gemmgen_builds_for_no_arch_is_refused_before_anything_compiles(monkeypatch):
    """On an A100 (say) the op and modules raise at once, naming the device, instead of compiling
    kernels (about 35 s each) that the first launch would then refuse."""
    from types import SimpleNamespace

    from gemmgen.integrations import ops
    from gemmgen.runtime import driver

    recipe = _recipe()
    compiled = []
    monkeypatch.setattr(driver, "device_facts", lambda index: (108, (8, 0)))
    monkeypatch.setattr(type(recipe), "compile", lambda self, *args, **kw: compiled.append(args))
    monkeypatch.setattr(ops, "_LAUNCHERS", {})
    monkeypatch.setattr(ops, "_DEVICES", {})
    cuda = torch.device("cuda", 0)
    a = SimpleNamespace(shape=torch.Size((64, 32)), device=cuda)
    b = SimpleNamespace(shape=torch.Size((32, 16)), device=cuda)
    with pytest.raises(gg.InvalidArgument, match=r"device cuda:0 has compute capability 8.0; gemmgen builds kernels "
                                                 r"for sm_90a"):
        ops.kernel_for(recipe, a, b)  # type: ignore[arg-type]  # stand-ins for CUDA tensors
    assert compiled == []


def test_entry_points_name_arguments_of_the_wrong_kind():
    """Each public entry point given the wrong kind of object raises InvalidArgument naming the
    parameter (they raised AttributeError from deep inside)."""
    wrong: Any = 3  # what a type checker would refuse, and gemmgen refuses too
    shape_list: Any = [[1, 2, 3]]  # shapes without the recipe names they belong to
    cases = [(lambda: gg.op(wrong), r"recipe: expected a gemmgen\.Recipe"),
             (lambda: gg.nn.FusedLinear.from_linear(wrong), r"linear: expected a torch\.nn\.Linear"),
             (lambda: gg.nn.fuse(wrong), r"model: expected a torch\.nn\.Module"),
             (lambda: gg.nn.model_launches(wrong, (8,)), r"model: expected a torch\.nn\.Module"),
             (lambda: gg.warmup([wrong]), r"items: expected gemmgen\.Recipe objects or \(Recipe, KernelConfig\) pairs"),
             (lambda: gg.warmup([_recipe()], shapes=shape_list), r"shapes: expected \{recipe name")]
    for call, message in cases:
        with pytest.raises(gg.InvalidArgument, match=message):
            call()


def test_the_op_checks_a_call_before_compiling_its_kernel(monkeypatch, gen):
    """A first call whose arguments the kernel would refuse raises before its kernel is compiled
    (about 35 s): the op's kernel lookup runs the same checks, then compiles."""
    from gemmgen.integrations import ops

    recipe = _recipe()
    compiled = []
    monkeypatch.setattr(type(recipe), "compile", lambda self, *args, **kw: compiled.append(args))
    monkeypatch.setattr(ops, "_LAUNCHERS", {})
    a, b, bias, res, s = _args(gen)
    with pytest.raises(gg.InvalidArgument, match=r"bias: expected dtype torch\.float16"):
        ops.Launcher(recipe)(a, b, bias.float(), res, s)
    with pytest.raises(gg.InvalidArgument, match=r"res: expected shape \(7, 9\)"):
        ops.Launcher(recipe)(a, b, bias, res[:3], s)
    assert compiled == []
    ops.kernel_for(recipe, a, b, (bias, res, s))
    assert len(compiled) == 1

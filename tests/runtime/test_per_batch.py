"""Operands per batch on the CPU: scalars and vectors per batch (`per_batch=True`: (L,), (L, N),
(L, M)) and a matrix shared by every batch (`gg.Matrix(dtype, per_batch=False)`: (M, N)). The
DSL's refusals, the keys, the call checks and their fixes, the emulation of the data flow through
the Params the runtime builds (each vector's batch stride, the scalar's pointer, the shared
matrix's pointer and row stride) against the recipe's reference under plain, pingpong,
clustered, stream-K and swapped kernels, that the check fails when a stride or the source is
wrong, and the torch op's forward and gradients."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import gemmgen as gg
from gemmgen.integrations.ops import op, schema
from gemmgen.ir.reference import reference
from gemmgen.runtime import arguments
from gemmgen.testing.calls import args_with_nonzero_reference
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled, uncompiled_kernel


def _head_bias(acc, bias, gain):
    """A bias per head (batch) and a shared per-row gain; the pre-activation kept, its rows summed."""
    pre = acc * gain + bias
    return {"d": gg.gelu(pre), "pre": pre, "row_sum": gg.sum(pre, dim=1)}


def _expert_scale(acc, alpha, beta, scale, c, shared):
    """A scale per row and an alpha per expert (batch), a beta per batch times C, a shared scalar."""
    return alpha * acc * scale + beta * c + shared


def _shared_bias(acc, position, c):
    """A position bias shared by every batch (attention's ALiBi-like bias), C per batch, an amax."""
    d = acc + position + c
    return {"d": d, "amax": gg.amax(d)}


def _gated_shared(acc, residual):
    """SwiGLU plus a half-width residual shared by every batch (read as pairs' halves)."""
    gate, up = gg.pairs(acc)
    return gg.silu(gate) * up + residual


RECIPES = {
    "head_bias": gg.Recipe("head_bias", _head_bias, batched=True,
                           operands={"bias": gg.RowVector(gg.bf16, per_batch=True), "gain": gg.ColVector(gg.f32)},
                           aux={"pre": gg.bf16, "row_sum": gg.f32}),
    "expert_scale": gg.Recipe("expert_scale", _expert_scale, batched=True, layout_a=gg.ColMajor, d=gg.f32,
                              operands={"alpha": gg.Scalar(per_batch=True), "beta": gg.Scalar(per_batch=True),
                                        "scale": gg.ColVector(gg.f16, per_batch=True), "c": gg.Matrix(gg.f16),
                                        "shared": gg.Scalar()}),
    "col_sums": gg.Recipe("col_sums", lambda acc, bias: {"d": acc + bias, "col_sum": gg.sum(acc + bias, dim=0)},
                          batched=True, operands={"bias": gg.RowVector(gg.f32, per_batch=True)},
                          aux={"col_sum": gg.f32}),
    "shared_bias": gg.Recipe("shared_bias", _shared_bias, batched=True, layout_b=gg.RowMajor,
                             operands={"position": gg.Matrix(gg.bf16, per_batch=False), "c": gg.Matrix(gg.f32)},
                             aux={"amax": gg.f32}),
    "gated_shared": gg.Recipe("gated_shared", _gated_shared, batched=True,
                              operands={"residual": gg.Matrix(gg.bf16, per_batch=False)}),
}
CONFIGS = [gg.KernelConfig(tile=(128, 128, 64)), gg.KernelConfig(tile=(64, 64, 64), schedule=gg.Schedule.PINGPONG),
           gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1)),
           gg.KernelConfig(tile=(128, 128, 64), cluster=(1, 2, 1), tile_scheduler=gg.TileScheduler.STREAM_K),
           gg.KernelConfig(tile=(64, 16, 64), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG, swap_ab=True),
           gg.KernelConfig(tile=(128, 64, 64), swap_ab=True)]
# (M, N, K, batch): M = 1, K tails, N not a multiple of any tile, one batch and several
SHAPES = [(1, 8, 16, 3), (37, 50, 72, 2), (129, 264, 200, 3), (300, 10, 129, 1)]


@pytest.mark.parametrize("name", RECIPES)
def test_emulated_calls_compute_the_recipe(name):
    recipe = RECIPES[name]
    configs = [c for c in CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    swapped = sum(c.swap_ab for c in configs)  # reductions either way round; column pairs never swapped
    assert (len(configs) - swapped, swapped) == (4, 0 if recipe.ir.epilogue.pairs else 2)
    for config in configs:
        ck = uncompiled(recipe, config)
        for shape in SHAPES:
            assert_computes(ck, shape, f"{name} {config.name}")


def test_an_expanded_tensor_gives_every_batch_the_same_values():
    """A batch stride of 0 (torch's expand) is a legal per-batch operand: every batch reads one."""
    recipe = RECIPES["expert_scale"]
    ck = uncompiled(recipe, recipe.default_config())
    a, b, ops, _ = args_with_nonzero_reference(recipe, 33, 40, 24, (3,))
    ops = {**ops, "alpha": torch.tensor([0.75]).expand(3), "scale": ops["scale"][:1].expand(3, 33)}
    want = reference(recipe.ir, a, b, ops)
    assert_computes(ck, (33, 40, 24, 3), "expanded", (a, b, ops, want))


@pytest.mark.parametrize("mistake", ["bias read as shared", "gain read per batch", "alpha's stride 0",
                                     "source shares the row vector", "shared matrix's other stride",
                                     "shared matrix read column-major"])
def test_a_wrong_stride_fails_the_check(mistake, monkeypatch):
    """The check is sensitive to each batch stride and to the shared matrix's layout: a stride
    written as 0, doubled or of the wrong mode, or the source's stride type changed, each makes the
    emulated call wrong (the unchanged kernel passes)."""
    recipe = gg.Recipe("t", lambda acc, bias, gain, alpha, w: (acc * gain + bias) * alpha + w, batched=True,
                       operands={"bias": gg.RowVector(gg.bf16, per_batch=True), "gain": gg.ColVector(gg.f32,
                                                                                                    per_batch=True),
                                 "alpha": gg.Scalar(per_batch=True), "w": gg.Matrix(gg.f32, per_batch=False)})
    config = gg.KernelConfig(tile=(128, 128, 64))
    shape = (33, 70, 40, 3)
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    real = arguments.ArgumentBuilder.input_values

    def patched(field: str, change):
        def values(self, p, encode):
            v = real(self, p, encode)
            v[field] = change(v[field])
            return v
        monkeypatch.setattr(arguments.ArgumentBuilder, "input_values", values)

    ck = uncompiled(recipe, config)
    if mistake == "bias read as shared":
        patched("epilogue.row.bias.batch_stride", lambda s: 0)
    elif mistake == "gain read per batch":
        patched("epilogue.col.gain.batch_stride", lambda s: 2 * s)
    elif mistake == "alpha's stride 0":
        patched("epilogue.scalar.alpha.batch_stride", lambda s: 0)
    elif mistake == "shared matrix's other stride":
        patched("epilogue.shared_load.w.stride", lambda s: 1)
    elif mistake == "shared matrix read column-major":
        ck = uncompiled(recipe, config, source_replaced("cute::Stride<int64_t, cute::_1, cute::_0>, void",
                                                        "cute::Stride<cute::_1, int64_t, cute::_0>, void"))
    else:
        ck = uncompiled(recipe, config, source_replaced("cute::Stride<cute::_0, cute::_1, int64_t>>",
                                                        "cute::Stride<cute::_0, cute::_1, cute::_0>>"))
    with pytest.raises(AssertionError):
        assert_computes(ck, shape, mistake)


def test_misshapen_or_misaligned_operands_are_refused_with_fixes_that_work():
    recipe = RECIPES["head_bias"]
    kernel = uncompiled_kernel(recipe)
    a, b = torch.randn(3, 8, 64).bfloat16(), torch.randn(3, 64, 37).bfloat16()
    b = b.mT.contiguous().mT
    gain = torch.randn(8)
    with pytest.raises(gg.InvalidArgument, match=r"bias: expected shape \(3, 37\) \(a bf16 tensor, one length-N "
                                                 r"vector per batch\), got \(37,\)"):
        kernel.prepare(a, b, bias=torch.randn(37).bfloat16(), gain=gain)
    bias = torch.randn(3, 37).bfloat16()  # contiguous: each batch's vector 74 bytes after the last
    with pytest.raises(gg.InvalidArgument, match=r"bias: batch stride 37 must be a multiple of 8 elements .* pass a "
                                                 r"copy in padded storage: (.*)$") as refused:
        kernel.prepare(a, b, bias=bias, gain=gain)
    fix = refused.value.args[0].split("padded storage: ")[1]
    scope = {"bias": bias}
    exec(fix, scope)  # the fix as the message spells it
    assert scope["bias"].stride() == (40, 1) and torch.equal(scope["bias"], bias)
    prep = kernel.prepare(a, b, bias=scope["bias"], gain=gain)
    assert prep.params is not None
    with pytest.raises(gg.InvalidArgument, match=r"bias: expected contiguous vectors .* pass bias.contiguous\(\)"):
        kernel.prepare(a, b, bias=torch.randn(3, 80).bfloat16()[:, ::2][:, :37], gain=gain)
    scalars = uncompiled_kernel(RECIPES["expert_scale"])
    a, b = (torch.randn(3, *shape).bfloat16().mT.contiguous().mT for shape in ((8, 64), (64, 16)))
    ops = {"beta": torch.ones(3), "scale": torch.randn(3, 8).half(), "c": torch.randn(3, 8, 16).half(), "shared": 1.0}
    with pytest.raises(gg.InvalidArgument, match=r"alpha: expected a torch.Tensor, got float"):
        scalars.prepare(a, b, alpha=0.5, **ops)
    with pytest.raises(gg.InvalidArgument, match=r"alpha: expected shape \(3,\) \(an fp32 tensor with one value per "
                                                 r"batch\), got \(\)"):
        scalars.prepare(a, b, alpha=torch.tensor(0.5), **ops)
    with pytest.raises(gg.InvalidArgument, match=r"alpha: expected dtype torch.float32"):
        scalars.prepare(a, b, alpha=torch.ones(3).bfloat16(), **ops)
    assert scalars.prepare(a, b, alpha=torch.ones(6)[::2], **ops).params is not None  # any stride for scalars
    shared = uncompiled_kernel(RECIPES["shared_bias"])
    a, b, c = torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 64, 16).bfloat16(), torch.randn(2, 8, 16)
    with pytest.raises(gg.InvalidArgument, match=r"position: expected shape \(8, 16\) \(one M x N matrix, shared by "
                                                 r"every batch\), got \(2, 8, 16\)"):
        shared.prepare(a, b, position=torch.randn(2, 8, 16).bfloat16(), c=c)
    with pytest.raises(gg.InvalidArgument, match=r"position: row stride 20 must be a multiple of 8 elements"):
        shared.prepare(a, b, position=torch.randn(8, 20).bfloat16()[:, :16], c=c)
    assert shared.prepare(a, b, position=torch.randn(8, 16).bfloat16(), c=c).params is not None


def test_the_dsl_refuses_per_batch_where_there_are_no_batches():
    row = gg.RowVector(gg.bf16, per_batch=True)
    with pytest.raises(gg.RecipeError, match=r"operand 'bias': per_batch=True \(one value per batch of A and B\) needs "
                                             r"a batched GEMM; declare the recipe with batched=True, or drop "
                                             r"per_batch=True"):
        gg.Recipe("t", lambda acc, bias: acc + bias, operands={"bias": row})
    shared = gg.Matrix(gg.bf16, per_batch=False)
    with pytest.raises(gg.RecipeError, match=r"operand 'w': per_batch=False \(one matrix shared by every batch\) "
                                             r"needs a batched GEMM"):
        gg.Recipe("t", lambda acc, w: acc + w, operands={"w": shared})
    with pytest.raises(gg.RecipeError, match=r"operand 'w': per_batch=False in a grouped GEMM"):
        gg.Recipe("t", lambda acc, w: acc + w, grouped=True, operands={"w": shared})
    with pytest.raises(gg.RecipeError, match=r"operand 'bias': per_batch=True in a grouped GEMM"):
        gg.Recipe("t", lambda acc, bias: acc + bias, grouped=True, operands={"bias": row})
    with pytest.raises(gg.RecipeError, match=r"operand 'k': a compile-time constant is fixed when the kernel is built"):
        gg.Recipe("t", lambda acc, k: acc * k, batched=True, operands={"k": gg.Scalar(value=2.0, per_batch=True)})
    with pytest.raises(gg.RecipeError, match=r"operand 'bias': per_batch must be True or False, got 'yes'"):
        gg.Recipe("t", lambda acc, bias: acc + bias, batched=True,
                  operands={"bias": gg.RowVector(gg.bf16, per_batch="yes")})  # type: ignore[arg-type]
    assert gg.Recipe("t", lambda acc, bias: acc + bias, batched=True, operands={"bias": row}).gemm.batched


def test_a_shared_operand_keeps_its_key_and_a_per_batch_one_has_its_own():
    def make(per_batch: bool) -> gg.Recipe:
        return gg.Recipe("t", lambda acc, bias: acc + bias, batched=True,
                         operands={"bias": gg.RowVector(gg.bf16, per_batch=per_batch)})

    shared, per_batch = make(False), make(True)
    assert shared.ir.canonical()["operands"] == [["bias", "row", "bf16"]]  # as before per_batch existed
    assert per_batch.ir.canonical()["operands"] == [["bias", "row", "bf16", ["per_batch", True]]]
    assert shared.key != per_batch.key
    swapped = per_batch.ir.transposed()
    assert swapped.epilogue.operands[0].kind is gg.OperandKind.COL and swapped.epilogue.operands[0].per_batch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def test_the_op_takes_tensors_per_batch_and_differentiates_them(gen):
    """The op's schema takes a per-batch scalar as a Tensor; its forward is the recipe's, and the
    gradients of A, B, the per-batch bias, scale and alpha and the shared matrix (summed over the
    batch) equal float64 autograd's of the same math."""
    recipe = gg.Recipe("per_batch_op", lambda acc, bias, scale, alpha, w: gg.silu(acc * scale * alpha + bias) * w,
                       batched=True, operands={"bias": gg.RowVector(gg.bf16, per_batch=True),
                                               "scale": gg.ColVector(gg.f32, per_batch=True),
                                               "alpha": gg.Scalar(per_batch=True),
                                               "w": gg.Matrix(gg.bf16, per_batch=False)})
    assert "Tensor alpha" in schema(recipe)
    a = torch.randn(3, 9, 40, generator=gen).bfloat16()
    b = torch.randn(3, 40, 24, generator=gen).bfloat16().mT.contiguous().mT
    bias, scale = torch.randn(3, 24, generator=gen).bfloat16(), torch.rand(3, 9, generator=gen) + 0.5
    alpha, w = torch.rand(3, generator=gen) + 0.5, torch.randn(9, 24, generator=gen).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (a, b, bias, scale, alpha, w)]
    y = op(recipe)(*leaves)
    ref = [t.double().requires_grad_() for t in (a, b, bias, scale, alpha, w)]
    want = F.silu(ref[0] @ ref[1] * ref[3][:, :, None] * ref[4][:, None, None] + ref[2][:, None, :]) * ref[5]
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    g = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(g)
    want.backward(g.double())
    for name, mine, theirs in zip(("a", "b", "bias", "scale", "alpha", "w"), leaves, ref, strict=True):
        assert theirs.grad is not None and mine.grad is not None and mine.grad.shape == theirs.grad.shape, name
        assert theirs.grad.abs().max() > 0
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=0, atol=2e-2 * theirs.grad.abs().max().item(),
                                   msg=name)


def test_a_scalar_read_from_a_tensor():
    """gg.Scalar(tensor=True) in a non-batched GEMM (a per-tensor fp8 scale computed on the GPU):
    the op takes a one-element fp32 tensor (0-d or (1,)), the emulated kernel reads it through the
    scalar broadcast's pointer (the value field left at its default), for plain and swapped
    kernels, M = 1 and K tails; the DSL refuses what it cannot be."""
    recipe = gg.Recipe("tensor_scale", lambda acc, s, bias: acc * s + bias, a=gg.e5m2, b=gg.e4m3,
                       operands={"s": gg.Scalar(tensor=True), "bias": gg.RowVector(gg.bf16)})
    assert "Tensor s" in schema(recipe)
    configs = [gg.KernelConfig(tile=(128, 128, 128)), gg.KernelConfig(tile=(128, 32, 128), swap_ab=True)]
    for config in configs:
        ck = uncompiled(recipe, config)
        for m, n, k in ((1, 16, 32), (130, 48, 160)):
            a, b, ops, _ = args_with_nonzero_reference(recipe, m, n, k, ())
            for s in (torch.tensor(0.375), torch.tensor([-2.5])):
                drawn = {**ops, "s": s}
                assert_computes(ck, (m, n, k, 1), f"tensor scalar {config.name}",
                                (a, b, drawn, reference(recipe.ir, a, b, drawn)))
    with pytest.raises(gg.InvalidArgument, match=r"s: expected shape \(1,\) \(a one-element fp32 tensor"):
        uncompiled_kernel(recipe).prepare(a, b, s=torch.ones(2), bias=ops["bias"])
    with pytest.raises(gg.RecipeError, match="operand 'k': a compile-time constant is fixed"):
        gg.Recipe("t", lambda acc, k: acc * k, operands={"k": gg.Scalar(value=2.0, tensor=True)})
    grouped = gg.Recipe("t", lambda acc, k: acc * k, grouped=True, operands={"k": gg.Scalar(tensor=True)})
    assert grouped.ir.epilogue.operand("k").per_batch  # one per group (tests/runtime/test_grouped_kernel.py)
    with pytest.raises(gg.RecipeError, match="operand 'k': tensor must be True or False"):
        gg.Recipe("t", lambda acc, k: acc * k, operands={"k": gg.Scalar(tensor=1)})  # type: ignore[arg-type]

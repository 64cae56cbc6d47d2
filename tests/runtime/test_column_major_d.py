"""Column-major D (`layout_d=gg.ColMajor`, issue 32 item 7) on the CPU: D, C, matrix operands and
aux outputs in column-major order, the kernel's tensor maps and strides for them (a plain kernel
writes column-major; a swapped one computes D^T row-major over the same memory), emulated through
the Params the runtime builds against the recipe's reference; gemmgen's own outputs are
column-major, a given output in the other order is refused with a fix that works, and the
refusals name the recipe argument."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.testing.checks import assert_computes, uncompiled, uncompiled_kernel


def _residual(acc, bias, c, w):
    pre = acc + bias
    return {"d": gg.gelu(pre) * w + c, "pre": pre, "amax": gg.amax(pre)}


RECIPES = {
    "residual": gg.Recipe("col_residual", _residual, batched=True, layout_d=gg.ColMajor, layout_a=gg.ColMajor,
                          operands={"bias": gg.RowVector(gg.bf16), "c": gg.Matrix(gg.bf16),
                                    "w": gg.Matrix(gg.f32, per_batch=False)},
                          aux={"pre": gg.bf16, "amax": gg.f32}),
    "row_sums": gg.Recipe("col_row_sums", lambda acc, scale: {"d": acc * scale, "s": gg.sum(acc * scale, dim=1)},
                          d=gg.f32, layout_d=gg.ColMajor, operands={"scale": gg.ColVector(gg.f32)},
                          aux={"s": gg.f32}),
}
CONFIGS = [gg.KernelConfig(tile=(128, 128, 64)), gg.KernelConfig(tile=(64, 64, 64), schedule=gg.Schedule.PINGPONG),
           gg.KernelConfig(tile=(128, 128, 64), cluster=(1, 2, 1), tile_scheduler=gg.TileScheduler.STREAM_K),
           gg.KernelConfig(tile=(64, 16, 64), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG, swap_ab=True)]
SHAPES = [(1, 8, 16, 2), (37, 50, 72, 3), (129, 264, 200, 1)]


@pytest.mark.parametrize("name", RECIPES)
def test_emulated_calls_compute_the_recipe(name):
    recipe = RECIPES[name]
    configs = [c for c in CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert sum(c.swap_ab for c in configs) == 1  # a reduction over N too: sm_90a kernels reduce over M and N
    for config in configs:
        ck = uncompiled(recipe, config)
        kernel_layout = ck.generated.kernel_recipe.gemm.layout_d
        assert kernel_layout is (gg.RowMajor if config.swap_ab else gg.ColMajor)
        for shape in SHAPES:
            assert_computes(ck, shape, f"{name} {config.name}")


def test_outputs_are_column_major_and_a_row_major_one_is_refused_with_a_fix_that_works():
    recipe = RECIPES["row_sums"]
    kernel = uncompiled_kernel(recipe)
    a, b, scale = torch.randn(37, 64).bfloat16(), torch.randn(64, 24).bfloat16().t().contiguous().t(), torch.randn(37)
    prep = kernel.prepare(a, b, scale=scale)
    d = prep.outputs[0]
    assert d.shape == (37, 24) and d.stride() == (1, 40)  # columns padded to 16 bytes: 37 -> 40 fp32
    with pytest.raises(gg.InvalidArgument, match=r"out: gemmgen writes this recipe's outputs column-major \(dim -2 "
                                                 r"contiguous\), got strides \(24, 1\); .* \((out = torch.empty.*)\) "
                                                 r"or omit out=") as refused:
        kernel.prepare(a, b, scale=scale, out=(torch.empty(37, 24), torch.empty(37)))
    fix = refused.value.args[0].split("in that order (")[1].split(") or omit")[0]
    assert fix == "out = torch.empty(24, 40, dtype=torch.float32, device='cpu').mT[..., :37, :]"
    scope: dict = {"torch": torch}
    exec(fix, scope)  # the fix as the message spells it
    given = kernel.prepare(a, b, scale=scale, out=(scope["out"], torch.empty(37)))
    assert given.outputs[0] is scope["out"]
    with pytest.raises(gg.InvalidArgument, match=r"out: column stride 37 must be a multiple of 4 elements .* storage: "
                                                 r"out = torch.empty\(24, 40, dtype=torch.float32, device='cpu'\)"
                                                 r"\.mT\[\.\.\., :37, :\], or omit out="):
        kernel.prepare(a, b, scale=scale, out=(torch.empty(24, 37).mT, torch.empty(37)))
    residual = uncompiled_kernel(RECIPES["residual"])
    a, b = torch.randn(2, 64, 8).bfloat16().mT, torch.randn(2, 64, 16).bfloat16().mT.contiguous().mT
    ops = {"bias": torch.randn(16).bfloat16(), "w": torch.randn(16, 8).mT}
    with pytest.raises(gg.InvalidArgument, match=r"c: expected a column-major tensor \(dim -2 contiguous\)"):
        residual.prepare(a, b, c=torch.randn(2, 8, 16).bfloat16(), **ops)
    assert residual.prepare(a, b, c=torch.randn(2, 16, 8).bfloat16().mT, **ops).params is not None


def test_the_dsl_refuses_column_major_d_where_it_cannot_be():
    with pytest.raises(gg.RecipeError, match=r"layout_d: column pairs \(gg.pairs\) read and write row-major"):
        gg.Recipe("t", lambda acc: gg.silu(gg.pairs(acc)[0]) * gg.pairs(acc)[1], layout_d=gg.ColMajor)
    with pytest.raises(gg.RecipeError, match=r"layout_d: a grouped GEMM's D holds each group's rows"):
        gg.Recipe("t", grouped=True, layout_d=gg.ColMajor)
    with pytest.raises(gg.RecipeError, match=r"layout_d"):
        gg.Recipe("t", layout_d="diagonal")
    plain, col = gg.Recipe("t"), gg.Recipe("t", layout_d=gg.ColMajor)
    assert plain.key != col.key and col.ir.canonical()["gemm"][-1] == "col"


def test_the_op_returns_column_major_outputs_and_differentiates():
    """Through the torch op (the CPU path): D comes back column-major, as the kernel writes it, and
    its gradients are the recipe's."""
    from gemmgen.integrations.ops import op

    recipe = gg.Recipe("col_op", lambda acc, bias: gg.silu(acc + bias), layout_d=gg.ColMajor,
                       operands={"bias": gg.RowVector(gg.bf16)})
    a = torch.randn(9, 32).bfloat16().requires_grad_()
    b = torch.randn(24, 32).bfloat16().t().requires_grad_()
    bias = torch.randn(24).bfloat16().requires_grad_()
    y = op(recipe)(a, b, bias)
    assert y.stride(0) == 1, y.stride()
    ref = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    want = torch.nn.functional.silu(ref[0] @ ref[1] + ref[2])
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    g = torch.randn(y.shape).bfloat16()
    y.backward(g)
    want.backward(g.double())
    for mine, theirs in zip((a, b, bias), ref, strict=True):
        assert mine.grad is not None and theirs.grad is not None and theirs.grad.abs().max() > 0
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=0, atol=2e-2 * theirs.grad.abs().max().item())

"""gg.row_index(), gg.column_index() and gg.gather (issue 32 item 5, the target gather): each
element's coordinates as fp32 values (gemmgen/include/gemmgen/coordinates.hpp), and a gather as
the sum over a dimension of where(index == coordinate, x, 0), next to gg.logsumexp a cross-entropy
in one GEMM. The reference against torch.gather and torch.tril, the emulated kernels (sm90 and
sm100, swapped for a gather over M), the call's checks, and mistakes that must fail."""

from __future__ import annotations

import math

import pytest
import torch

import gemmgen as gg
from gemmgen.testing.calls import EMULATED_CONFIGS, emulated_shapes
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled, uncompiled_kernel


def _cross_entropy(acc, target):
    return {"d": acc, "lse": gg.logsumexp(acc, dim=1), "logit": gg.gather(acc, target)}


def _causal(acc, valid):
    masked = gg.where(gg.column_index() <= gg.row_index(), acc, -math.inf)
    return gg.where(gg.column_index() < valid, masked, 0.0)


RECIPES = {
    # an LM head's logits with each token's log-normalizer and target logit (loss = lse - logit)
    "cross_entropy": gg.Recipe("cross_entropy", _cross_entropy, batched=True, aux={"lse": gg.f32, "logit": gg.f32},
                               operands={"target": gg.ColVector(gg.i32, per_batch=True)}),
    # one row's value per column, over M: a swapped kernel
    "columns": gg.Recipe("gather_columns", lambda acc, row: {"d": acc, "x": gg.gather(acc * 2.0, row, dim=0)},
                         aux={"x": gg.f32}, operands={"row": gg.RowVector(gg.i32)}),
    # a causal mask, and a bound on the columns a scalar gives
    "causal": gg.Recipe("causal_mask", _causal, batched=True, operands={"valid": gg.Scalar()}),
}
SM100 = gg.Arch.SM100A


def _gathered(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.gather of x (..., M, N) at one index per row (dim 1) or per column (dim 0), 0 where
    the index is outside the dimension."""
    extent = x.shape[-1] if dim == 1 else x.shape[-2]
    inside = (index >= 0) & (index < extent)
    at = index.clamp(0, extent - 1).long()
    picked = x.gather(-1, at.unsqueeze(-1)).squeeze(-1) if dim == 1 else \
        x.gather(-2, at.unsqueeze(-2).expand(*x.shape[:-2], 1, x.shape[-1])).squeeze(-2)
    return torch.where(inside, picked, 0.0)


def test_the_reference_is_torchs_gather_and_mask():
    """Fresh inputs and indices (some outside the row: an ignore_index), a NaN and an inf in a row
    away from its target: the gather against torch.gather exactly, the cross-entropy against
    torch's, the mask against torch.tril."""
    a, b = torch.randn(3, 33, 40).bfloat16(), torch.randn(3, 40, 70).bfloat16()
    target = torch.randint(-1, 71, (3, 33), dtype=torch.int32)
    target[0, :4] = torch.tensor([0, 69, -100, 70], dtype=torch.int32)
    acc = a.float() @ b.float()
    _, lse, logit = RECIPES["cross_entropy"].reference(a, b, target=target)
    assert torch.equal(logit, _gathered(acc, target, 1)) and logit.abs().sum() > 0
    inside = (target >= 0) & (target < 70)
    loss = torch.nn.functional.cross_entropy(acc[inside], target[inside].long(), reduction="none")
    torch.testing.assert_close((lse - logit)[inside], loss, rtol=1e-5, atol=1e-5)
    target[1, 5], b2 = 7, b.clone()
    b2[1, :, 3], b2[1, :, 9] = float("nan"), float("inf")  # away from row 5's target
    _, _, logit2 = RECIPES["cross_entropy"].reference(a, b2, target=target)
    assert torch.equal(logit2[1, 5], acc[1, 5, 7]) and logit2[1, 5].isfinite()
    _, x = RECIPES["columns"].reference(a[0], b[0], row=target[0, :1].expand(70).contiguous())
    assert torch.equal(x, _gathered(2.0 * acc[0], target[0, :1].expand(70), 0))
    d = RECIPES["causal"].reference(a, b, valid=50.0)
    want = torch.where(torch.ones(33, 70).tril().bool(), acc, -math.inf)
    want[..., 50:] = 0.0
    torch.testing.assert_close(d.float(), want.bfloat16().float(), rtol=0, atol=0)


@pytest.mark.parametrize("name", RECIPES)
def test_emulated_kernels_compute_gathers_and_masks(name):
    recipe = RECIPES[name]
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert {c.arch for c in configs} == {gg.Arch.SM90A, SM100}
    if name != "causal":
        # over M: swapped on sm_100a (its kernels reduce over their N only); sm_90a ones reduce over either
        assert all(c.swap_ab == (name == "columns") for c in configs if c.arch is SM100)
        assert {c.swap_ab for c in configs if c.arch is gg.Arch.SM90A} == {False, True}
    for config in configs:
        ck = uncompiled(recipe, config)
        assert "gemmgen::epi::Coordinate<" in ck.generated.source
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, f"{name} {config.name}")


@pytest.mark.parametrize("mistake", ["row for column", "not transposed"])
def test_mistakes_fail_the_check(mistake, monkeypatch):
    """The column's coordinate read as the row's, or a swapped kernel given the caller's
    coordinates (the transposed IR not trading them), fails the emulated call."""
    shape = (130, 200, 24, 2)
    if mistake == "row for column":
        recipe, config = RECIPES["cross_entropy"], EMULATED_CONFIGS[0]
        assert_computes(uncompiled(recipe, config), shape, "unchanged")
        ck = uncompiled(recipe, config, source_replaced("gemmgen::epi::Coordinate<1>", "gemmgen::epi::Coordinate<0>"))
    else:
        recipe, config = RECIPES["causal"], EMULATED_CONFIGS[2]
        assert_computes(uncompiled(recipe, config), shape, "unchanged")
        monkeypatch.setattr(gg.ir.Op, "transposed", property(lambda self: self))
        ck = uncompiled(recipe, config)
    with pytest.raises(AssertionError):
        assert_computes(ck, shape, mistake)


def test_the_call_refuses_what_it_cannot_index():
    k = uncompiled_kernel(RECIPES["columns"])
    a, b = torch.randn(5, 8).bfloat16(), torch.randn(8, 6).bfloat16()
    with pytest.raises(gg.InvalidArgument, match=r"row: expected dtype torch.int32 .* row.to\(torch.int32\)"):
        k.prepare(a, b, row=torch.zeros(6, dtype=torch.int64))
    k = uncompiled_kernel(RECIPES["cross_entropy"])
    wide = torch.empty(1, 8, 2**24 + 1, dtype=torch.bfloat16)
    with pytest.raises(gg.InvalidArgument, match=r"b: N = 16777217; .* exact up to 2\^24"):
        k.prepare(torch.randn(1, 5, 8).bfloat16(), wide, target=torch.zeros(1, 5, dtype=torch.int32))


def test_misuse_is_refused_naming_the_fix():
    with pytest.raises(gg.RecipeError, match=r"matrix operands may be bf16, f16, f32, not i32"):
        gg.Recipe("t", lambda acc, c: acc + c, operands={"c": gg.Matrix(gg.i32)})
    with pytest.raises(gg.RecipeError, match=r"gather: dim=2; expected 0"):
        gg.Recipe("t", lambda acc, i: {"d": acc, "g": gg.gather(acc, i, dim=2)}, aux={"g": gg.f32},
                  operands={"i": gg.ColVector(gg.i32)})
    with pytest.raises(gg.RecipeError, match=r"gg.row_index\(\) in a grouped GEMM is not supported yet"):
        gg.Recipe("t", lambda acc: acc * gg.row_index(), grouped=True)
    with pytest.raises(gg.RecipeError, match=r"row_index: gemmgen ops can only be used inside an epilogue"):
        gg.row_index()

"""The grouped op: CPU and fake implementations, gradients against the unfused layer, tracing."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import InvalidArgument
from gemmgen.ir.reference import group_bounds
from gemmgen.testing.grouped import (
    assert_gradients,
    block_grouped_inputs,
    fp8_grouped_inputs,
    grouped_inputs,
    moe_recipe,
    unfused_grouped,
)
from tests.data.gpu_matrix import (
    moe_fp8_recipe,
)


def test_op_cpu_fake_and_opcheck():
    op = gg.op(moe_recipe())
    a, b, offsets, bias, weight = grouped_inputs(offsets=(5, 5, 20, 37))
    d = op(a, b, offsets, bias, weight)
    assert d.shape == (37, 48) and d.dtype == torch.bfloat16
    torch.testing.assert_close(d.double(), unfused_grouped(a, b, offsets, bias, weight), rtol=1.6e-2, atol=1e-2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(t) for t in (a, b, offsets, bias, weight)))
    assert fake.shape == (37, 48) and fake.stride() == (48, 1)
    torch.library.opcheck(op.default, (a, b, offsets, bias, weight))


def test_op_gradients_match_the_unfused_layer():
    op = gg.op(moe_recipe())
    a, b, offsets, bias, weight = grouped_inputs(offsets=(5, 5, 20, 37))
    leaves = [t.clone().requires_grad_(True) for t in (a, b, bias, weight)]
    grad = torch.randn(37, 48)
    op(leaves[0], leaves[1], offsets, leaves[2], leaves[3]).float().backward(grad)
    ref = [t.detach().double().requires_grad_(True) for t in (a, b, bias, weight)]
    unfused_grouped(ref[0], ref[1], offsets, ref[2], ref[3]).backward(grad.double())
    assert_gradients(leaves, ref)


def test_fp8_op_differentiates_scales_not_inputs():
    """The fp8 op's gradients reach the scales and the bias (the accumulator recomputed from the fp8
    values, exact in bf16), like the unfused layer's in fp64; fp8 A or B raise InvalidArgument."""
    op = gg.op(moe_fp8_recipe())
    a, b, offsets, ops = fp8_grouped_inputs(offsets=(5, 5, 20, 37))
    leaves = {k: v.clone().requires_grad_(True) for k, v in ops.items()}
    grad = torch.randn(37, 48)
    op(a, b, offsets, *leaves.values()).float().backward(grad)
    ref = {k: v.detach().double().requires_grad_(True) for k, v in ops.items()}
    rows = []
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), 37)):
        acc = a[start:end].double() @ b[g].double()
        rows.append(acc * ref["scale_a"][start:end, None] * ref["scale_b"][g] + ref["bias"][g])
    torch.cat(rows).backward(grad.double())
    for k in ops:
        mine, theirs = leaves[k].grad, ref[k].grad
        assert mine is not None and theirs is not None, k
        error = (mine.double() - theirs).norm() / theirs.norm()
        assert error < 1e-2, (k, float(error))
    with pytest.raises(InvalidArgument, match="no gradient for fp8"):
        op(a.float().requires_grad_(True).to(torch.float8_e4m3fn), b, offsets, *ops.values()).sum().backward()


def test_op_traces_without_graph_breaks():
    op = gg.op(moe_recipe())
    a, b, offsets, bias, weight = grouped_inputs(offsets=(5, 5, 20, 37))

    def layer(a, b, offsets, bias, weight):
        return op(torch.relu(a), b, offsets, bias, weight) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b, offsets, bias, weight), layer(a, b, offsets, bias, weight))


def test_block_scaled_op_realigns_scales_and_refuses_their_gradients(examples):
    """The op (CPU: the reference) copies scales in any layout into the one the kernel reads, traces
    with fake tensors, and differentiates the routing weights through the dequantized accumulator."""
    r = examples["moe_fp8_block"]
    op = gg.op(r)
    a, b, offsets, ops, _, _ = block_grouped_inputs(offsets=(5, 5, 20, 37))
    want = r.reference(a, b, offsets, **ops)
    other = {**ops, "scale_a": ops["scale_a"].mT.contiguous().mT, "scale_b": ops["scale_b"].contiguous()}
    torch.testing.assert_close(op(a, b, offsets, *other.values()), want)
    # all but test_schema, whose check for mutated inputs cannot compare fp8 tensors on the CPU
    torch.library.opcheck(op.default, (a, b, offsets, *ops.values()),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    weight = ops["weight"].clone().requires_grad_(True)
    grad = torch.randn(37, 136)
    op(a, b, offsets, ops["scale_a"], ops["scale_b"], weight).float().backward(grad)
    acc = r.reference(a, b, offsets, **{**ops, "weight": torch.ones(37)}).double()
    want = (acc * grad.double()).sum(1)  # within 1% in norm, as assert_gradients: the op recomputes in bf16
    assert weight.grad is not None and (weight.grad.double() - want).norm() / want.norm() < 1e-2
    with pytest.raises(InvalidArgument, match="scale_a: gemmgen has no gradient for block scales"):
        op(a, b, offsets, ops["scale_a"].requires_grad_(True), ops["scale_b"], ops["weight"]).sum().backward()


def test_the_masked_layout_through_the_op_and_its_gradients():
    """The op on the masked layout (a (groups, max_m, K), masked_m for offsets), NaN in every row past
    a group's count: D (groups, max_m, N), also as the fake implementation says, and every gradient
    against per-group fp64 torch; the rows past the counts get a zero gradient, their NaN nowhere."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = gg.op(moe_recipe())
    groups, max_m, k, n = 4, 7, 64, 48
    a, b, bias = torch.randn(groups, max_m, k).bfloat16(), torch.randn(groups, k, n).bfloat16(), \
        torch.randn(groups, n).bfloat16()
    weight = torch.rand(groups, max_m)
    masked = torch.tensor([3, 0, 7, 9], dtype=torch.int32)  # empty, full, over max_m: clamped
    counts = masked.clamp(0, max_m).tolist()
    for g, count in enumerate(counts):
        a[g, count:], weight[g, count:] = float("nan"), float("nan")
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(t) for t in (a, b, masked, bias, weight)))
    assert fake.shape == (groups, max_m, n) and fake.stride() == (max_m * n, n, 1)
    leaves = [t.clone().requires_grad_(True) for t in (a, b, bias, weight)]
    d = op(leaves[0], leaves[1], masked, leaves[2], leaves[3])
    assert d.shape == (groups, max_m, n) and d.dtype == torch.bfloat16
    grad = torch.randn(groups, max_m, n)
    d.float().backward(grad)
    ref = [t.double().requires_grad_(True) for t in (a, b, bias, weight)]
    loss = torch.zeros((), dtype=torch.float64)
    for g, count in enumerate(counts):
        y = torch.nn.functional.silu(ref[0][g, :count] @ ref[1][g] + ref[2][g]) * ref[3][g, :count, None]
        torch.testing.assert_close(d[g, :count].double(), y, rtol=1.6e-2, atol=1e-2)
        loss = loss + (y * grad[g, :count].double()).sum()
    loss.backward()
    for name, mine, want in zip(("a", "b", "bias", "weight"), leaves, ref, strict=True):
        assert mine.grad is not None and want.grad is not None and not mine.grad.isnan().any(), name
        error = (mine.grad.double() - want.grad.nan_to_num()).norm() / want.grad.nan_to_num().norm()
        assert error < 1e-2, (name, float(error))
    assert leaves[0].grad is not None and leaves[3].grad is not None
    for g, count in enumerate(counts):  # no gradient reaches a row past its group's count
        assert (leaves[0].grad[g, count:] == 0).all() and (leaves[3].grad[g, count:] == 0).all()
    full = torch.full_like(masked, max_m)  # every row written: eager and traced outputs comparable
    torch.library.opcheck(op.default, (a.nan_to_num(), b, full, bias, weight.nan_to_num()))


def test_a_tensor_scalars_gradient_is_per_group():
    """A grouped recipe's tensor scalar (one value per group) gets one gradient per group, against
    per-group fp64 torch; shared through `expand`, autograd sums them. Each gradient is a sum over
    its group of terms the op rounds to bf16 (dL/dD among them), and a sum of random-signed terms
    can cancel to far below them, where a tolerance per value fails on rounding alone: the error
    is bounded against the per-group gradients' norm."""
    recipe = gg.Recipe("moe_scaled_op", lambda acc, s: gg.silu(acc * s), grouped=True,
                       operands={"s": gg.Scalar(tensor=True)})
    a, b, offsets, _, _ = grouped_inputs(offsets=(5, 5, 20, 37))
    s = torch.tensor([0.5, 4.0, 1.5, 0.25], requires_grad=True)
    shared = torch.tensor([2.0], requires_grad=True)
    grad = torch.randn(37, 48)
    for scale, leaf in ((s, s), (shared.expand(4), shared)):
        gg.op(recipe)(a, b, offsets, scale).float().backward(grad)
        per_group = scale.detach().double().requires_grad_(True)  # one leaf per group, in fp64
        loss = torch.stack([(torch.nn.functional.silu(a[start:end].double() @ b[g].double() * per_group[g]) *
                             grad[start:end].double()).sum()
                            for g, (start, end) in enumerate(group_bounds([5, 5, 20, 37], 37))]).sum()
        loss.backward()
        assert leaf.grad is not None and per_group.grad is not None
        want = per_group.grad if leaf.numel() == 4 else per_group.grad.sum(0, keepdim=True)
        assert leaf.grad.shape == want.shape
        error = float((leaf.grad.double() - want).norm())
        assert error <= 1e-2 * float(per_group.grad.norm()), (leaf.grad, want)

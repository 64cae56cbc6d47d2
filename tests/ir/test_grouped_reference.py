"""A grouped recipe's semantics: each group's rows through its own B (and its own block scales)."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import RecipeError
from gemmgen.ir.reference import group_bounds
from gemmgen.testing.grouped import block_grouped_inputs, grouped_inputs, moe_recipe


@pytest.mark.parametrize("offsets, rows, want", [
    ([5, 5, 20, 30], 37, [(0, 5), (5, 5), (5, 20), (20, 30)]),
    ([10, 4, 12], 37, [(0, 10), (10, 10), (10, 12)]),  # decreasing: an empty group, never an overlap
    ([-3, 50, 60], 37, [(0, 0), (0, 37), (37, 37)]),  # clamped to the rows of A
])
def test_group_bounds(offsets, rows, want):
    assert group_bounds(offsets, rows) == want


def test_reference_is_each_group_through_its_own_b():
    r = moe_recipe()
    a, b, offsets, bias, weight = grouped_inputs()
    d = r.reference(a, b, offsets, bias=bias, weight=weight).float()
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), a.shape[0])):
        acc = a[start:end].double() @ b[g].double()
        want = torch.nn.functional.silu(acc + bias[g].double()) * weight[start:end, None].double()
        assert want.abs().sum() > 0 or start == end
        torch.testing.assert_close(d[start:end].double(), want, rtol=1.6e-2, atol=1e-2)
    assert d[30:].isnan().all()  # after the last group: not written


def test_block_scaled_reference_is_each_groups_scaled_k_blocks(examples):
    """Group g's rows: the sum over K blocks of (A_g,kb @ B_g,kb) times each row's scale of that K
    block and each 128 x 128 block's scale of B_g, in float64 by explicit loops; the K tail's block
    partial; rows in no group NaN."""
    r = examples["moe_fp8_block"]
    a, b, offsets, ops, _, _ = block_grouped_inputs()
    d = r.reference(a, b, offsets, **ops).double()
    sa, sb = ops["scale_a"].double(), ops["scale_b"].double()
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), 37)):
        want = torch.zeros(end - start, 136, dtype=torch.float64)
        for kb in range(3):  # K = 304: blocks of 128, 128 and 48
            ks = slice(128 * kb, 128 * (kb + 1))
            for nb in range(2):  # N = 136: 128 and 8
                ns = slice(128 * nb, 128 * (nb + 1))
                part = a[start:end, ks].double() @ b[g, ks, ns].double()
                want[:, ns] += part * sa[start:end, kb, None] * sb[g, kb, nb]
        want *= ops["weight"][start:end, None].double()
        assert want.abs().sum() > 0 or start == end
        torch.testing.assert_close(d[start:end], want, rtol=1.6e-2, atol=1e-2)
    assert d[30:].isnan().all()
    with pytest.raises(RecipeError, match=r"block_scale: M granularity 128 in a grouped GEMM"):
        gg.Recipe("g", a=gg.e4m3, b=gg.e4m3, grouped=True, block_scale=(128, 128, 128))

"""The TMA layout rules on their own (no kernel needed): what `tma_readable` copies passes them."""

from __future__ import annotations

import pytest
import torch

from gemmgen.errors import LayoutMismatch
from gemmgen.runtime.checks import _aligned_ptr, _matrix, tma_readable
from gemmgen.types import Layout


def _refused(t: torch.Tensor, layout: Layout, batched: bool) -> bool:
    try:
        _aligned_ptr("t", t)
        _matrix("t", t, t.shape[-2], t.shape[-1], layout, batched, t.shape[0] if batched else 1, ("M", "K"))
    except LayoutMismatch:
        return True
    return False


CASES = {  # name -> a view over `base` that TMA cannot read as it is, in either layout
    "row, odd width": lambda base: base[: 7 * 13].view(7, 13),
    "column-major, odd height": lambda base: base[: 7 * 13].view(13, 7).t(),
    "odd offset": lambda base: base[1: 7 * 16 + 1].view(7, 16),
    "batch, odd width": lambda base: base[: 3 * 7 * 13].view(3, 7, 13),
    "expanded batch": lambda base: base[: 7 * 16].view(1, 7, 16).expand(3, 7, 16),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", [Layout.ROW, Layout.COL])
@pytest.mark.parametrize("case", list(CASES))
def test_tma_readable_copies_pass_the_checks_with_the_same_values(case, layout, dtype):
    t = CASES[case](torch.randn(3 * 7 * 16 + 1).to(dtype))
    batched = t.dim() == 3
    assert _refused(t, layout, batched)
    copy = tma_readable(t, layout)
    assert not _refused(copy, layout, batched)
    assert copy.shape == t.shape and copy.dtype == t.dtype and torch.equal(copy, t)
    assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_vectors_become_contiguous_and_aligned():
    strided = torch.randn(33)[1::2]
    copy = tma_readable(strided, Layout.ROW)
    assert copy.stride() == (1,) and copy.data_ptr() % 16 == 0 and torch.equal(copy, strided)

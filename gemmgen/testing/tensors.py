"""Test tensors laid out the way TMA needs them (tests only)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ir import Output, Reduction
from ..types import Layout

FP32_UNIT_ROUNDOFF = 2.0**-24


def strided_matrix(make: Callable[..., torch.Tensor], rows: int, cols: int, dtype: torch.dtype, layout: Layout,
                   lead: tuple[int, ...] = (), pad: int = 0) -> torch.Tensor:
    """A (lead,) rows x cols view in `layout` over storage from `make(*shape)`, its leading dimension
    rounded up to 16 bytes (what TMA needs) plus `pad` elements."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    if layout is Layout.ROW:
        ld = -(-cols // per) * per + pad
        return make(*lead, rows, ld).to(dtype)[..., :cols]
    ld = -(-rows // per) * per + pad
    return make(*lead, cols, ld).to(dtype)[..., :rows].transpose(-1, -2)


def assert_output_close(o: Output, got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor,
                        problem: tuple[int, int], rtol: float, atol: float, msg: str = "") -> None:
    """`got` against the reference `want` of output `o` of an (M, N) `problem`, NaN where NaN.

    A sum is held to the bound of recursive summation: two evaluations whose terms differ by `rtol`
    of each term's magnitude, summing `terms` of them in any order, differ by at most
    (rtol + terms * 2^-24) times the sum of the terms' magnitudes (`magnitude`,
    `reference(..., magnitudes=True)`: a term acc + bias has the magnitude |A| @ |B| + |bias|).
    The error of a sum scales with what was summed, not with the result, which cancellation can
    make as small as anything. Every other output: torch.testing.assert_close with rtol, atol."""
    if o.reduce is not Reduction.SUM:
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda s: f"{msg}: {s}")
        return
    m, n = problem
    terms = m * n if o.dim is None else n if o.dim == 1 else m
    bound = (rtol + terms * FP32_UNIT_ROUNDOFF) * magnitude.float() + atol
    err = (got.float() - want.float()).abs()
    same_nan = got.isnan() & want.isnan()
    bad = ~((err <= bound) | same_nan)
    if got.shape != want.shape or bad.any():
        worst = (err - bound).nan_to_num(float("inf")).argmax() if bad.any() else 0
        raise AssertionError(f"{msg}: sum {o.name!r} of {terms} terms: {int(bad.sum())} of {want.numel()} values "
                             f"off by more than (rtol + terms * 2^-24) * sum |terms| + atol; worst at flat "
                             f"index {int(worst)}: got {got.flatten()[worst].item()}, want "
                             f"{want.flatten()[worst].item()}, bound {bound.flatten()[worst].item()}"
                             if got.shape == want.shape else f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}")

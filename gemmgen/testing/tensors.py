"""Test tensors laid out the way TMA needs them (tests only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..ir import EXTREMA, BlockOp, Output, Reduction
from ..types import Layout

FP32_UNIT_ROUNDOFF = 2.0**-24
#: How far two fp32 evaluations of an epilogue value (sums in other orders, another libm's last
#: places) may differ, relative to the scale of its rounding error (`reference(..., magnitudes=True)`):
#: fp32's tolerance in `testing.calls.TOLERANCE`, about 1700 terms' unit roundoff.
FP32_VALUE_RTOL = 1e-4


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
    make as small as anything. A max, min or amax picks one value: off by at most `rtol` of it and
    of the largest term's magnitude (its `magnitude`), plus `atol`. Every other output:
    torch.testing.assert_close with rtol, atol."""
    if o.reduce in EXTREMA:
        bound = rtol * (want.float().abs() + magnitude.float()) + atol
        _assert_within(got, want, bound, f"{o.name!r}, a max, min or amax: ", "rtol * (|value| + magnitude) + atol",
                       msg)
        return
    if o.reduce is not Reduction.SUM:
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda s: f"{msg}: {s}")
        return
    m, n = problem
    terms = m * n if o.dim is None else n if o.dim == 1 else m
    bound = (rtol + terms * FP32_UNIT_ROUNDOFF) * magnitude.float() + atol
    _assert_within(got, want, bound, f"sum {o.name!r} of {terms} terms: ",
                   "(rtol + terms * 2^-24) * sum |terms| + atol", msg)


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str, rule: str,
                   msg: str) -> None:
    """|got - want| within `bound`, or both the same NaN or infinity (an empty reduction's identity)."""
    if got.shape != want.shape:
        raise AssertionError(f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got.float() - want.float()).abs()
    bad = ~((err <= bound) | (got.isnan() & want.isnan()) | (got.float() == want.float()))
    if bad.any():
        worst = int((err - bound).nan_to_num(float("inf")).argmax())
        raise AssertionError(f"{msg}: {what}{int(bad.sum())} of {want.numel()} values off by more than {rule}; "
                             f"worst at flat index {worst}: got {got.flatten()[worst].item()}, want "
                             f"{want.flatten()[worst].item()}, bound {bound.flatten()[worst].item()}")


#: (rtol, atol) for an output of a recipe, given its reference: what a call site holds that output to.
Tolerance = Callable[[Output, torch.Tensor], tuple[float, float]]


def assert_outputs_close(outputs: Sequence[Output], got: Sequence[torch.Tensor], want: Sequence[torch.Tensor],
                         magnitude: Sequence[torch.Tensor], problem: tuple[int, int], tolerance: Tolerance,
                         msg: str = "") -> None:
    """Every output of a recipe against the reference, each held to `tolerance(o, want)`
    (`assert_output_close`), except a quantized output with its scales (gg.quantize's row blocks,
    gg.quantize_columns' copy): those two by what they mean, q times its block's scale
    (`assert_dequantized_close`). A block whose values are within their rounding error of zero has
    any scale at all, and its fp8 values with it: a one-row block holding 1e-9 is 448 and 2e-12,
    holding 0 is 0 and 1; either is the same value."""
    assert len(outputs) == len(got) == len(want) == len(magnitude), msg
    paired = quantized_pairs(outputs)
    scales = set(paired.values())
    for i, o in enumerate(outputs):
        where = f"{msg} {o.name}".strip()
        if i in paired:
            block = o.blocks.block if o.blocks is not None else o.column_blocks.block  # type: ignore[union-attr]
            assert_dequantized_close(got[i], got[paired[i]], want[i], want[paired[i]], magnitude[i], o.dtype.torch,
                                     block, tolerance(o, want[i])[0], where)
        elif i not in scales:
            rtol, atol = tolerance(o, want[i])
            assert_output_close(o, got[i], want[i], magnitude[i], problem, rtol, atol, where)


def quantized_pairs(outputs: Sequence[Output]) -> dict[int, int]:
    """Index of each quantized output (row blocks of `BlockOp.QUANTIZE`, or a column-block copy)
    -> index of the output holding its scales, where the recipe returns them."""
    def key(o: Output) -> tuple[str, object] | None:
        if o.blocks is not None and o.blocks.op is BlockOp.QUANTIZE:
            return "rows", o.blocks
        return ("columns", o.column_blocks) if o.column_blocks is not None else None

    scales = {key(o): j for j, o in enumerate(outputs)
              if o.reduce in (Reduction.BLOCK_SCALE, Reduction.COLUMN_BLOCK_SCALE) and key(o) is not None}
    return {i: scales[key(o)] for i, o in enumerate(outputs) if o.reduce is None and key(o) in scales}


def assert_dequantized_close(got_q: torch.Tensor, got_scale: torch.Tensor, want_q: torch.Tensor,
                             want_scale: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, block: int,
                             rtol: float, msg: str = "") -> None:
    """Values of fp8 `dtype` `got_q` (..., R, C) times their per-row block scales (..., R, ceil(C / block))
    against the reference's, NaN where NaN: within `rtol` of the value (the two roundings to fp8),
    plus `FP32_VALUE_RTOL` of the scale of the quantized value's own error (`magnitude`, in the
    reference's scaled units, as `reference(..., magnitudes=True)` gives it), plus one fp8
    subnormal step of each side's scale."""
    if got_q.shape != want_q.shape or got_scale.shape != want_scale.shape:
        raise AssertionError(f"{msg}: shapes {tuple(got_q.shape)}, {tuple(got_scale.shape)} != "
                             f"{tuple(want_q.shape)}, {tuple(want_scale.shape)}")
    columns = got_q.shape[-1]

    def spread(scale: torch.Tensor) -> torch.Tensor:
        return scale.float().repeat_interleave(block, -1)[..., :columns]

    finfo = torch.finfo(dtype)
    step = finfo.smallest_normal * finfo.eps  # the fp8 type's smallest subnormal
    got, want = got_q.float() * spread(got_scale), want_q.float() * spread(want_scale)
    bound = (rtol * want.abs() + FP32_VALUE_RTOL * magnitude.float() * spread(want_scale) +
             step * (spread(got_scale) + spread(want_scale)))
    _assert_within(got, want, bound, "dequantized: ", "rtol * |value| + 1e-4 * its error's scale + a subnormal "
                   "step of each scale", msg)

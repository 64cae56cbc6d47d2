"""Checks of a call's outputs (D, aux tensors, reductions, D's row-block factors): dtype, shape,
device, layout, and that no output overlaps an input or another output."""

from __future__ import annotations

import itertools

import torch

from ..errors import InvalidArgument, LayoutMismatch
from ..types import DType, Layout
from .checks import Span, _aligned_ptr, _dtype, _matrix, _need_tensor
from .problem import TensorArg


def check_output(name: str, t: object, dtype: DType, shape: tuple[int, ...], device: torch.device,
                 batched: bool, l: int, layout: Layout = Layout.ROW) -> TensorArg:  # noqa: E741
    """An output tensor on its own (dtype, shape, device, alignment, strides); see `check_no_alias`."""
    t = _need_tensor(name, t)
    _dtype(name, t, dtype)
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgument(f"{name}: on {t.device} but the inputs are on {device}")
    m, n = shape[-2], shape[-1]
    return TensorArg(_aligned_ptr(name, t), _matrix(name, t, m, n, layout, batched, l, ("M", "N"), output=True))


def check_reduction_output(name: str, t: object, shape: tuple[int, ...], device: torch.device,
                           modes: tuple[int, int, int]) -> TensorArg:
    """A reduced output (`gg.amax`, `gg.sum`): fp32 of `shape` ((L,) or () over M and N; (L, M)
    or (M,) per row; (L, N) or (N,) per column), contiguous; its TensorArg's strides are the
    (M, N, L) mode strides `modes` the kernel's reduction indexes it with."""
    t = _fp32_output(name, t, shape, device, "the reduction's values per batch")
    if not t.is_contiguous():
        raise LayoutMismatch(name, f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}; "
                             f"pass a contiguous tensor")
    if t.data_ptr() % 4:
        raise LayoutMismatch(name, f"{name}: address {t.data_ptr():#x} is not 4-byte aligned (fp32 stores need it)")
    return TensorArg(t.data_ptr(), modes)


def _fp32_output(name: str, t: object, shape: tuple[int, ...], device: torch.device, what: str) -> torch.Tensor:
    """An fp32 output in `out` of `shape` on the inputs' device."""
    t = _need_tensor(name, t)
    _dtype(name, t, DType.F32)
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name}: expected shape {shape} ({what}), got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgument(f"{name}: on {t.device} but the inputs are on {device}")
    return t


def block_factors_layout(shape: tuple[int, ...], l: int) -> tuple[tuple[int, ...], tuple[int, int, int]]:  # noqa: E741
    """(torch strides, (M, N, L) mode strides) of the factors of D's row blocks (gg.quantize's scales,
    gg.rms_norm's rstd, gg.exp_minus_max's maxima), (L, M, blocks) or (M, blocks), as gemmgen
    allocates them: M contiguous, each column of blocks padded to 16 bytes,
    what gg.quantize_blockwise(x, (1, block), scale_layout=gg.ColMajor) gives and a block-scaled
    GEMM's scale_a must be (`GemmSpec.scale_layouts`)."""
    m, blocks = shape[-2], shape[-1]
    column = -(-m // 4) * 4
    if len(shape) == 2:
        return (1, column), (1, column, 0)
    return (blocks * column, 1, column), (1, column, blocks * column if l > 1 else 0)


def check_block_factors_output(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> TensorArg:
    """The factors of D's row blocks passed in `out`: fp32 of `shape`, in any layout whose elements do not overlap
    (the kernel writes each through its strides)."""
    t = _fp32_output(name, t, shape, device, "one factor per row and block of D's columns")
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    if any(s <= 0 for s, _ in dims) or any(s < ps * pn for (ps, pn), (s, _) in itertools.pairwise(dims)):
        raise LayoutMismatch(name, f"{name}: strides {tuple(t.stride())} make elements overlap; pass a tensor of "
                             f"its own, e.g. {name.split('[')[-1].rstrip(']')} = torch.empty({shape}, "
                             "dtype=torch.float32, device=...)")
    if t.data_ptr() % 4:
        raise LayoutMismatch(name, f"{name}: address {t.data_ptr():#x} is not 4-byte aligned (fp32 stores need it)")
    batch = t.stride(0) if len(shape) == 3 and shape[0] > 1 else 0
    return TensorArg(t.data_ptr(), (t.stride(-2), t.stride(-1), batch))


def check_no_alias(name: str, span: tuple[int, int] | None, inputs: tuple[Span, ...], same_as: str | None = None
                   ) -> None:
    """An output's bytes (`span`, None if empty) must not overlap any input's (`input_spans`),
    except the input `same_as`: C when D is the very same tensor (address, strides and type), which
    each element's thread reads before it writes it (beta = 1 in place, as cuBLAS allows)."""
    if span is None:
        return
    lo, hi = span
    for x_name, x_lo, x_hi in inputs:
        if x_name == same_as:
            continue
        if lo < x_hi and x_lo < hi:
            raise InvalidArgument(f"{name}: shares memory with input {x_name}; gemmgen writes in place only D over "
                                  f"the very tensor it reads as C (the same address, strides and type; elsewhere "
                                  f"the kernel would read {x_name} after writing over it): pass a separate output "
                                  f"tensor, or omit {name}= to get a new one")


def check_outputs_disjoint(spans: list[tuple[str, tuple[int, int] | None]]) -> None:
    """Given outputs (name, byte span) must not overlap each other: the kernel's stores to them
    would race, leaving one output's values in another."""
    for i, (name, span) in enumerate(spans):
        for other, other_span in spans[:i]:
            if span is not None and other_span is not None and span[0] < other_span[1] and other_span[0] < span[1]:
                raise InvalidArgument(f"{name}: shares memory with {other}; give each output its own tensor")


def output_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last byte) a strided tensor can touch; None if it is empty."""
    return _span(t) if t.numel() else None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last byte) a non-empty strided tensor can touch."""
    lo = t.data_ptr()
    return lo, lo + t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)))

"""fp8 block quantization in the layouts block-scaled kernels read (`Recipe(block_scale=...)`).

    a_q, scale_a = gg.quantize_blockwise(a, (1, 128), scale_layout=gg.ColMajor)     # A: M x K
    b_q, scale_b = gg.quantize_blockwise(w.t(), (128, 128), scale_layout=gg.RowMajor)  # B: K x N
    d = kernel(a_q, b_q, scale_a, scale_b)

A grouped kernel reads both K-major and unpadded (`GemmSpec.scale_layouts`):

    x_q, scale_a = gg.quantize_blockwise(x, (1, 128), compact=True)                   # tokens: T x K
    w_q, scale_b = gg.quantize_blockwise(w.mT, (128, 128), scale_layout=gg.ColMajor, compact=True)  # G x K x N

Each block's scale is its largest magnitude over the fp8 type's largest value, so the block's values
span the fp8 range; x is approximately q * scale, block by block.

A microscaled kernel (`Recipe(block_scale=gg.MXFP8)`, sm_100a) reads one UE8M0 exponent per 32
values of K of each row of A and each column of B, in the MMA's blocked order:

    a_q, scale_a = gg.quantize_mx(a)          # A: M x K
    w_q, scale_b = gg.quantize_mx(w)          # the weight as N x K: B is w_q.t()
    d = kernel(a_q, w_q.t(), scale_a, scale_b)

Exponents computed elsewhere, (..., rows, ceil(K / 32)) in row order, go through
gg.to_blocked_scales.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgument
from ..ir import GemmSpec, microscaling
from ..ir.microscaling import UE8M0_BIAS, scale_columns, to_blocked
from ..ir.ops import FP8_MAX, quantize_blocks, round_to
from ..types import DType, Layout, Microscaling, OperandKind, as_dtype, as_layout
from .checks import copy_in_layout


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], dtype: DType | str = DType.E4M3,
                       scale_layout: Layout | str = Layout.ROW, compact: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for `x` (..., R, C): q in `dtype` with x's shape and memory order, scale fp32
    (..., ceil(R / block[0]), ceil(C / block[1])) in `scale_layout`, its leading dimension padded to
    16 bytes (TMA), or not with `compact` (as grouped kernels read scales). An all-zero block gets
    scale 1."""
    dt = as_dtype(dtype, "dtype")
    if dt not in FP8_MAX:
        raise InvalidArgument(f"dtype: expected gg.e4m3 or gg.e5m2, got {dt.value}")
    layout = as_layout(scale_layout, "scale_layout")
    if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.is_floating_point()):
        raise InvalidArgument(f"x: expected a floating-point tensor of at least 2 dims, got {x!r:.80}")
    if not (isinstance(block, tuple | list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
        raise InvalidArgument(f"block: expected (rows, cols) positive ints such as (1, 128), got {block!r}")
    scaled, scale = quantize_blocks(x, (block[0], block[1]), dt)
    q = torch.empty_like(x, dtype=dt.torch)
    q.copy_(round_to(scaled, dt))
    return q, copy_in_layout(scale, layout, 1 if compact else 4)  # 4 fp32: 16 bytes, for TMA


def quantize_mx(x: torch.Tensor, scaling: Microscaling = Microscaling.MXFP8, dtype: DType | str = DType.E4M3
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) for `x` (..., R, K), quantized along K: q in fp8 `dtype` (x's shape, row-major),
    scales UE8M0 (..., round_up(R, 128), round_up(ceil(K / 32), 4)) in the MMA's blocked order,
    each vector's 2^(floor(log2 amax) - emax) as the OCP MX spec has it. x is approximately q times
    its vector's scale."""
    if not isinstance(scaling, Microscaling):
        raise InvalidArgument(f"scaling: expected gg.MXFP8, got {scaling!r}")
    dt = as_dtype(dtype, "dtype")
    if dt not in FP8_MAX:
        raise InvalidArgument(f"dtype: expected gg.e4m3 or gg.e5m2, got {dt.value}")
    if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.is_floating_point()):
        raise InvalidArgument(f"x: expected a floating-point tensor of at least 2 dims, got {x!r:.80}")
    q, scales = microscaling.quantize(x, scaling, dt)
    return q.contiguous(), to_blocked(scales)


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (..., rows, ceil(K / 32)) in row order -> the MMA's blocked order (..., round_up(rows,
    128), round_up(ceil(K / 32), 4)), what a microscaled kernel's scale_a and scale_b take."""
    if not (isinstance(scales, torch.Tensor) and scales.dim() >= 2 and scales.dtype == DType.UE8M0.torch):
        raise InvalidArgument(f"scales: expected a torch.float8_e8m0fnu tensor of at least 2 dims (rows, "
                              f"ceil(K / 32)), got {scales!r:.80}; exponent bytes view as "
                              "scales.view(torch.float8_e8m0fnu)")
    return to_blocked(scales)


def random_block_scale(kind: OperandKind, gemm: GemmSpec, m: int, n: int, k: int, lead: tuple[int, ...] = (),
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """Random scales between 0.5 and 2 for a block-scaled GEMM's `scale_a` or `scale_b`, in the
    shape and layout its kernel reads (inputs for tests, tuning and benchmarks; a grouped GEMM's
    `m` is its rows of A, and `lead` holds scale_b's groups)."""
    assert kind.block_scale
    if gemm.microscaling is not None:  # exponents 2^-3 to 2^3, in the blocked order
        fmt = gemm.microscaling
        rows = m if kind is OperandKind.SCALE_A else n
        exponents = torch.randint(UE8M0_BIAS - 3, UE8M0_BIAS + 4, (*lead, rows, scale_columns(k, fmt)),
                                  dtype=torch.uint8)
        return to_blocked(exponents.view(fmt.scale_dtype.torch)).to(device)
    assert gemm.block_scale is not None
    gm, gn, gk = gemm.block_scale
    k_blocks = -(-k // gk)
    layout_a, layout_b = gemm.scale_layouts
    if kind is OperandKind.SCALE_A:
        shape, layout = (-(-m // gm), k_blocks), layout_a
    else:
        shape, layout = (k_blocks, -(-n // gn)), layout_b
    return copy_in_layout(torch.rand(*lead, *shape, device=device) * 1.5 + 0.5, layout, 1 if gemm.grouped else 4)

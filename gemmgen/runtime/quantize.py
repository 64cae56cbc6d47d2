"""fp8 block quantization in the layouts block-scaled kernels read (`Recipe(block_scale=...)`).

    a_q, scale_a = gg.quantize_blockwise(a, (1, 128), scale_layout=gg.ColMajor)     # A: M x K
    b_q, scale_b = gg.quantize_blockwise(w.t(), (128, 128), scale_layout=gg.RowMajor)  # B: K x N
    d = kernel(a_q, b_q, scale_a, scale_b)

A grouped kernel reads both K-major and unpadded (`GemmSpec.scale_layouts`):

    x_q, scale_a = gg.quantize_blockwise(x, (1, 128), compact=True)                   # tokens: T x K
    w_q, scale_b = gg.quantize_blockwise(w.mT, (128, 128), scale_layout=gg.ColMajor, compact=True)  # G x K x N

Each block's scale is its largest magnitude over the fp8 type's largest value, so the block's values
span the fp8 range; x is approximately q * scale, block by block.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgument
from ..ir import GemmSpec
from ..ir.ops import FP8_MAX, quantize_blocks, round_to
from ..types import DType, Layout, OperandKind, as_dtype, as_layout
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


def random_block_scale(kind: OperandKind, gemm: GemmSpec, m: int, n: int, k: int, lead: tuple[int, ...] = (),
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """Random scales between 0.5 and 2 for a block-scaled GEMM's `scale_a` or `scale_b`, in the
    shape and layout its kernel reads (inputs for tests, tuning and benchmarks; a grouped GEMM's
    `m` is its rows of A, and `lead` holds scale_b's groups)."""
    assert gemm.block_scale is not None and kind.block_scale
    gm, gn, gk = gemm.block_scale
    k_blocks = -(-k // gk)
    layout_a, layout_b = gemm.scale_layouts
    if kind is OperandKind.SCALE_A:
        shape, layout = (-(-m // gm), k_blocks), layout_a
    else:
        shape, layout = (k_blocks, -(-n // gn)), layout_b
    return copy_in_layout(torch.rand(*lead, *shape, device=device) * 1.5 + 0.5, layout, 1 if gemm.grouped else 4)

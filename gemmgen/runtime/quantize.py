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

An NVFP4 kernel (`block_scale=gg.NVFP4`) reads packed fp4 and one e4m3 scale per 16 values; a
per-tensor scale keeps the e4m3 scales in range, and the epilogue multiplies it back:

    sa, sw = gg.nvfp4_tensor_scale(a), gg.nvfp4_tensor_scale(w)
    a_q, scale_a = gg.quantize_mx(a, gg.NVFP4, tensor_scale=sa)    # A: M x K/2 bytes
    w_q, scale_b = gg.quantize_mx(w, gg.NVFP4, tensor_scale=sw)
    d = kernel(a_q, w_q.t(), scale_a, scale_b, alpha=float(sa * sw))  # the epilogue: acc * alpha

A gg.Scalar is a host value (`float` reads the GPU's); a per-token gg.ColVector of scales avoids
that read, as gg.nn.NVFP4Linear does.

Scales computed elsewhere, (..., rows, ceil(K / vector)) in row order, go through
gg.to_blocked_scales.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..errors import InvalidArgument
from ..ir import GemmSpec, microscaling
from ..ir.graph import K_GROUPED_TOKEN_ALIGN
from ..ir.microscaling import E2M1_MAX, UE8M0_BIAS, grouped_blocked_rows, scale_columns, to_blocked
from ..ir.ops import FP8_MAX, fp8_scale, power_of_two_above, quantize_blocks, round_to
from ..ir.reference import k_grouped_scale_blocks, k_grouped_tokens, k_grouped_width
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


def quantize_mx(x: torch.Tensor, scaling: Microscaling = Microscaling.MXFP8, dtype: DType | str | None = None,
                tensor_scale: float | torch.Tensor | None = None, offsets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) for `x` (..., R, K), quantized along K, scales in the MMA's blocked order
    (..., round_up(R, 128), round_up(ceil(K / vector), 4)). MXFP8: q in fp8 `dtype` (x's shape,
    row-major), scales UE8M0, each vector's 2^(floor(log2 amax) - emax) as the OCP MX spec has it.
    NVFP4: q packed fp4 (torch.float4_e2m1fn_x2, (..., R, ceil(K / 2))), scales e4m3 (each vector's
    amax / 6) of x / `tensor_scale`: 1 if None, a float, or a float tensor that broadcasts against x
    with one value along K (one per tensor, `nvfp4_tensor_scale`, or one per row: (..., R, 1)). x is
    approximately q times its vector's scale (times tensor_scale). With `offsets` (a grouped GEMM's
    int32 group ends), x is its tokens (T, K) and the scales are in the grouped blocked order, each
    group's rows from a block of their own (`to_blocked_scales`)."""
    if not isinstance(scaling, Microscaling):
        raise InvalidArgument(f"scaling: expected gg.MXFP8 or gg.NVFP4, got {scaling!r}")
    dt = as_dtype(scaling.elements[0] if dtype is None else dtype, "dtype")
    if dt not in scaling.elements:
        names = " or ".join(f"gg.{e.value}" for e in scaling.elements)
        raise InvalidArgument(f"dtype: expected {names}, got {dt.value} ({scaling!r} quantizes to those)")
    if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.is_floating_point()):
        raise InvalidArgument(f"x: expected a floating-point tensor of at least 2 dims, got {x!r:.80}")
    if tensor_scale is not None:
        if scaling is not Microscaling.NVFP4:
            raise InvalidArgument(f"tensor_scale: {scaling!r}'s power-of-two scales span every fp32 range, so it "
                                  "takes no tensor scale; drop tensor_scale=")
        x = x.float() / _tensor_scale(tensor_scale, x)
    q, scales = microscaling.quantize(x, scaling, dt)
    return q.contiguous(), to_blocked_scales(scales, offsets)


def nvfp4_tensor_scale(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """NVFP4's tensor scale of `x`: amax / (6 * 448), so that each vector's scale (its amax / 6
    over it) fits e4m3 and the largest uses its whole range; 1 where x is all zeros. An fp32 0-dim
    tensor on x's device, or with `per_row` one per row of K: (..., R, 1)."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= (2 if per_row else 0)):
        raise InvalidArgument(f"x: expected a floating-point tensor{' of at least 2 dims' if per_row else ''}, "
                              f"got {x!r:.80}")
    magnitude = x.detach().abs().float()
    if per_row:
        amax = magnitude.amax(dim=-1, keepdim=True) if x.shape[-1] else magnitude.new_zeros((*x.shape[:-1], 1))
    else:
        amax = magnitude.amax() if x.numel() else magnitude.new_zeros(())
    return (amax / (E2M1_MAX * 448.0)).where(amax > 0, 1.0)


def _tensor_scale(value: float | torch.Tensor, x: torch.Tensor) -> float | torch.Tensor:
    """NVFP4's tensor scale as x divides by it: a positive float, or a float tensor of one value
    along K that broadcasts against x (its values are not read here: that would synchronize)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() <= x.dim() and \
            (value.dim() == 0 or value.shape[-1] == 1) and value.device == x.device:
        try:
            if torch.broadcast_shapes(value.shape, x.shape) == x.shape:
                return value.float()
        except RuntimeError:
            pass
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise InvalidArgument(f"tensor_scale: expected a positive finite float, or a float tensor on x's device with one "
                          f"value along K that broadcasts against x {tuple(x.shape)} (per tensor: "
                          f"gg.nvfp4_tensor_scale(x); per row: shape (..., R, 1)), got {value!r:.80}")


def to_blocked_scales(scales: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Scales (..., rows, ceil(K / vector)) in row order -> the MMA's blocked order (..., round_up(rows,
    128), round_up(ceil(K / vector), 4)), what a microscaled kernel's scale_a and scale_b take:
    MXFP8's UE8M0 (torch.float8_e8m0fnu) or NVFP4's e4m3 (torch.float8_e4m3fn). With `offsets` (a
    grouped GEMM's int32 group ends, on the scales' device), a grouped kernel's scale_a: the
    tokens' scales (T, C) in the grouped blocked order ((ceil(T / 128) + G) * 128 rows, each group
    from a block of its own: `ir.microscaling`), torch ops that never read the offsets on the host."""
    dtypes = (DType.UE8M0.torch, DType.UE4M3.torch)
    if not (isinstance(scales, torch.Tensor) and scales.dim() >= 2 and scales.dtype in dtypes):
        raise InvalidArgument(f"scales: expected a torch.float8_e8m0fnu (MXFP8) or torch.float8_e4m3fn (NVFP4) "
                              f"tensor of at least 2 dims (rows, ceil(K / vector)), got {scales!r:.80}; MXFP8's "
                              "exponent bytes view as scales.view(torch.float8_e8m0fnu)")
    if offsets is None:
        return to_blocked(scales)
    if not (isinstance(offsets, torch.Tensor) and offsets.dtype == torch.int32 and offsets.dim() == 1
            and len(offsets) > 0 and offsets.device == scales.device and scales.dim() == 2):
        raise InvalidArgument(f"offsets: expected a grouped GEMM's int32 group ends (G,) on the scales' device, with "
                              f"the tokens' (T, C) scales, got {offsets!r:.80} for scales of shape "
                              f"{tuple(scales.shape)}")
    return microscaling.to_grouped_blocked(scales, offsets)


def quantize_k_grouped(x: torch.Tensor, offsets: torch.Tensor, dtype: DType | str = DType.E4M3,
                       power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(copy, scales) for a K-grouped fp8 GEMM (`grouped=gg.Grouping.K`, block_scale=(1, 1, 128)):
    x (T, C) tokens-major, split into groups by `offsets` (int32 ends, on x's device), quantized
    along the tokens per 128 of each group's tokens and each column (`quantize_blockwise`'s
    formula; with `power_of_two` its scales rounded up to powers of two).

    copy: (C, T') in `dtype`, tokens-contiguous, group g's tokens from column 16 * (g + ceil(first /
    16)) on and zeros around them (`GemmSpec.token_align`: TMA reads each group from a 16-byte
    aligned address); T' = 16 * (G + ceil(T / 16)). scales: fp32 (G + T16 // 128, C) with T16 =
    16 * ceil(T / 16), the most tokens a copy T' wide holds (what a kernel sizes them by), group g's
    blocks from row g + first // 128 on, 1 in rows no group uses. A weight gradient dW = dY^T X
    takes a = the copy of dY, b = the copy of X, transposed (`.t()`). Only torch ops on x's device:
    no host sync, the offsets stay where they are."""
    dt = as_dtype(dtype, "dtype")
    if dt not in FP8_MAX:
        raise InvalidArgument(f"dtype: expected gg.e4m3 or gg.e5m2, got {dt.value}")
    tokens, columns = _check_k_grouped(x, offsets, fp8=False)
    groups, block = offsets.numel(), 128
    t, group, first, column = _token_columns(offsets, tokens)
    row = group + first // block + (t - first) // block  # reference.k_grouped_scale_block
    width = k_grouped_width(tokens, groups, K_GROUPED_TOKEN_ALIGN)
    blocks = k_grouped_scale_blocks(k_grouped_tokens(width, groups, K_GROUPED_TOKEN_ALIGN), groups)
    amax = x.new_zeros((blocks, columns), dtype=torch.float32)
    amax.scatter_reduce_(0, row[:, None].expand(-1, columns), x[t].float().abs(), "amax")
    scales = fp8_scale(amax, dt)
    if power_of_two:
        scales = power_of_two_above(scales)
    copy = torch.zeros((columns, width), dtype=dt.torch, device=x.device)
    copy[:, column] = round_to(x[t].float() / scales[row], dt).to(dt.torch).t()
    return copy, scales


def k_grouped_copy(q: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """An fp8 (T, C) tensor already quantized (one scale per tensor: the values need no other) as a
    K-grouped fp8 GEMM's operand: `quantize_k_grouped`'s (C, T') tokens-contiguous copy, each group's
    tokens aligned, zeros around them."""
    tokens, columns = _check_k_grouped(q, offsets, fp8=True)
    t, _, _, column = _token_columns(offsets, tokens)
    copy = torch.zeros((columns, k_grouped_width(tokens, offsets.numel(), K_GROUPED_TOKEN_ALIGN)), dtype=q.dtype,
                       device=q.device)
    copy.view(torch.uint8)[:, column] = q.view(torch.uint8)[t].t()
    return copy


def _check_k_grouped(x: object, offsets: object, fp8: bool) -> tuple[int, int]:
    """(tokens, columns) of a tensor to lay out for a K-grouped GEMM (`fp8`: already quantized), and
    its offsets, checked."""
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_floating_point()
            and (x.element_size() == 1) == fp8):
        raise InvalidArgument(f"x: expected {'an fp8' if fp8 else 'a floating-point'} (tokens, columns) tensor, "
                              f"got {x!r:.80}")
    if not (isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.dtype == torch.int32
            and offsets.device == x.device and offsets.numel() > 0):
        raise InvalidArgument(f"offsets: expected the groups' int32 ends (G,) on x's device ({x.device}), got "
                              f"{offsets!r:.80}")
    return x.shape[0], x.shape[1]


def _token_columns(offsets: torch.Tensor, tokens: int) -> tuple[torch.Tensor, ...]:
    """(token, its group, the group's first token, its column in the copy) of every token in a group
    (reference.group_bounds and k_grouped_token_column, by torch ops on the offsets' device)."""
    groups, align = offsets.numel(), K_GROUPED_TOKEN_ALIGN
    ends = offsets.long().clamp(0, tokens).cummax(0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    t = torch.arange(tokens, device=offsets.device)
    group = torch.searchsorted(ends, t, right=True)  # G past the last group's end: in no group
    inside = group < groups
    t, group = t[inside], group[inside]
    first = starts[group]
    return t, group, first, align * (group + (first + align - 1) // align) + t - first


def random_block_scale(kind: OperandKind, gemm: GemmSpec, m: int, n: int, k: int, lead: tuple[int, ...] = (),
                       device: torch.device | str = "cpu", groups: int = 0) -> torch.Tensor:
    """Random scales between 0.5 and 2 for a block-scaled GEMM's `scale_a` or `scale_b`, in the
    shape and layout its kernel reads (inputs for tests, tuning and benchmarks; a grouped GEMM's
    `m` is its rows of A, and `lead` holds scale_b's groups; a grouped microscaled GEMM's scale_a
    is as many rows as its `groups` may place in the grouped blocked order, all random)."""
    assert kind.block_scale
    if gemm.microscaling is not None:  # in the blocked order: 2^-3 to 2^3, or e4m3 from 0.25 to 4
        fmt = gemm.microscaling
        rows = (grouped_blocked_rows(m, groups) if gemm.grouped else m) if kind is OperandKind.SCALE_A else n
        shape = (*lead, rows, scale_columns(k, fmt))
        if fmt is Microscaling.NVFP4:
            scales = (torch.rand(shape) * 3.75 + 0.25).to(fmt.scale_dtype.torch)
        else:
            scales = torch.randint(UE8M0_BIAS - 3, UE8M0_BIAS + 4, shape, dtype=torch.uint8).view(fmt.scale_dtype.torch)
        return to_blocked(scales).to(device)
    assert gemm.block_scale is not None
    gm, gn, gk = gemm.block_scale
    k_blocks = -(-k // gk)
    layout_a, layout_b = gemm.scale_layouts
    if kind is OperandKind.SCALE_A:
        shape, layout = (-(-m // gm), k_blocks), layout_a
    else:
        shape, layout = (k_blocks, -(-n // gn)), layout_b
    return copy_in_layout(torch.rand(*lead, *shape, device=device) * 1.5 + 0.5, layout, 1 if gemm.grouped else 4)

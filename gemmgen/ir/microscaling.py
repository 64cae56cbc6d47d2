"""Microscaled (MX, NVFP4) operands: their scales' blocked order, and their meaning in torch.

sm_100a's block-scaled MMA reads one scale per `vector` K values of each row of A and each column
of B: MXFP8's UE8M0 exponent per 32, NVFP4's unsigned e4m3 per 16. It reads them in CUTLASS's
`Sm1xxBlockScaledConfig` order, the order of cuBLASLt's VEC32_UE8M0 / VEC16_UE4M3 scales and
torch._scaled_mm's "blocked" (swizzled 32 x 4 x 4) ones: the (rows, ceil(K / vector)) scale matrix,
padded to whole 128 x 4 blocks, is stored block by block (K blocks fastest, then row blocks, then
the batch), each block of 512 bytes holding its (row r, column c) at (r % 32) * 16 + (r // 32) * 4
+ c. Padding holds 1 (UE8M0 127, e4m3 0x38): rows and K past the problem are read as zeros by the
TMA, and a NaN scale there would turn them into NaN.

A grouped GEMM's scale_a holds its tokens' scales in the same order, each group's rows starting a
block of their own: group g, whose rows of A start at row s, starts at block s // 128 + g (so no
group shares a block, each group's blocks follow the group before it, and the place depends on
the group's first row alone: the setup kernel computes it per group, and torch ops without
reading the offsets on the host). The whole holds (ceil(T / 128) + G) blocks of rows for T rows
of A in G groups (`grouped_blocked_rows`); rows no group has are padding.

NVFP4's values are fp4 (e2m1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte as torch's
float4_e2m1fn_x2 and CUTLASS hold them: element 2i in the low nibble, 2i + 1 in the high one.

The layout's arithmetic is plain Python (the argument builder's); the formulas use tensor methods,
and import torch where they need its dtypes, so that importing this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import DType, Microscaling
from .ops import FP8_MAX, round_to

if TYPE_CHECKING:
    import torch

#: Rows and scale columns of one block of the blocked order.
BLOCK_ROWS, BLOCK_COLUMNS = 128, 4
#: The UE8M0 bias: byte e means 2^(e - 127); 255 is NaN.
UE8M0_BIAS = 127
#: 1.0 in e4m3 (NVFP4's scales): the blocked order's padding.
E4M3_ONE = 0x38
_EMAX = {DType.E4M3: 8, DType.E5M2: 15}  # the largest power of two an fp8 type holds
#: The fp4 (e2m1) magnitudes, by the low three bits of a code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def scale_columns(k: int, fmt: Microscaling) -> int:
    """Scales per row: one per `fmt.vector` values of K (a partial last one included)."""
    return -(-k // fmt.vector)


def blocked_shape(rows: int, k: int, fmt: Microscaling) -> tuple[int, int]:
    """The (padded rows, padded scale columns) of one matrix's scales in the blocked order."""
    return -(-rows // BLOCK_ROWS) * BLOCK_ROWS, -(-scale_columns(k, fmt) // BLOCK_COLUMNS) * BLOCK_COLUMNS


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(..., rows, C) scales -> (..., padded rows, padded C) holding them in the blocked order (the
    same dtype; the padding 1)."""
    *lead, rows, columns = scales.shape
    pr, pc = -(-rows // BLOCK_ROWS) * BLOCK_ROWS, -(-columns // BLOCK_COLUMNS) * BLOCK_COLUMNS
    raw = _bytes(scales)
    padded = raw.new_full((*lead, pr, pc), _one(scales))
    padded[..., :rows, :columns] = raw
    blocks = padded.unflatten(-1, (pc // 4, 4)).unflatten(-3, (pr // 128, 4, 32))  # (.., rb, 4, 32, cb, 4)
    order = blocks.movedim(-2, -4).movedim(-2, -3)  # (.., rb, cb, 32, 4, 4): r % 32, r // 32 % 4, c % 4
    return order.reshape(*lead, pr, pc).contiguous().view(scales.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The (..., rows, columns) scales held in blocked order by `blocked` (`to_blocked`'s inverse)."""
    *lead, pr, pc = blocked.shape
    order = _bytes(blocked).reshape(*lead, pr // 128, pc // 4, 32, 4, 4)
    blocks = order.movedim(-2, -4).movedim(-3, -2)  # (.., rb, 4, 32, cb, 4)
    return blocks.reshape(*lead, pr, pc)[..., :rows, :columns].view(blocked.dtype)


def grouped_blocked_rows(rows: int, groups: int) -> int:
    """Rows of a grouped GEMM's scale_a in the grouped blocked order (T rows of A, G groups)."""
    return (-(-rows // BLOCK_ROWS) + groups) * BLOCK_ROWS


def grouped_row_places(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Where each of A's `rows` rows lies among the grouped blocked order's rows (int64, on the
    offsets' device): group g's rows from block first // 128 + g on. Groups are bounded as
    `reference.group_bounds` has them (each ends at its clamped running maximum of the offsets);
    a row in no group (past the last group) keeps its place after it."""
    import torch

    ends = offsets.long().cummax(dim=0).values.clamp(0, rows)
    firsts = torch.cat((ends.new_zeros(1), ends[:-1]))
    row = torch.arange(rows, device=offsets.device)
    group = torch.searchsorted(ends, row, right=True).clamp(max=len(ends) - 1)
    first = firsts[group]
    return (first // BLOCK_ROWS + group) * BLOCK_ROWS + row - first


def to_grouped_blocked(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A grouped GEMM's token scales (T, C) in row order -> the grouped blocked order
    (`grouped_blocked_rows(T, G)`, padded C), the padding 1."""
    rows, columns = scales.shape
    raw = _bytes(scales)
    placed = raw.new_full((grouped_blocked_rows(rows, len(offsets)), columns), _one(scales))
    placed[grouped_row_places(offsets, rows)] = raw
    return to_blocked(placed.view(scales.dtype))


def from_grouped_blocked(blocked: torch.Tensor, offsets: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The (rows, columns) token scales held by `blocked` in the grouped blocked order."""
    placed = from_blocked(blocked, blocked.shape[-2], columns)
    return placed[grouped_row_places(offsets, rows)]


def scale_values(scales: torch.Tensor, fmt: Microscaling) -> torch.Tensor:
    """The scales as fp32: UE8M0 as powers of two (255: NaN), NVFP4's as e4m3 values."""
    if fmt is Microscaling.NVFP4:
        return scales.view(DType.UE4M3.torch).float()
    e = _bytes(scales).float()
    return (e - UE8M0_BIAS).exp2().where(e != 255, float("nan"))


def values(t: torch.Tensor, dtype: DType) -> torch.Tensor:
    """A or B as fp32, K along the last dim: fp8 as it is, packed fp4 (..., K / 2 bytes) unpacked to
    (..., K)."""
    import torch

    if dtype is not DType.E2M1:
        return t.float()
    raw = _bytes(t)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)  # element 2i, 2i + 1
    table = torch.tensor(E2M1_VALUES, device=t.device)
    magnitude = table[(codes & 7).long()]
    return magnitude.where(codes < 8, -magnitude)


def absolute(t: torch.Tensor, dtype: DType) -> torch.Tensor:
    """|t| in fp32, but packed fp4 stays packed (its sign bits cleared) for `values` to unpack."""
    if dtype is not DType.E2M1:
        return t.float().abs()
    return (_bytes(t) & 0x77).view(t.dtype)


def dequantize(x: torch.Tensor, scales: torch.Tensor, fmt: Microscaling) -> torch.Tensor:
    """fp32 values x (..., rows, K) times their scales (..., rows, ceil(K / vector)) in logical
    order: what the MMA multiplies."""
    per_value = scale_values(scales, fmt).repeat_interleave(fmt.vector, dim=-1)[..., : x.shape[-1]]
    return x.float() * per_value


def quantize(x: torch.Tensor, fmt: Microscaling, dtype: DType, round_up: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in `dtype`, scales (..., rows, ceil(K / vector)) in logical order) for x (..., rows,
    K), each vector of K scaled to span its type. MXFP8: the OCP MX spec's floor rule, 2^(floor(log2
    amax) - emax of `dtype`), the values saturating, a vector of zeros 2^0; with `round_up`,
    2^ceil(log2(amax / the type's largest value)) instead (nothing saturates). NVFP4: amax / 6 rounded
    to e4m3 (saturating at 448), the values rounded to nearest fp4 (ties to even), packed in pairs
    along K (K odd: a zero last value); a vector whose scale is 0 holds zeros."""
    values_ = x.float()
    k = values_.shape[-1]
    columns = scale_columns(k, fmt)
    padded = values_.new_zeros((*values_.shape[:-1], columns * fmt.vector))
    padded[..., :k] = values_
    amax = padded.unflatten(-1, (columns, fmt.vector)).abs().amax(dim=-1)
    if fmt is Microscaling.NVFP4:
        scale = (amax / E2M1_MAX).clamp(max=448.0).to(DType.UE4M3.torch)
        per_value = scale.float().repeat_interleave(fmt.vector, dim=-1)
        scaled = (padded / per_value.where(per_value > 0, 1.0)).where(per_value > 0, 0.0)
        return _pack_e2m1(scaled[..., : k + k % 2]), scale
    if round_up:  # 2^ceil(log2(amax / max)), so nothing saturates (Transformer Engine's MXFP8 training rule)
        mantissa, power = (amax / FP8_MAX[dtype]).where(amax > 0, 1.0).frexp()
        exponent = (power - (mantissa == 0.5).int()).float()
    else:
        exponent = amax.where(amax > 0, 1.0).log2().floor() - _EMAX[dtype]
    exponent = exponent.where(amax > 0, 0.0).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    scaled = padded / exponent.exp2().repeat_interleave(fmt.vector, dim=-1)
    q = round_to(scaled[..., :k], dtype)
    return q, (exponent + UE8M0_BIAS).to(_uint8()).view(fmt.scale_dtype.torch)


def _pack_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 (..., K even) -> fp4 codes, nearest with ties to even (saturating at 6), packed in
    pairs along K: torch.float4_e2m1fn_x2 (..., K / 2)."""
    import torch

    magnitude = x.abs().clamp(max=E2M1_MAX)
    table = x.new_tensor(E2M1_VALUES)
    midpoints = (table[1:] + table[:-1]) / 2
    index = torch.bucketize(magnitude, midpoints)  # a tie at midpoints[i] gives i: round down
    tie = (index < len(midpoints)) & (magnitude == midpoints[index.clamp(max=len(midpoints) - 1)])
    index = index + (tie & (index % 2 == 1)).long()  # ties to the even code (an even mantissa)
    codes = (index + 8 * (x < 0).long()).to(_uint8())
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(DType.E2M1.torch)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (uint8 views of one-byte dtypes; uint8 as it is)."""
    uint8 = _uint8()
    return t if t.dtype == uint8 else t.view(uint8)


def _one(scales: torch.Tensor) -> int:
    """The byte of a scale of 1 in `scales`' type (e4m3 for NVFP4, else UE8M0)."""
    return E4M3_ONE if scales.dtype == DType.UE4M3.torch else UE8M0_BIAS


def _uint8() -> torch.dtype:
    import torch

    return torch.uint8

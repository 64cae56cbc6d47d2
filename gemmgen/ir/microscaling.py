"""Microscaled (MX) operands: their scales' blocked order, and their meaning in torch.

sm_100a's block-scaled MMA reads one UE8M0 exponent per `vector` (32) K values of each row of A and
each column of B. It reads them in CUTLASS's `Sm1xxBlockScaledConfig` order, the order of
cuBLASLt's VEC32_UE8M0 scales and torch._scaled_mm's "blocked" (swizzled 32 x 4 x 4) ones: the
(rows, ceil(K / 32)) scale matrix, padded to whole 128 x 4 blocks, is stored block by block (K
blocks fastest, then row blocks, then the batch), each block of 512 bytes holding its (row r,
column c) at (r % 32) * 16 + (r // 32) * 4 + c. Padding holds 127 (2^0): rows and K past the
problem are read as zeros by the TMA, and a NaN scale (255) there would turn them into NaN.

The layout's arithmetic is plain Python (the argument builder's); the formulas use tensor methods,
and import torch where they need its dtypes, so that importing this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import DType, Microscaling
from .ops import round_to

if TYPE_CHECKING:
    import torch

#: Rows and scale columns of one block of the blocked order.
BLOCK_ROWS, BLOCK_COLUMNS = 128, 4
#: The UE8M0 bias: byte e means 2^(e - 127); 255 is NaN.
UE8M0_BIAS = 127
_EMAX = {DType.E4M3: 8, DType.E5M2: 15}  # the largest power of two an fp8 type holds


def scale_columns(k: int, fmt: Microscaling) -> int:
    """Scales per row: one per `fmt.vector` values of K (a partial last one included)."""
    return -(-k // fmt.vector)


def blocked_shape(rows: int, k: int, fmt: Microscaling) -> tuple[int, int]:
    """The (padded rows, padded scale columns) of one matrix's scales in the blocked order."""
    return -(-rows // BLOCK_ROWS) * BLOCK_ROWS, -(-scale_columns(k, fmt) // BLOCK_COLUMNS) * BLOCK_COLUMNS


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(..., rows, C) scales -> (..., padded rows, padded C) holding them in the blocked order (the
    same dtype; the padding 127)."""
    *lead, rows, columns = scales.shape
    pr, pc = -(-rows // BLOCK_ROWS) * BLOCK_ROWS, -(-columns // BLOCK_COLUMNS) * BLOCK_COLUMNS
    raw = _bytes(scales)
    padded = raw.new_full((*lead, pr, pc), UE8M0_BIAS)
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


def exponents(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as fp32 powers of two (255: NaN)."""
    e = _bytes(scales).float()
    return (e - UE8M0_BIAS).exp2().where(e != 255, float("nan"))


def dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: Microscaling) -> torch.Tensor:
    """fp32 values (..., rows, K) times their scales (..., rows, ceil(K / vector)), UE8M0, in
    logical order: what the MMA multiplies."""
    per_value = exponents(scales).repeat_interleave(fmt.vector, dim=-1)[..., : values.shape[-1]]
    return values.float() * per_value


def quantize(x: torch.Tensor, fmt: Microscaling, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in fp8 `dtype`, UE8M0 scales (..., rows, ceil(K / vector)) in logical order) for x
    (..., rows, K), each vector of K scaled as the OCP MX spec's floor rule has it: 2^(floor(log2
    amax) - emax of `dtype`), the values saturating; a vector of zeros gets 2^0."""
    values = x.float()
    k = values.shape[-1]
    columns = scale_columns(k, fmt)
    padded = values.new_zeros((*values.shape[:-1], columns * fmt.vector))
    padded[..., :k] = values
    amax = padded.unflatten(-1, (columns, fmt.vector)).abs().amax(dim=-1)
    exponent = amax.where(amax > 0, 1.0).log2().floor() - _EMAX[dtype]
    exponent = exponent.where(amax > 0, 0.0).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    scaled = padded / exponent.exp2().repeat_interleave(fmt.vector, dim=-1)
    q = round_to(scaled[..., :k], dtype)
    return q, (exponent + UE8M0_BIAS).to(_uint8()).view(fmt.scale_dtype.torch)


def _bytes(scales: torch.Tensor) -> torch.Tensor:
    """The scales' bytes (uint8 views of float8_e8m0fnu; uint8 as it is)."""
    uint8 = _uint8()
    return scales if scales.dtype == uint8 else scales.view(uint8)


def _uint8() -> torch.dtype:
    import torch

    return torch.uint8

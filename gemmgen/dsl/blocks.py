"""D computed per block of its rows' columns (gg.quantize, gg.rms_norm, gg.exp_minus_max) and a value
stored transposed and quantized per block of rows of each column (gg.quantize_columns): epilogue
outputs, not values to compute with (gemmgen/include/gemmgen/row_blocks.hpp, column_blocks.hpp)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import RecipeError
from ..ir import BlockOp, Op, f32
from .operands import constant
from .values import OutputOnly, Value, _binary, _reduced_value

#: The column blocks of D's rows gg.quantize, gg.rms_norm and gg.exp_minus_max take: whole 8-column
#: MMA atoms, at most a 128-column epilogue subtile.
ROW_BLOCKS = (8, 16, 32, 64, 128)


class BlockOutput(OutputOnly):
    """One of the two outputs of `gg.quantize`, `gg.rms_norm` or `gg.exp_minus_max`: D's values,
    computed per block of columns of each row, or each block's factor (fp32, one per row and
    block). Returned from the epilogue, D's under 'd' and the factors under an aux name declared
    gg.f32; not values to compute with."""

    __slots__ = ("block", "call", "constant", "factor", "op", "power_of_two", "stat", "value")

    def __init__(self, op: BlockOp, value: Value, stat: Value, block: int, constant: float, call: object,
                 factor: bool, power_of_two: bool = False) -> None:
        self.op, self.value, self.stat, self.block, self.constant = op, value, stat, block, constant
        self.call, self.factor, self.power_of_two = call, factor, power_of_two

    def _error(self) -> RecipeError:
        return RecipeError(f"gg.{self.op.value}(...) gives outputs, not values to compute with: return them, "
                           f"{BLOCK_EXAMPLES[self.op]}")

    def _misuse(self, *args: Any) -> Any:
        raise self._error()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __neg__ = __pos__ = __abs__ = __pow__ = _misuse

    def __repr__(self) -> str:
        return f"gemmgen.{self.op.value}({self.stat!r}, block={self.block})[{int(self.factor)}]"


#: How each op's two values are returned (the fix its misuse messages give).
BLOCK_EXAMPLES = {
    BlockOp.QUANTIZE: "q, scale = gg.quantize(y, block=128); return {'d': q, 'scale': scale}, declared with "
                      "d=gg.e4m3 and aux={'scale': gg.f32}",
    BlockOp.RMS_NORM: "y, rstd = gg.rms_norm(x, block=128); return {'d': y, 'rstd': rstd}, declared with "
                      "aux={'rstd': gg.f32}",
    BlockOp.EXP: "p, m = gg.exp_minus_max(x, block=128); return {'d': p, 'max': m}, declared with "
                 "aux={'max': gg.f32}",
}


def _block_width(block: Any, op_name: str) -> int:
    if not isinstance(block, int) or isinstance(block, bool) or block not in ROW_BLOCKS:
        raise RecipeError(f"{op_name}: block={block!r}; expected one of {', '.join(map(str, ROW_BLOCKS))} columns, "
                          "e.g. block=128")
    return block


def quantize(x: Any, block: int = 128, power_of_two: bool = False) -> tuple[BlockOutput, BlockOutput]:
    """(values, scales): D quantized to its fp8 type per `block` columns of each row, as DeepSeek-V3
    quantizes activations (1 x 128) and MX formats do (1 x 32, with fp32 scales here): each block's
    scale is its largest |x| over the fp8 type's largest value (1 for a block of zeros or holding a
    NaN), D holds x / scale, and the scales output (M, ceil(N / block)) holds the scales, in the
    layout a block-scaled GEMM reads its A's: what gg.quantize_blockwise(x, (1, block),
    scale_layout=gg.ColMajor) gives, bit for bit. With `power_of_two`, each scale is rounded up to
    a power of two (Transformer Engine's blockwise scales: the division is exact). Return the values
    as 'd' and the scales under an aux name declared gg.f32."""
    width = _block_width(block, "quantize")
    v = _reduced_value(x, "quantize")
    pow2, call = _flag(power_of_two, "quantize", "power_of_two"), object()
    return (BlockOutput(BlockOp.QUANTIZE, v, v, width, 0.0, call, factor=False, power_of_two=pow2),
            BlockOutput(BlockOp.QUANTIZE, v, v, width, 0.0, call, factor=True, power_of_two=pow2))


class ColumnBlockOutput(BlockOutput):
    """One of the two outputs of `gg.quantize_columns`: the transposed copy (an fp8 aux output) or
    its scales (fp32, one per column and block of rows). Returned from the epilogue under aux
    names; not values to compute with."""

    def _error(self) -> RecipeError:
        return RecipeError(f"gg.quantize_columns(...) gives outputs, not values to compute with: return them, "
                           f"{COLUMN_BLOCKS_EXAMPLE}")

    def __repr__(self) -> str:
        return f"gemmgen.quantize_columns({self.stat!r}, block={self.block})[{int(self.factor)}]"


COLUMN_BLOCKS_EXAMPLE = ("q_t, scale_t = gg.quantize_columns(y); return {'d': y, 'y_t': q_t, 'y_t_scale': scale_t}, "
                         "declared with aux={'y_t': gg.e4m3, 'y_t_scale': gg.f32}")


def quantize_columns(x: Any, block: int = 128, power_of_two: bool = False
                     ) -> tuple[ColumnBlockOutput, ColumnBlockOutput]:
    """(copy, scales): x stored transposed, (N, M) with M contiguous, and quantized per `block`
    rows of each column by gg.quantize's rule: the K-major copy a weight-gradient GEMM reads, whose
    K is D's rows (the tokens). Its scales (N, ceil(M / block)) are in the layout a block-scaled
    GEMM reads its operands' along K. Return both under aux names declared in an fp8 type and
    gg.f32; D and other outputs are written as well. block=128 only (a CTA's tile of rows).
    `power_of_two` rounds each scale up to a power of two, as gg.quantize's does."""
    if block != 128 or isinstance(block, bool):
        raise RecipeError(f"quantize_columns: block={block!r}; expected 128 rows (DeepSeek-V3's 128 x 1 blocks)")
    v = _reduced_value(x, "quantize_columns")
    pow2, call = _flag(power_of_two, "quantize_columns", "power_of_two"), object()
    return (ColumnBlockOutput(BlockOp.QUANTIZE, v, v, block, 0.0, call, factor=False, power_of_two=pow2),
            ColumnBlockOutput(BlockOp.QUANTIZE, v, v, block, 0.0, call, factor=True, power_of_two=pow2))


def _flag(value: Any, op_name: str, arg: str) -> bool:
    if not isinstance(value, bool):
        raise RecipeError(f"{op_name}: {arg}={value!r}; expected True or False")
    return value


def rms_norm(x: Any, block: int, eps: float = 1e-6, weight: Any = None) -> tuple[BlockOutput, BlockOutput]:
    """(values, rstd): D = x / sqrt(mean(x^2) + eps) per `block` columns of each row, times `weight`
    (a gg.RowVector of N values, or None): an RMSNorm over each head of `block` columns (head-wise
    RMSNorm, the QK-norm of Qwen3 and OLMo 2) computed in the GEMM's epilogue, the heads' statistic
    reduced there. rstd (M, N / block), each head's 1 / sqrt(mean(x^2) + eps), is an optional aux
    output (declared gg.f32: what the norm's backward needs). A partial last head (N not a multiple
    of `block`) is normalized over its own columns."""
    width = _block_width(block, "rms_norm")
    stat = _reduced_value(x, "rms_norm")
    value = stat if weight is None else _binary(Op.MUL, stat, weight, "rms_norm")
    call, e = object(), _positive(eps, "rms_norm", "eps", "1e-6 (it keeps a head of zeros finite)")
    return (BlockOutput(BlockOp.RMS_NORM, value, stat, width, e, call, factor=False),
            BlockOutput(BlockOp.RMS_NORM, value, stat, width, e, call, factor=True))


def exp_minus_max(x: Any, block: int, scale: float = 1.0) -> tuple[BlockOutput, BlockOutput]:
    """(values, maxima): D = exp(scale * (x - max)) per `block` columns of each row, max the block's
    largest x: a softmax's numerator over each block, never above 1, and each block's max, an
    optional aux output (declared gg.f32) from which blocks combine into a softmax over the row
    (online softmax: multiply a block's values by exp(scale * (max - the row's max))). `scale` is a
    positive number (a temperature's inverse, 1 / sqrt(head dim), log2(e) for an exp2). A NaN in
    a block makes its max NaN, as torch.amax does; a partial last block's max is over its columns."""
    width = _block_width(block, "exp_minus_max")
    v = _reduced_value(x, "exp_minus_max")
    call, s = object(), _positive(scale, "exp_minus_max", "scale", "1.0 (a positive scale keeps every value at most 1)")
    return (BlockOutput(BlockOp.EXP, v, v, width, s, call, factor=False),
            BlockOutput(BlockOp.EXP, v, v, width, s, call, factor=True))


def _positive(value: Any, op_name: str, arg: str, example: str) -> float:
    """`value` as the kernel's fp32 constant, which must be positive and finite."""
    v = f32(constant(value, f"{op_name} {arg}"))
    if not (v > 0 and math.isfinite(v)):
        raise RecipeError(f"{op_name}: {arg}={value!r}; expected a positive number such as {example}")
    return v

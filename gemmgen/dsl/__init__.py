"""What a user writes: operand declarations, traced epilogue values and ops, and `Recipe`."""

from .backward import OperandGradient
from .blocks import BlockOutput, ColumnBlockOutput, exp_minus_max, quantize, quantize_columns, rms_norm
from .operands import ColVector, Matrix, OperandDecl, RowVector, Scalar, Seed
from .recipe import DEEPSEEK_BLOCK_SCALE, Backward, Recipe
from .values import (
    OPS,
    Reduced,
    Value,
    abs,
    amax,
    cast,
    clamp,
    column_index,
    cos,
    eq,
    erf,
    exp,
    gather,
    ge,
    gelu,
    gelu_tanh,
    gt,
    interleave,
    le,
    leaky_relu,
    logsumexp,
    lt,
    max,
    maximum,
    min,
    minimum,
    ne,
    pairs,
    rand,
    reduce_max,
    reduce_min,
    relu,
    row_index,
    sigmoid,
    silu,
    sin,
    stochastic_round,
    sum,
    tanh,
    where,
)

__all__ = [
    "DEEPSEEK_BLOCK_SCALE", "OPS", "Backward", "ColVector", "Matrix", "OperandDecl", "OperandGradient", "BlockOutput",
    "ColumnBlockOutput",
    "Recipe", "Reduced", "RowVector", "Scalar", "Seed", "Value", "abs", "amax", "cast", "clamp", "column_index", "cos",
    "eq", "erf", "exp", "exp_minus_max", "gather", "ge", "gt", "interleave", "le", "lt", "ne", "sin", "where",
    "gelu", "gelu_tanh", "leaky_relu", "logsumexp", "max", "maximum", "min", "minimum", "pairs", "quantize",
    "quantize_columns", "rand",
    "rms_norm", "reduce_max", "reduce_min", "relu", "row_index", "sigmoid", "silu", "stochastic_round", "sum", "tanh"
]

"""The epilogue IR (`graph`), its op table (`ops`), its meaning in torch (`reference`) and its
derivative (`autodiff`)."""

from .columns import Columns
from .graph import (
    BLOCK_SCALE_OPERANDS,
    EXTREMA,
    LSE_IDENTITY,
    BlockOp,
    ColumnBlocks,
    EpilogueIR,
    GemmSpec,
    Node,
    Operand,
    Output,
    RecipeIR,
    Reduction,
    RowBlocks,
    content_key,
    f32,
    f32_bits,
    microscaling_operands,
    normalize,
    post_order,
)
from .ops import BINARY_OPS, UNARY_OPS, Op, Param

__all__ = ["BINARY_OPS", "BLOCK_SCALE_OPERANDS", "EXTREMA", "BlockOp", "ColumnBlocks", "Columns", "EpilogueIR",
           "GemmSpec", "LSE_IDENTITY", "Node", "Op", "Operand", "Output", "Param", "RecipeIR", "Reduction", "RowBlocks",
           "UNARY_OPS", "content_key", "f32", "f32_bits", "microscaling_operands", "normalize", "post_order"]

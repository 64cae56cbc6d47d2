"""Operand declarations: what a recipe's epilogue reads besides the accumulator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import RecipeError
from ..ir import Operand, f32
from ..types import DType, OperandKind, as_dtype

_VECTOR_DTYPES = (DType.BF16, DType.F16, DType.F32)


@dataclass(frozen=True)
class Scalar:
    """A scalar operand: a runtime fp32 value, or a compile-time constant when `value` is given."""

    value: float | None = None
    dtype: DType = DType.F32
    kind = OperandKind.SCALAR


@dataclass(frozen=True)
class RowVector:
    """One value per output column (length N), e.g. a bias. Shared by every batch."""

    dtype: DType
    kind = OperandKind.ROW


@dataclass(frozen=True)
class ColVector:
    """One value per output row (length M), e.g. a per-token scale. Shared by every batch."""

    dtype: DType
    kind = OperandKind.COL


@dataclass(frozen=True)
class Matrix:
    """A full M x N input (C, a residual), batched like D."""

    dtype: DType
    kind = OperandKind.MATRIX


OperandDecl = Scalar | RowVector | ColVector | Matrix
RESERVED_NAMES = ("acc", "a", "b", "d", "out", "offsets")


def constant(x: Any, what: str) -> float:
    """A compile-time constant: a Python number, rounded to fp32."""
    import numbers

    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return f32(x)
    raise RecipeError(f"{what}: expected a compile-time constant (a Python number), got {type(x).__name__}; "
                      "runtime values cannot be used here")


def check_operand(name: str, decl: Any) -> Operand | float:
    if not name.isidentifier() or name in RESERVED_NAMES:
        raise RecipeError(f"operand {name!r}: names must be Python identifiers other than acc, a, b, d, out, "
                          "offsets")
    if not isinstance(decl, Scalar | RowVector | ColVector | Matrix):
        raise RecipeError(f"operand {name!r}: expected gg.Scalar(), gg.RowVector(dtype), gg.ColVector(dtype) or "
                          f"gg.Matrix(dtype), got {decl!r}")
    if isinstance(decl, Scalar):
        if decl.value is not None:
            return constant(decl.value, f"operand {name!r} constant value")
        if as_dtype(decl.dtype, f"operand {name!r} dtype") is not DType.F32:
            raise RecipeError(f"operand {name!r}: runtime scalars are fp32; declare gg.Scalar() (dtype f32)")
        return Operand(name, OperandKind.SCALAR, DType.F32)
    dtype = as_dtype(decl.dtype, f"operand {name!r} dtype")
    if dtype not in _VECTOR_DTYPES:
        raise RecipeError(f"operand {name!r}: {decl.kind.value} operands may be bf16, f16 or f32, not {dtype.value}")
    return Operand(name, decl.kind, dtype)


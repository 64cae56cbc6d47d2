"""Operand declarations: what a recipe's epilogue reads besides the accumulator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import RecipeError
from ..ir import Operand, f32
from ..types import DType, OperandKind, as_dtype

_MATRIX_DTYPES = (DType.BF16, DType.F16, DType.F32)
_VECTOR_DTYPES = (*_MATRIX_DTYPES, DType.I32)  # i32: indices (gemmgen.gather)


@dataclass(frozen=True)
class Scalar:
    """A scalar operand: a runtime fp32 value, or a compile-time constant when `value` is given.
    A call passes a runtime scalar as a Python number; with `tensor`, as a one-element fp32 tensor
    on the kernel's device that the kernel reads at launch (a scale computed on the GPU: no device
    sync, and a CUDA graph replays with the value it holds then); a grouped recipe's, one per group:
    a (groups,) tensor (`s.expand(groups)` shares one). With `per_batch` (a batched recipe's), one
    fp32 per batch: an (L,) tensor."""

    value: float | None = None
    dtype: DType = DType.F32
    per_batch: bool = False
    tensor: bool = False
    kind = OperandKind.SCALAR


@dataclass(frozen=True)
class RowVector:
    """One value per output column (length N), e.g. a bias. Shared by every batch, or with
    `per_batch` (a batched recipe's) one vector per batch: (L, N)."""

    dtype: DType
    per_batch: bool = False
    kind = OperandKind.ROW


@dataclass(frozen=True)
class ColVector:
    """One value per output row (length M), e.g. a per-token scale. Shared by every batch, or with
    `per_batch` (a batched recipe's) one vector per batch: (L, M)."""

    dtype: DType
    per_batch: bool = False
    kind = OperandKind.COL


@dataclass(frozen=True)
class Matrix:
    """A full M x N input (C, a residual), batched like D; with `per_batch=False` (a batched
    recipe's) one M x N matrix shared by every batch."""

    dtype: DType
    per_batch: bool = True
    kind = OperandKind.MATRIX


@dataclass(frozen=True)
class Seed:
    """The seed of the epilogue's random numbers (`gemmgen.rand`, `gemmgen.stochastic_round`): a
    call passes a Python int in [0, 2^63), or a one-element int64 tensor on the kernel's device,
    which the kernel reads at launch (a CUDA graph replays with the value it holds then)."""

    kind = OperandKind.SEED


OperandDecl = Scalar | RowVector | ColVector | Matrix | Seed
RESERVED_NAMES = ("acc", "a", "b", "d", "out", "offsets")


def constant(x: Any, what: str) -> float:
    """A compile-time constant: a Python number, rounded to fp32."""
    import numbers

    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return f32(x)
    raise RecipeError(f"{what}: expected a compile-time constant (a Python number), got {type(x).__name__}; "
                      "runtime values cannot be used here")


def check_operand(name: str, decl: Any, batched: bool, grouped: bool) -> Operand | float:
    """The IR operand (or a constant's fp32 value) of one declaration in a recipe whose GEMM is
    `batched` or `grouped`."""
    if not name.isidentifier() or name in RESERVED_NAMES:
        raise RecipeError(f"operand {name!r}: names must be Python identifiers other than acc, a, b, d, out, "
                          "offsets")
    if not isinstance(decl, Scalar | RowVector | ColVector | Matrix | Seed):
        raise RecipeError(f"operand {name!r}: expected gg.Scalar(), gg.RowVector(dtype), gg.ColVector(dtype), "
                          f"gg.Matrix(dtype) or gg.Seed(), got {decl!r}")
    if isinstance(decl, Seed):
        if grouped:
            raise RecipeError(f"operand {name!r}: random numbers (gg.Seed) in a grouped GEMM are not supported yet "
                              "(a group's kernel numbers its rows from the group's first); declare the recipe "
                              "without grouped=True")
        return Operand(name, OperandKind.SEED, DType.I64)
    per_batch = _per_batch(name, decl, batched, grouped)
    if isinstance(decl, Scalar):
        if decl.value is not None:
            if per_batch or decl.tensor is True:
                raise RecipeError(f"operand {name!r}: a compile-time constant is fixed when the kernel is built; "
                                  "drop per_batch= and tensor=, or drop value= to pass the scalar at run time")
            return constant(decl.value, f"operand {name!r} constant value")
        if as_dtype(decl.dtype, f"operand {name!r} dtype") is not DType.F32:
            raise RecipeError(f"operand {name!r}: runtime scalars are fp32; declare gg.Scalar() (dtype f32)")
        return Operand(name, OperandKind.SCALAR, DType.F32, per_batch=per_batch or _tensor(name, decl))
    dtype = as_dtype(decl.dtype, f"operand {name!r} dtype")
    allowed = _MATRIX_DTYPES if isinstance(decl, Matrix) else _VECTOR_DTYPES
    if dtype not in allowed:
        raise RecipeError(f"operand {name!r}: {decl.kind.value} operands may be "
                          f"{', '.join(d.value for d in allowed)}, not {dtype.value}")
    return Operand(name, decl.kind, dtype, per_batch=per_batch)


def _tensor(name: str, decl: Scalar) -> bool:
    """A runtime scalar passed as a tensor (`Scalar.tensor`): in the IR a scalar per batch, read
    through its pointer (a non-batched GEMM's one batch: a one-element tensor; a grouped GEMM's
    batches are its groups, whose index the kernel's epilogue reads it at)."""
    if not isinstance(decl.tensor, bool):
        raise RecipeError(f"operand {name!r}: tensor must be True or False, got {decl.tensor!r}")
    return decl.tensor


def _per_batch(name: str, decl: Scalar | RowVector | ColVector | Matrix, batched: bool, grouped: bool) -> bool:
    """An operand's `per_batch`: a scalar or vector is shared by default and a matrix per batch;
    the other choice needs a batched GEMM's batches."""
    default = isinstance(decl, Matrix)
    per_batch = decl.per_batch
    if not isinstance(per_batch, bool):
        raise RecipeError(f"operand {name!r}: per_batch must be True or False, got {per_batch!r}")
    if per_batch == default:
        return per_batch
    what = f"per_batch={per_batch}"
    if grouped:
        raise RecipeError(f"operand {name!r}: {what} in a grouped GEMM, whose groups are not batches: its row vectors "
                          f"are already per group (G, N), its column vectors and matrices per row of A; drop {what}")
    if not batched:
        one = "one matrix shared by every batch" if default else "one value per batch of A and B"
        raise RecipeError(f"operand {name!r}: {what} ({one}) needs a batched GEMM; declare the recipe with "
                          f"batched=True, or drop {what}")
    return per_batch


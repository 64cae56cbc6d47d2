"""Element types, layouts and operand kinds shared by every layer.

Enum values are stable strings: they enter cache keys and generated file names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import RecipeError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _DTypeInfo:
    bits: int
    cutlass: str
    torch_name: str


class DType(enum.Enum):
    """Element types gemmgen can declare. fp8 (e4m3, e5m2) is for A and B, i32 for row and column
    vectors (indices: `gemmgen.gather`), i64 for random seeds (`gemmgen.Seed`), e2m1 (fp4, two per
    byte: torch's float4_e2m1fn_x2) for NVFP4's A and B, ue8m0 and ue4m3 for the scales of
    microscaled A and B (`Microscaling`); the rest for everything."""

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    I32 = "i32"
    I64 = "i64"
    UE8M0 = "ue8m0"
    E2M1 = "e2m1"
    UE4M3 = "ue4m3"

    @property
    def info(self) -> _DTypeInfo:
        return _DTYPE_INFO[self]

    @property
    def bits(self) -> int:
        return self.info.bits

    @property
    def nbytes(self) -> int:
        """Bytes per element (0 for the packed fp4: `packed`)."""
        return self.info.bits // 8

    @property
    def packed(self) -> int:
        """Elements per byte of its torch tensors: 2 for fp4 (torch's float4_e2m1fn_x2 holds a pair,
        the even element in the low nibble, as CUTLASS packs them), else 1."""
        return 2 if self.info.bits == 4 else 1

    @property
    def cutlass(self) -> str:
        """The CUTLASS C++ element type."""
        return self.info.cutlass

    @property
    def torch(self) -> torch.dtype:  # torch is imported lazily (no import-time side effects)
        dtype = _TORCH_DTYPES.get(self)
        if dtype is None:  # once per member: the host path reads this several times per new call
            import torch

            dtype = _TORCH_DTYPES[self] = getattr(torch, self.info.torch_name)
        return dtype

    def __repr__(self) -> str:
        return f"gemmgen.{self.value}"


_DTYPE_INFO = {
    DType.BF16: _DTypeInfo(16, "cutlass::bfloat16_t", "bfloat16"),
    DType.F16: _DTypeInfo(16, "cutlass::half_t", "float16"),
    DType.F32: _DTypeInfo(32, "float", "float32"),
    DType.E4M3: _DTypeInfo(8, "cutlass::float_e4m3_t", "float8_e4m3fn"),
    DType.E5M2: _DTypeInfo(8, "cutlass::float_e5m2_t", "float8_e5m2"),
    DType.I32: _DTypeInfo(32, "int32_t", "int32"),
    DType.I64: _DTypeInfo(64, "int64_t", "int64"),
    DType.UE8M0: _DTypeInfo(8, "cutlass::float_ue8m0_t", "float8_e8m0fnu"),
    DType.E2M1: _DTypeInfo(4, "cutlass::float_e2m1_t", "float4_e2m1fn_x2"),
    # torch has no unsigned e4m3: NVFP4's scales are float8_e4m3fn tensors of non-negative values
    DType.UE4M3: _DTypeInfo(8, "cutlass::float_ue4m3_t", "float8_e4m3fn"),
}

_TORCH_DTYPES: dict[DType, torch.dtype] = {}

#: bfloat16 (`torch.bfloat16`).
bf16 = DType.BF16
#: IEEE half precision (`torch.float16`); `fp16` is the same.
f16 = fp16 = DType.F16
#: IEEE single precision (`torch.float32`), as D, aux outputs and reductions; `fp32` is the same.
f32 = fp32 = DType.F32
#: fp8 with 4 exponent and 3 mantissa bits (`torch.float8_e4m3fn`; largest finite value 448).
e4m3 = DType.E4M3
#: fp8 with 5 exponent and 2 mantissa bits (`torch.float8_e5m2`; largest finite value 57344).
e5m2 = DType.E5M2
#: fp4 (NVFP4's values: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte (`torch.float4_e2m1fn_x2`).
e2m1 = DType.E2M1
#: int32 (`torch.int32`): index vectors, such as `gemmgen.gather`'s.
i32 = DType.I32


class Microscaling(enum.Enum):
    """A microscaled format of A and B, scaled by sm_100a's block-scaled tcgen05 MMA itself: one
    scale per `vector` consecutive K values of each row of A and each column of B, read from tensor
    memory by the MMA (no rescaling in registers). MXFP8 (OCP MX): fp8 values, a power of two
    (UE8M0) per 32. NVFP4: fp4 (e2m1) values, an unsigned e4m3 per 16 (a per-tensor fp32 scale,
    where one is used, goes in the epilogue: `gemmgen.nvfp4_tensor_scale`)."""

    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @property
    def vector(self) -> int:
        """Values of K per scale."""
        return 32 if self is Microscaling.MXFP8 else 16

    @property
    def scale_dtype(self) -> DType:
        return DType.UE8M0 if self is Microscaling.MXFP8 else DType.UE4M3

    @property
    def elements(self) -> tuple[DType, ...]:
        """The element types of A and B it scales."""
        return (DType.E4M3, DType.E5M2) if self is Microscaling.MXFP8 else (DType.E2M1,)

    def __repr__(self) -> str:
        return f"gemmgen.{self.name}"


#: OCP MX fp8 (`block_scale=gemmgen.MXFP8`, sm_100a): e4m3 or e5m2 values, a UE8M0 scale per 32 values of K.
MXFP8 = Microscaling.MXFP8
#: NVIDIA's fp4 (`block_scale=gemmgen.NVFP4`, sm_100a): e2m1 values, an unsigned e4m3 scale per 16 values of K.
NVFP4 = Microscaling.NVFP4


class Layout(enum.Enum):
    """Memory order of a 2-D operand (the innermost two dims of a batched tensor)."""

    ROW = "row"  # last dim contiguous
    COL = "col"  # first dim contiguous

    @property
    def cutlass(self) -> str:
        return "cutlass::layout::RowMajor" if self is Layout.ROW else "cutlass::layout::ColumnMajor"

    @property
    def transposed(self) -> Layout:
        """The layout of the transposed matrix over the same memory."""
        return Layout.COL if self is Layout.ROW else Layout.ROW


class Grouping(enum.Enum):
    """What a grouped GEMM's groups split (`Recipe(grouped=...)`): `ROWS`, the MoE forward's and
    dgrad's (each group's rows of A through its own B: D is T x N); `K`, the experts' weight
    gradient's (each group's K, its tokens, into its own D: D is G x M x N, with no padding of a
    group's tokens)."""

    ROWS = "rows"
    K = "k"


#: Row-major: the last dim contiguous.
RowMajor = Layout.ROW
#: Column-major: dim -2 contiguous (a row-major tensor's `.mT`).
ColMajor = Layout.COL


class OperandKind(enum.Enum):
    """How an operand is indexed: epilogue operands against the M x N output, block scales
    against A's rows and K (`SCALE_A`) or B's columns and K (`SCALE_B`)."""

    SCALAR = "scalar"  # one value
    ROW = "row"  # one value per output column: length N (e.g. bias)
    COL = "col"  # one value per output row: length M (e.g. per-token scale)
    MATRIX = "matrix"  # full M x N (e.g. C or a residual)
    SCALE_A = "scale_a"  # per block of A's rows and K, read by the main loop (GemmSpec.block_scale, .microscaling)
    SCALE_B = "scale_b"  # per block of B's K and columns
    SEED = "seed"  # a random stream's seed: 64 bits, a Python int or a device int64 (gemmgen.rand)

    @property
    def transposed(self) -> OperandKind:
        """The kind indexing the transposed problem the same way: rows and columns trade places,
        and so do A and B."""
        return {OperandKind.ROW: OperandKind.COL, OperandKind.COL: OperandKind.ROW,
                OperandKind.SCALE_A: OperandKind.SCALE_B, OperandKind.SCALE_B: OperandKind.SCALE_A}.get(self, self)

    @property
    def block_scale(self) -> bool:
        return self in (OperandKind.SCALE_A, OperandKind.SCALE_B)


def as_dtype(value: object, what: str) -> DType:
    """Accept a DType, its string value, or a torch dtype; raise RecipeError naming `what` otherwise."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        for d in DType:
            if value == d.value or value == d.info.torch_name:
                return d
    else:
        name = getattr(value, "__str__", lambda: "")().removeprefix("torch.")
        for d in DType:
            if name == d.info.torch_name:
                return d
    names = ", ".join(d.value for d in DType)
    raise RecipeError(f"{what}: expected a gemmgen dtype ({names}), got {value!r}")


def as_layout(value: object, what: str) -> Layout:
    if isinstance(value, Layout):
        return value
    if isinstance(value, str) and value.lower() in ("row", "col", "column", "r", "c"):
        return Layout.ROW if value.lower().startswith("r") else Layout.COL
    raise RecipeError(f"{what}: expected gemmgen.RowMajor or gemmgen.ColMajor ('row'/'col'), got {value!r}")

"""gemmgen: fused GEMM kernels for Hopper, declared in Python, emitted as CUTLASS 3.x, compiled by NVRTC."""

from typing import Any

from ._version import __version__
from .bundle import add_bundle
from .config import KernelConfig, Schedule, TileScheduler
from .dsl import (
    DEEPSEEK_BLOCK_SCALE,
    OPS,
    ColVector,
    Matrix,
    Recipe,
    RowVector,
    Scalar,
    Value,
    abs,
    amax,
    cast,
    clamp,
    exp,
    gelu,
    gelu_tanh,
    leaky_relu,
    max,
    maximum,
    min,
    minimum,
    reduce_max,
    reduce_min,
    relu,
    sigmoid,
    silu,
    sum,
    tanh,
)
from .errors import (
    CompileError,
    ConfigError,
    GemmgenError,
    InvalidArgument,
    KernelNotAvailable,
    LayoutMismatch,
    NotDeterministic,
    RecipeError,
    ToolchainError,
)
from .errors import UnknownOpError as _UnknownOpError
from .parallel import build_bundle, warmup
from .quantize import quantize_blockwise
from .tuning import add_tuning, autotune
from .types import ColMajor, DType, Layout, OperandKind, RowMajor, bf16, e4m3, e5m2, f16, f32, fp16, fp32

__all__ = [
    "DEEPSEEK_BLOCK_SCALE", "OPS", "ColMajor", "ColVector", "CompileError", "ConfigError", "DType", "GemmgenError",
    "InvalidArgument", "KernelConfig", "KernelNotAvailable", "Layout", "LayoutMismatch", "Matrix", "NotDeterministic",
    "OperandKind", "Recipe", "RecipeError", "RowMajor", "RowVector", "Scalar", "Schedule", "TileScheduler",
    "ToolchainError", "Value", "__version__", "abs", "add_bundle", "amax", "add_tuning", "autotune", "bf16",
    "build_bundle", "cast", "clamp", "e4m3", "e5m2", "exp", "f16", "f32", "fp16", "fp32", "gelu", "gelu_tanh",
    "leaky_relu", "max", "maximum", "min", "minimum", "quantize_blockwise", "reduce_max", "reduce_min", "relu",
    "sigmoid", "silu", "sum", "tanh", "warmup",
]


def __getattr__(name: str) -> Any:
    """`gemmgen.nn` and `gemmgen.op` load torch integration lazily; `gg.softplus` and friends name
    the op that does not exist and list the ones that do."""
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    if name == "op":
        from .integrations.ops import op

        return op
    if name.startswith("_"):
        raise AttributeError(name)
    raise _UnknownOpError(f"gemmgen has no op or name {name!r}; epilogue ops are: {', '.join(OPS)}")

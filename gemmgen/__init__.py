"""gemmgen: fused GEMM kernels for Hopper (sm_90a) and Blackwell (sm_100a), declared in Python,
emitted as CUTLASS 3.x, compiled by NVRTC.

The layers, bottom up: `ir` (the epilogue IR and its op table), `config` (kernel configs),
`codegen` (per architecture), `compile` (NVRTC, cache, bundles), `runtime` (calling kernels from
torch), `dsl` (`Recipe`), `tuning` (which config a call launches), `aot` (warm-up, bundles),
and the integrations: `integrations` (torch ops), `training` (low-precision recipes), `nn`
(modules), `cli`.

Importing gemmgen imports no torch: the torch integration (`gemmgen.op`, `gemmgen.nn`,
`gemmgen.training`, `gemmgen.quantize_blockwise`, `gemmgen.quantize_mx`) loads when first used.
"""

import typing as _typing
from types import ModuleType as _ModuleType

from ._version import __version__
from .aot import add_bundle, build_bundle, unfused_report, warmup
from .compile import CompiledKernel
from .config import Arch, EpilogueCollective, KernelConfig, Schedule, TileScheduler
from .dsl import (
    DEEPSEEK_BLOCK_SCALE,
    OPS,
    Backward,
    ColVector,
    Matrix,
    OperandGradient,
    Recipe,
    RowVector,
    Scalar,
    Seed,
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
    exp_minus_max,
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
    quantize,
    quantize_columns,
    rand,
    reduce_max,
    reduce_min,
    relu,
    rms_norm,
    row_index,
    sigmoid,
    silu,
    sin,
    stochastic_round,
    sum,
    tanh,
    where,
)
from .errors import (
    CompileError,
    ConfigError,
    GemmgenError,
    GemmgenWarning,
    InvalidArgument,
    KernelNotAvailable,
    LayoutMismatch,
    NotDeterministic,
    RecipeError,
    ToolchainError,
)
from .errors import UnknownOpError as _UnknownOpError
from .tuning import add_tuning, autotune
from .types import (
    MXFP8,
    NVFP4,
    ColMajor,
    DType,
    Grouping,
    Layout,
    Microscaling,
    OperandKind,
    RowMajor,
    bf16,
    e2m1,
    e4m3,
    e5m2,
    f16,
    f32,
    fp16,
    fp32,
    i32,
)

if _typing.TYPE_CHECKING:  # loaded on first use by __getattr__: they import torch
    from . import nn, training
    from .integrations.ops import op
    from .runtime.grouped import GroupedKernel
    from .runtime.kernel import Kernel
    from .runtime.quantize import (
        k_grouped_copy,
        nvfp4_tensor_scale,
        quantize_blockwise,
        quantize_k_grouped,
        quantize_mx,
        to_blocked_scales,
    )

__all__ = [
    "DEEPSEEK_BLOCK_SCALE", "MXFP8", "NVFP4", "OPS", "Arch", "Backward", "ColMajor", "ColVector", "CompileError",
    "CompiledKernel", "ConfigError", "DType", "EpilogueCollective", "GemmgenError", "GemmgenWarning", "GroupedKernel",
    "Grouping",
    "InvalidArgument",
    "Kernel", "KernelConfig", "KernelNotAvailable", "Layout", "LayoutMismatch", "Matrix", "Microscaling",
    "NotDeterministic", "OperandGradient", "OperandKind", "Recipe", "RecipeError", "RowMajor", "RowVector",
    "Scalar", "Schedule", "Seed", "TileScheduler", "ToolchainError", "Value", "__version__", "abs", "add_bundle",
    "add_tuning", "amax", "autotune", "bf16", "build_bundle", "cast", "clamp", "column_index", "e2m1", "e4m3", "e5m2",
    "cos", "eq", "erf", "exp", "exp_minus_max", "gather", "ge", "gt", "interleave", "le", "lt", "ne", "sin",
    "where", "f16", "f32", "fp16", "fp32", "i32", "gelu", "gelu_tanh", "leaky_relu", "logsumexp", "max", "maximum",
    "k_grouped_copy", "min", "minimum", "nn", "nvfp4_tensor_scale", "op", "pairs", "quantize", "quantize_blockwise",
    "quantize_columns",
    "quantize_k_grouped", "quantize_mx",
    "rand", "reduce_max",
    "reduce_min", "relu", "rms_norm", "row_index", "sigmoid", "silu", "stochastic_round", "sum", "tanh",
    "to_blocked_scales", "training", "unfused_report", "warmup"
]

_LAZY = {"nn": ("gemmgen.nn", None), "training": ("gemmgen.training", None), "op": ("gemmgen.integrations.ops", "op"),
         "Kernel": ("gemmgen.runtime.kernel", "Kernel"), "GroupedKernel": ("gemmgen.runtime.grouped", "GroupedKernel"),
         "quantize_blockwise": ("gemmgen.runtime.quantize", "quantize_blockwise"),
         "quantize_k_grouped": ("gemmgen.runtime.quantize", "quantize_k_grouped"),
         "k_grouped_copy": ("gemmgen.runtime.quantize", "k_grouped_copy"),
         "quantize_mx": ("gemmgen.runtime.quantize", "quantize_mx"),
         "nvfp4_tensor_scale": ("gemmgen.runtime.quantize", "nvfp4_tensor_scale"),
         "to_blocked_scales": ("gemmgen.runtime.quantize", "to_blocked_scales")}


def __getattr__(name: str) -> _typing.Any:
    """The torch integration, loaded lazily; `gg.softplus` and friends name the op that does not
    exist and list the ones that do."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        loaded = importlib.import_module(module)
        return loaded if attr is None else getattr(loaded, attr)
    if name.startswith("_"):
        raise AttributeError(name)
    raise _UnknownOpError(f"gemmgen has no op or name {name!r}; epilogue ops are: {', '.join(OPS)}")


def __dir__() -> list[str]:
    """What `dir(gemmgen)` and tab completion show: `__all__` (the lazy torch integration too, not
    imported by listing it) and the layers' packages, not the helpers this module imports."""
    layers = (k for k, v in globals().items() if isinstance(v, _ModuleType) and not k.startswith("_"))
    return sorted({*__all__, *layers})

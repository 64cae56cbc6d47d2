"""What gemmgen's modules share: the activations they fuse, the dtypes they compute in (and the
torch math they fall back on where gemmgen has no kernel), the dense outputs they return, and
`RecipeModule`, whose recipes and op callers derive from its fields and whose options are read-only."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import dsl
from ..config import Arch
from ..errors import GemmgenWarning, InvalidArgument, ReadOnlyOption, RecipeError
from ..runtime.driver import current_arch
from .pairs import split_pairs

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)

def _gated(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """fn(gate) * up over adjacent column pairs (`gemmgen.pairs`): the weight's rows interleave the
    gate's and the up projection's (`interleave_pairs`), and the output is half as wide."""
    def gated(x: Any) -> Any:
        gate, up = dsl.pairs(x)
        return fn(gate) * up
    return gated


#: The activations a layer takes (`activation=`), by name: None is none; the gated ones act on column pairs.
ACTIVATIONS = {
    None: lambda x: x,
    "relu": dsl.relu,
    "gelu": dsl.gelu,
    "gelu_tanh": dsl.gelu_tanh,
    "silu": dsl.silu,
    "swiglu": _gated(dsl.silu),
    "geglu": _gated(dsl.gelu),
}
#: The gated activations: a weight of 2 x out_features rows, gate and up interleaved.
GATED = frozenset({"swiglu", "geglu"})


def activation_fn(activation: str | None, gated: bool = False) -> Callable[[Any], Any]:
    """The epilogue function of an activation name (None: identity); RecipeError for another name,
    and for a gated one where the layer takes none (`gated`: FusedLinear and FusedMLP do)."""
    names = sorted(k for k in ACTIVATIONS if k and (gated or k not in GATED))
    if activation in GATED and not gated:
        raise RecipeError(f"activation: {activation!r} is a gated activation (column pairs), which FusedLinear, "
                          f"FusedMLP and GroupedLinear take and this layer does not yet; use one of {names} or None")
    if activation not in ACTIVATIONS:
        raise RecipeError(f"activation: expected one of {names} or None, got {activation!r}")
    return ACTIVATIONS[activation]


def weight_rows(out_features: int, activation: str | None) -> int:
    """Rows of a layer's weight: a gated activation's gate and up rows, interleaved, per output."""
    return 2 * out_features if activation in GATED else out_features


def unsupported(in_features: int, dtype: torch.dtype) -> str | None:
    """Why gemmgen cannot run a Linear of this width in this compute dtype, or None if it can (for
    FusedLinear's errors and fuse's report)."""
    if dtype not in COMPUTE_DTYPES:
        return f"weights are {dtype}; gemmgen computes in bf16/f16 (compute_dtype= casts them per call)"
    per = 16 // torch.empty((), dtype=dtype).element_size()
    if in_features % per:
        return f"in_features {in_features} is not a multiple of {per} (TMA reads x and W in 16-byte rows)"
    return None


def check_layer_dtype(dtype: object) -> torch.dtype:
    """A layer's `dtype=` as its constructor takes it: torch.bfloat16 or torch.float16, as nn.Linear's
    `dtype` is a torch.dtype (not 'bf16' or gemmgen.bf16)."""
    if dtype not in COMPUTE_DTYPES or not isinstance(dtype, torch.dtype):
        got = f"{dtype!r} (a {type(dtype).__name__})" if not isinstance(dtype, torch.dtype) else str(dtype)
        raise InvalidArgument(f"dtype: expected torch.bfloat16 or torch.float16 (gemmgen's layers compute in "
                              f"bf16 or f16), got {got}; pass dtype=torch.bfloat16")
    return dtype


def check_parameter(name: str, t: torch.Tensor, shape: tuple[int, ...], meaning: str) -> None:
    """A parameter a caller may have replaced (`layer.weight = nn.Parameter(...)`) still fits the
    layer, reported in the layer's terms rather than the kernel's."""
    if t.shape != shape:
        raise InvalidArgument(f"{name}: expected shape {shape} = {meaning}, got {tuple(t.shape)}; a replaced "
                              f"{name} must keep the layer's shape (make a new layer for another)")


def check_compute_dtype(compute_dtype: torch.dtype | None) -> None:
    """`compute_dtype` as from_linear and fuse take it: None (the weights' dtype), bf16 or f16."""
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise InvalidArgument(f"compute_dtype: expected torch.bfloat16, torch.float16 or None (the weights' "
                              f"dtype), got {compute_dtype!r}")


class ReadOnlyOptions(nn.Module):
    """A module whose constructor options (`_options`) are read-only once set: its kernels and
    parameters were made for them, so an assignment (`layer.activation = "gelu"`) is refused with a
    ReadOnlyOption naming the option, instead of taking no effect or failing later inside backward."""

    _options: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._options and (name in self.__dict__ or
                                      isinstance(inspect.getattr_static(type(self), name, None), property)):
            raise ReadOnlyOption(f"{type(self).__name__}.{name} is read-only: the layer's kernels and parameters "
                                 f"were made for {name}={getattr(self, name, None)!r}; construct a new layer with "
                                 f"the {name}= argument instead")
        super().__setattr__(name, value)


class RecipeModule(ReadOnlyOptions):
    """A module whose recipes and op callers derive from its fields (`_set_recipes`, resolved once so
    that forward stays traceable by torch.compile, and again after `.to()`, `.half()` and the like,
    which can change the dtype they are for). Pickled without them, as a recipe holds its
    epilogue's lambda: `torch.save(model)`, deepcopy and multiprocessing rebuild them."""

    _derived: tuple[str, ...] = ("recipe", "_op")

    def _set_recipes(self) -> None:
        raise NotImplementedError

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)
        self._set_recipes()
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for derived in self._derived:
            state.pop(derived, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._set_recipes()


def launch_arch(arch: Arch | str | None) -> Arch:
    """The architecture a module's `launches` are for: `arch`, else the current CUDA device's
    (sm_90a without one), as `gemmgen.warmup` has it: the kernels the op launches there."""
    return Arch.parse(arch) if arch is not None else current_arch()


def call_dtypes(x: torch.Tensor, weight_dtype: torch.dtype, fixed: torch.dtype | None
                ) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, output dtype) of a layer's call on `x`, as nn.Linear's would be: under autocast
    on x's device, autocast's dtype for both (autocast leaves fp64 weights alone, and so do we);
    otherwise a `fixed` compute dtype (`compute_dtype=`: weights cast per call) with the output in
    x's dtype, else the weights' dtype for both, where an input of another dtype is an error, as
    for nn.Linear."""
    device = x.device.type
    if weight_dtype != torch.float64 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype, dtype
    if fixed is not None:
        return fixed, x.dtype
    if x.dtype != weight_dtype:
        raise InvalidArgument(f"input: dtype {x.dtype}, but this layer computes in {weight_dtype}; cast the input "
                              f"(input.to({weight_dtype})) or run under torch.autocast, as for nn.Linear")
    return weight_dtype, weight_dtype


def warn_no_kernel(module: nn.Module, dtype: torch.dtype) -> None:
    """Say once per layer and dtype (a GemmgenWarning, which Python's filters show once per
    message) that `module` runs torch's math, not a gemmgen kernel, as gemmgen has none computing
    in `dtype` (fp32, fp64: after `model.float()`, say)."""
    warned = module.__dict__.setdefault("_no_kernel_warned", set())
    if dtype in warned:
        return
    warned.add(dtype)
    warnings.warn(f"{type(module).__name__}: gemmgen has no kernel computing in {dtype} (its kernels compute in "
                  f"torch.bfloat16 or torch.float16), so the layer runs its reference math, torch ops in {dtype}; "
                  f".to(torch.bfloat16) or torch.autocast runs gemmgen's kernels", GemmgenWarning, stacklevel=2)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None) -> torch.Tensor:
    """activation(x @ W^T + b) by torch ops, differentiable, in x's dtype: what a layer computes
    where gemmgen has no kernel for its dtype (a gated activation over the interleaved pairs)."""
    pre = F.linear(x, weight, bias)
    if activation in GATED:
        gate, up = split_pairs(pre, dim=-1)
        return (F.silu(gate) if activation == "swiglu" else F.gelu(gate)) * up
    if activation == "relu":
        return F.relu(pre)
    if activation == "silu":
        return F.silu(pre)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(pre, approximate="tanh" if activation == "gelu_tanh" else "none")
    return pre


def dense_output(y: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A kernel's output as the replaced torch module returns it: `shape`, contiguous, in `dtype`.
    The kernel writes rows whose stride is a multiple of 16 bytes (TMA stores), so an output whose
    last dim is not a multiple of 8 (bf16/f16) comes back padded, a view that `.view()` refuses;
    it is copied here, once: on the GPU an extra read and write of the output, for those widths
    only (a multiple of 8 costs nothing, and so does a cast the call needs anyway)."""
    y = y.reshape(shape)
    if dtype is not None and y.dtype != dtype:
        return y.to(dtype, memory_format=torch.contiguous_format)
    return y if y.is_contiguous() else y.contiguous()


def conv1d_sizes(layer: object) -> tuple[int, int] | None:
    """(in_features, out_features) of transformers' Conv1D (GPT-2's x @ W + b), known by its class
    (its name and module) and 2-d weight (in x out) without importing transformers; None for
    anything else. The one test of what a Conv1D is (fuse's, the layers')."""
    cls = type(layer)
    weight = layer._parameters.get("weight") if isinstance(layer, nn.Module) else None
    if cls.__name__ != "Conv1D" or not cls.__module__.startswith("transformers.") or weight is None \
            or weight.dim() != 2:
        return None
    rows, cols = weight.shape
    return rows, cols

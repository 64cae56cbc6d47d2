"""What gemmgen's modules share: the activations they fuse, the dtypes they compute in, and
`RecipeModule`, whose recipes and op callers derive from its fields."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import dsl
from ..config import Arch
from ..errors import InvalidArgument, RecipeError
from ..runtime.driver import current_arch

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)

def _gated(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """fn(gate) * up over adjacent column pairs (`gemmgen.pairs`): the weight's rows interleave the
    gate's and the up projection's (`interleave_pairs`), and the output is half as wide."""
    def gated(x: Any) -> Any:
        gate, up = dsl.pairs(x)
        return fn(gate) * up
    return gated


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


class RecipeModule(nn.Module):
    """A module whose recipes and op callers derive from its fields (`_set_recipes`, resolved once so
    that forward stays traceable by torch.compile). Pickled without them, as a recipe holds its
    epilogue's lambda: `torch.save(model)`, deepcopy and multiprocessing rebuild them."""

    _derived: tuple[str, ...] = ("recipe", "_op")

    def _set_recipes(self) -> None:
        raise NotImplementedError

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

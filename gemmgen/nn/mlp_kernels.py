"""The kernels a bf16 or f16 FusedMLP launches (`MLPKernels`): each layer's forward, fc1's forward
saving what backward reads, and backward's derived kernel (`mlp_backward`), made once per kind of
module (`mlp_kernels`). The low-precision ones are `low_precision.mlp_gemms`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..dsl import Backward
from ..integrations.ops import OpCaller, caller
from ..types import Layout
from .linear import linear_recipe


@functools.cache
def mlp_backward(activation: str, bias: bool, dtype: torch.dtype, recompute: bool,
                 weight_in_out: bool = False) -> Backward:
    """fc1's derived backward (`Recipe.backward`): for fc2's dgrad GEMM (A = dL/dY, B = W2 as
    stored: out x hidden, row-major; with `weight_in_out`, GPT-2's Conv1D, hidden x out, read as
    a column-major B), reading the saved accumulator; with `recompute`, fc1's own GEMM again,
    reading dL/dh and also writing h (`fwd_d`)."""
    fc1 = linear_recipe(activation, bias, dtype, weight_in_out=weight_in_out)
    if not recompute:
        saving = fc1.backward(layout_b=Layout.COL if weight_in_out else None)
        if not saving.recompute:  # a gated fc1 with a bias recomputes (Recipe.backward)
            return saving
    return fc1.backward(recompute=True, recompute_d=True)


@dataclass(frozen=True)
class MLPKernels:
    """The gemmgen ops a FusedMLP launches computing in one dtype: each layer's forward, fc1's
    forward that also stores what backward reads (`fc1_saving`), and backward's derived kernel
    (`bwd`). Made once per kind (`mlp_kernels`) and captured by each forward, so that backward runs
    what its forward saved for whatever the module's options are by then."""

    backward: Backward
    fc1: OpCaller
    fc1_saving: OpCaller
    bwd: OpCaller
    fc2: OpCaller

    @property
    def recompute(self) -> bool:
        return self.backward.recompute


@functools.cache
def mlp_kernels(activation: str, bias1: bool, bias2: bool, dtype: torch.dtype, recompute: bool,
                weight_in_out: bool = False) -> MLPKernels:
    """A FusedMLP's `MLPKernels` (shared by every module of the same kind); `weight_in_out`: both
    layers' weights stored in x out (GPT-2's Conv1D)."""
    backward = mlp_backward(activation, bias1, dtype, recompute, weight_in_out)
    return MLPKernels(backward, caller(linear_recipe(activation, bias1, dtype, weight_in_out=weight_in_out)),
                      caller(backward.forward), caller(backward.kernel),
                      caller(linear_recipe(None, bias2, dtype, weight_in_out=weight_in_out)))


__all__ = ["MLPKernels", "mlp_backward", "mlp_kernels"]

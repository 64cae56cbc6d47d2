"""The recipe of a Linear layer with its bias and activation, and the activation's backward as the
unfused layers run it: what FusedLinear, FusedMLP and their low-precision steps share."""

from __future__ import annotations

import functools

import torch

from ..dsl import Recipe, RowVector
from ..types import as_dtype
from .base import GATED, activation_fn
from .pairs import interleave_pairs, split_pairs


@functools.cache
def linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype, save_pre_activation: bool = False,
                  weight_in_out: bool = False) -> Recipe:
    """The recipe of a Linear layer (x @ W^T with W stored out x in; with `weight_in_out`, x @ W
    with W stored in x out, as GPT-2's Conv1D holds it: B read N-major) plus bias and activation.
    With `save_pre_activation`, the kernel also stores `pre` (x @ W^T + b, before the activation)
    as an aux output, for the activation's backward: what the unfused Linear's output would have
    been."""
    act = activation_fn(activation, gated=True)
    d = as_dtype(dtype, "dtype")
    name = (f"linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}{'_pre' if save_pre_activation else ''}"
            f"{'_kn' if weight_in_out else ''}")
    kw: dict = {"a": d, "b": d, "d": d, "layout_a": "row", "layout_b": "row" if weight_in_out else "col"}
    if save_pre_activation:
        kw["aux"] = {"pre": d}
    if bias:
        kw["operands"] = {"bias": RowVector(d)}
        if save_pre_activation:
            return Recipe(name, lambda acc, bias: {"d": act(acc + bias), "pre": acc + bias}, **kw)
        return Recipe(name, lambda acc, bias: act(acc + bias), **kw)
    if save_pre_activation:
        return Recipe(name, lambda acc: {"d": act(acc), "pre": acc}, **kw)
    return Recipe(name, lambda acc: act(acc), **kw)


def activation_backward(activation: str, g: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """dL/dpre from dL/dy and the saved pre-activation: the same aten kernels the unfused
    activation module's backward runs (a gated one's on the gate, times up, and act(gate) for up,
    interleaved as the pre-activation's columns are)."""
    if activation in GATED:
        gate, up = split_pairs(pre, dim=-1)
        if activation == "swiglu":
            d_gate, act = torch.ops.aten.silu_backward(g * up, gate), torch.nn.functional.silu(gate)
        else:
            d_gate, act = torch.ops.aten.gelu_backward(g * up, gate), torch.nn.functional.gelu(gate)
        return interleave_pairs(d_gate, g * act, dim=-1)
    if activation == "relu":
        return torch.ops.aten.threshold_backward(g, pre, 0)
    if activation == "silu":
        return torch.ops.aten.silu_backward(g, pre)
    return torch.ops.aten.gelu_backward(g, pre, approximate="tanh" if activation == "gelu_tanh" else "none")


__all__ = ["activation_backward", "linear_recipe"]

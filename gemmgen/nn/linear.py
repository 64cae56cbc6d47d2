"""`FusedLinear`: nn.Linear plus bias and activation as one gemmgen kernel per forward.

    layer = gemmgen.nn.FusedLinear(4096, 14336, activation="silu", dtype=torch.bfloat16)

Forward is `activation(x @ W^T + b)` as one gemmgen op (torch.ops.gemmgen.*): the GPU launches
the fused kernel; elsewhere the op evaluates the recipe's reference. Backward (`_LinearFunction`)
is the unfused layers' own: the activation's aten backward on the stored pre-activation, then the
dgrad/wgrad GEMMs in the parameters' dtype; with `recompute=True` nothing but the inputs is kept,
and backward launches the recipe's derived kernel (the GEMM again, dL/dpre and the bias gradient
in one launch) instead; with `accumulate_grad=True` the weight gradient is added in fp32 into
`weight.main_grad` (`grads.weight_grad`).

A gated activation (`activation="swiglu"` or `"geglu"`: act(gate) * up) takes a weight of
2 x out_features rows, gate and up interleaved (`gemmgen.nn.interleave_pairs(w_gate, w_up)`), and
writes out_features columns from its pairs of accumulator columns (docs/pairs.md).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from .. import tuning
from ..config import Arch, KernelConfig
from ..dsl import Recipe, RowVector
from ..errors import InvalidArgument
from ..integrations.ops import caller
from ..types import as_dtype
from .base import (
    GATED,
    RecipeModule,
    activation_fn,
    check_compute_dtype,
    check_layer_dtype,
    check_parameter,
    launch_arch,
    unsupported,
    weight_rows,
)
from .grads import weight_grad, weight_grad_recipe
from .pairs import interleave_pairs, split_pairs


@functools.cache
def linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype, save_pre_activation: bool = False) -> Recipe:
    """The recipe of a Linear layer (x @ W^T with W stored out x in) plus bias and activation. With
    `save_pre_activation`, the kernel also stores `pre` (x @ W^T + b, before the activation) as an
    aux output, for the activation's backward: what the unfused Linear's output would have been."""
    act = activation_fn(activation, gated=True)
    d = as_dtype(dtype, "dtype")
    name = f"linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}{'_pre' if save_pre_activation else ''}"
    kw: dict = {"a": d, "b": d, "d": d, "layout_a": "row", "layout_b": "col"}
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


def _activation_backward(activation: str, g: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
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


class _LinearFunction(torch.autograd.Function):
    """Forward: the fused kernel (with `pre` stored when the activation needs it for backward).
    Backward: as nn.Linear + activation would run it (the activation's aten backward on `pre`, then
    dgrad/wgrad GEMMs and the bias sum in the parameters' dtype), skipping what nobody asked for.
    With `recompute`, nothing but the inputs is saved, and backward launches the recipe's derived
    kernel (`Recipe.backward(recompute=True)`: the GEMM again, turning dL/dy into dL/dpre and the
    bias gradient in one launch) before the dgrad and wgrad GEMMs."""

    @staticmethod
    def forward(ctx: Any, layer: FusedLinear, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        args = (x, w) if bias is None else (x, w, bias)
        if layer.activation is None or layer.recompute:
            y, pre = layer._op(*args), None
        else:
            assert layer._op_saving_pre is not None, "a layer with an activation has a training recipe"
            y, pre = layer._op_saving_pre(*args)
        ctx.layer, ctx.has_bias = layer, bias is not None
        ctx.save_for_backward(x, w, bias if layer.recompute else None, pre)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        layer: FusedLinear = ctx.layer
        x, w, bias, pre = ctx.saved_tensors
        _, need_x, need_w, need_b = ctx.needs_input_grad
        gb = None
        if layer.activation is None:
            g_pre = g
        elif layer._bwd is not None:  # recompute: the derived kernel
            outs = layer._bwd.by_name(x, w, {"bias": bias, "grad_d": g.contiguous()})
            g_pre = outs["d"]
            # over column pairs the bias gradient, a sum over M, is torch's (below)
            gb = outs["grad_bias"].to(bias.dtype) if ctx.has_bias and need_b and "grad_bias" in outs else None
        else:
            g_pre = _activation_backward(layer.activation, g, pre)
        gx = g_pre @ w.t() if need_x else None
        gw = weight_grad(layer.weight, g_pre, x, layer.accumulate_grad) if need_w else None
        if gb is None and ctx.has_bias and need_b:
            gb = g_pre.sum(0)
        return None, gx, gw, gb


@functools.cache
def linear_backward(activation: str, bias: bool, dtype: torch.dtype) -> Recipe:
    """The derived kernel a recomputing layer's backward launches: its GEMM again, reading dL/dy
    (`grad_d`) and writing dL/dpre and the bias gradient (`Recipe.backward(recompute=True)`)."""
    return linear_recipe(activation, bias, dtype).backward(recompute=True).kernel


def _training_flags(recompute: object, accumulate_grad: object) -> tuple[bool, bool]:
    for name, value in (("recompute", recompute), ("accumulate_grad", accumulate_grad)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name}: expected True or False, got {value!r}")
    return bool(recompute), bool(accumulate_grad)


def _require_supported(in_features: int, dtype: torch.dtype) -> None:
    reason = unsupported(in_features, dtype)
    if reason:
        raise InvalidArgument(f"FusedLinear: {reason}; keep nn.Linear for this layer")


class FusedLinear(RecipeModule):
    """nn.Linear plus activation as one gemmgen kernel. It computes in `compute_dtype` (bf16 or
    f16): the parameters' dtype unless `from_linear` was given another, in which case parameters
    (fp32 master weights, say) are cast to it on every call, as autocast casts nn.Linear's. Like
    nn.Linear under autocast, an input of another dtype is cast only when autocast is on (or the
    parameters are cast anyway); otherwise it is an error, as nn.Linear's would be."""

    weight: torch.Tensor  # as nn.Linear declares them: from_linear shares the Linear's
    bias: torch.Tensor | None
    _derived = ("recipe", "training_recipe", "_op", "_op_saving_pre", "_bwd")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 recompute: bool = False, accumulate_grad: bool = False) -> None:
        super().__init__()
        _require_supported(in_features, check_layer_dtype(dtype))
        activation_fn(activation, gated=True)  # a bad name is refused before anything is allocated
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.compute_dtype = dtype
        self.recompute, self.accumulate_grad = _training_flags(recompute, accumulate_grad)
        rows = weight_rows(out_features, activation)
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device)) if bias else None
        self._set_recipes()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str | None = None,
                    compute_dtype: torch.dtype | None = None, recompute: bool = False,
                    accumulate_grad: bool = False) -> FusedLinear:
        """A FusedLinear sharing `linear`'s parameters (no copy), computing in `compute_dtype`
        (default: the weights' dtype)."""
        if not isinstance(linear, nn.Linear):
            raise InvalidArgument(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        check_compute_dtype(compute_dtype)
        activation_fn(activation, gated=True)
        dtype = compute_dtype or linear.weight.dtype
        _require_supported(linear.in_features, dtype)
        out_features = linear.out_features
        if activation in GATED:
            if out_features % 2:
                raise InvalidArgument(f"linear: {out_features} output features; a gated activation ({activation}) "
                                      "takes its rows in pairs, gate and up interleaved: give a Linear of 2 x F rows "
                                      "(gemmgen.nn.interleave_pairs(w_gate, w_up))")
            out_features //= 2
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features, fused.activation = linear.in_features, out_features, activation
        fused.compute_dtype = dtype
        fused.recompute, fused.accumulate_grad = _training_flags(recompute, accumulate_grad)
        fused.weight = linear.weight
        fused.bias = linear.bias
        fused._set_recipes()
        return fused

    def _set_recipes(self) -> None:
        """The inference recipe and, with an activation, the training one that also stores `pre`."""
        activation, bias, dtype = self.activation, self.bias is not None, self.compute_dtype
        self.recipe = linear_recipe(activation, bias, dtype)
        self.training_recipe = linear_recipe(activation, bias, dtype, save_pre_activation=True) if activation else None
        self._op = caller(self.recipe)
        self._op_saving_pre = caller(self.training_recipe) if self.training_recipe is not None else None
        self._bwd = caller(linear_backward(activation, bias, dtype)) if activation and self.recompute else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, w, bias, lead = self.inputs(x)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, w, bias)):
            y = _LinearFunction.apply(self, x2, w, bias)
        else:
            y = self._op(x2, w) if bias is None else self._op(x2, w, bias)
        return y.reshape(*lead, self.out_features)

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Size]:
        """What the kernel takes for an input x (..., in_features): x as rows (M, in_features), the
        weight as B (W^T, a column-major view) and the bias in the compute dtype
        (`kernel_parameters`), x cast as nn.Linear's input under autocast would be, and x's
        leading dims, to reshape the output with."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgument(f"input: expected a torch.Tensor of shape (..., {self.in_features}), got "
                                  f"{type(x).__name__}")
        w, bias = self.kernel_parameters()
        dtype = self.compute_dtype
        if x.dtype != dtype:
            if self.weight.dtype != dtype or torch.is_autocast_enabled(x.device.type):  # parameters cast anyway
                x = x.to(dtype)
            else:
                raise InvalidArgument(f"input: dtype {x.dtype}, but this layer computes in {dtype}; cast the "
                                      f"input (input.to({dtype})) or run under torch.autocast, as for nn.Linear")
        shape = x.shape
        if not shape or shape[-1] != self.in_features:
            raise self._wrong_input(x)
        lead = shape[:-1]
        try:
            x2 = x.reshape(-1, self.in_features)
        except RuntimeError:  # not a strided tensor
            raise self._wrong_input(x) from None
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return x2, w, bias, lead

    def kernel_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as the kernel's B (W^T, a column-major view) and the bias, checked against
        the layer's shape and cast to the compute dtype (per call, as autocast casts nn.Linear's)."""
        w, bias = self.weight, self.bias
        rows = self.weight_rows
        what = "2 x out_features: gate and up interleaved" if rows != self.out_features else "out_features"
        check_parameter("weight", w, (rows, self.in_features), f"({what}, in_features)")
        if bias is not None:
            check_parameter("bias", bias, (rows,), f"({what},)")
        if w.dtype != self.compute_dtype:
            w = w.to(self.compute_dtype)
            bias = bias.to(self.compute_dtype) if bias is not None else None
        return w.t(), bias

    @property
    def weight_rows(self) -> int:
        """The weight's rows: out_features, or twice that for a gated activation (the GEMM's N)."""
        return weight_rows(self.out_features, self.activation)

    def _wrong_input(self, x: torch.Tensor) -> InvalidArgument:
        return InvalidArgument(f"input: expected a dense tensor of shape (..., {self.in_features}) (in_features), "
                               f"got {x.layout} {tuple(x.shape)}")

    def launches(self, tokens: int, training: bool = False, sm_count: int | None = None,
                 device: tuning.Device | None = None, arch: Arch | str | None = None) -> tuple[Recipe, KernelConfig]:
        """(recipe, config) of the kernel forward launches for an input of `tokens` rows, as the launch
        policy decides (`tuning.choose_launch`) on `arch` (default: the current device's, sm_90a
        without one; `sm_count`: the arch's reference GPU's): with `device`
        (`gemmgen.tuning.Device.current()` on the GPU that will run the model) an autotune result
        registered for it first; `training`: with gradients wanted, when the kernel also stores the
        pre-activation. What to build ahead of time, e.g.
        `gg.warmup([layer.launches(t) for t in (1, 512, 4096)] + [layer.launches(4096, training=True)])`."""
        saving = training and self.training_recipe is not None and not self.recompute
        recipe = self.training_recipe if saving and self.training_recipe is not None else self.recipe
        return recipe, tuning.config_for(recipe, tokens, self.weight_rows, self.in_features, 1, device=device,
                                         sm_count=sm_count, arch=launch_arch(arch))

    def backward_launches(self, tokens: int, sm_count: int | None = None, device: tuning.Device | None = None,
                          arch: Arch | str | None = None) -> list[tuple[Recipe, KernelConfig]]:
        """(recipe, config) of the gemmgen kernels a backward of `tokens` rows launches: the derived
        kernel with `recompute`, the fp32 weight-gradient GEMM with `accumulate_grad`."""
        out = []
        if self._bwd is not None:
            out.append((self._bwd.recipe, (tokens, self.weight_rows, self.in_features)))
        if self.accumulate_grad:
            out.append((weight_grad_recipe(self.compute_dtype), (self.weight_rows, self.in_features, tokens)))
        target = launch_arch(arch)
        return [(r, tuning.config_for(r, *shape, 1, device=device, sm_count=sm_count, arch=target)) for r, shape in out]

    def config_for(self, tokens: int, sm_count: int | None = None, arch: Arch | str | None = None) -> KernelConfig:
        """The config of `launches(tokens)` (inference, no device)."""
        return self.launches(tokens, sm_count=sm_count, arch=arch)[1]

    def extra_repr(self) -> str:
        cast = f", compute_dtype={self.compute_dtype}" if self.weight.dtype != self.compute_dtype else ""
        training = "".join(f", {k}=True" for k in ("recompute", "accumulate_grad") if getattr(self, k))
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}{cast}{training}")

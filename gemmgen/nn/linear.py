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
writes out_features columns from its pairs of accumulator columns (docs/design/pairs.md).

As a drop-in nn.Linear the layer computes in the dtype nn.Linear would (`base.call_dtypes`): its
parameters', following `.to()`, `.half()` and `.float()`, or autocast's; it returns that dtype
(with `compute_dtype=`, the input's), and a contiguous output of nn.Linear's shape. Where gemmgen
has no kernel for that dtype (fp32, fp64) it says so once and runs the same math with torch ops.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import tuning
from ..config import Arch, KernelConfig
from ..dsl import Recipe
from ..errors import InvalidArgument
from ..integrations.ops import OpCaller, caller
from ..training import Precision
from .activations import activation_backward, linear_recipe
from .base import (
    COMPUTE_DTYPES,
    GATED,
    RecipeModule,
    activation_fn,
    call_dtypes,
    check_compute_dtype,
    check_layer_dtype,
    check_parameter,
    conv1d_sizes,
    dense_output,
    launch_arch,
    reference_linear,
    unsupported,
    warn_no_kernel,
    weight_rows,
)
from .grads import accumulating, weight_grad
from .low_precision import (
    LinearGemms,
    LowPrecisionLinear,
    WeightCache,
    check_precision,
    check_recompute,
    forward_operands,
    linear_gemms,
)
from .plan import linear_plan


@dataclass(frozen=True)
class LinearKernels:
    """The gemmgen ops a FusedLinear launches computing in one dtype: forward's (`op`), forward's
    with gradients wanted (`op_saving_pre`: also storing the pre-activation; None without an
    activation) and, with `recompute`, backward's derived kernel (`bwd`). Made once per activation,
    bias, dtype and recompute (`linear_kernels`) and captured by each forward, so that backward
    runs what its forward saved for whatever the layer's options are by then."""

    recipe: Recipe
    training_recipe: Recipe | None
    op: OpCaller
    op_saving_pre: OpCaller | None
    bwd: OpCaller | None


@functools.cache
def linear_kernels(activation: str | None, bias: bool, dtype: torch.dtype, recompute: bool,
                   weight_in_out: bool = False) -> LinearKernels:
    """A FusedLinear's `LinearKernels` (shared by every layer of the same kind)."""
    recipe = linear_recipe(activation, bias, dtype, weight_in_out=weight_in_out)
    training = linear_recipe(activation, bias, dtype, True, weight_in_out) if activation else None
    saving = caller(training) if training is not None and not recompute else None
    bwd = caller(linear_backward(activation, bias, dtype, weight_in_out)) if activation and recompute else None
    return LinearKernels(recipe, training, caller(recipe), saving, bwd)


class _LinearFunction(torch.autograd.Function):
    """Forward: the fused kernel (with `pre` stored when the activation needs it for backward).
    Backward: as nn.Linear + activation would run it (the activation's aten backward on `pre`, then
    dgrad/wgrad GEMMs and the bias sum in the parameters' dtype), skipping what nobody asked for.
    With `recompute`, nothing but the inputs is saved, and backward launches the recipe's derived
    kernel (`Recipe.backward(recompute=True)`: the GEMM again, turning dL/dy into dL/dpre and the
    bias gradient in one launch) before the dgrad and wgrad GEMMs."""

    @staticmethod
    def forward(ctx: Any, layer: FusedLinear, kernels: LinearKernels, accumulate: bool, x: torch.Tensor,
                w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        args = (x, w) if bias is None else (x, w, bias)
        if kernels.op_saving_pre is not None:
            y, pre = kernels.op_saving_pre(*args)
        else:  # no activation, or recompute
            y, pre = kernels.op(*args), None
        ctx.layer, ctx.kernels, ctx.accumulate, ctx.has_bias = layer, kernels, accumulate, bias is not None
        ctx.save_for_backward(x, w, bias if kernels.bwd is not None else None, pre)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        layer: FusedLinear = ctx.layer
        kernels: LinearKernels = ctx.kernels
        x, w, bias, pre = ctx.saved_tensors
        _, _, _, need_x, need_w, need_b = ctx.needs_input_grad
        gb = None
        if layer.activation is None:
            g_pre = g
        elif kernels.bwd is not None:  # recompute: the derived kernel
            outs = kernels.bwd.by_name(x, w, {"bias": bias, "grad_d": g.contiguous()})
            g_pre = outs["d"]
            # over column pairs the bias gradient, a sum over M, is torch's (below)
            gb = outs["grad_bias"].to(bias.dtype) if ctx.has_bias and need_b and "grad_bias" in outs else None
        else:
            g_pre = activation_backward(layer.activation, g, pre)
        gx = g_pre @ w.t() if need_x else None
        gw = weight_grad(layer.weight, g_pre, x, ctx.accumulate, layer.weight_in_out) if need_w else None
        if gb is None and ctx.has_bias and need_b:
            gb = g_pre.sum(0)
        return None, None, None, gx, gw, gb


@functools.cache
def linear_backward(activation: str, bias: bool, dtype: torch.dtype, weight_in_out: bool = False) -> Recipe:
    """The derived kernel a recomputing layer's backward launches: its GEMM again, reading dL/dy
    (`grad_d`) and writing dL/dpre and the bias gradient (`Recipe.backward(recompute=True)`)."""
    return linear_recipe(activation, bias, dtype, weight_in_out=weight_in_out).backward(recompute=True).kernel


def training_flag(name: str, value: object) -> bool:
    """`recompute=` or `accumulate_grad=` as the layers take them: True or False."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}: expected True or False, got {value!r}")
    return value


def require_supported(in_features: int, dtype: torch.dtype) -> None:
    """Refuse a layer of `in_features` that gemmgen cannot run in `dtype`, saying why."""
    reason = unsupported(in_features, dtype)
    if reason:
        raise InvalidArgument(f"FusedLinear: {reason}; keep nn.Linear for this layer")


class FusedLinear(RecipeModule):
    """nn.Linear plus activation as one gemmgen kernel. It computes in its parameters' dtype (bf16
    or f16), following `.to()`, `.half()` and `.float()`, unless `from_linear` was given a
    `compute_dtype`, in which case parameters (fp32 master weights, say) are cast to it on every
    call and the output is in the input's dtype. Like nn.Linear, under autocast it computes in and
    returns autocast's dtype, and otherwise an input of another dtype than the parameters' is an
    error. Where gemmgen has no kernel for the dtype (fp32, fp64 parameters outside autocast) it
    says so once (a GemmgenWarning) and runs the same math with torch ops in that dtype.

    `in_features`, `out_features`, `activation` and `compute_dtype` are read-only (construct a new
    layer for others); `recompute` and `accumulate_grad` may be changed and apply from the next
    forward."""

    weight: torch.Tensor  # as nn.Linear declares them: from_linear shares the Linear's
    bias: torch.Tensor | None
    _derived = ("_kernels",)
    _options = ("in_features", "out_features", "activation", "compute_dtype", "precision", "weight_in_out")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 recompute: bool = False, accumulate_grad: bool = False, precision: Precision | None = None) -> None:
        super().__init__()
        require_supported(in_features, check_layer_dtype(dtype))
        activation_fn(activation, gated=True)  # a bad name is refused before anything is allocated
        self._configure(in_features, out_features, activation, None, recompute, accumulate_grad, precision)
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
                    accumulate_grad: bool = False, precision: Precision | None = None) -> FusedLinear:
        """A FusedLinear sharing `linear`'s parameters (no copy), computing in `compute_dtype`
        (default: the weights' dtype, whatever it becomes), its GEMMs in `precision`."""
        if not isinstance(linear, nn.Linear):
            raise InvalidArgument(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        out_features = cls._checked_linear(linear, activation, compute_dtype)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._configure(linear.in_features, out_features, activation, compute_dtype, recompute, accumulate_grad,
                         precision)
        fused.weight = linear.weight
        fused.bias = linear.bias
        fused._set_recipes()
        return fused

    @classmethod
    def from_conv1d(cls, conv: nn.Module, activation: str | None = None, compute_dtype: torch.dtype | None = None,
                    recompute: bool = False, accumulate_grad: bool = False) -> FusedLinear:
        """A FusedLinear sharing the parameters of transformers' `Conv1D` (GPT-2's x @ W + b, W
        stored in x out): its kernel reads W as it is stored (B N-major), so nothing is transposed
        or copied, and its `weight` stays (in_features, out_features) (`weight_in_out`)."""
        in_features, out_features = cls._checked_conv1d(conv, activation, compute_dtype, "conv")
        weight, bias = conv.get_parameter("weight"), conv._parameters.get("bias")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._configure(in_features, out_features, activation, compute_dtype, recompute, accumulate_grad, None,
                         weight_in_out=True)
        fused.weight = weight
        fused.bias = bias
        fused._set_recipes()
        return fused

    @classmethod
    def sharing(cls, parameters: dict[str, Any], in_features: int, out_features: int, activation: str | None,
                compute_dtype: torch.dtype | None, weight_in_out: bool = False,
                precision: Precision | None = None) -> FusedLinear:
        """A FusedLinear registered nowhere whose `weight` and `bias` are the entries of
        `parameters`: the very dict another module registers its own in (`module._parameters`),
        so that `.to()`, load_state_dict (`assign=True` too) and replaced parameters reach it. How
        a FusedMLP that `fuse` put into a model runs parameters that the model keeps where they were
        (the same state_dict keys). `weight_in_out`: the weight is a Conv1D's (`from_conv1d`)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.__dict__["_parameters"] = parameters
        layer._configure(in_features, out_features, activation, compute_dtype, False, False, precision,
                         weight_in_out=weight_in_out)
        layer._set_recipes()
        return layer

    @staticmethod
    def _checked_conv1d(conv: object, activation: str | None, compute_dtype: torch.dtype | None,
                        name: str) -> tuple[int, int]:
        """(in_features, out_features) of a FusedLinear made of transformers' Conv1D `conv` (the
        argument `name`), after refusing what gemmgen cannot run."""
        sizes = conv1d_sizes(conv)
        if sizes is None:
            raise InvalidArgument(f"{name}: expected transformers' Conv1D (a 2-d weight, in x out), got "
                                  f"{type(conv).__name__}")
        check_compute_dtype(compute_dtype)
        if activation in GATED:
            raise InvalidArgument(f"activation: {activation} reads gate and up interleaved in an out x in weight; a "
                                  "Conv1D takes relu, gelu, gelu_tanh, silu or None")
        activation_fn(activation, gated=True)
        assert isinstance(conv, nn.Module)
        require_supported(sizes[0], compute_dtype or conv._parameters["weight"].dtype)  # type: ignore[union-attr]
        return sizes

    @staticmethod
    def _checked_linear(linear: nn.Linear, activation: str | None, compute_dtype: torch.dtype | None) -> int:
        """The out_features of a FusedLinear made of `linear` (half its rows for a gated activation),
        after refusing what gemmgen cannot run."""
        check_compute_dtype(compute_dtype)
        activation_fn(activation, gated=True)
        require_supported(linear.in_features, compute_dtype or linear.weight.dtype)
        out_features = linear.out_features
        if activation in GATED:
            if out_features % 2:
                raise InvalidArgument(f"linear: {out_features} output features; a gated activation ({activation}) "
                                      "takes its rows in pairs, gate and up interleaved: give a Linear of 2 x F rows "
                                      "(gemmgen.nn.interleave_pairs(w_gate, w_up))")
            out_features //= 2
        return out_features

    def _configure(self, in_features: int, out_features: int, activation: str | None,
                   compute_dtype: torch.dtype | None, recompute: bool, accumulate_grad: bool,
                   precision: Precision | None, weight_in_out: bool = False) -> None:
        """The options, set once (`_options` are read-only after this)."""
        self.weight_in_out = weight_in_out  # W stored in x out (GPT-2's Conv1D), read N-major
        self.precision = check_precision(precision, in_features, out_features, activation, "FusedLinear")
        self._weights = WeightCache()
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self._fixed_dtype = compute_dtype
        self._recompute = check_recompute(training_flag("recompute", recompute), self.precision, "FusedLinear")
        self._accumulate_grad = training_flag("accumulate_grad", accumulate_grad)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in outside autocast: `from_linear`'s `compute_dtype`, else
        its weight's (after `.half()`, torch.float16)."""
        return self._fixed_dtype or self.weight.dtype

    @property
    def recompute(self) -> bool:
        """Whether backward recomputes the GEMM (the derived kernel) instead of storing the
        pre-activation in forward; may be changed, and applies from the next forward."""
        return self._recompute

    @recompute.setter
    def recompute(self, value: bool) -> None:
        self._recompute = check_recompute(training_flag("recompute", value), self.precision, "FusedLinear")
        self._set_recipes()

    @property
    def accumulate_grad(self) -> bool:
        """Whether backward adds the weight gradient in fp32 into `weight.main_grad` instead of
        setting `.grad`; may be changed, and applies from the next forward."""
        return self._accumulate_grad

    @accumulate_grad.setter
    def accumulate_grad(self, value: bool) -> None:
        self._accumulate_grad = training_flag("accumulate_grad", value)

    def _set_recipes(self) -> None:
        """Forget the kernels made for other dtypes or options, and make those of the dtype the
        layer computes in now (so that a traced forward finds them)."""
        self._kernels: dict[tuple[torch.dtype, bool], LinearKernels] = {}
        self.kernels(self.kernel_dtype)

    def kernels(self, dtype: torch.dtype) -> LinearKernels:
        """The layer's kernels computing in `dtype` (bf16 or f16), with its bias as it is now."""
        key = (dtype, self.bias is not None)
        found = self._kernels.get(key)
        if found is None:
            found = self._kernels[key] = linear_kernels(self.activation, key[1], dtype, self._recompute,
                                                        self.weight_in_out)
        return found

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype of the kernels `recipe` and `launches` name: `compute_dtype`, or for a layer
        without kernels in it (fp32 parameters), bf16, as it computes under bf16 autocast."""
        dtype = self.compute_dtype
        return dtype if dtype in COMPUTE_DTYPES else torch.bfloat16

    @property
    def recipe(self) -> Recipe:
        """The recipe of forward's kernel (in `kernel_dtype`; with `precision`, its fprop's)."""
        if self.precision is not None:
            return self._gemms.fprop.recipe
        return self.kernels(self.kernel_dtype).recipe

    @property
    def training_recipe(self) -> Recipe | None:
        """The recipe of forward's kernel with gradients wanted: it also stores the pre-activation
        (None without an activation)."""
        if self.precision is not None:
            return None if self._gemms.fprop_saving is None else self._gemms.fprop_saving.recipe
        return self.kernels(self.kernel_dtype).training_recipe

    @property
    def _gemms(self) -> LinearGemms:
        """The kernels of a layer with a `precision` (in `kernel_dtype`)."""
        assert self.precision is not None
        return linear_gemms(self.precision, self.activation, self.bias is not None, self.kernel_dtype)

    @property
    def _op(self) -> OpCaller:
        return self.kernels(self.kernel_dtype).op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_type(x)
        dtype, out_dtype = call_dtypes(x, self.weight.dtype, self._fixed_dtype)
        if dtype not in COMPUTE_DTYPES:
            warn_no_kernel(self, dtype)
            return self.reference(x)
        x2, lead = self.rows(x, dtype)
        if self.precision is not None:
            return dense_output(self._low_precision(x2, dtype), (*lead, self.out_features), out_dtype)
        w, bias = self.kernel_parameters(dtype)
        kernels = self.kernels(dtype)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, w, bias)):
            y = _LinearFunction.apply(self, kernels, self._accumulate_grad, x2, w, bias)
        else:
            y = kernels.op(x2, w) if bias is None else kernels.op(x2, w, bias)
        return dense_output(y, (*lead, self.out_features), out_dtype)

    def _low_precision(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward in `precision` (nn.low_precision): the weight as it is (a bf16 or fp32 master
        weight, quantized once per optimizer step), the bias cast to `dtype`."""
        w, bias = self.weight, self.kernel_bias(dtype)
        gemms = linear_gemms(self.precision, self.activation, bias is not None, dtype)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias)):
            return LowPrecisionLinear.apply(gemms, self._weights, self.activation, self._accumulate_grad, x, w, bias)
        args = forward_operands(gemms, self._weights, x, self._weights.get(w, gemms))
        return gemms.fprop(*args) if bias is None else gemms.fprop(*args, bias)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's math by torch ops in x's dtype (the parameters cast to it): what it runs
        where gemmgen has no kernel (fp32, fp64). With `accumulate_grad` the weight's gradient
        goes into its `main_grad` here too."""
        weight = accumulating(self.weight) if self._accumulate_grad else self.weight
        bias = self.bias
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
            bias = bias.to(x.dtype) if bias is not None else None
        return reference_linear(x, weight.t() if self.weight_in_out else weight, bias, self.activation)

    def _check_input_type(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise InvalidArgument(f"input: expected a torch.Tensor of shape (..., {self.in_features}), got "
                                  f"{type(x).__name__}")

    def rows(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Size]:
        """x (..., in_features) as the kernel's rows (M, in_features) in `dtype` (cast as
        autocast would cast nn.Linear's input), and its leading dims, to reshape the output with."""
        if x.dtype != dtype:
            x = x.to(dtype)
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
        return x2, lead

    def kernel_parameters(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as the kernel's B (W^T, a column-major view; W itself where it is stored in x
        out) and the bias, checked against the layer's shape and cast to `dtype` (default
        `compute_dtype`; per call, as autocast casts nn.Linear's)."""
        dtype = dtype or self.compute_dtype
        w, bias = self.weight, self.kernel_bias(dtype)
        if w.dtype != dtype:
            w = w.to(dtype)
        return (w if self.weight_in_out else w.t()), bias

    def kernel_bias(self, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The bias cast to `dtype` (default `compute_dtype`), weight and bias checked against the
        layer's shape: what a low-precision step, which quantizes the weight as it is, reads."""
        dtype = dtype or self.compute_dtype
        w, bias = self.weight, self.bias
        rows = self.weight_rows
        what = "2 x out_features: gate and up interleaved" if rows != self.out_features else "out_features"
        if self.weight_in_out:
            check_parameter("weight", w, (self.in_features, rows), "(in_features, out_features), as Conv1D holds it")
        else:
            check_parameter("weight", w, (rows, self.in_features), f"({what}, in_features)")
        if bias is not None:
            check_parameter("bias", bias, (rows,), f"({what},)")
        return bias if bias is None or bias.dtype == dtype else bias.to(dtype)

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
        `gg.warmup([layer.launches(t) for t in (1, 512, 4096)] + [layer.launches(4096, training=True)])`.
        The kernels are `kernel_dtype`'s."""
        return linear_plan(self, tokens, training)[0].launch(sm_count, device, launch_arch(arch))

    def backward_launches(self, tokens: int, sm_count: int | None = None, device: tuning.Device | None = None,
                          arch: Arch | str | None = None) -> list[tuple[Recipe, KernelConfig]]:
        """(recipe, config) of the gemmgen kernels a backward of `tokens` rows launches: the derived
        kernel with `recompute`, the fp32 weight-gradient GEMM with `accumulate_grad`; every GEMM of
        the step, torch's too, is `gemmgen.nn.plan.linear_plan`'s."""
        target = launch_arch(arch)
        return [g.launch(sm_count, device, target) for g in linear_plan(self, tokens) if g.backward and g.recipe]

    def config_for(self, tokens: int, sm_count: int | None = None, arch: Arch | str | None = None) -> KernelConfig:
        """The config of `launches(tokens)` (inference, no device)."""
        return self.launches(tokens, sm_count=sm_count, arch=arch)[1]

    def extra_repr(self) -> str:
        fixed = self._fixed_dtype
        cast = f", compute_dtype={fixed}" if fixed is not None and self.weight.dtype != fixed else ""
        training = "".join(f", {k}=True" for k in ("recompute", "accumulate_grad") if getattr(self, k))
        precision = f", precision={self.precision}" if self.precision is not None else ""
        stored = ", weight_in_out=True" if self.weight_in_out else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}{cast}{training}{precision}{stored}")

"""`GroupedLinear`: a mixture-of-experts layer's expert Linears, plus bias and activation, as one
grouped gemmgen kernel.

    experts = gemmgen.nn.GroupedLinear(8, 4096, 14336, activation="silu", dtype=torch.bfloat16)
    y = experts(x, offsets)   # x: (tokens, in), sorted by expert; offsets: int32, where each expert's rows end

Forward is `activation(x_e @ W_e^T + b_e)` for the rows of each expert e, one grouped gemmgen op
(torch.ops.gemmgen.*) whose offsets stay on the GPU: no host sync, CUDA-graph safe. Rows after the
last expert's end are not written (unspecified, as with `torch._grouped_mm`). Backward is the op's,
gemmgen kernels only (16-bit experts): one derived kernel (the grouped GEMM again, its epilogue
turning dL/dy into dL/dacc, of which the bias gradient is each expert's sum), then dx by a grouped
GEMM and dW by a K-grouped one (each expert's tokens its K, none padded), with the same offsets.

A gated activation (`"swiglu"`, `"geglu"`: act(gate) * up, the experts of Mixtral, DeepSeek and
Qwen MoE models) takes weights of 2 x out_features rows per expert, gate and up interleaved
(`interleave_pairs`), and writes out_features columns: the up projection's whole epilogue in the
grouped kernel, over its accumulator's column pairs (docs/design/pairs.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import tuning
from ..config import Arch
from ..dsl import Backward, Recipe, RowVector
from ..errors import InvalidArgument
from ..integrations.grouped import GroupedOp
from ..integrations.ops import op
from ..ir.reference import group_bounds, masked_group_bounds
from ..training import Precision
from ..types import as_dtype
from .base import (
    COMPUTE_DTYPES,
    GATED,
    RecipeModule,
    activation_fn,
    call_dtypes,
    check_layer_dtype,
    check_parameter,
    dense_output,
    launch_arch,
    reference_linear,
    unsupported,
    warn_no_kernel,
    weight_rows,
)
from .low_precision import WeightCache, check_precision
from .low_precision_grouped import GroupedGemms, grouped_gemms, low_precision_grouped
from .plan import grouped_plan


def check_grouped_precision(value: object, in_features: int, weight_rows: int, activation: str | None,
                            where: str = "GroupedLinear") -> Precision | None:
    """A grouped layer's `precision=` (`where` names the layer): None, or a precision with grouped
    kernels of its own whose fp8 rows the layer's features fit (`low_precision.check_precision`)."""
    precision = check_precision(value, in_features, weight_rows, activation, where)
    if precision is not None and not precision.grouped:
        raise InvalidArgument(f"{where}: precision={precision} has no grouped kernels yet; use "
                              "gemmgen.training.Float8Blockwise() or Float8Tensorwise(), or leave precision= out")
    return precision


def rows_aligned(bias: torch.Tensor) -> torch.Tensor:
    """The experts' biases with each row 16-byte aligned, as the kernel reads them in 16-byte
    vectors: a padded copy (differentiable, traceable) where out_features is not a multiple of 8
    (bf16/f16), in place of the op's copy after its check refuses the layout."""
    pad = -bias.shape[1] % (16 // bias.element_size())
    return torch.nn.functional.pad(bias, (0, pad))[:, :bias.shape[1]] if pad else bias


@functools.cache
def grouped_linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype) -> Recipe:
    """The recipe of a group of expert Linears (x_e @ W_e^T, the weights stacked as E x out x in)
    plus each expert's bias and the activation (a gated one over column pairs: out = rows / 2)."""
    act = activation_fn(activation, gated=True)
    d = as_dtype(dtype, "dtype")
    name = f"grouped_linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}"
    kw: dict[str, Any] = {"a": d, "b": d, "d": d, "grouped": True}
    if bias:
        return Recipe(name, lambda acc, bias: act(acc + bias), operands={"bias": RowVector(d)}, **kw)
    return Recipe(name, lambda acc: act(acc), **kw)


@functools.cache
def _derived(recipe: Recipe) -> Backward | None:
    """The derived backward of a layer's recipe, made once (`GroupedOp.derived`)."""
    return GroupedOp(recipe).derived


class GroupedLaunches:
    """`launches` of a layer of `num_experts` experts run by one grouped recipe (`self.recipe`)."""

    recipe: Recipe
    num_experts: int
    in_features: int
    out_features: int
    activation: str | None

    @property
    def weight_rows(self) -> int:
        """Each expert's weight rows: the kernel's N (out_features, or twice that for a gated
        activation)."""
        return weight_rows(self.out_features, self.activation)

    def launches(self, rows: int | None = None, device: tuning.Device | None = None,
                 arch: Arch | str | None = None) -> tuple[Recipe, Any]:
        """(recipe, config) of the kernel forward launches for `rows` rows of tokens (all experts'
        together; None: the kernel for groups of many rows) on `arch` (default: the current
        device's, sm_90a without one): what to build ahead of time, e.g.
        `gg.warmup([experts.launches(), experts.launches(decode_rows)])`. The kernel depends on the
        rows per expert on average (`gemmgen.tuning.grouped_choice`), never on how they split; with
        `device`, on an autotune result registered for it first (`tuning.choose_launch`)."""
        target = launch_arch(arch)
        if rows is None:
            return self.recipe, self.recipe.default_config(target)
        return self.recipe, tuning.config_for(self.recipe, rows, self.weight_rows, self.in_features,
                                              self.num_experts, device=device, arch=target)


    @property
    def derived_backward(self) -> Backward | None:
        """The recipe's derived backward (`Recipe.backward`), None where torch differentiates."""
        return _derived(self.recipe)

    def backward_launches(self, rows: int | None = None, device: tuning.Device | None = None,
                          arch: Arch | str | None = None) -> list[tuple[Recipe, Any]]:
        """(recipe, config) of the gemmgen kernels a backward launches for `rows` rows of tokens
        (None: the kernels for groups of many rows), chosen as forward's is: the derived one (the
        grouped GEMM again, writing dL/dacc) or the accumulator again, then dx's grouped GEMM and
        dW's K-grouped one (`gemmgen.nn.plan.grouped_plan`); with a `precision`, its fp8 kernels;
        none for BlockScaledGroupedLinear's fp8 experts (their gradients are torch's)."""
        target = launch_arch(arch)
        planned = [g for g in grouped_plan(self, rows or 1) if g.backward]
        recipes = [g.recipe for g in planned if g.recipe is not None]
        if rows is None:
            return [(r, r.default_config(target)) for r in recipes]
        return [g.launch(None, device, target) for g in planned if g.recipe is not None]


class GroupedOps(RecipeModule):
    """A module launching grouped ops (`grouped_linear`), each resolved once per activation, dtype
    and bias (in `_set_recipes`, so that a traced forward finds them made)."""

    _ops: dict[tuple[str | None, torch.dtype, bool], Any]

    def op_for(self, activation: str | None, dtype: torch.dtype, bias: bool) -> Any:
        """The grouped op of `grouped_linear_recipe(activation, bias, dtype)`."""
        key = (activation, dtype, bias)
        found = self._ops.get(key)
        if found is None:
            found = self._ops[key] = op(grouped_linear_recipe(activation, bias, dtype)).default
        return found


class GroupedLinear(GroupedLaunches, GroupedOps):
    """`num_experts` nn.Linear layers (plus activation) applied to the rows of their own experts in
    one grouped kernel: `weight` is (num_experts, rows, in_features), each expert's as nn.Linear
    stores it, and `bias` (num_experts, rows), where rows is out_features, or 2 x out_features
    for a gated activation (gate and up interleaved). It computes in the parameters' dtype (bf16
    or f16), following `.to()` and `.half()`, or under autocast in autocast's, as nn.Linear does;
    otherwise an input of another dtype is an error. With fp32 or fp64 parameters (`.float()`),
    for which gemmgen has no kernel, it says so once and computes each expert's rows with torch
    ops (reading the offsets on the host). The output is contiguous (`base.dense_output`). With
    `precision=gemmgen.training.Float8Blockwise()` or `Float8Tensorwise()` every GEMM of its step
    is an fp8 gemmgen kernel, the weight gradient a K-grouped one over each expert's tokens, none
    padded (`nn.low_precision_grouped`); the parameters stay bf16 or fp32. `forward(x, masked_m=)`
    takes DeepGEMM's masked layout (16-bit experts). `num_experts`, `in_features`,
    `out_features`, `activation` and `precision` are read-only."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    _derived = ("recipe", "_ops")
    _options = ("num_experts", "in_features", "out_features", "activation", "compute_dtype", "precision")

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 activation: str | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, precision: Precision | None = None) -> None:
        super().__init__()
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise InvalidArgument(f"num_experts: expected a positive int, got {num_experts!r}")
        reason = unsupported(in_features, check_layer_dtype(dtype))
        if reason:
            raise InvalidArgument(f"GroupedLinear: {reason}")
        activation_fn(activation, gated=True)  # a bad name is refused before anything is allocated
        self.precision = check_grouped_precision(precision, in_features, weight_rows(out_features, activation),
                                                 activation)
        self._weights = WeightCache()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.activation = activation
        rows = self.weight_rows
        self.weight = nn.Parameter(torch.empty(num_experts, rows, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(num_experts, rows, dtype=dtype, device=device)) if bias else None
        self._set_recipes()
        self.reset_parameters()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in outside autocast: its weight's."""
        return self.weight.dtype

    def _set_recipes(self) -> None:
        """The recipe (of the dtype it computes in, bf16 for fp32 parameters, as under bf16
        autocast), and its op (the grouped op itself: its Autograd kernel is the backward)."""
        self._ops = {}
        dtype = self.compute_dtype if self.compute_dtype in COMPUTE_DTYPES else torch.bfloat16
        self.recipe = grouped_linear_recipe(self.activation, self.bias is not None, dtype)
        if self.precision is not None:  # forward's kernel is fprop's in the precision
            self.recipe = self.low_precision_gemms.fprop.recipe
        else:
            self.op_for(self.activation, dtype, self.bias is not None)

    @property
    def low_precision_gemms(self) -> GroupedGemms:
        """The kernels of a layer with a `precision` (nn.low_precision_grouped), in the dtype it
        computes in outside autocast."""
        assert self.precision is not None
        dtype = self.compute_dtype if self.compute_dtype in COMPUTE_DTYPES else torch.bfloat16
        return grouped_gemms(self.precision, grouped_linear_recipe(self.activation, self.bias is not None, dtype),
                             self.activation is not None)

    def reset_parameters(self) -> None:
        """Each expert initialised as nn.Linear initialises itself."""
        for e in range(self.num_experts):
            nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)


    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], activation: str | None = None,
                     precision: Precision | None = None) -> GroupedLinear:
        """A GroupedLinear holding a copy of the experts' parameters, stacked (one tensor each). For
        a gated activation each Linear holds 2 x out_features rows, gate and up interleaved
        (`interleave_pairs(gate_proj.weight, up_proj.weight)`)."""
        if not linears or not all(isinstance(m, nn.Linear) for m in linears):
            raise InvalidArgument("linears: expected a non-empty sequence of torch.nn.Linear")
        first = linears[0]
        shapes = {(m.in_features, m.out_features, m.bias is not None, m.weight.dtype) for m in linears}
        if len(shapes) != 1:
            raise InvalidArgument(f"linears: the experts differ in (in_features, out_features, bias, dtype): "
                                  f"{sorted(shapes, key=str)}; a grouped kernel needs them alike")
        activation_fn(activation, gated=True)
        out_features = first.out_features
        if activation in GATED:
            if out_features % 2:
                raise InvalidArgument(f"linears: {out_features} output features; a gated activation ({activation}) "
                                      "takes its rows in pairs, gate and up interleaved: give Linears of 2 x F rows "
                                      "(gemmgen.nn.interleave_pairs(w_gate, w_up))")
            out_features //= 2
        layer = cls(len(linears), first.in_features, out_features, first.bias is not None, activation,
                    first.weight.dtype, first.weight.device, precision)
        with torch.no_grad():
            layer.weight.copy_(torch.stack([m.weight for m in linears]))
            if layer.bias is not None:
                layer.bias.copy_(torch.stack([m.bias for m in linears]))
        return layer

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | None = None, masked_m: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`x` (tokens, in_features) sorted by expert with `offsets` (int32, where each expert's rows
        end), or the masked layout: `x` (num_experts, max_m, in_features) with `masked_m` (int32, how
        many of each expert's max_m rows are tokens), giving (num_experts, max_m, out); rows past
        masked_m are neither read nor written (DeepGEMM's layout for CUDA-graph decode)."""
        offsets = self._groups(x, offsets, masked_m)
        rows = self.weight_rows
        what = "2 x out_features: gate and up interleaved" if rows != self.out_features else "out_features"
        check_parameter("weight", self.weight, (self.num_experts, rows, self.in_features),
                        f"(num_experts, {what}, in_features)")
        if self.precision is not None:
            return self._low_precision(x, offsets)
        return grouped_linear(self, self.activation, x, offsets, self.weight, self.bias)

    def _groups(self, x: object, offsets: torch.Tensor | None, masked_m: torch.Tensor | None) -> torch.Tensor:
        """The call's offsets or masked_m, after checking that x is shaped for the one given."""
        masked = masked_m is not None
        want = f"({self.num_experts}, max_m, {self.in_features}) with masked_m" if masked else \
            f"(tokens, {self.in_features}) rows sorted by expert"
        if (offsets is None) == (masked_m is None):
            raise InvalidArgument("offsets/masked_m: pass one: offsets for x (tokens, in_features) sorted by expert, "
                                  "or masked_m for the masked layout x (num_experts, max_m, in_features)")
        shaped = isinstance(x, torch.Tensor) and x.dim() == 2 + masked and x.shape[-1] == self.in_features and \
            (not masked or x.shape[0] == self.num_experts)
        if not shaped:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidArgument(f"input: expected {want}, got {got}")
        if masked and self.precision is not None:
            raise InvalidArgument(f"masked_m: precision={self.precision} takes x (tokens, in_features) with offsets; "
                                  "the masked layout runs 16-bit experts (leave precision= out)")
        return masked_m if masked_m is not None else offsets  # type: ignore[return-value]

    def _low_precision(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        assert self.precision is not None
        _, out_dtype = call_dtypes(x, self.weight.dtype, None)
        y = grouped_linear_in(self.precision, self._weights, self.activation, x, offsets, self.weight, self.bias)
        return dense_output(y, y.shape, out_dtype)

    def reference(self, x: torch.Tensor, offsets: torch.Tensor | None = None,
                  masked_m: torch.Tensor | None = None) -> torch.Tensor:
        """Each expert's rows through its Linear and the activation with torch ops in x's dtype
        (rows in no expert zero): what the layer runs where gemmgen has no kernel. It reads the
        offsets (or masked_m) on the host."""
        return grouped_reference(x, self._groups(x, offsets, masked_m), self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        precision = f", precision={self.precision}" if self.precision is not None else ""
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, activation={self.activation!r}"
                f"{precision}")



def grouped_linear(layer: GroupedOps, activation: str | None, x: torch.Tensor, offsets: torch.Tensor,
                   weight: torch.Tensor, bias: torch.Tensor | None, fixed: torch.dtype | None = None) -> torch.Tensor:
    """activation(x_e @ W_e^T + b_e) for the rows of each expert e of `x` (sorted by expert,
    `offsets` where each expert's rows end), `weight` E x rows x in, by `layer`'s grouped op, in
    the dtype nn.Linear would compute in (`base.call_dtypes`; `fixed`: a compute dtype the
    parameters are cast to per call). Where gemmgen has no kernel for that dtype, `layer` says so
    once and the math runs by torch ops (`grouped_reference`)."""
    dtype, out_dtype = call_dtypes(x, weight.dtype, fixed)
    if dtype not in COMPUTE_DTYPES:
        warn_no_kernel(layer, dtype)
        return grouped_reference(x, offsets, weight, bias, activation)
    x = x.to(dtype) if x.dtype != dtype else x
    if weight.dtype != dtype:  # autocast's, or a fixed compute dtype
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    run, w = layer.op_for(activation, dtype, bias is not None), weight.transpose(1, 2)
    y = run(x, w, offsets) if bias is None else run(x, w, offsets, rows_aligned(bias))
    return dense_output(y, y.shape, out_dtype)


def grouped_linear_in(precision: Precision, cache: WeightCache, activation: str | None, x: torch.Tensor,
                      offsets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      fixed: torch.dtype | None = None, source: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_linear` in `precision` (nn.low_precision_grouped): the weights as they are (bf16 or
    fp32 masters, quantized once per optimizer step into `cache`; `source`, the parameter an
    interleaved weight is made from), x and the bias in the dtype the layer computes in (bf16 for
    fp32 masters; `fixed`: a compute dtype)."""
    dtype, _ = call_dtypes(x, weight.dtype, fixed)
    dtype = dtype if dtype in COMPUTE_DTYPES else torch.bfloat16
    gemms = grouped_gemms(precision, grouped_linear_recipe(activation, bias is not None, dtype), activation is not None)
    x = x.to(dtype) if x.dtype != dtype else x
    bias = None if bias is None else rows_aligned(bias.to(dtype))
    return low_precision_grouped(gemms, cache, x, offsets, weight, bias, source)


def grouped_reference(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: str | None) -> torch.Tensor:
    """Each expert's rows of `x` through its Linear (`weight[e]`, `bias[e]`) and the activation by
    torch ops in x's dtype, rows in no expert zero. It reads the offsets on the host; a 3-D `x` is
    the masked layout, `offsets` its masked_m (`reference.masked_group_bounds`)."""
    rows = x.shape[:-1].numel()
    bounds = masked_group_bounds(offsets.tolist(), x.shape[1]) if x.dim() == 3 else \
        group_bounds(offsets.tolist(), rows)
    flat = x.reshape(rows, x.shape[-1])
    weight = weight.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    out = x.new_zeros(rows, weight.shape[1] // 2 if activation in GATED else weight.shape[1])
    for e, (lo, hi) in enumerate(bounds):
        out[lo:hi] = reference_linear(flat[lo:hi], weight[e], bias[e] if bias is not None else None, activation)
    return out.view(*x.shape[:-1], out.shape[-1])

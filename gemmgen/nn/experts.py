"""`GroupedExperts`: a mixture-of-experts block's experts as transformers 5 holds them (3-D
`gate_up_proj` and `down_proj` parameters), run by two grouped gemmgen kernels.

    experts = gemmgen.nn.GroupedExperts.from_experts(block.experts, "swiglu")
    y = experts(hidden_states, top_k_index, top_k_weights)   # the experts module's own call

`fuse(model)` puts one in place of each experts module it can run (Mixtral's, Qwen-MoE's,
DeepSeek's routed experts, ...); the router stays the model's. Forward sorts the token-expert
pairs by expert and finds where each expert's rows end (offsets computed on the device: no host
sync, no token padded), runs the up projection with its gated activation (`"swiglu"`, `"geglu"`)
over gate and up interleaved in column pairs, then the down projection, each one grouped kernel
over the same offsets, weights each row by its routing weight and sums each token's top-k rows in
the order transformers' grouped experts sum them. An expert id outside [0, num_experts) (expert
parallelism's sentinel) contributes nothing. Backward is the grouped ops' (gemmgen kernels).

The parameters are the experts module's own, under its names: the state_dict does not change.
transformers stores gate and up as the two halves of `gate_up_proj` ("concatenated"); the kernel
reads them interleaved (docs/design/pairs.md), so a concatenated weight is interleaved per call
with gradients wanted (a copy, whose gradient autograd takes apart again) and otherwise once per
change of the weight, kept until it changes (costing the memory of `gate_up_proj` once more).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..dsl import Recipe
from ..errors import InvalidArgument
from ..training import Precision
from .base import COMPUTE_DTYPES, GATED, check_compute_dtype, check_parameter, unsupported
from .grouped import (
    GroupedLaunches,
    GroupedOps,
    check_grouped_precision,
    grouped_linear,
    grouped_linear_in,
    grouped_linear_recipe,
)
from .low_precision import WeightCache
from .low_precision_grouped import GroupedGemms, grouped_gemms
from .pairs import contents_key, interleave_pairs, same_contents

#: The arguments of the experts modules this module replaces, as transformers names them.
EXPERTS_CALL = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass(frozen=True)
class ExpertProjection(GroupedLaunches):
    """One of a GroupedExperts' two grouped GEMMs, as `model_launches` and the plans read a
    GroupedLinear: its recipe and sizes (`GroupedLaunches.launches`); with a `precision`, its
    kernels in it (`low_precision_gemms`, whose fprop `recipe` is)."""

    recipe: Recipe
    num_experts: int
    in_features: int
    out_features: int
    activation: str | None
    precision: Precision | None = None
    low_precision_gemms: GroupedGemms | None = None


class GroupedExperts(GroupedOps):
    """The experts of a mixture-of-experts block, called as transformers' experts modules are
    (`forward(hidden_states, top_k_index, top_k_weights)`), computing each routed token's
    `down_e(act(gate_e(x)) * up_e(x))` times its routing weight, summed over its top-k experts.

    `gate_up_proj` is (num_experts, 2 x intermediate_size, hidden_size), gate and up as halves
    (`concatenated=True`, transformers' layout) or interleaved row by row; `down_proj` is
    (num_experts, hidden_size, intermediate_size); optional biases `gate_up_proj_bias` and
    `down_proj_bias`. It computes in the parameters' dtype (or `compute_dtype`, the parameters
    cast per call), under autocast in autocast's, as nn.Linear would; with fp32 or fp64 parameters
    it says so once and runs each expert's rows by torch ops. Its options are read-only."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_up_proj_bias: torch.Tensor | None
    down_proj_bias: torch.Tensor | None
    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: str
    concatenated: bool
    _fixed_dtype: torch.dtype | None
    precision: Precision | None = None
    _weights: tuple[WeightCache, WeightCache]
    _derived = ("_ops", "_pairs", "_pairs_key")
    _options = ("num_experts", "hidden_size", "intermediate_size", "activation", "concatenated", "compute_dtype",
                "precision")

    @classmethod
    def from_experts(cls, experts: nn.Module, activation: str, compute_dtype: torch.dtype | None = None,
                     concatenated: bool = True, precision: Precision | None = None) -> GroupedExperts:
        """A GroupedExperts sharing `experts`' parameters (no copy, the same names), which must be
        `gate_up_proj` and `down_proj` as the class docstring describes (and the biases if it has
        them); `activation` ("swiglu" or "geglu") is what it applies to gate and up; `precision`
        (`gemmgen.training.Float8Blockwise()` or `Float8Tensorwise()`) trains both projections in
        fp8, as GroupedLinear."""
        if activation not in GATED:
            raise InvalidArgument(f"activation: expected one of {sorted(GATED)} (act(gate) * up), got {activation!r}")
        check_compute_dtype(compute_dtype)
        gate_up, down = (experts._parameters.get(n) if isinstance(experts, nn.Module) else None
                         for n in ("gate_up_proj", "down_proj"))
        if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
            raise InvalidArgument("experts: expected a module with 3-d parameters gate_up_proj (num_experts, "
                                  "2 x intermediate, hidden) and down_proj (num_experts, hidden, intermediate), "
                                  f"as transformers 5 holds experts; got {type(experts).__name__}")
        num_experts, rows, hidden = gate_up.shape
        if rows % 2 or tuple(down.shape) != (num_experts, hidden, rows // 2):
            raise InvalidArgument(f"experts: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do "
                                  "not make (E, 2I, H) and (E, H, I)")
        for n, k in (("hidden_size", hidden), ("intermediate_size", rows // 2)):
            reason = unsupported(k, compute_dtype or gate_up.dtype)
            if reason:
                raise InvalidArgument(f"experts: {n} {k}: {reason}")
        checked = check_grouped_precision(precision, hidden, rows, activation, "GroupedExperts (gate_up_proj)")
        check_grouped_precision(precision, rows // 2, hidden, None, "GroupedExperts (down_proj)")
        layer = cls()
        layer.precision = checked
        layer._weights = (WeightCache(), WeightCache())  # gate_up_proj's and down_proj's fp8 copies
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            layer.register_parameter(name, experts._parameters.get(name))
        layer.num_experts, layer.hidden_size, layer.intermediate_size = num_experts, hidden, rows // 2
        layer.activation, layer.concatenated = activation, concatenated
        layer._fixed_dtype = compute_dtype
        layer._set_recipes()
        return layer

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts compute in outside autocast: `compute_dtype`, else the weights'."""
        return self._fixed_dtype or self.gate_up_proj.dtype

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype of the kernels `projections` name (bf16 for fp32 parameters, as under autocast)."""
        return self.compute_dtype if self.compute_dtype in COMPUTE_DTYPES else torch.bfloat16

    def _set_recipes(self) -> None:
        """Forget the kernels made for another dtype; make those of the dtype computed in now."""
        self._ops = {}
        self.__dict__["_pairs_key"] = None
        self.__dict__.pop("_pairs", None)
        if self.precision is None:
            self.op_for(self.activation, self.kernel_dtype, self.gate_up_proj_bias is not None)
            self.op_for(None, self.kernel_dtype, self.down_proj_bias is not None)

    def projections(self) -> tuple[ExpertProjection, ExpertProjection]:
        """The up projection (with the gated activation) and the down projection, as grouped GEMMs."""
        dtype, e, h, i = self.kernel_dtype, self.num_experts, self.hidden_size, self.intermediate_size
        up = grouped_linear_recipe(self.activation, self.gate_up_proj_bias is not None, dtype)
        down = grouped_linear_recipe(None, self.down_proj_bias is not None, dtype)
        if self.precision is None:
            return ExpertProjection(up, e, h, i, self.activation), ExpertProjection(down, e, i, h, None)
        kernels = [grouped_gemms(self.precision, r, act) for r, act in ((up, True), (down, False))]
        return (ExpertProjection(kernels[0].fprop.recipe, e, h, i, self.activation, self.precision, kernels[0]),
                ExpertProjection(kernels[1].fprop.recipe, e, i, h, None, self.precision, kernels[1]))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x, index, weights = hidden_states, top_k_index, top_k_weights
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidArgument(f"hidden_states: expected (tokens, {self.hidden_size}), got {got}")
        if (not isinstance(index, torch.Tensor) or index.dim() != 2 or index.shape[0] != x.shape[0]
                or index.dtype.is_floating_point or index.dtype.is_complex):
            raise InvalidArgument(f"top_k_index: expected integer expert ids of shape ({x.shape[0]}, top_k), got "
                                  f"{_described(index)}")
        if not isinstance(weights, torch.Tensor) or weights.shape != index.shape:
            raise InvalidArgument(f"top_k_weights: expected the routing weights, shaped as top_k_index "
                                  f"{tuple(index.shape)}, got {_described(weights)}")
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        check_parameter("gate_up_proj", self.gate_up_proj, (e, 2 * i, h), "(num_experts, 2 x intermediate, hidden)")
        check_parameter("down_proj", self.down_proj, (e, h, i), "(num_experts, hidden, intermediate)")
        tokens, top_k = index.shape
        expert_ids, order = torch.sort(index.reshape(-1), stable=True)
        # where each expert's rows end: ids past the last expert (expert parallelism's) fall after it
        offsets = torch.searchsorted(expert_ids, torch.arange(e, device=index.device, dtype=expert_ids.dtype),
                                     right=True, out_int32=True)
        rows = x[order // top_k]
        w_up, b_up = self._gate_up()
        if self.precision is not None:  # nn.low_precision_grouped's step, each weight quantized once per step
            gated = grouped_linear_in(self.precision, self._weights[0], self.activation, rows, offsets, w_up, b_up,
                                      self._fixed_dtype, self.gate_up_proj if self.concatenated else None)
            y = grouped_linear_in(self.precision, self._weights[1], None, gated, offsets, self.down_proj,
                                  self.down_proj_bias, self._fixed_dtype)
        else:
            gated = grouped_linear(self, self.activation, rows, offsets, w_up, b_up, self._fixed_dtype)
            y = grouped_linear(self, None, gated, offsets, self.down_proj, self.down_proj_bias, self._fixed_dtype)
        # ids outside [0, E) (expert parallelism's sentinels) count for nothing, as in transformers
        routed = (expert_ids >= 0) & (expert_ids < e)
        y = torch.where(routed.unsqueeze(-1), y * weights.reshape(-1)[order].unsqueeze(-1), 0)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return y[back].view(tokens, top_k, h).sum(dim=1).to(x.dtype)

    def _gate_up(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The up projection's weight and bias with gate and up interleaved: as held, or for a
        concatenated weight, a copy made per call with gradients wanted, and otherwise kept until
        the weight changes (another tensor, or written in place)."""
        w, b = self.gate_up_proj, self.gate_up_proj_bias
        if not self.concatenated:
            return w, b
        tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (w, b))
        if tracked or torch.compiler.is_compiling():
            self.__dict__.pop("_pairs", None)
            return _interleaved(w), _interleaved(b)
        key = (contents_key(w), contents_key(b))
        kept = self.__dict__.get("_pairs_key")
        if kept is None or not same_contents(kept, key):
            with torch.no_grad():
                self.__dict__["_pairs"] = (_interleaved(w), _interleaved(b))
            self.__dict__["_pairs_key"] = key
        return self.__dict__["_pairs"]

    def extra_repr(self) -> str:
        bias = self.gate_up_proj_bias is not None
        precision = f", precision={self.precision}" if self.precision is not None else ""
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, bias={bias}, "
                f"concatenated={self.concatenated}{precision}")


def _interleaved(t: torch.Tensor | None) -> Any:
    """gate and up, the halves of the last-but-one dim of (E, 2I, H) (or the last of a bias
    (E, 2I)), interleaved row by row."""
    if t is None:
        return None
    dim = 1
    half = t.shape[dim] // 2
    return interleave_pairs(t.narrow(dim, 0, half), t.narrow(dim, half, half), dim=dim)


def _described(t: object) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def experts_call(module: nn.Module) -> bool:
    """Whether `module.forward` takes transformers' experts arguments (`EXPERTS_CALL`)."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(names[:3]) == EXPERTS_CALL and len(names) == 3


__all__ = ["EXPERTS_CALL", "ExpertProjection", "GroupedExperts", "experts_call"]

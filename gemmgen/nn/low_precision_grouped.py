"""A GroupedLinear's training step in a low precision (`GroupedLinear(..., precision=)`:
`gemmgen.training.Float8Blockwise` or `Float8Tensorwise`): every GEMM of forward and backward a
gemmgen kernel over fp8 operands, and no expert's tokens padded.

    fprop  y_e = act(x_e W_e^T + b_e)   grouped fp8 kernel: x per token and 128 features, W_e in
                                        128 x 128 blocks (tensorwise: x one scale, W_e one each)
    dacc   act'(acc) dL/dy              the same grouped GEMM again, its epilogue derived (none
                                        without an activation: dL/dacc is dL/dy)
    dgrad  dx_e = dL/dacc_e W_e         grouped fp8 kernel: dL/dacc per token (tensorwise: e5m2),
                                        W_e transposed (exact: the same blocks, or scale)
    wgrad  dW_e = dL/dacc_e^T x_e       K-grouped fp8 kernel over both tensors' tokens-contiguous
                                        copies, per 128 of each expert's tokens (gg.quantize_k_grouped;
                                        tensorwise: the same values, gg.k_grouped_copy)

The bias gradient is each expert's sum of dL/dacc. The weights are quantized once per optimizer
step, in both orientations (`WeightCache`, which also keeps delayed scaling's amax histories: x's,
dL/dacc's and one per expert's weight). The quantized copies of x and dL/dacc are torch ops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..dsl import Recipe
from ..integrations.grouped import grouped_input_grad_recipe, grouped_weight_grad_recipe
from ..integrations.ops import OpCaller, caller
from ..runtime.grouped import row_groups
from ..training import AmaxHistory, Gemm, Precision, QuantizedWeight
from .low_precision import WeightCache


@dataclass(frozen=True)
class GroupedGemms:
    """A low-precision GroupedLinear's kernels: `fprop` (the layer's epilogue), `dacc` (fprop's
    grouped GEMM again with the derived epilogue: dL/dacc from dL/dy; None without an activation),
    `dgrad` and `wgrad` (K-grouped, D in the weight's dtype)."""

    precision: Precision
    fprop: OpCaller
    dacc: OpCaller | None
    dgrad: OpCaller
    wgrad: OpCaller

    def weight(self, w: torch.Tensor, history: AmaxHistory | None = None) -> QuantizedWeight:
        """The experts' weights for fprop's and dgrad's B (`WeightCache.get` calls it once per
        optimizer step)."""
        return self.precision.experts(w, history)


@functools.cache
def grouped_gemms(precision: Precision, recipe: Recipe, activation: bool) -> GroupedGemms:
    """The kernels of a low-precision GroupedLinear whose bf16 or f16 recipe is `recipe`
    (`grouped_linear_recipe`; `activation`: whether it has one), shared by every layer of its kind."""
    p, dtype = precision, recipe.gemm.d.torch
    fprop = p.grouped_recipe(recipe, Gemm.FPROP)
    dacc = caller(p.grouped_dacc(recipe)) if activation else None
    return GroupedGemms(p, caller(fprop), dacc, caller(p.grouped_recipe(grouped_input_grad_recipe(dtype), Gemm.DGRAD)),
                        caller(p.grouped_recipe(grouped_weight_grad_recipe(dtype, accumulate=False), Gemm.WGRAD)))


def low_precision_grouped(gemms: GroupedGemms, cache: WeightCache, x: torch.Tensor, offsets: torch.Tensor,
                          weight: torch.Tensor, bias: torch.Tensor | None, source: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """One grouped layer's y in `gemms`' precision: its step (`LowPrecisionGrouped`) where gradients
    are wanted, else fprop alone. `source`: the parameter `weight` is made from per call (an
    interleaved copy of it), whose values decide when the weight is quantized again."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return LowPrecisionGrouped.apply(gemms, cache, x, offsets, weight, bias, source)
    qw = cache.get(weight, gemms, source)
    xq = gemms.precision.tokens(x, Gemm.FPROP, weight.shape[0], cache.history("input", gemms.precision))
    return gemms.fprop(xq.data, qw.rows.data, offsets, xq.scale, qw.rows.scale, *(() if bias is None else (bias,)))


class LowPrecisionGrouped(torch.autograd.Function):
    """A GroupedLinear's step in its precision (the module docstring's five GEMMs)."""

    @staticmethod
    def forward(ctx: Any, gemms: GroupedGemms, cache: WeightCache, x: torch.Tensor, offsets: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, source: torch.Tensor | None) -> torch.Tensor:
        p = gemms.precision
        qw = cache.get(weight, gemms, source)
        x_history = cache.history("input", p)
        xq = p.tokens(x, Gemm.FPROP, weight.shape[0], x_history)
        y = gemms.fprop(xq.data, qw.rows.data, offsets, xq.scale, qw.rows.scale, *(() if bias is None else (bias,)))
        # wgrad's B: x along each expert's tokens now (1 byte per value), or x kept and quantized in backward
        ctx.kept = None if p.save_original_input else p.along_tokens(x, offsets, "b", x_history)
        ctx.gemms, ctx.qw, ctx.cache = gemms, qw, cache
        ctx.save_for_backward(offsets, bias, xq.data, xq.scale, x if p.save_original_input else None)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        gemms: GroupedGemms = ctx.gemms
        p, qw = gemms.precision, ctx.qw
        offsets, bias, xq, x_scale, x = ctx.saved_tensors
        _, _, need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        rows, experts = g.shape[0], qw.rows.data.shape[0]
        _, group, covered = row_groups(offsets, rows, experts)
        g = g.contiguous()
        if gemms.dacc is not None:
            operands = {"scale_a": x_scale, "scale_b": qw.rows.scale, "bias": bias, "grad_d": g}
            g = gemms.dacc.by_name(xq, qw.rows.data, operands, offsets)["d"]
        g_acc = torch.where(covered.unsqueeze(1), g, 0.0)  # rows in no expert: no gradient
        gb = g_acc.float().new_zeros(experts, g_acc.shape[1]).index_add_(0, group, g_acc.float()).to(bias.dtype) \
            if bias is not None and need_b else None
        gx = gw = None
        g_history = ctx.cache.history("grad", p)
        if need_x:
            gq = p.tokens(g_acc, Gemm.DGRAD, experts, g_history)
            gx = gemms.dgrad(gq.data, qw.columns.data, offsets, gq.scale, qw.columns.scale)
            gx = torch.where(covered.unsqueeze(1), gx, 0.0)
        if need_w:
            ga = p.along_tokens(g_acc, offsets, "a", g_history)
            xb = ctx.kept if ctx.kept is not None else p.along_tokens(x, offsets, "b", ctx.cache.history("input", p))
            gw = gemms.wgrad(ga.data, xb.data.t(), offsets, ga.scale, xb.scale)
        return None, None, gx, None, gw, gb, None


__all__ = ["GroupedGemms", "LowPrecisionGrouped", "grouped_gemms", "low_precision_grouped"]

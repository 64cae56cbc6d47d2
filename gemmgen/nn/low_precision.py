"""The layers' training step in a low precision (`precision=`, `gemmgen.training`): every GEMM of
forward and backward a gemmgen kernel over quantized operands.

FusedLinear: fprop (the layer's epilogue, saving the pre-activation where backward needs it), then
in backward the activation's derivative (aten, on the saved pre-activation), dgrad and wgrad.
FusedMLP: fc1's fprop saving its accumulator, fc2's fprop; in backward **fc2's dgrad GEMM carries
fc1's derived epilogue** (the activation's derivative from the saved accumulator, fc1's bias
gradient as a sum over the tokens), as in bf16, then fc2's wgrad and fc1's dgrad and wgrad.

What is quantized where (Float8Blockwise): X per token and 128 features for fprop and along the
tokens for wgrad (kept from the forward, or with `save_original_input` quantized again in
backward); dY (and dL/dacc1 in the MLP) per token for dgrad and along the tokens for wgrad; W in
128 x 128 blocks for both of its GEMMs, once per optimizer step (`WeightCache`). X's and dY's two
copies each come from one pass (`Precision.operands`: on the GPU under Float8Blockwise and
current scaling gemmgen's cast-transpose kernel, else torch ops); in a FusedMLP under
Float8Blockwise, fc1's kernel writes h and fc2's dgrad kernel writes dL/dacc1 quantized both
ways from their epilogues
(`Precision.quantizing_backward`: gg.quantize and gg.quantize_columns; docs/design/training.md);
under Float8Tensorwise they write them quantized with the delayed scale, or (current scaling)
16-bit with their amax, from which one pass quantizes both copies (on the GPU the per-tensor
cast-transpose kernel; X and dY take the amax kernel's amax first).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..dsl import Matrix, Recipe
from ..errors import InvalidArgument
from ..integrations.ops import OpCaller, caller, direct_call_allowed, kernel_for
from ..training import AmaxHistory, Gemm, Operand, Precision, QuantizedWeight, as_precision
from ..types import DType
from .activations import activation_backward, linear_recipe
from .grads import main_grad


@functools.cache
def fp32_weight_grad_recipe(accumulate: bool) -> Recipe:
    """dW = dY^T X in fp32 (the wgrad GEMM's own epilogue, before a precision makes it fp8);
    with `accumulate`, main_grad + dY^T X, whose C is main_grad (beta = 1)."""
    if accumulate:
        return Recipe("weight_grad_accumulate", lambda acc, main_grad: acc + main_grad, d=DType.F32,
                      operands={"main_grad": Matrix(DType.F32)})
    return Recipe("weight_grad", lambda acc: acc, d=DType.F32)


@dataclass(frozen=True)
class LinearGemms:
    """A low-precision Linear's kernels: `fprop` (with `fprop_saving` also writing the
    pre-activation, for the activation's backward), `dgrad` (no epilogue) and `wgrad` (fp32;
    `wgrad_accumulate` into main_grad)."""

    precision: Precision
    fprop: OpCaller
    fprop_saving: OpCaller | None
    dgrad: OpCaller
    wgrad: OpCaller
    wgrad_accumulate: OpCaller

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, history: AmaxHistory | None = None) -> Operand:
        return self.precision.operand(t, gemm, which, self._recipe(gemm), history)

    def operands(self, t: torch.Tensor, rows: tuple[Gemm, str], columns: tuple[Gemm, str],
                 history: AmaxHistory | None = None) -> tuple[Operand, Operand]:
        """`t` along its columns for `rows` = (gemm, "a" or "b") and along its rows for `columns`
        (`Precision.operands`: one pass of t where the precision has a kernel for it)."""
        return self.precision.operands(t, (*rows, self._recipe(rows[0])), (*columns, self._recipe(columns[0])),
                                       history)

    def _recipe(self, gemm: Gemm) -> Recipe:
        return {Gemm.FPROP: self.fprop, Gemm.DGRAD: self.dgrad, Gemm.WGRAD: self.wgrad}[gemm].recipe

    def weight(self, w: torch.Tensor, history: AmaxHistory | None = None) -> QuantizedWeight:
        return self.precision.weight(w, self.fprop.recipe, self.dgrad.recipe, history)


@functools.cache
def linear_gemms(precision: Precision, activation: str | None, bias: bool, dtype: torch.dtype) -> LinearGemms:
    """The kernels of a low-precision FusedLinear (shared by every layer of the same kind)."""
    p = precision
    fprop = caller(p.recipe(linear_recipe(activation, bias, dtype), Gemm.FPROP))
    saving = caller(p.recipe(linear_recipe(activation, bias, dtype, save_pre_activation=True), Gemm.FPROP)) \
        if activation else None
    dgrad = caller(p.recipe(linear_recipe(None, False, dtype), Gemm.DGRAD))
    wgrad = caller(p.recipe(fp32_weight_grad_recipe(False), Gemm.WGRAD))
    accumulate = caller(p.recipe(fp32_weight_grad_recipe(True), Gemm.WGRAD))
    return LinearGemms(p, fprop, saving, dgrad, wgrad, accumulate)


def check_precision(value: object, in_features: int, out_features: int, activation: str | None,
                    where: str) -> Precision | None:
    """A layer's `precision=`: None, or a precision whose GEMMs can take the layer."""
    precision = as_precision(value, where)
    if precision is None:
        return None
    for name, features in (("in_features", in_features), ("out_features", out_features)):
        if features % 16:
            raise InvalidArgument(f"{where}: {name} = {features} is not a multiple of 16: {precision} reads fp8 rows "
                                  f"along it (16-byte rows for TMA); leave precision= out for this layer")
    return precision


def check_recompute(recompute: bool, precision: Precision | None, where: str) -> bool:
    """`recompute=`, refused with a precision: the low-precision step keeps the pre-activation
    (or fc1's accumulator) and has no recomputing backward yet."""
    if recompute and precision is not None:
        raise InvalidArgument(f"{where}: recompute=True with precision={precision}: the low-precision step keeps "
                              "the pre-activation and does not recompute it yet; leave recompute= out")
    return recompute


class WeightCache:
    """A layer's weights quantized once per optimizer step, not once per micro-batch: held until
    the weight's values change (`Precision.weight_version`: an in-place step, a replaced or cast
    parameter). Under delayed scaling it also keeps the amax history of each of the layer's
    tensors (`history`), advanced when the weight changes: once per optimizer step. Not state: it
    is not in the state_dict, and `.to()` forgets the weights (a moved weight's version differs).
    Under CUDA-graph capture nothing is held: the graph quantizes on each replay."""

    def __init__(self) -> None:
        self._held: tuple[tuple[int, ...], QuantizedWeight] | None = None  # (ids of its sources, its copies)
        self._histories: dict[str, AmaxHistory | None] = {}
        self.quantized = 0  # how many times a weight was quantized (tests count them)

    def history(self, tensor: str, precision: Precision) -> AmaxHistory | None:
        """The amax history of the layer's `tensor` ("input", "weight" or "grad"), where
        `precision` scales from one."""
        if tensor not in self._histories:
            self._histories[tensor] = precision.history()
        return self._histories[tensor]

    def get(self, w: torch.Tensor, gemms: QuantizesWeights,
            source: torch.Tensor | tuple[torch.Tensor, ...] | None = None) -> QuantizedWeight:
        """`w` quantized by `gemms`, held until its values change; with `source`, the parameters `w`
        is made from per call (a transposed or interleaved copy: a gated MLP's gate and up), whose
        values decide instead. One weight per cache: another one replaces it (a moved or replaced
        parameter)."""
        history = self.history("weight", gemms.precision)
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            if history is not None:
                raise InvalidArgument(f"{gemms.precision}: delayed scaling advances its amax histories once per "
                                      "optimizer step, which a replayed CUDA graph does not see; use "
                                      "scaling='current' in a captured step")
            # a CUDA graph replays what it captured: the quantization goes into the graph, so that
            # each replay quantizes the weight's values of then (a held copy would go stale after
            # the next optimizer step)
            self.quantized += 1
            return gemms.weight(w)
        sources = (w,) if source is None else source if isinstance(source, tuple) else (source,)
        key = tuple(map(id, sources))
        version = tuple(map(gemms.precision.weight_version, sources))
        held = self._held[1] if self._held is not None and self._held[0] == key else None
        if held is None or held.version != version:
            if held is not None:  # an optimizer step: the histories' next scales
                for h in self._histories.values():
                    if h is not None:
                        h.advance()
            held = dataclasses.replace(gemms.weight(w, history), version=version)
            self._held = (key, held)
            self.quantized += 1
        return held


class QuantizesWeights(Protocol):
    """What `WeightCache.get` quantizes with: a layer's kernels (`LinearGemms`, `GroupedGemms`)."""

    @property
    def precision(self) -> Precision: ...

    def weight(self, w: torch.Tensor, history: AmaxHistory | None = None) -> QuantizedWeight: ...


def forward_operands(gemms: LinearGemms, cache: WeightCache, x: torch.Tensor | Operand, qw: QuantizedWeight
                     ) -> tuple[torch.Tensor, ...]:
    """fprop's A, B, scale_a, scale_b for input rows `x` (or their quantized copy, fprop's A as an
    epilogue wrote it) and the quantized weight."""
    xq = x if isinstance(x, Operand) else gemms.operand(x, Gemm.FPROP, "a", cache.history("input", gemms.precision))
    return xq.data, qw.rows.data, xq.scale, qw.rows.scale


def input_operands(gemms: LinearGemms, cache: WeightCache, x: torch.Tensor) -> tuple[Operand, torch.Tensor | Operand]:
    """X (tokens x features) as fprop's A, and what forward keeps of it for wgrad: X along the
    tokens (wgrad's B; both copies from one pass where the precision has a kernel for it), or X
    itself (`save_original_input`, quantized again in backward)."""
    history = cache.history("input", gemms.precision)
    if gemms.precision.save_original_input:
        return gemms.operand(x, Gemm.FPROP, "a", history), x
    return gemms.operands(x, (Gemm.FPROP, "a"), (Gemm.WGRAD, "b"), history)


def grad_operands(gemms: LinearGemms, cache: WeightCache, g: torch.Tensor, need_x: bool, need_w: bool
                  ) -> tuple[Operand | None, Operand | None]:
    """dL/dacc (tokens x out) as dgrad's A (where dX is needed) and along the tokens as wgrad's A
    (where dW is): both from one pass where both are needed and the precision has a kernel for it."""
    history = cache.history("grad", gemms.precision)
    if need_x and need_w:
        return gemms.operands(g, (Gemm.DGRAD, "a"), (Gemm.WGRAD, "a"), history)
    return (gemms.operand(g, Gemm.DGRAD, "a", history) if need_x else None,
            gemms.operand(g.t(), Gemm.WGRAD, "a", history) if need_w else None)


def input_grad(gemms: LinearGemms, cache: WeightCache, g: torch.Tensor | Operand, qw: QuantizedWeight
               ) -> torch.Tensor:
    """dX = dL/dacc W by the dgrad kernel (`g` quantized here, or an Operand: dgrad's A already)."""
    gq = g if isinstance(g, Operand) else gemms.operand(g, Gemm.DGRAD, "a", cache.history("grad", gemms.precision))
    return gemms.dgrad(gq.data, qw.columns.data, gq.scale, qw.columns.scale)


def weight_gradient(gemms: LinearGemms, cache: WeightCache, weight: torch.Tensor, g: torch.Tensor | Operand,
                    saved: torch.Tensor | Operand, accumulate: bool) -> torch.Tensor | None:
    """dW = dL/dacc^T X by the wgrad kernel, in the weight's dtype; with `accumulate`, None after
    adding it into `weight.main_grad` in fp32 (on the GPU in place: beta = 1). `g` is dL/dacc, or
    an Operand: wgrad's A already (dL/dacc^T along the tokens, as an epilogue wrote it)."""
    p = gemms.precision
    ga = g if isinstance(g, Operand) else gemms.operand(g.t(), Gemm.WGRAD, "a", cache.history("grad", p))
    xb = saved if isinstance(saved, Operand) else gemms.operand(saved.t(), Gemm.WGRAD, "b", cache.history("input", p))
    args = (ga.data, xb.data, ga.scale, xb.scale)
    if not accumulate:
        return gemms.wgrad(*args).to(weight.dtype)
    buffer = main_grad(weight)
    if buffer.is_cuda and direct_call_allowed((*args, buffer)):
        kernel_for(gemms.wgrad_accumulate.recipe, ga.data, xb.data, (*args[2:], buffer))(*args, buffer, out=buffer)
    else:  # the op (tracing, a dispatch mode, the CPU): a new tensor, copied back
        buffer.copy_(gemms.wgrad_accumulate(*args, buffer))
    return None


class LowPrecisionLinear(torch.autograd.Function):
    """A FusedLinear's step in its precision: forward the fprop kernel, backward the activation's
    aten derivative on the saved pre-activation, then the dgrad and wgrad kernels and the bias sum."""

    @staticmethod
    def forward(ctx: Any, gemms: LinearGemms, cache: WeightCache, activation: str | None, accumulate: bool,
                x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw = cache.get(weight, gemms)
        xq, saved = input_operands(gemms, cache, x)
        args = forward_operands(gemms, cache, xq, qw) + (() if bias is None else (bias,))
        if gemms.fprop_saving is not None:
            y, pre = gemms.fprop_saving(*args)
        else:
            y, pre = gemms.fprop(*args), None
        ctx.gemms, ctx.cache, ctx.qw, ctx.activation, ctx.accumulate = gemms, cache, qw, activation, accumulate
        ctx.has_bias = bias is not None
        ctx.saved_operand = saved if isinstance(saved, Operand) else None
        ctx.save_for_backward(weight, pre, saved if isinstance(saved, torch.Tensor) else None)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        weight, pre, x = ctx.saved_tensors
        _, _, _, _, need_x, need_w, need_b = ctx.needs_input_grad
        g = g.contiguous()
        g_pre = g if ctx.activation is None else activation_backward(ctx.activation, g, pre)
        g_rows, g_columns = grad_operands(ctx.gemms, ctx.cache, g_pre, need_x, need_w)
        gx = input_grad(ctx.gemms, ctx.cache, g_rows, ctx.qw) if g_rows is not None else None
        saved = ctx.saved_operand if ctx.saved_operand is not None else x
        gw = weight_gradient(ctx.gemms, ctx.cache, weight, g_columns, saved, ctx.accumulate) \
            if g_columns is not None else None
        gb = g_pre.sum(0) if ctx.has_bias and need_b else None
        return None, None, None, None, gx, gw, gb


@dataclass(frozen=True)
class MLPGemms:
    """A low-precision FusedMLP's kernels: each layer's (`LinearGemms`), fc1's fprop also saving its
    accumulator (`fc1_saving`), and fc2's dgrad carrying fc1's derived epilogue (`bwd`). Where the
    precision quantizes in the epilogue (`Precision.quantizing_backward`), `fc1_quantizing` and
    `bwd_quantizing` are those two kernels writing their D as the next GEMMs read it: h as fc2's
    fprop A and wgrad B (under `save_original_input`, fprop A and h itself, kept), dL/dacc1 as
    fc1's dgrad A and wgrad A; else None."""

    fc1: LinearGemms
    fc1_saving: OpCaller
    bwd: OpCaller
    fc2: LinearGemms
    fc1_quantizing: OpCaller | None = None
    bwd_quantizing: OpCaller | None = None


@functools.cache
def mlp_gemms(precision: Precision, activation: str, bias1: bool, bias2: bool, dtype: torch.dtype) -> MLPGemms:
    """The kernels of a low-precision FusedMLP (shared by every module of the same kind)."""
    recipe = linear_recipe(activation, bias1, dtype)
    backward, quantizing = precision.backward(recipe), precision.quantizing_backward(recipe)
    return MLPGemms(linear_gemms(precision, activation, bias1, dtype), caller(backward.forward),
                    caller(backward.kernel), linear_gemms(precision, None, bias2, dtype),
                    *((caller(quantizing.forward), caller(quantizing.kernel)) if quantizing else ()))


class LowPrecisionMLP(torch.autograd.Function):
    """A FusedMLP's step in its precision, both layers one autograd node so that backward fuses
    across their boundary: fc2's dgrad kernel turns dL/dY into dL/dacc1 and fc1's bias gradient."""

    @staticmethod
    def forward(ctx: Any, gemms: MLPGemms, caches: tuple[WeightCache, WeightCache], accumulate: bool,
                w1_source: tuple[torch.Tensor, ...] | None, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                w2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
        q1, q2 = caches[0].get(w1, gemms.fc1, w1_source), caches[1].get(w2, gemms.fc2)
        xq, kept_x = input_operands(gemms.fc1, caches[0], x)
        fc1_args = (*forward_operands(gemms.fc1, caches[0], xq, q1), *(() if b1 is None else (b1,)))
        h: torch.Tensor | Operand
        kept_h: torch.Tensor | Operand
        p = gemms.fc2.precision
        if gemms.fc1_quantizing is not None:
            # h quantized by fc1's epilogue for both of fc2's GEMMs that read it (with save_original_input
            # for its fprop, h itself kept and quantized again in the backward)
            history = caches[1].history("input", p)
            operands = {"scale_a": fc1_args[2], "scale_b": fc1_args[3], "bias": b1,
                        **p.quantizing_operands(Gemm.FPROP, history, x.device)}
            outs = gemms.fc1_quantizing.by_name(fc1_args[0], fc1_args[1], operands)
            (h, kept_h), saved_acc = p.quantized(outs, Gemm.FPROP, operands, history), outs["saved_acc"]
        else:
            h_bf16, saved_acc = gemms.fc1_saving(*fc1_args)
            h, kept_h = input_operands(gemms.fc2, caches[1], h_bf16)
        y = gemms.fc2.fprop(*forward_operands(gemms.fc2, caches[1], h, q2), *(() if b2 is None else (b2,)))
        ctx.gemms, ctx.caches, ctx.q, ctx.accumulate, ctx.has_b2 = gemms, caches, (q1, q2), accumulate, b2 is not None
        kept = (kept_x, kept_h)
        ctx.operands = tuple(k if isinstance(k, Operand) else None for k in kept)
        ctx.save_for_backward(w1, b1, w2, saved_acc, *(k if isinstance(k, torch.Tensor) else None for k in kept))
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        gemms: MLPGemms = ctx.gemms
        q1, q2 = ctx.q
        w1, b1, w2, saved_acc, x, h = ctx.saved_tensors
        kept_x, kept_h = (o if o is not None else t for o, t in zip(ctx.operands, (x, h), strict=True))
        _, _, _, _, need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        g = g.contiguous()
        c1, c2 = ctx.caches
        gq, g_t = grad_operands(gemms.fc2, c2, g, True, need_w2)
        assert gq is not None
        operands = {"scale_a": gq.scale, "scale_b": q2.columns.scale, "saved_acc": saved_acc, "bias": b1}
        g_acc1: Operand | None
        g_acc1_t: torch.Tensor | Operand | None
        if gemms.bwd_quantizing is not None:  # dL/dacc1 quantized by the kernel for fc1's dgrad and wgrad
            history = c1.history("grad", gemms.fc1.precision)
            operands |= gemms.fc1.precision.quantizing_operands(Gemm.DGRAD, history, g.device)
            outs = gemms.bwd_quantizing.by_name(gq.data, q2.columns.data, operands)
            g_acc1, g_acc1_t = gemms.fc1.precision.quantized(outs, Gemm.DGRAD, operands, history)
        else:  # dL/dacc1 in 16 bits: quantized here, both copies in one pass where the precision can
            outs = gemms.bwd.by_name(gq.data, q2.columns.data, operands)
            g_acc1, g_acc1_t = grad_operands(gemms.fc1, c1, outs["d"], need_x, need_w1)
        gx = input_grad(gemms.fc1, c1, g_acc1, q1) if need_x and g_acc1 is not None else None
        gw1 = weight_gradient(gemms.fc1, c1, w1, g_acc1_t, kept_x, ctx.accumulate) \
            if need_w1 and g_acc1_t is not None else None
        gb1 = outs["grad_bias"].to(b1.dtype) if b1 is not None and need_b1 else None
        gw2 = weight_gradient(gemms.fc2, c2, w2, g_t, kept_h, ctx.accumulate) if g_t is not None else None
        gb2 = g.sum(0) if ctx.has_b2 and need_b2 else None
        return None, None, None, None, gx, gw1, gb1, gw2, gb2


__all__ = ["LinearGemms", "LowPrecisionLinear", "LowPrecisionMLP", "MLPGemms", "QuantizesWeights", "WeightCache",
           "check_precision", "check_recompute", "forward_operands", "fp32_weight_grad_recipe", "grad_operands",
           "input_grad", "input_operands", "linear_gemms", "mlp_gemms", "weight_gradient"]

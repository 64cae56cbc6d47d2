"""`FusedMLP`: Linear -> activation -> Linear, with the backward fused at the layer boundary.

    mlp = gemmgen.nn.FusedMLP(4096, 14336, 4096, activation="gelu", dtype=torch.bfloat16)

Forward is two gemmgen kernels: fc1 with its bias and activation (also saving its accumulator
for the backward, `Recipe.backward`), fc2 with its bias. Backward runs fc2's dgrad GEMM with fc1's
derived epilogue: dL/dY @ W2 is dL/dh, and the same kernel turns it into dL/dacc1 (the
activation's derivative from the saved accumulator) and fc1's bias gradient (a sum over the
tokens), where the unfused model runs a GEMM, then the activation's backward and a reduction.
The rest is the plain dgrad and wgrad GEMMs and fc2's bias gradient.

`recompute=True` saves nothing but the input: backward runs dL/dh = dL/dY @ W2 as a plain GEMM
and fc1's GEMM again with the derived epilogue (dL/dacc1, fc1's bias gradient and h itself, for
fc2's weight gradient): one more GEMM, and no hidden-sized tensor kept from the forward.

A gated activation (`activation="swiglu"` or `"geglu"`, Llama's and its successors' MLP: fc1's
weight holds 2 x hidden rows, gate and up interleaved) works the same: fc2's dgrad GEMM (dL/dh,
hidden columns) reads fc1's saved accumulator (2 x hidden columns) as its pairs and writes
dL/dgate and dL/dup interleaved (docs/design/pairs.md). With a bias, fc1 always recomputes (its
derived epilogue would add the bias to the saved accumulator's pairs, which it does not yet);
fc1's bias gradient, a sum over the tokens, is then torch's.

`accumulate_grad=True` adds the weight gradients in fp32 into each weight's `main_grad` (created
as zeros if missing), as Megatron-LM and Transformer Engine do, instead of setting `.grad`.

As a drop-in module it follows `.to()`, `.half()`, `.float()` and autocast as nn.Linear does
(`FusedLinear`), and returns a contiguous output of the unfused MLP's shape and dtype.

`fuse(model, mlp=True)` puts FusedMLPs into models without changing their state_dict (the same
keys, shapes and layouts, so checkpoints load strictly both ways and gradients reach the
parameters the model had): `FusedMLP.chain` in place of a Linear -> activation -> Linear, holding
the first Linear's parameters as its own and running the second's from an `MLPSecondLayer` left in
that Linear's place; `FusedMLP.gated` in place of a gated MLP module, with the module's own
children (gate, up, down, activation) under their names, interleaving gate's and up's rows at
call time (`_fc1_parameters`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import tuning
from ..config import Arch, KernelConfig
from ..dsl import Backward, Recipe
from ..errors import InvalidArgument
from ..training import Precision
from .base import (
    COMPUTE_DTYPES,
    GATED,
    ReadOnlyOptions,
    RecipeModule,
    activation_fn,
    call_dtypes,
    check_parameter,
    conv1d_sizes,
    dense_output,
    launch_arch,
    warn_no_kernel,
)
from .grads import accumulating, halves_weight_grad, pairs_weight_grad, weight_grad
from .linear import FusedLinear, training_flag
from .low_precision import (
    LowPrecisionMLP,
    MLPGemms,
    WeightCache,
    check_precision,
    check_recompute,
    forward_operands,
    mlp_gemms,
)
from .mlp_kernels import MLPKernels, mlp_kernels
from .pairs import GateUpHalf, contents_key, interleave_pairs, same_contents
from .plan import mlp_plan


class _MLPFunction(torch.autograd.Function):
    """Both layers as one autograd node, so that backward can fuse across their boundary."""

    @staticmethod
    def forward(ctx: Any, mlp: FusedMLP, kernels: MLPKernels, accumulate: bool, x: torch.Tensor,
                w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
        args1 = (x, w1) if b1 is None else (x, w1, b1)
        if kernels.recompute:
            h, saved = kernels.fc1(*args1), None
        else:
            h, saved = kernels.fc1_saving(*args1)
        y = kernels.fc2(h, w2) if b2 is None else kernels.fc2(h, w2, b2)
        ctx.mlp, ctx.kernels, ctx.accumulate, ctx.has_b2 = mlp, kernels, accumulate, b2 is not None
        ctx.save_for_backward(x, w1, b1, w2, saved, None if kernels.recompute else h)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        mlp: FusedMLP = ctx.mlp
        kernels: MLPKernels = ctx.kernels
        x, w1, b1, w2, saved, h = ctx.saved_tensors
        _, _, _, need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        g = g.contiguous()
        w2_rows = w2.t()  # W2 as out x hidden: the dgrad GEMM's B (row-major; a Conv1D's, column-major)
        if kernels.recompute:
            inputs = {"bias": b1, "grad_d": torch.matmul(g, w2_rows)}
            a, b = x, w1
        else:
            inputs, a, b = {"saved_acc": saved, "bias": b1}, g, w2_rows
        outs = kernels.bwd.by_name(a, b, inputs)
        g_acc1 = outs["d"]
        if kernels.recompute:
            h = outs["fwd_d"]
        gx = torch.matmul(g_acc1, w1.t()) if need_x else None
        gw1 = mlp._fc1_weight_grad(g_acc1, x, ctx.accumulate) if need_w1 else None
        gb1 = None
        if b1 is not None and need_b1:  # over column pairs a sum over M: torch's
            gb1 = outs["grad_bias"].to(b1.dtype) if "grad_bias" in outs else g_acc1.sum(0).to(b1.dtype)
        gw2 = weight_grad(mlp.fc2.weight, g, h, ctx.accumulate, mlp.fc2.weight_in_out) if need_w2 else None
        gb2 = g.sum(0) if ctx.has_b2 and need_b2 else None
        return None, None, None, gx, gw1, gb1, gw2, gb2


class MLPSecondLayer(ReadOnlyOptions):
    """What `fuse(model, mlp=True)` leaves in the place of the second Linear of a Linear ->
    activation -> Linear that it made one FusedMLP (`FusedMLP.chain`, in the first Linear's
    place): that Linear's `weight` and `bias`, registered where the model had them (the same
    state_dict keys; the FusedMLP runs them), and a forward that returns its input, as the FusedMLP
    has already applied the layer to it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    _options = ("in_features", "out_features")

    def __init__(self, linear: nn.Module, name: str, applied_by: str) -> None:
        """`linear`'s parameters (shared; an nn.Linear's or a Conv1D's), for the model's `name`
        (where it is, for reprs), whose FusedMLP is at `applied_by`."""
        super().__init__()
        sizes = conv1d_sizes(linear)
        if sizes is None:
            assert isinstance(linear, nn.Linear), "FusedMLP.chain refuses other layers"
            sizes = linear.in_features, linear.out_features
        self.in_features, self.out_features = sizes
        self.name, self.applied_by = name, applied_by
        self.weight = linear.get_parameter("weight")
        self.bias = linear._parameters.get("bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"applied by the FusedMLP at {self.applied_by!r}")


class FusedMLP(RecipeModule):
    """Linear(in, hidden) -> activation -> Linear(hidden, out) as gemmgen kernels, trained with
    fc1's activation derivative and bias gradient inside fc2's dgrad GEMM (module docstring).
    `fc1` and `fc2` are FusedLinear layers (fc2 without activation) holding the parameters: its
    children when built by the constructor or `from_linears`, and views of the parameters a model
    keeps where they were when `fuse` built it (`chain`, `gated`).

    It computes as FusedLinear does: in the parameters' dtype (following `.to()`), or autocast's,
    or `compute_dtype`; in torch ops where gemmgen has no kernel (fp32, fp64), said once.
    `activation` is read-only; `recompute` and `accumulate_grad` may be changed and apply from the
    next forward."""

    fc1: FusedLinear
    fc2: FusedLinear
    precision: Precision | None
    _derived = ("_kernels", "_pairs_key")
    _options = ("activation", "precision")

    def __init__(self, in_features: int, hidden_features: int, out_features: int, activation: str = "gelu",
                 bias: bool = True, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 recompute: bool = False, accumulate_grad: bool = False, precision: Precision | None = None) -> None:
        _check_activation(activation)
        super().__init__()
        self.fc1 = FusedLinear(in_features, hidden_features, bias, activation, dtype, device, precision=precision)
        self.fc2 = FusedLinear(hidden_features, out_features, bias, None, dtype, device, precision=precision)
        self._configure(recompute, accumulate_grad, precision)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, activation: str, fc2: nn.Linear, compute_dtype: torch.dtype | None = None,
                     recompute: bool = False, accumulate_grad: bool = False, precision: Precision | None = None
                     ) -> FusedMLP:
        """A FusedMLP sharing the two Linears' parameters (no copy), as its children `fc1` and
        `fc2` (so its state_dict keys are fc1.* and fc2.*; `fuse` keeps a model's own)."""
        _check_linears(fc1, activation, fc2)
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.fc1 = FusedLinear.from_linear(fc1, activation, compute_dtype, precision=precision)
        mlp.fc2 = FusedLinear.from_linear(fc2, None, compute_dtype, precision=precision)
        mlp._check_dtypes(fc1.weight, fc2.weight)
        mlp._configure(recompute, accumulate_grad, precision)
        return mlp

    @classmethod
    def chain(cls, fc1: nn.Module, activation: str, fc2: nn.Module, second: MLPSecondLayer,
              compute_dtype: torch.dtype | None = None, precision: Precision | None = None) -> FusedMLP:
        """A FusedMLP to take `fc1`'s place in a model where fc1 -> activation -> fc2 ran, with
        `second` (an MLPSecondLayer of fc2) in fc2's: it registers fc1's parameters as its own
        `weight` and `bias`, and reads fc2's from `second`, so that the model's state_dict keys stay
        the Linears' (what `fuse(mlp=True)` makes). fc1 and fc2 are nn.Linear layers, or both
        transformers' Conv1D (GPT-2's MLP: its kernels read the weights as stored, in x out)."""
        conv = conv1d_sizes(fc1) is not None
        if conv:  # GPT-2's: both layers transformers' Conv1D, their weights stored in x out
            if precision is not None:
                raise InvalidArgument(f"precision: {precision} reads weights stored out x in (nn.Linear's); fc1 "
                                      "and fc2 are Conv1D layers: leave precision= out")
            _check_activation(activation)
            n_in, hidden = FusedLinear._checked_conv1d(fc1, activation, compute_dtype, "fc1")
            n_hidden, n_out = FusedLinear._checked_conv1d(fc2, None, compute_dtype, "fc2")
            if hidden != n_hidden or (fc1.bias is None) != (fc2.bias is None):
                raise InvalidArgument(f"fc1, fc2: fc1's {hidden} outputs must feed fc2's {n_hidden} inputs, and "
                                      "both have a bias or neither; keep them as separate layers")
        else:
            _check_linears(fc1, activation, fc2)
            assert isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear), "_check_linears refuses others"
            n_in, hidden = fc1.in_features, FusedLinear._checked_linear(fc1, activation, compute_dtype)
            FusedLinear._checked_linear(fc2, None, compute_dtype)
            n_hidden, n_out = fc2.in_features, fc2.out_features
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.register_parameter("weight", fc1.get_parameter("weight"))
        mlp.register_parameter("bias", fc1._parameters.get("bias"))
        mlp.__dict__["_second"] = second
        mlp.__dict__["fc1"] = FusedLinear.sharing(mlp._parameters, n_in, hidden, activation, compute_dtype, conv)
        mlp.__dict__["fc2"] = FusedLinear.sharing(second._parameters, n_hidden, n_out, None, compute_dtype, conv)
        mlp._check_dtypes(fc1.get_parameter("weight"), fc2.get_parameter("weight"))
        mlp._configure(False, False, precision)
        return mlp

    @classmethod
    def gated(cls, owner: nn.Module, names: tuple[str, str, str, str], activation: str,
              compute_dtype: torch.dtype | None = None, chunked: bool = False,
              precision: Precision | None = None) -> FusedMLP:
        """A FusedMLP to take the place of `owner`, a gated MLP whose forward is
        `down(act(gate(x)) * up(x))` (`names`: its children gate, up, down and act): its children
        are owner's, under the same names (so the state_dict keys, and the parameters gradients
        reach, stay the module's), and fc1's weight is gate's and up's rows interleaved at call
        time (`_fc1_parameters`). What `fuse(mlp=True)` makes of Llama's MLP. `chunked`: gate and
        up are the halves of one Linear's rows (`names[0]`, also `names[1]`), as in a chunked GLU
        `down(act(a) * b)` with `a, b = wi(x).chunk(2, dim=-1)` (ModernBERT's). `precision` trains
        it in a low precision, as `FusedMLP(..., precision=)` (no biases then)."""
        wi = owner.get_submodule(names[0])
        gate: nn.Module | GateUpHalf
        up: nn.Module | GateUpHalf
        if chunked:
            if not isinstance(wi, nn.Linear) or names[1] != names[0] or wi.out_features % 2:
                raise InvalidArgument(f"{names[0]}: a chunked GLU's gate and up are the halves of one torch.nn.Linear "
                                      "of an even number of outputs, named twice in names")
            gate, up = GateUpHalf(wi, 0), GateUpHalf(wi, 1)
        else:
            gate, up = wi, owner.get_submodule(names[1])
        down = owner.get_submodule(names[2])
        if not (isinstance(gate, nn.Linear | GateUpHalf) and isinstance(up, nn.Linear | GateUpHalf)
                and isinstance(down, nn.Linear)):
            raise InvalidArgument(f"{', '.join(names[:3])}: expected torch.nn.Linear layers")
        if activation not in GATED:
            raise InvalidArgument(f"activation: a gated MLP takes one of {sorted(GATED)}, got {activation!r}")
        if gate.weight.shape != up.weight.shape or (gate.bias is None) != (up.bias is None):
            raise InvalidArgument(f"{names[0]}, {names[1]}: the gate and up projections differ in shape or bias")
        if gate.out_features != down.in_features or (gate.bias is None) != (down.bias is None):
            raise InvalidArgument(f"{names[0]}, {names[2]}: {names[0]}'s {gate.out_features} outputs must feed "
                                  f"{names[2]}'s {down.in_features} inputs, and all have a bias or none")
        FusedLinear._checked_linear(wi, None, compute_dtype)  # type: ignore[arg-type]
        FusedLinear._checked_linear(down, None, compute_dtype)
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        for name, child in owner.named_children():
            mlp.add_module(name, child)
        pairs: dict[str, Any] = {}
        mlp.__dict__["_gated"] = names[:3]
        mlp.__dict__["_chunked"] = chunked
        mlp.__dict__["_pairs_parameters"] = pairs
        mlp._forget_pairs(compute_dtype or gate.weight.dtype)
        mlp.__dict__["fc1"] = FusedLinear.sharing(pairs, gate.in_features, gate.out_features, activation,
                                                  compute_dtype, precision=precision)
        mlp.__dict__["fc2"] = FusedLinear.sharing(down._parameters, down.in_features, down.out_features, None,
                                                  compute_dtype, precision=precision)
        mlp._check_dtypes(gate.weight, down.weight)
        mlp._configure(False, False, precision)
        return mlp

    def _check_dtypes(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        if self.fc1.compute_dtype != self.fc2.compute_dtype:
            raise InvalidArgument(f"fc1, fc2: weights of {w1.dtype} and {w2.dtype}; give compute_dtype= so that "
                                  "both layers compute in one type")

    def _configure(self, recompute: bool, accumulate_grad: bool, precision: Precision | None) -> None:
        fc1, fc2 = self.fc1, self.fc2
        self.__dict__["precision"] = check_precision(precision, fc1.in_features, fc2.in_features, fc1.activation,
                                                     "FusedMLP")
        if self.precision is not None and fc1.activation in GATED and fc1.bias is not None:
            raise InvalidArgument(f"FusedMLP: a gated activation ({fc1.activation}) with biases under precision="
                                  f"{self.precision}: its backward would recompute fc1's GEMM, which the low-precision "
                                  "step does not do yet; use bias=False (Llama's MLP has none) or leave precision= out")
        self._weights = (WeightCache(), WeightCache())
        self._recompute = check_recompute(training_flag("recompute", recompute), self.precision, "FusedMLP")
        self._accumulate_grad = training_flag("accumulate_grad", accumulate_grad)
        self._set_recipes()

    @property
    def activation(self) -> str:
        """fc1's activation (read-only: its kernels were made for it)."""
        return str(self.fc1.activation)

    @property
    def recompute(self) -> bool:
        """Whether backward recomputes fc1's GEMM instead of storing its accumulator and h (always,
        for a gated fc1 with a bias); may be changed, and applies from the next forward."""
        fc1, fc2 = self.fc1.bias is not None, self.fc2.bias is not None
        return self._kernels_for(self.fc1.kernel_dtype, fc1, fc2).recompute

    @recompute.setter
    def recompute(self, value: bool) -> None:
        self._recompute = check_recompute(training_flag("recompute", value), self.precision, "FusedMLP")
        self._set_recipes()

    @property
    def accumulate_grad(self) -> bool:
        """Whether backward adds the weight gradients in fp32 into each weight's `main_grad`
        instead of setting `.grad`; may be changed, and applies from the next forward."""
        return self._accumulate_grad

    @accumulate_grad.setter
    def accumulate_grad(self, value: bool) -> None:
        self._accumulate_grad = training_flag("accumulate_grad", value)

    @property
    def _gemms(self) -> MLPGemms:
        """The kernels of a module with a `precision` (in fc1's `kernel_dtype`)."""
        assert self.precision is not None
        return mlp_gemms(self.precision, self.activation, self.fc1.bias is not None, self.fc2.bias is not None,
                         self.fc1.kernel_dtype)

    @property
    def _backward(self) -> Backward:
        fc1, fc2 = self.fc1.bias is not None, self.fc2.bias is not None
        return self._kernels_for(self.fc1.kernel_dtype, fc1, fc2).backward

    def _set_recipes(self) -> None:
        """Forget kernels made for other dtypes or options, re-read a gated MLP's gate and up (the
        dtype or device may have changed), and make the kernels of the dtype it computes in now."""
        self._kernels: dict[tuple[torch.dtype, bool, bool], MLPKernels] = {}
        names = self.__dict__.get("_gated")
        if names is not None:
            gate, _ = self._gate_up()
            self._forget_pairs(self.fc1._fixed_dtype or gate.weight.dtype)
            self.fc2.__dict__["_parameters"] = self._modules[names[2]]._parameters  # type: ignore[union-attr]
        self._kernels_for(self.fc1.kernel_dtype, self.fc1.bias is not None, self.fc2.bias is not None)

    def _kernels_for(self, dtype: torch.dtype, bias1: bool, bias2: bool) -> MLPKernels:
        key = (dtype, bias1, bias2)
        found = self._kernels.get(key)
        if found is None:
            found = self._kernels[key] = mlp_kernels(self.activation, bias1, bias2, dtype, self._recompute,
                                                     self.fc1.weight_in_out)
        return found

    def _gate_up(self) -> tuple[nn.Linear | GateUpHalf, nn.Linear | GateUpHalf]:
        gate, up, _ = self.__dict__["_gated"]
        if self.__dict__.get("_chunked"):
            wi = self._modules[gate]
            assert isinstance(wi, nn.Linear)
            return GateUpHalf(wi, 0), GateUpHalf(wi, 1)
        return self._modules[gate], self._modules[up]  # type: ignore[return-value]

    def _weight(self) -> torch.Tensor:
        """The weight whose dtype the module follows: fc1's (gate's, for a gated module)."""
        return self._gate_up()[0].weight if self.__dict__.get("_gated") else self.fc1.weight

    def _forget_pairs(self, dtype: torch.dtype) -> None:
        """Free a gated module's interleaved copy of gate and up (`_pairs`), leaving in fc1's
        parameter dict meta tensors of its shape and `dtype` (what fc1's recipe and launches read)."""
        gate, _ = self._gate_up()
        pairs = self.__dict__["_pairs_parameters"]
        rows = 2 * gate.out_features
        pairs["weight"] = torch.empty((rows, gate.in_features), dtype=dtype, device="meta")
        pairs["bias"] = torch.empty(rows, dtype=dtype, device="meta") if gate.bias is not None else None
        self.__dict__["_pairs_key"] = None

    def _pairs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A gated module's fc1 weight and bias in `dtype`, for calls without gradients: gate's and
        up's rows interleaved, made again only when one of them has changed (another tensor, or
        written in place: its version), and kept in fc1's parameter dict (so `fc1.weight` is it).
        The copy costs the memory of gate and up once more while kept; a forward with gradients
        wanted, `.to()` and the like free it (`_forget_pairs`)."""
        gate, up = self._gate_up()
        key = (dtype, tuple(contents_key(t) for t in (gate.weight, up.weight, gate.bias, up.bias)))
        kept: tuple[torch.dtype, tuple[tuple[object, int, int], ...]] | None = self.__dict__.get("_pairs_key")
        fresh = kept is not None and kept[0] == dtype and same_contents(kept[1], key[1])
        pairs = self.__dict__["_pairs_parameters"]
        if not fresh:
            with torch.no_grad():
                pairs["weight"] = _interleaved(gate.weight, up.weight, dtype)
                pairs["bias"] = _interleaved_bias(gate, up, dtype)
            self.__dict__["_pairs_key"] = key
        return pairs["weight"], pairs["bias"]

    def _fc1_parameters(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fc1's weight as its kernel's B (W1^T) and its bias, in `dtype`. A gated module's are
        gate's and up's rows interleaved: with gradients wanted, per call (a copy of gate and up,
        whose gradient autograd takes apart again), else kept until they change (`_pairs`)."""
        if not self.__dict__.get("_gated"):
            return self.fc1.kernel_parameters(dtype)
        gate, up = self._checked_gate_up()
        tracked = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (gate.weight, up.weight, gate.bias, up.bias))
        w1: torch.Tensor
        b1: torch.Tensor | None
        if tracked or torch.compiler.is_compiling():
            if not torch.compiler.is_compiling() and self.__dict__["_pairs_key"] is not None:
                self._forget_pairs(dtype)
            w1 = _interleaved(gate.weight, up.weight, dtype)
            b1 = _interleaved_bias(gate, up, dtype)
        else:
            w1, b1 = self._pairs(dtype)
        return w1.t(), b1

    def _checked_gate_up(self) -> tuple[nn.Linear | GateUpHalf, nn.Linear | GateUpHalf]:
        """A gated module's gate and up, their weights checked against fc1's shape."""
        hidden, n_in = self.fc1.out_features, self.fc1.in_features
        names = self.__dict__["_gated"]
        if self.__dict__.get("_chunked"):
            check_parameter(f"{names[0]}.weight", self.get_submodule(names[0]).get_parameter("weight"),
                            (2 * hidden, n_in), "(2 x hidden, in_features): its halves gate and up")
        gate, up = self._gate_up()
        for name, layer in zip(names, (gate, up), strict=False):
            check_parameter(f"{name}.weight", layer.weight, (hidden, n_in), "(hidden, in_features)")
        return gate, up

    def _master_fc1(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """fc1's weight (out x in) in its own dtype (the master weights a precision quantizes) and,
        for a gated module, the parameters it is interleaved from (`_fc1_parameters`: per call with
        gradients, else kept), whose values say when to quantize it again (`WeightCache.get`)."""
        names = self.__dict__.get("_gated")
        if names is None:
            return self.fc1.weight, None
        w1_t, _ = self._fc1_parameters(self._weight().dtype)
        return w1_t.t(), tuple(self.get_submodule(n).get_parameter("weight") for n in dict.fromkeys(names[:2]))

    def _fc1_weight_grad(self, g_acc1: torch.Tensor, x: torch.Tensor, accumulate: bool) -> torch.Tensor | None:
        """fc1's weight gradient, for its kernel's B (`grads.weight_grad`); a gated module's into
        gate's and up's own `main_grad` with `accumulate`."""
        if not self.__dict__.get("_gated"):
            return weight_grad(self.fc1.weight, g_acc1, x, accumulate, self.fc1.weight_in_out)
        if self.__dict__.get("_chunked"):
            wi = self._modules[self.__dict__["_gated"][0]]
            return halves_weight_grad(wi.weight, g_acc1, x, accumulate)  # type: ignore[union-attr, arg-type]
        gate, up = self._gate_up()
        return pairs_weight_grad(gate.weight, up.weight, g_acc1, x, accumulate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc1._check_input_type(x)
        dtype, out_dtype = call_dtypes(x, self._weight().dtype, self.fc1._fixed_dtype)
        if dtype not in COMPUTE_DTYPES:
            warn_no_kernel(self, dtype)
            return self.reference(x)
        x2, lead = self.fc1.rows(x, dtype)
        if self.precision is not None:
            return dense_output(self._low_precision(x2, dtype), (*lead, self.fc2.out_features), out_dtype)
        w1, b1 = self._fc1_parameters(dtype)
        w2, b2 = self.fc2.kernel_parameters(dtype)
        kernels = self._kernels_for(dtype, b1 is not None, b2 is not None)
        params = (x2, w1, b1, w2, b2)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params):
            y = _MLPFunction.apply(self, kernels, self._accumulate_grad, *params)
        else:
            h = kernels.fc1(x2, w1) if b1 is None else kernels.fc1(x2, w1, b1)
            y = kernels.fc2(h, w2) if b2 is None else kernels.fc2(h, w2, b2)
        return dense_output(y, (*lead, self.fc2.out_features), out_dtype)

    def _low_precision(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward in `precision` (nn.low_precision): the weights as they are (bf16 or fp32 master
        weights, quantized once per optimizer step), the biases in `dtype`."""
        if self.fc2.out_features % 16:
            raise InvalidArgument(f"FusedMLP: out_features = {self.fc2.out_features} is not a multiple of 16: "
                                  f"{self.precision} reads fp8 rows along it; leave precision= out")
        w1, source = self._master_fc1()
        b1, b2 = self.fc1.kernel_bias(dtype), self.fc2.kernel_bias(dtype)
        gemms = mlp_gemms(self.precision, self.activation, b1 is not None, b2 is not None, dtype)
        params = (x, w1, b1, self.fc2.weight, b2)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params):
            return LowPrecisionMLP.apply(gemms, self._weights, self._accumulate_grad, source, *params)
        q1, q2 = self._weights[0].get(w1, gemms.fc1, source), self._weights[1].get(params[3], gemms.fc2)
        caches = self._weights
        h = gemms.fc1.fprop(*forward_operands(gemms.fc1, caches[0], x, q1), *(() if b1 is None else (b1,)))
        return gemms.fc2.fprop(*forward_operands(gemms.fc2, caches[1], h, q2), *(() if b2 is None else (b2,)))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's math by torch ops in x's dtype: what it runs where gemmgen has no kernel (fp32,
        fp64 parameters outside autocast); `accumulate_grad` holds here too."""
        names = self.__dict__.get("_gated")
        if names is None:
            return self.fc2.reference(self.fc1.reference(x))
        # a chunked GLU's one Linear, whose output's halves are gate and up; else gate's and up's
        layers: list[nn.Linear | GateUpHalf] = [cast(nn.Linear, self._modules[names[0]])] \
            if self.__dict__.get("_chunked") else list(self._gate_up())
        pre: list[torch.Tensor] = []
        for layer in layers:
            w, b = layer.weight, layer.bias
            w = accumulating(w) if self._accumulate_grad else w
            pre.append(F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)))
        if len(pre) == 1:
            pre = list(pre[0].chunk(2, dim=-1))
        act = F.silu if self.activation == "swiglu" else F.gelu  # the gated activations' (base.ACTIVATIONS)
        return self.fc2.reference(act(pre[0]) * pre[1])

    def launches(self, tokens: int, training: bool = False, sm_count: int | None = None,
                 device: tuning.Device | None = None, arch: Arch | str | None = None
                 ) -> list[tuple[Recipe, KernelConfig]]:
        """(recipe, config) of each gemmgen kernel a forward of `tokens` rows launches (with
        `training`, as it runs when gradients are wanted), as the launch policy decides (see
        FusedLinear.launches)."""
        target = launch_arch(arch)
        return [g.launch(sm_count, device, target) for g in mlp_plan(self, tokens, training) if not g.backward]

    def backward_launches(self, tokens: int, sm_count: int | None = None, device: tuning.Device | None = None,
                          arch: Arch | str | None = None) -> list[tuple[Recipe, KernelConfig]]:
        """(recipe, config) of the gemmgen kernels a backward of `tokens` rows launches: the derived
        kernel (its GEMM fc2's dgrad, or fc1's again with `recompute`), and with `accumulate_grad`
        the two fp32 weight-gradient GEMMs; every GEMM of the step, torch's too, is
        `gemmgen.nn.plan.mlp_plan`'s."""
        target = launch_arch(arch)
        return [g.launch(sm_count, device, target) for g in mlp_plan(self, tokens) if g.backward and g.recipe]

    def extra_repr(self) -> str:
        second = self.__dict__.get("_second")
        sizes = ""
        if second is not None or self.__dict__.get("_gated"):
            sizes = (f"in_features={self.fc1.in_features}, hidden_features={self.fc1.out_features}, "
                     f"out_features={self.fc2.out_features}, ")
        where = f", fc2's parameters at {second.name!r}" if second is not None else ""
        precision = f", precision={self.precision}" if self.precision is not None else ""
        return (f"{sizes}activation={self.activation!r}, recompute={self.recompute}, "
                f"accumulate_grad={self.accumulate_grad}{precision}{where}")


def _interleaved_bias(gate: nn.Linear | GateUpHalf, up: nn.Linear | GateUpHalf, dtype: torch.dtype
                      ) -> torch.Tensor | None:
    """gate's and up's biases interleaved in `dtype` (`_interleaved`), None where they have none."""
    return None if gate.bias is None or up.bias is None else _interleaved(gate.bias, up.bias, dtype)


def _interleaved(even: torch.Tensor, odd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`interleave_pairs` of the two in `dtype` (cast first: a bf16 copy of fp32 master weights)."""
    return interleave_pairs(even.to(dtype), odd.to(dtype))


def _check_activation(activation: object) -> None:
    if activation is None or not isinstance(activation, str):
        raise InvalidArgument(f"activation: a FusedMLP needs one of relu, gelu, gelu_tanh, silu, swiglu, geglu, got "
                              f"{activation!r}")
    activation_fn(activation, gated=True)


def _check_linears(fc1: object, activation: str, fc2: object) -> None:
    """Two Linears that make a FusedMLP with `activation`: fc1's outputs (half its rows for a gated
    activation) feed fc2, and both have a bias or neither."""
    _check_activation(activation)
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
        raise InvalidArgument(f"fc1, fc2: expected torch.nn.Linear layers, got {type(fc1).__name__} and "
                              f"{type(fc2).__name__}")
    hidden = fc1.out_features // 2 if activation in GATED else fc1.out_features
    if hidden != fc2.in_features or (fc1.bias is None) != (fc2.bias is None):
        gate_up = f" ({activation}: half of fc1's rows, gate and up interleaved)" if activation in GATED else ""
        raise InvalidArgument(f"fc1, fc2: fc1's {hidden} outputs{gate_up} must feed fc2's {fc2.in_features} "
                              "inputs, and both have a bias or neither; keep them as separate layers")

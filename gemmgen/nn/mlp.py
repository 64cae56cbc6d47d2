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
dL/dgate and dL/dup interleaved (docs/pairs.md). With a bias, fc1 always recomputes (its
derived epilogue would add the bias to the saved accumulator's pairs, which it does not yet);
fc1's bias gradient, a sum over the tokens, is then torch's.

`accumulate_grad=True` adds the weight gradients in fp32 into each weight's `main_grad` (created
as zeros if missing), as Megatron-LM and Transformer Engine do, instead of setting `.grad`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .. import tuning
from ..config import Arch, KernelConfig
from ..dsl import Backward, Recipe
from ..errors import InvalidArgument
from ..integrations.ops import caller
from .base import GATED, RecipeModule, activation_fn, launch_arch
from .grads import weight_grad, weight_grad_recipe
from .linear import FusedLinear, linear_recipe


@functools.cache
def mlp_backward(activation: str, bias: bool, dtype: torch.dtype, recompute: bool) -> Backward:
    """fc1's derived backward (`Recipe.backward`): for fc2's dgrad GEMM (A = dL/dY, B = W2 as
    stored, out x hidden, row-major), reading the saved accumulator; with `recompute`, fc1's own
    GEMM again, reading dL/dh and also writing h (`fwd_d`)."""
    fc1 = linear_recipe(activation, bias, dtype)
    if not recompute:
        saving = fc1.backward()
        if not saving.recompute:  # a gated fc1 with a bias recomputes (Recipe.backward)
            return saving
    return fc1.backward(recompute=True, recompute_d=True)


class _MLPFunction(torch.autograd.Function):
    """Both layers as one autograd node, so that backward can fuse across their boundary."""

    @staticmethod
    def forward(ctx: Any, mlp: FusedMLP, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                w2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
        args1 = (x, w1) if b1 is None else (x, w1, b1)
        if mlp.recompute:
            h, saved = mlp.fc1._op(*args1), None
        else:
            h, saved = mlp._fc1_saving(*args1)
        y = mlp.fc2._op(h, w2) if b2 is None else mlp.fc2._op(h, w2, b2)
        ctx.mlp, ctx.has_b2 = mlp, b2 is not None
        ctx.save_for_backward(x, w1, b1, w2, saved, None if mlp.recompute else h)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        mlp: FusedMLP = ctx.mlp
        x, w1, b1, w2, saved, h = ctx.saved_tensors
        _, need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        g = g.contiguous()
        w2_rows = w2.t()  # W2 as stored (out x hidden): the dgrad GEMM's B, row-major
        if mlp.recompute:
            inputs = {"bias": b1, "grad_d": torch.matmul(g, w2_rows)}
            a, b = x, w1
        else:
            inputs, a, b = {"saved_acc": saved, "bias": b1}, g, w2_rows
        outs = mlp._bwd.by_name(a, b, inputs)
        g_acc1 = outs["d"]
        if mlp.recompute:
            h = outs["fwd_d"]
        gx = torch.matmul(g_acc1, w1.t()) if need_x else None
        gw1 = weight_grad(mlp.fc1.weight, g_acc1, x, mlp.accumulate_grad) if need_w1 else None
        gb1 = None
        if b1 is not None and need_b1:  # over column pairs a sum over M: torch's
            gb1 = outs["grad_bias"].to(b1.dtype) if "grad_bias" in outs else g_acc1.sum(0).to(b1.dtype)
        gw2 = weight_grad(mlp.fc2.weight, g, h, mlp.accumulate_grad) if need_w2 else None
        gb2 = g.sum(0) if ctx.has_b2 and need_b2 else None
        return None, gx, gw1, gb1, gw2, gb2


class FusedMLP(RecipeModule):
    """Linear(in, hidden) -> activation -> Linear(hidden, out) as gemmgen kernels, trained with
    fc1's activation derivative and bias gradient inside fc2's dgrad GEMM (module docstring).
    `fc1` and `fc2` are FusedLinear layers (fc2 without activation) holding the parameters."""

    fc1: FusedLinear
    fc2: FusedLinear
    _derived = ("_fc1_saving", "_backward", "_bwd")

    def __init__(self, in_features: int, hidden_features: int, out_features: int, activation: str = "gelu",
                 bias: bool = True, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 recompute: bool = False, accumulate_grad: bool = False) -> None:
        _check_activation(activation)
        super().__init__()
        self.fc1 = FusedLinear(in_features, hidden_features, bias, activation, dtype, device)
        self.fc2 = FusedLinear(hidden_features, out_features, bias, None, dtype, device)
        self._configure(recompute, accumulate_grad)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, activation: str, fc2: nn.Linear, compute_dtype: torch.dtype | None = None,
                     recompute: bool = False, accumulate_grad: bool = False) -> FusedMLP:
        """A FusedMLP sharing the two Linears' parameters (no copy)."""
        _check_activation(activation)
        if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
            raise InvalidArgument(f"fc1, fc2: expected torch.nn.Linear layers, got {type(fc1).__name__} and "
                                  f"{type(fc2).__name__}")
        hidden = fc1.out_features // 2 if activation in GATED else fc1.out_features
        if hidden != fc2.in_features or (fc1.bias is None) != (fc2.bias is None):
            gate_up = f" ({activation}: half of fc1's rows, gate and up interleaved)" if activation in GATED else ""
            raise InvalidArgument(f"fc1, fc2: fc1's {hidden} outputs{gate_up} must feed fc2's {fc2.in_features} "
                                  "inputs, and both have a bias or neither; keep them as separate layers")
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.fc1 = FusedLinear.from_linear(fc1, activation, compute_dtype)
        mlp.fc2 = FusedLinear.from_linear(fc2, None, compute_dtype)
        if mlp.fc1.compute_dtype != mlp.fc2.compute_dtype:
            raise InvalidArgument(f"fc1, fc2: weights of {fc1.weight.dtype} and {fc2.weight.dtype}; give "
                                  "compute_dtype= so that both layers compute in one type")
        mlp._configure(recompute, accumulate_grad)
        return mlp

    def _configure(self, recompute: bool, accumulate_grad: bool) -> None:
        for name, value in (("recompute", recompute), ("accumulate_grad", accumulate_grad)):
            if not isinstance(value, bool):
                raise InvalidArgument(f"{name}: expected True or False, got {value!r}")
        self.recompute, self.accumulate_grad = recompute, accumulate_grad
        self._set_recipes()
        self.recompute = self._backward.recompute  # a gated fc1 with a bias always recomputes

    @property
    def activation(self) -> str:
        assert self.fc1.activation is not None
        return self.fc1.activation

    def _set_recipes(self) -> None:
        bias = self.fc1.bias is not None
        self._backward = mlp_backward(self.activation, bias, self.fc1.compute_dtype, self.recompute)
        self._fc1_saving = caller(self._backward.forward)
        self._bwd = caller(self._backward.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, w1, b1, lead = self.fc1.inputs(x)
        w2, b2 = self.fc2.kernel_parameters()
        params = (x2, w1, b1, w2, b2)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params):
            y = _MLPFunction.apply(self, *params)
        else:
            y = self.fc2(self.fc1(x2))
        return y.reshape(*lead, self.fc2.out_features)

    def launches(self, tokens: int, training: bool = False, sm_count: int | None = None,
                 device: tuning.Device | None = None, arch: Arch | str | None = None
                 ) -> list[tuple[Recipe, KernelConfig]]:
        """(recipe, config) of each gemmgen kernel a forward of `tokens` rows launches (with
        `training`, as it runs when gradients are wanted), as the launch policy decides (see
        FusedLinear.launches)."""
        m, hidden, n_in = tokens, self.fc1.weight_rows, self.fc1.in_features
        target = launch_arch(arch)
        fc2 = self.fc2.launches(tokens, sm_count=sm_count, device=device, arch=target)
        if not training or self.recompute:
            return [self.fc1.launches(tokens, sm_count=sm_count, device=device, arch=target), fc2]
        fc1 = self._backward.forward
        return [(fc1, tuning.config_for(fc1, m, hidden, n_in, 1, device=device, sm_count=sm_count, arch=target)), fc2]

    def backward_launches(self, tokens: int, sm_count: int | None = None, device: tuning.Device | None = None,
                          arch: Arch | str | None = None) -> list[tuple[Recipe, KernelConfig]]:
        """(recipe, config) of the gemmgen kernels a backward of `tokens` rows launches: the derived
        kernel (its GEMM fc2's dgrad, or fc1's again with `recompute`), and with `accumulate_grad`
        the two fp32 weight-gradient GEMMs."""
        hidden, n_in, n_out = self.fc1.out_features, self.fc1.in_features, self.fc2.out_features
        rows = self.fc1.weight_rows  # fc1's GEMM's N: 2 x hidden for a gated activation
        kernels = [(self._backward.kernel, (tokens, rows if self.recompute else hidden, n_in if self.recompute
                                            else n_out))]
        if self.accumulate_grad:
            wgrad = weight_grad_recipe(self.fc1.compute_dtype)
            kernels += [(wgrad, (rows, n_in, tokens)), (wgrad, (n_out, hidden, tokens))]
        target = launch_arch(arch)
        return [(r, tuning.config_for(r, *shape, 1, device=device, sm_count=sm_count, arch=target))
                for r, shape in kernels]

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, recompute={self.recompute}, accumulate_grad={self.accumulate_grad}"


def _check_activation(activation: object) -> None:
    if activation is None or not isinstance(activation, str):
        raise InvalidArgument(f"activation: a FusedMLP needs one of relu, gelu, gelu_tanh, silu, swiglu, geglu, got "
                              f"{activation!r}")
    activation_fn(activation, gated=True)

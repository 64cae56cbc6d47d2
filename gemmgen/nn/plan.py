"""Every GEMM of a gemmgen layer's training step, in the order it runs, with the gemmgen recipe that
computes it or None where torch does (`torch.matmul`, `torch._grouped_mm`): one place that says
what a step launches, read by the layers' `launches` and `backward_launches` (what to build ahead of
time) and by `gemmgen.advise` (what each GEMM costs)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .. import tuning
from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..dsl import Recipe
from ..integrations.grouped import (
    grouped_accumulator_recipe,
    grouped_input_grad_recipe,
    grouped_weight_grad_recipe,
)
from ..types import DType
from .grads import weight_grad_recipe


class Pass(enum.Enum):
    """Which product of a step a GEMM is, for y = x W^T: forward, dL/dx, dL/dW."""

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


@dataclass(frozen=True)
class PlannedGemm:
    """One GEMM of a step: (m, n, k) and `groups` (a grouped GEMM's experts: m is then the rows of
    all experts together), which product it is, what it computes (`what`, for people) and the
    recipe gemmgen launches for it, or None where torch computes it."""

    layer: str
    pass_: Pass
    what: str
    m: int
    n: int
    k: int
    recipe: Recipe | None
    groups: int = 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(M, N, K, L) as the launch policy takes it (a grouped GEMM's L is its groups)."""
        return self.m, self.n, self.k, self.groups

    @property
    def backward(self) -> bool:
        return self.pass_ is not Pass.FPROP

    def launch(self, sm_count: int | None = None, device: tuning.Device | None = None,
               arch: Arch = DEFAULT_ARCH) -> tuple[Recipe, KernelConfig]:
        """(recipe, config) the launch policy chooses for this GEMM (`tuning.choose_launch`)."""
        if self.recipe is None:
            raise ValueError(f"{self.layer} {self.what}: torch computes it; gemmgen launches no kernel")
        return self.recipe, tuning.config_for(self.recipe, *self.shape, device=device, sm_count=sm_count, arch=arch)


def linear_plan(layer, tokens: int, training: bool = True, name: str = "linear") -> list[PlannedGemm]:  # type: ignore[no-untyped-def]
    """A FusedLinear's GEMMs for an input of `tokens` rows: forward (with `training`, as it runs when
    gradients are wanted), then, with `training`, backward's."""
    rows, n_in, t = layer.weight_rows, layer.in_features, tokens
    if layer.precision is not None:
        recipe = layer.training_recipe if training and layer.training_recipe is not None else layer.recipe
    else:
        kernels = layer.kernels(layer.kernel_dtype)
        saving = training and kernels.training_recipe is not None and not layer._recompute
        recipe = kernels.training_recipe if saving and kernels.training_recipe is not None else kernels.recipe
    out = [PlannedGemm(name, Pass.FPROP, "y = act(x W^T + b)", t, rows, n_in, recipe)]
    if not training:
        return out
    if layer.precision is not None:
        gemms = layer._gemms
        wgrad = gemms.wgrad_accumulate if layer._accumulate_grad else gemms.wgrad
        return [*out, PlannedGemm(name, Pass.DGRAD, "dx = dL/dacc W", t, n_in, rows, gemms.dgrad.recipe),
                PlannedGemm(name, Pass.WGRAD, "dW = dL/dacc^T x", rows, n_in, t, wgrad.recipe)]
    bwd = layer.kernels(layer.kernel_dtype).bwd
    if bwd is not None:
        out.append(PlannedGemm(name, Pass.DGRAD, "dL/dacc: fprop's GEMM again, its epilogue derived", t, rows,
                               n_in, bwd.recipe))
    return [*out, PlannedGemm(name, Pass.DGRAD, "dx = dL/dacc W", t, n_in, rows, None),
            _bf16_wgrad(name, "dW = dL/dacc^T x", rows, n_in, t, layer._accumulate_grad, layer.kernel_dtype,
                        layer.weight_in_out)]


def _bf16_wgrad(name: str, what: str, rows: int, n_in: int, t: int, accumulate: bool, dtype: torch.dtype,
                weight_in_out: bool = False) -> PlannedGemm:
    """A bf16 layer's weight gradient: gemmgen's fp32 GEMM into main_grad (`accumulate_grad`; x^T
    dL/dacc for a weight stored in x out, as GPT-2's Conv1D), else torch's x^T dL/dacc (the
    kernel's B = W^T: in x out)."""
    if accumulate and weight_in_out:
        return PlannedGemm(name, Pass.WGRAD, "dW = x^T dL/dacc, into main_grad", n_in, rows, t,
                           weight_grad_recipe(dtype))
    if accumulate:
        return PlannedGemm(name, Pass.WGRAD, what + ", into main_grad", rows, n_in, t, weight_grad_recipe(dtype))
    return PlannedGemm(name, Pass.WGRAD, what.replace("dW = dL/dacc^T x", "dW^T = x^T dL/dacc"), n_in, rows, t, None)


def mlp_plan(mlp, tokens: int, training: bool = True, name: str = "mlp") -> list[PlannedGemm]:  # type: ignore[no-untyped-def]
    """A FusedMLP's GEMMs for `tokens` rows: fc1 and fc2 forward, then with `training` backward's
    (fc2's dgrad carrying fc1's activation derivative, or with `recompute` fc1's GEMM again)."""
    t, rows, hidden = tokens, mlp.fc1.weight_rows, mlp.fc1.out_features
    n_in, n_out = mlp.fc1.in_features, mlp.fc2.out_features
    fc1, fc2 = f"{name}.fc1", f"{name}.fc2"
    if mlp.precision is not None:
        g = mlp._gemms
        first = (g.fc1_quantizing or g.fc1_saving) if training else g.fc1.fprop
        forward = [PlannedGemm(fc1, Pass.FPROP, "h = act(x W1^T)", t, rows, n_in, first.recipe),
                   PlannedGemm(fc2, Pass.FPROP, "y = h W2^T", t, n_out, hidden, g.fc2.fprop.recipe)]
        if not training:
            return forward
        wgrads = [(f.wgrad_accumulate if mlp._accumulate_grad else f.wgrad).recipe for f in (g.fc1, g.fc2)]
        return [*forward,
                PlannedGemm(fc2, Pass.DGRAD, "dL/dacc1 = act'(acc1) (dL/dy W2)", t, hidden, n_out,
                            (g.bwd_quantizing or g.bwd).recipe),
                PlannedGemm(fc1, Pass.DGRAD, "dx = dL/dacc1 W1", t, n_in, rows, g.fc1.dgrad.recipe),
                PlannedGemm(fc1, Pass.WGRAD, "dW1 = dL/dacc1^T x", rows, n_in, t, wgrads[0]),
                PlannedGemm(fc2, Pass.WGRAD, "dW2 = dL/dy^T h", n_out, hidden, t, wgrads[1])]
    recompute = mlp.recompute
    if not training or recompute:
        first_recipe = linear_plan(mlp.fc1, t, training=False)[0].recipe
    else:
        first_recipe = mlp._backward.forward
    forward = [PlannedGemm(fc1, Pass.FPROP, "h = act(x W1^T + b1)", t, rows, n_in, first_recipe),
               PlannedGemm(fc2, Pass.FPROP, "y = h W2^T + b2", t, n_out, hidden,
                           linear_plan(mlp.fc2, t, training=False)[0].recipe)]
    if not training:
        return forward
    if recompute:
        dacc1 = [PlannedGemm(fc2, Pass.DGRAD, "dL/dh = dL/dy W2", t, hidden, n_out, None),
                 PlannedGemm(fc1, Pass.DGRAD, "dL/dacc1: fc1's GEMM again, its epilogue derived", t, rows, n_in,
                             mlp._backward.kernel)]
    else:
        dacc1 = [PlannedGemm(fc2, Pass.DGRAD, "dL/dacc1 = act'(acc1) (dL/dy W2)", t, hidden, n_out,
                             mlp._backward.kernel)]
    return [*forward, *dacc1,
            PlannedGemm(fc1, Pass.DGRAD, "dx = dL/dacc W", t, n_in, rows, None),
            _bf16_wgrad(fc1, "dW = dL/dacc^T x", rows, n_in, t, mlp._accumulate_grad, mlp.fc1.kernel_dtype,
                        mlp.fc1.weight_in_out),
            _bf16_wgrad(fc2, "dW = dL/dacc^T x", n_out, hidden, t, mlp._accumulate_grad, mlp.fc1.kernel_dtype,
                        mlp.fc2.weight_in_out)]


def grouped_plan(layer, rows: int, training: bool = True, name: str = "experts") -> list[PlannedGemm]:  # type: ignore[no-untyped-def]
    """A GroupedLinear's GEMMs for `rows` routed rows over its experts: the grouped kernel, then with
    `training` its derived kernel (the grouped GEMM again, writing dL/dacc; or the accumulator
    again, which autograd differentiates), dx (a grouped GEMM) and dW (a K-grouped one: each
    expert's rows are its K), gemmgen kernels where the experts are 16-bit (`integrations.grouped`)
    or the layer has a precision (`nn.low_precision_grouped`)."""
    e, wr, n_in = layer.num_experts, layer.weight_rows, layer.in_features
    out = [PlannedGemm(name, Pass.FPROP, "y_e = act(x_e W_e^T + b_e)", rows, wr, n_in, layer.recipe, e)]
    if not training:
        return out
    if getattr(layer, "precision", None) is not None:  # nn.low_precision_grouped's kernels
        gemms = layer.low_precision_gemms
        derived = [] if gemms.dacc is None else [
            PlannedGemm(name, Pass.DGRAD, "dL/dacc: the grouped GEMM again, its epilogue derived", rows, wr, n_in,
                        gemms.dacc.recipe, e)]
        return [*out, *derived,
                PlannedGemm(name, Pass.DGRAD, "dx_e = dL/dacc_e W_e", rows, n_in, wr, gemms.dgrad.recipe, e),
                PlannedGemm(name, Pass.WGRAD, "dW_e = dL/dacc_e^T x_e (groups split K)", wr, n_in, rows,
                            gemms.wgrad.recipe, e)]
    g = layer.recipe.ir.gemm
    kernels = g.a in (DType.BF16, DType.F16) and not g.scaled
    derived = layer.derived_backward
    accumulator = grouped_accumulator_recipe(g.a.torch, g.layout_b) if kernels else None
    dacc = (PlannedGemm(name, Pass.DGRAD, "dL/dacc: the grouped GEMM again, its epilogue derived", rows, wr, n_in,
                        derived.kernel, e) if derived is not None else
            PlannedGemm(name, Pass.DGRAD, "acc again, differentiated by autograd", rows, wr, n_in, accumulator, e))
    dgrad = grouped_input_grad_recipe(g.a.torch) if kernels else None
    wgrad = grouped_weight_grad_recipe(g.a.torch, accumulate=False) if kernels else None
    return [*out, dacc,
            PlannedGemm(name, Pass.DGRAD, "dx_e = dL/dacc_e W_e", rows, n_in, wr, dgrad, e),
            PlannedGemm(name, Pass.WGRAD, "dW_e^T = x_e^T dL/dacc_e (groups split K)", n_in, wr, rows, wgrad, e)]

"""The op of a dense (or batched) recipe: `op(a, b, *operands) -> D` or `(D, aux...)`.

Its backward launches the recipe's derived backward kernel (`Recipe.backward(recompute=True)`:
the forward's GEMM again, whose epilogue turns dL/dD into dL/dacc and the operands' gradients),
then the dgrad and wgrad GEMMs; where a recipe has no such kernel, or a gradient flows into an aux
output too, the epilogue is differentiated with torch autograd instead (`DenseOp.vjp`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import tuning
from ..config import KernelConfig
from ..dsl import Backward, Recipe
from ..errors import RecipeError
from ..ir import Reduction
from ..ir.reference import accumulate, evaluate_epilogue
from ..runtime.base import allocate_output
from ..runtime.checks import check_call, problem_size_check
from ..runtime.output_checks import block_factors_layout
from ..types import DType, Layout, OperandKind
from .kinds import OpKind


def _block_factors(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The factors of D's row blocks in the layout the kernel gives them (`checks.block_factors_layout`)."""
    strides, _ = block_factors_layout(shape, shape[0] if len(shape) == 3 else 1)
    return torch.empty_strided(shape, strides, dtype=torch.float32, device=device)


class DenseOp(OpKind):
    def outputs(self, a: torch.Tensor, b: torch.Tensor, args: tuple, device: torch.device) -> list[torch.Tensor]:
        gemm = self.recipe.ir.gemm
        shape = (*((a.shape[0],) if gemm.batched else ()), a.shape[-2], b.shape[-1])
        return [allocate_output(o.shape(shape), o.dtype.torch, device, Layout.ROW if o.column_blocks else gemm.layout_d)
                if o.reduce is None
                else _block_factors(o.shape(shape), device) if o.reduce in (Reduction.BLOCK_SCALE,
                                                                             Reduction.COLUMN_BLOCK_SCALE)
                else torch.zeros(o.shape(shape), dtype=o.dtype.torch, device=device) for o in self.recipe.outputs]

    def check(self, a: Any, b: Any, args: tuple, require_cuda: bool, config: KernelConfig | None = None) -> None:
        sized = problem_size_check(config.tile, config.cluster, config.swap_ab) if config is not None else None
        check_call(self.recipe.ir, a, b, dict(zip(self.names, args, strict=False)), require_cuda=require_cuda,
                   size_check=sized)

    def key(self, a: torch.Tensor, b: torch.Tensor) -> tuple:
        return a.shape, b.shape[-1], a.device, tuning.generation()

    def problem(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
        l = a.shape[0] if self.recipe.ir.gemm.batched and a.dim() == 3 else 1  # noqa: E741
        return a.shape[-2], b.shape[-1], a.shape[-1], l

    def reference(self, a: torch.Tensor, b: torch.Tensor, args: tuple) -> tuple[torch.Tensor, ...]:
        ref = self.recipe.reference(a, b, **dict(zip(self.names, args, strict=True)))
        return ref if isinstance(ref, tuple) else (ref,)

    @functools.cached_property
    def derived(self) -> Backward | None:
        """The backward kernel `vjp` launches: this recipe's GEMM again, reading dL/dD (in D's type,
        bf16 for an fp8 D) and writing dL/dacc in A's type (bf16 for fp8) and every tensor
        operand's gradient; None where the recipe has none (D does not depend differentiably on
        the accumulator)."""
        g = self.recipe.ir.gemm
        wrt = [o.name for o in self.recipe.ir.epilogue.operands
               if o.kind is not OperandKind.SEED and (o.kind is not OperandKind.SCALAR or o.per_batch)]
        try:
            return self.recipe.backward(recompute=True, saved=g.d if g.d.bits >= 16 else DType.BF16, wrt=wrt)
        except RecipeError:
            return None

    def vjp(self, inputs: list, grads: tuple, needed: tuple[bool, ...], call: Callable[[Recipe], Any]) -> tuple:
        """Gradients of every input: through the derived backward kernel (`derived`) when only D
        receives a gradient, else with torch autograd (`torch_vjp`)."""
        self.refuse_undifferentiable(needed)
        if self.derived is not None and grads[0] is not None and all(g is None for g in grads[1:]):
            return self.fused_vjp(self.derived, inputs, grads[0], needed, call)
        return self.torch_vjp(inputs, grads, needed)

    def fused_vjp(self, derived: Backward, inputs: list, grad: torch.Tensor, needed: tuple[bool, ...],
                  call: Callable[[Recipe], Any]) -> tuple:
        """One launch of the backward kernel (dL/dacc and the fused operand gradients, from the
        recomputed accumulator and dL/dD), then dA = dL/dacc B^T and dB = A^T dL/dacc in the
        operands' precision; gradients the kernel cannot compute (`Backward.rest`) with torch from
        the accumulator, recomputed by a GEMM as `torch_vjp` does."""
        a, b, *rest = inputs
        ops = dict(zip(self.names, rest, strict=True))
        kernel = derived.kernel
        incoming = next(o.dtype for o in kernel.operands if o.name == "grad_d").torch
        ops_in = {**ops, "grad_d": grad.to(incoming)}
        by_name = call(kernel).by_name(a.detach(), b.detach(), ops_in)
        g_acc = by_name["d"]
        ga = torch.matmul(g_acc, b.transpose(-1, -2)) if needed[0] else None
        gb = torch.matmul(a.transpose(-1, -2), g_acc) if needed[1] else None
        wanted = dict(zip(self.names, needed[2:], strict=True))
        unfused = [g for g in derived.gradients if g.reason and wanted[g.operand]]
        in_torch = {}
        if unfused:
            acc = accumulate(self.recipe.ir.gemm, a.detach(), b.detach(), ops)
            in_torch = derived.rest_gradients(acc, ops_in)
        out: dict[str, torch.Tensor | None] = {}
        for g in derived.gradients:
            v = ops[g.operand]
            if not wanted[g.operand] or not isinstance(v, torch.Tensor):
                continue
            if g.output is None:  # no gradient reaches it
                out[g.operand] = torch.zeros_like(v)
            elif g.reason:
                out[g.operand] = in_torch[g.operand].to(v.dtype)
            else:
                value = by_name[g.output]
                out[g.operand] = (value.sum(g.sum_dims) if g.sum_dims else value).to(v.dtype)
        return (ga, gb, *[out.get(k) for k in self.names])

    def torch_vjp(self, inputs: list, grads: tuple, needed: tuple[bool, ...]) -> tuple:
        """Gradients of the fused op, the way torch differentiates the unfused layers: the accumulator
        is recomputed by a GEMM in the operands' precision (what the unfused model would have saved),
        the epilogue is differentiated in fp32 with autograd, and dacc maps back to A and B through
        GEMMs in the operands' precision (fp32 accumulation), like nn.Linear's backward; fp32 GEMMs
        would be far slower on a GPU and gain nothing over the unfused model's gradients. `needed`
        (per input, autograd's needs_input_grad) skips what nobody asked for: a frozen weight costs
        no weight-gradient GEMM."""
        recipe = self.recipe
        a, b, *rest = inputs
        ops = dict(zip(self.names, rest, strict=True))
        fp8 = recipe.ir.gemm.fp8
        with torch.enable_grad():
            # torch has no plain fp8 GEMM; the fp8 values are exact in fp32, as the kernel reads them
            acc = (accumulate(recipe.ir.gemm, a.detach(), b.detach(), ops) if fp8
                   else torch.matmul(a.detach(), b.detach()).float()).requires_grad_(True)
            leaves = {k: v.detach().float().requires_grad_(True)
                      for (k, v), need in zip(ops.items(), needed[2:], strict=True)
                      if need and isinstance(v, torch.Tensor) and v.is_floating_point()}
            outs = evaluate_epilogue(recipe.ir.epilogue, acc, {**ops, **leaves}, round_outputs=False)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
            wrt = [acc, *leaves.values()]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g.float() for _, g in pairs], allow_unused=True)
        g_leaf = dict(zip(leaves, got[1:], strict=True))
        ga = gb = None
        if needed[0] or needed[1]:
            g_acc = (got[0] if got[0] is not None else torch.zeros_like(acc)).to(a.dtype)
            ga = torch.matmul(g_acc, b.transpose(-1, -2)) if needed[0] else None
            gb = torch.matmul(a.transpose(-1, -2), g_acc) if needed[1] else None
        # autograd already summed broadcast operands (row/col vectors) back to their own shapes
        rest = [None if g_leaf.get(k) is None else g_leaf[k].to(v.dtype) for k, v in ops.items()]
        return (ga, gb, *rest)

"""The op of a grouped (MoE) recipe: `op(a, b, offsets, *operands) -> d`.

The CUDA implementation launches the kernel the launch policy picks from the rows per group on
average (never from the groups' sizes, which only the GPU knows). Rows of D after the last group's
end are not written (unspecified), as with `torch._grouped_mm`.

Gradients follow the unfused model with torch's own grouped GEMM (`torch._grouped_mm`, which takes
the same offsets), so backward never reads the offsets on the host either: the accumulator is
recomputed, the epilogue differentiated in fp32 with autograd (row vectors gathered per row of A by
each row's group, so their gradients sum back per group), and dacc maps back to A (per group, dacc
B_g^T) and to B (per group, A_g^T dacc).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import tuning
from ..config import KernelConfig
from ..dsl import Recipe
from ..errors import InvalidArgument
from ..ir.reference import evaluate_epilogue, expand_block_scale
from ..runtime.base import allocate_output
from ..runtime.grouped import operands_per_row, row_groups, vectors_as_matrices
from ..runtime.grouped_checks import check_grouped_call
from .kinds import OpKind


class GroupedOp(OpKind):
    extra_inputs = ("Tensor offsets",)

    def outputs(self, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        d = self.recipe.ir.outputs[0]  # N/2 columns over column pairs (`ir.columns`)
        return [allocate_output(d.shape((a.shape[0], b.shape[-1])), self.recipe.ir.gemm.d.torch, device)]

    def check(self, a: Any, b: Any, args: tuple, require_cuda: bool, config: KernelConfig | None = None) -> None:
        offsets, *operands = args
        check_grouped_call(self.recipe.ir, a, b, offsets, dict(zip(self.names, operands, strict=False)),
                           require_cuda=require_cuda)

    def key(self, a: torch.Tensor, b: torch.Tensor) -> tuple:
        """A's rows, B's shape (groups, K, N), the device and the tuning generation (0.3 us on the CPU
        machine: docs/measurements.md)."""
        return a.shape[0], b.shape, a.get_device(), tuning.generation()

    def problem(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
        """(rows of A, N, K, groups)."""
        return a.shape[0], b.shape[-1], b.shape[-2], b.shape[0]

    def reference(self, a: torch.Tensor, b: torch.Tensor, args: tuple) -> tuple[torch.Tensor, ...]:
        offsets, *operands = args
        return (self.recipe.reference(a, b, offsets, **dict(zip(self.names, operands, strict=True))),)

    def vjp(self, inputs: list, grads: tuple, needed: tuple[bool, ...], call: Callable[[Recipe], Any]) -> tuple:
        recipe, (grad,) = self.recipe, grads
        self.refuse_undifferentiable(needed)
        a, b, offsets, *rest = inputs
        gemm = recipe.ir.gemm
        mm_dtype = torch.bfloat16 if gemm.fp8 else a.dtype  # e4m3 and e5m2 values are exact in bf16
        if a.is_cuda and mm_dtype != torch.bfloat16:
            raise InvalidArgument(f"a: gradients of a grouped recipe use torch._grouped_mm, which takes bf16 on the "
                                  f"GPU, not {a.dtype}; declare the recipe with a=gg.bf16, b=gg.bf16, or detach the "
                                  "inputs")
        rows, groups = a.shape[0], b.shape[0]
        if rows == 0 or groups == 0:
            return (torch.zeros_like(a) if needed[0] else None, torch.zeros_like(b) if needed[1] else None, None,
                    *[torch.zeros_like(v) if isinstance(v, torch.Tensor) and need else None
                      for v, need in zip(rest, needed[3:], strict=True)])
        ops = {o.name: v for o, v in zip(recipe.operands, rest, strict=True) if not o.kind.block_scale}
        needs = dict(zip(self.names, needed[3:], strict=True))
        a_mm, b_mm = a.detach().to(mm_dtype), b.detach().to(mm_dtype)
        if gemm.block_scale is not None:  # dequantized, as the unfused model would multiply them
            _, gn, gk = gemm.block_scale
            scale_a, scale_b = rest[:2]  # the first operands (RecipeIR.operands)
            a_mm = (a.float() * expand_block_scale(scale_a, 1, gk, a.shape)).to(mm_dtype)
            b_mm = (b.float() * expand_block_scale(scale_b, gk, gn, b.shape)).to(mm_dtype)
        ends, group, covered = row_groups(offsets, rows, groups)
        covered = covered.unsqueeze(1)
        with torch.enable_grad():
            acc = torch._grouped_mm(a_mm, b_mm, offs=ends).float()
            acc = torch.where(covered, acc, 0.0).requires_grad_(True)  # rows in no group: not computed
            leaves = {k: v.detach().float().requires_grad_(True) for k, v in ops.items()
                      if needs[k] and isinstance(v, torch.Tensor)}
            per_row = operands_per_row(recipe.ir, {**ops, **leaves}, group)
            out = evaluate_epilogue(vectors_as_matrices(recipe.ir), acc, per_row, round_outputs=False)[0]
            got = torch.autograd.grad(out, [acc, *leaves.values()], torch.where(covered, grad.float(), 0.0),
                                      allow_unused=True)
        g_leaf = dict(zip(leaves, got[1:], strict=True))
        ga = gb = None
        if needed[0] or needed[1]:
            if got[0] is None:  # D does not depend on the accumulator
                g_acc = a.new_zeros(rows, b.shape[-1])
            else:
                g_acc = torch.where(covered, got[0], 0.0).to(a.dtype)
            g_acc = _rows_16_bytes_apart(g_acc)  # torch._grouped_mm wants 16-byte strides (N odd: padded)
            if needed[0]:
                ga = torch.where(covered, torch._grouped_mm(g_acc, b.transpose(-1, -2), offs=ends), 0.0).to(a.dtype)
            if needed[1]:
                gb = torch._grouped_mm(a.t(), g_acc, offs=ends).to(b.dtype)
        by_name = {k: g_leaf[k].to(v.dtype) for k, v in ops.items() if g_leaf.get(k) is not None}
        return (ga, gb, None, *[by_name.get(name) for name in self.names])


def _rows_16_bytes_apart(t: torch.Tensor) -> torch.Tensor:
    """`t` (rows, N), or a copy of it whose rows are padded to a multiple of 16 bytes."""
    per = 16 // t.element_size()
    if t.shape[1] % per == 0:
        return t
    return t.new_zeros(t.shape[0], t.shape[1] + (-t.shape[1] % per))[:, :t.shape[1]].copy_(t)

"""The op of a grouped (MoE) recipe: `op(a, b, offsets, *operands) -> d`; a K-grouped one's
(`KGroupedOp`) is a weight gradient, D per group.

The CUDA implementation launches the kernel the launch policy picks from the rows per group on
average (never from the groups' sizes, which only the GPU knows). Rows of D after the last group's
end are not written (unspecified), as with `torch._grouped_mm`.

Backward never reads the offsets on the host either, and with 16-bit A and B launches gemmgen
kernels only. Where every gradient asked for follows from dL/dacc (a bias's: its sum over each
group's rows), it launches the recipe's derived backward kernel (`Recipe.backward(recompute=True)`:
the grouped GEMM again, whose epilogue turns dL/dD into dL/dacc). Otherwise (a routing weight's
gradient needs the accumulator itself) it follows the unfused model: the accumulator is recomputed
by a grouped GEMM into fp32, the epilogue differentiated in fp32 with autograd (row vectors gathered
per row of A by each row's group, so their gradients sum back per group). Then dacc maps back to A
with a grouped GEMM (per group, dacc B_g^T) and to B with a K-grouped one (`KGroupedOp`: per group,
A_g^T dacc over the group's tokens, none padded). Block-scaled operands (dequantized to bf16) take
`torch._grouped_mm` for these three.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import tuning
from ..config import KernelConfig
from ..dsl import Backward, Matrix, Recipe
from ..errors import InvalidArgument, RecipeError
from ..ir.reference import evaluate_epilogue, expand_block_scale, masked_rows, row_operands
from ..runtime.base import allocate_output
from ..runtime.grouped import operands_per_row, row_groups, vectors_as_matrices
from ..runtime.grouped_checks import check_grouped_call
from ..types import DType, Grouping, Layout, OperandKind, as_dtype
from .kinds import OpKind


class GroupedOp(OpKind):
    extra_inputs = ("Tensor offsets",)

    def outputs(self, a: torch.Tensor, b: torch.Tensor, args: tuple, device: torch.device) -> list[torch.Tensor]:
        d = self.recipe.ir.outputs[0]  # N/2 columns over column pairs (`ir.columns`)
        shape = d.shape((a.shape[-2], b.shape[-1]))
        if a.dim() == 3:  # the masked layout: (groups, max_m, N)
            out = allocate_output((a.shape[0] * shape[0], shape[1]), self.recipe.ir.gemm.d.torch, device)
            return [out.view(a.shape[0], *shape)]
        return [allocate_output(shape, self.recipe.ir.gemm.d.torch, device)]

    def check(self, a: Any, b: Any, args: tuple, require_cuda: bool, config: KernelConfig | None = None) -> None:
        offsets, *operands = args
        check_grouped_call(self.recipe.ir, a, b, offsets, dict(zip(self.names, operands, strict=False)),
                           require_cuda=require_cuda)

    def key(self, a: torch.Tensor, b: torch.Tensor) -> tuple:
        """A's rows (the masked layout's groups and max_m), B's shape (groups, K, N), the device and
        the tuning generation (0.3 us on the CPU machine: docs/design/measurements.md)."""
        return a.shape[:-1], b.shape, a.get_device(), tuning.generation()

    def problem(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
        """(rows of A, N, K, groups); the masked layout's rows are groups * max_m, the most it holds."""
        return a.shape[:-1].numel(), b.shape[-1], b.shape[-2], b.shape[0]

    def reference(self, a: torch.Tensor, b: torch.Tensor, args: tuple) -> tuple[torch.Tensor, ...]:
        offsets, *operands = args
        return (self.recipe.reference(a, b, offsets, **dict(zip(self.names, operands, strict=True))),)

    @functools.cached_property
    def derived(self) -> Backward | None:
        """The backward kernel the fused path launches: this recipe's grouped GEMM again, reading
        dL/dD as `grad_d` and writing dL/dacc (in A's type); None for fp8 recipes (their A and B
        get no gradient) and where D does not depend on the accumulator."""
        if self.recipe.ir.gemm.fp8:
            return None
        wrt = [o.name for o in self.recipe.ir.epilogue.operands if o.kind is not OperandKind.SEED]
        try:
            return self.recipe.backward(recompute=True, wrt=wrt)
        except RecipeError:
            return None

    def sums_of_dacc(self, needs: dict[str, bool]) -> bool:
        """Whether the derived kernel's dL/dacc gives every operand gradient asked for: each is a
        sum of it (its value in `Backward.rest` is D's: a bias) or zero. A grouped kernel writes D
        only, so any other gradient (a routing weight's: dL/dD times the activation) needs the
        accumulator, which the torch path recomputes."""
        derived = self.derived
        if derived is None:
            return False
        rest = derived.rest
        values = {o.name: o.node for o in rest.outputs} if rest is not None else {}
        return all(values.get(g.output) == values.get("d") for g in derived.gradients
                   if needs[g.operand] and g.output is not None)

    def vjp(self, inputs: list, grads: tuple, needed: tuple[bool, ...], call: Callable[[Recipe], Any]) -> tuple:
        """Gradients of every input: through the derived backward kernel where `sums_of_dacc`,
        else as the unfused model computes them (`torch_vjp`)."""
        recipe, (grad,) = self.recipe, grads
        self.refuse_undifferentiable(needed)
        if inputs[0].dim() == 3:
            return self.masked_vjp(inputs, grad, needed, call)
        a, b, _, *rest = inputs
        mm_dtype = torch.bfloat16 if recipe.ir.gemm.fp8 else a.dtype  # e4m3 and e5m2 values are exact in bf16
        if a.is_cuda and mm_dtype != torch.bfloat16:
            raise InvalidArgument(f"a: gradients of a grouped recipe use torch._grouped_mm, which takes bf16 on the "
                                  f"GPU, not {a.dtype}; declare the recipe with a=gg.bf16, b=gg.bf16, or detach the "
                                  "inputs")
        rows, groups = a.shape[0], b.shape[0]
        if rows == 0 or groups == 0:
            return (torch.zeros_like(a) if needed[0] else None, torch.zeros_like(b) if needed[1] else None, None,
                    *[torch.zeros_like(v) if isinstance(v, torch.Tensor) and need else None
                      for v, need in zip(rest, needed[3:], strict=True)])
        needs = dict(zip(self.names, needed[3:], strict=True))
        if self.sums_of_dacc(needs):
            return self.fused_vjp(inputs, grad, needed, call)
        return self.torch_vjp(inputs, grad, needed, mm_dtype, call)

    def masked_vjp(self, inputs: list, grad: torch.Tensor, needed: tuple[bool, ...],
                   call: Callable[[Recipe], Any]) -> tuple:
        """Gradients of a masked-layout call (A (groups, max_m, K), `masked_m`), by `vjp` over the
        offsets layout of every group's max_m rows: the rows past masked_m (which the forward read
        nowhere) and their gradient zeroed first, in copies. The layout is decode's; training pays
        for the copies and for the padding rows' share of dA's and dB's GEMMs."""
        a, b, masked_m, *rest = inputs
        groups, max_m = a.shape[:2]
        ends, _, covered = row_groups(masked_m, groups * max_m, groups, max_m)
        flat_a, flat_ops = masked_rows(self.recipe.ir, a, dict(zip(self.names, rest, strict=True)))
        per_row = row_operands(self.recipe.ir)

        def kept(t: Any) -> Any:  # rows in no group zeroed (fp8: their bits): their garbage reaches nothing
            if not isinstance(t, torch.Tensor):
                return t
            bits = t.view(torch.uint8) if t.element_size() == 1 else t
            zeroed = torch.where(covered.view(-1, *[1] * (t.dim() - 1)), bits, torch.zeros((), dtype=bits.dtype))
            return zeroed.view(t.dtype)

        flat_grad = kept(grad.flatten(0, 1))
        flat_inputs = [kept(flat_a), b, ends, *[kept(v) if k in per_row else v for k, v in flat_ops.items()]]
        got = self.vjp(flat_inputs, (flat_grad,), needed, call)
        ga = None if got[0] is None else got[0].view(a.shape)
        shaped = [g.view(v.shape) if g is not None and k in per_row else g
                  for g, (k, v) in zip(got[3:], zip(self.names, rest, strict=True), strict=True)]
        return (ga, got[1], None, *shaped)

    def fused_vjp(self, inputs: list, grad: torch.Tensor, needed: tuple[bool, ...],
                  call: Callable[[Recipe], Any]) -> tuple:
        """One launch of the derived kernel (dL/dacc from the recomputed accumulator and dL/dD),
        the operands' gradients as sums of dL/dacc (a row vector's per group), then dA and dB."""
        derived = self.derived
        assert derived is not None
        a, b, offsets, *rest = inputs
        ops = dict(zip(self.names, rest, strict=True))
        incoming = next(o.dtype for o in derived.kernel.operands if o.name == "grad_d").torch
        ends, group, covered = row_groups(offsets, a.shape[0], b.shape[0])
        grad_d = _rows_16_bytes_apart(grad.to(incoming))  # TMA reads rows 16 bytes apart
        g_acc = call(derived.kernel).by_name(a.detach(), b.detach(), {**ops, "grad_d": grad_d}, offsets)["d"]
        g_acc = torch.where(covered.unsqueeze(1), g_acc, 0.0)  # rows in no group: not written
        kinds = {o.name: o.kind for o in self.recipe.ir.epilogue.operands}
        wanted = dict(zip(self.names, needed[3:], strict=True))
        wide = g_acc.float() if any(wanted.values()) else g_acc  # the operands' sums, in fp32
        out: dict[str, torch.Tensor] = {}
        for g in derived.gradients:
            v = ops[g.operand]
            if not wanted[g.operand] or not isinstance(v, torch.Tensor):
                continue
            kind = kinds[g.operand]
            if g.output is None:  # no gradient reaches it
                value = torch.zeros_like(v)
            elif kind is OperandKind.ROW:  # per group: the sum over its rows
                value = wide.new_zeros(b.shape[0], wide.shape[1]).index_add_(0, group, wide)
            elif kind is OperandKind.SCALAR and isinstance(v, torch.Tensor):  # a tensor scalar: per group
                value = wide.new_zeros(b.shape[0]).index_add_(0, group, wide.sum(1))
            else:
                value = wide.sum(1) if kind is OperandKind.COL else wide.sum()
            out[g.operand] = value.to(v.dtype)
        ga, gb = _input_gradients(g_acc, a, b, ends, covered, needed, call)
        return (ga, gb, None, *[out.get(name) for name in self.names])

    def torch_vjp(self, inputs: list, grad: torch.Tensor, needed: tuple[bool, ...], mm_dtype: torch.dtype,
                  call: Callable[[Recipe], Any]) -> tuple:
        """The unfused model's gradients: the accumulator recomputed in the operands' precision (a
        gemmgen grouped GEMM into fp32; block-scaled operands dequantized first, through
        `torch._grouped_mm`), the epilogue differentiated in fp32 with autograd."""
        recipe = self.recipe
        a, b, offsets, *rest = inputs
        gemm = recipe.ir.gemm
        rows = a.shape[0]
        ops = {o.name: v for o, v in zip(recipe.operands, rest, strict=True) if not o.kind.block_scale}
        needs = dict(zip(self.names, needed[3:], strict=True))
        a_mm, b_mm = a.detach().to(mm_dtype), b.detach().to(mm_dtype)
        if gemm.block_scale is not None:  # dequantized, as the unfused model would multiply them
            _, gn, gk = gemm.block_scale
            scale_a, scale_b = rest[:2]  # the first operands (RecipeIR.operands)
            a_mm = (a.float() * expand_block_scale(scale_a, 1, gk, a.shape)).to(mm_dtype)
            b_mm = (b.float() * expand_block_scale(scale_b, gk, gn, b.shape)).to(mm_dtype)
        ends, group, covered = row_groups(offsets, rows, b.shape[0])
        if mm_dtype in (torch.bfloat16, torch.float16) and gemm.block_scale is None:  # a gemmgen kernel
            acc = call(grouped_accumulator_recipe(mm_dtype, gemm.layout_b))(a_mm, b_mm, ends)
        else:
            acc = torch._grouped_mm(a_mm, b_mm, offs=ends).float()
        with torch.enable_grad():
            acc = torch.where(covered.unsqueeze(1), acc, 0.0).requires_grad_(True)  # rows in no group
            leaves = {k: v.detach().float().requires_grad_(True) for k, v in ops.items()
                      if needs[k] and isinstance(v, torch.Tensor)}
            per_row = operands_per_row(recipe.ir, {**ops, **leaves}, group)
            out = evaluate_epilogue(vectors_as_matrices(recipe.ir), acc, per_row, round_outputs=False)[0]
            got = torch.autograd.grad(out, [acc, *leaves.values()],
                                      torch.where(covered.unsqueeze(1), grad.float(), 0.0), allow_unused=True)
        g_leaf = dict(zip(leaves, got[1:], strict=True))
        ga = gb = None
        if needed[0] or needed[1]:
            if got[0] is None:  # D does not depend on the accumulator
                g_acc = a.new_zeros(rows, b.shape[-1])
            else:
                g_acc = torch.where(covered.unsqueeze(1), got[0], 0.0).to(a.dtype)
            ga, gb = _input_gradients(g_acc, a, b, ends, covered, needed, call)
        by_name = {k: g_leaf[k].to(v.dtype) for k, v in ops.items() if g_leaf.get(k) is not None}
        return (ga, gb, None, *[by_name.get(name) for name in self.names])


class KGroupedOp(GroupedOp):
    """A K-grouped recipe's op (`gg.Grouping.K`): `op(a, b, offsets, *operands) -> d`, a the M x T
    `.t()` of a tokens-major tensor, b T x N, d G x M x N (G: offsets' length). A weight gradient:
    it is not differentiated itself."""

    def outputs(self, a: torch.Tensor, b: torch.Tensor, args: tuple, device: torch.device) -> list[torch.Tensor]:
        groups = args[0].shape[0]
        return [allocate_output((groups, a.shape[0], b.shape[-1]), self.recipe.ir.gemm.d.torch, device)]

    def key(self, a: torch.Tensor, b: torch.Tensor) -> tuple:
        """M, the tokens and N, the device and the tuning generation (the groups' count and sizes
        change no config)."""
        return a.shape, b.shape[-1], a.get_device(), tuning.generation()

    def problem(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
        """(M, N, the tokens, 1): each group's M x N, over K = the tokens of all groups together."""
        return a.shape[0], b.shape[-1], a.shape[1], 1

    @functools.cached_property
    def derived(self) -> Backward | None:
        return None

    def vjp(self, inputs: list, grads: tuple, needed: tuple[bool, ...], call: Callable[[Recipe], Any]) -> tuple:
        if any(needed):
            raise InvalidArgument(f"{self.recipe.name}: a K-grouped GEMM is a weight gradient, which gemmgen does "
                                  "not differentiate; call it on tensors that do not require grad (torch.no_grad())")
        return tuple(None for _ in needed)


@functools.cache
def grouped_accumulator_recipe(dtype: torch.dtype, layout_b: Layout) -> Recipe:
    """A grouped GEMM's fp32 accumulator alone: what a backward recomputes where the epilogue's
    gradient needs it (a routing weight's)."""
    d = as_dtype(dtype, "dtype")
    return Recipe(f"grouped_accumulator_{d.value}_{layout_b.value}", a=d, b=d, d=DType.F32, layout_b=layout_b,
                  grouped=True)


@functools.cache
def grouped_input_grad_recipe(dtype: torch.dtype) -> Recipe:
    """dX of a group of expert Linears: dacc_e (rows x N) times W_e (N x K, the weights stacked as
    G x N x K and read row-major), each group's rows through its own expert, as the forward."""
    d = as_dtype(dtype, "dtype")
    return Recipe(f"grouped_input_grad_{d.value}", a=d, b=d, d=d, layout_b=Layout.ROW, grouped=True)


@functools.cache
def grouped_weight_grad_recipe(dtype: torch.dtype, accumulate: bool) -> Recipe:
    """The experts' weight gradient as one K-grouped GEMM (`gg.Grouping.K`): dW_e = dY_e^T X_e over
    expert e's tokens, called with (dY.t(), X, offsets), no token padded. `accumulate`: fp32 D
    added to the experts' fp32 `main_grad` (G x out x in, read as C: beta = 1), as Megatron-style
    training keeps it; else D in `dtype`."""
    d = as_dtype(dtype, "dtype")
    kw: dict[str, Any] = {"a": d, "b": d, "layout_a": Layout.COL, "layout_b": Layout.ROW, "grouped": Grouping.K}
    if accumulate:
        return Recipe(f"grouped_weight_grad_accumulate_{d.value}", lambda acc, main_grad: acc + main_grad,
                      d=DType.F32, operands={"main_grad": Matrix(DType.F32)}, **kw)
    return Recipe(f"grouped_weight_grad_{d.value}", d=d, **kw)


def _input_gradients(g_acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                     covered: torch.Tensor, needed: tuple[bool, ...], call: Callable[[Recipe], Any]
                     ) -> tuple[torch.Tensor | None, ...]:
    """dA (per group, dacc B_g^T; rows in no group zero) and dB (per group, A_g^T dacc), where
    `needed`; `g_acc` is zero in rows in no group. Both are gemmgen ops (16-bit A and B): dA a
    grouped GEMM over the groups' rows, dB a K-grouped one over their tokens, no token padded;
    other dtypes take `torch._grouped_mm`'s. `call(recipe)` launches a recipe (`ops.caller`)."""
    g_acc = _rows_16_bytes_apart(g_acc)  # TMA reads rows 16 bytes apart (N odd: padded)
    ga = gb = None
    kernels = a.dtype in (torch.bfloat16, torch.float16) and g_acc.dtype == a.dtype == b.dtype
    dgrad = grouped_input_grad_recipe(a.dtype) if kernels else None
    wgrad = grouped_weight_grad_recipe(a.dtype, accumulate=False) if kernels else None
    if needed[0]:
        bt = b.transpose(-1, -2)
        value = call(dgrad)(g_acc, _rows_16_bytes_apart_3d(bt), ends) if dgrad is not None else \
            torch._grouped_mm(g_acc, bt, offs=ends)
        ga = torch.where(covered.unsqueeze(1), value, 0.0).to(a.dtype)
    if needed[1]:
        gb = call(wgrad)(_rows_16_bytes_apart(a).t(), g_acc, ends) if wgrad is not None else \
            torch._grouped_mm(a.t(), g_acc, offs=ends)
        gb = gb.to(b.dtype)
    return ga, gb


def _rows_16_bytes_apart_3d(t: torch.Tensor) -> torch.Tensor:
    """A (G, rows, N) tensor whose rows are contiguous and 16 bytes apart: `t` or a padded copy."""
    per = 16 // t.element_size()
    if t.shape[-1] == 1 or (t.stride(-1) == 1 and t.stride(-2) % per == 0 and
                            (t.shape[0] == 1 or t.stride(0) % per == 0)):
        return t
    wide = t.new_zeros(t.shape[0], t.shape[1], t.shape[2] + (-t.shape[2] % per))[..., :t.shape[2]]
    return wide.copy_(t)


def _rows_16_bytes_apart(t: torch.Tensor) -> torch.Tensor:
    """`t` (rows, N), or a copy of it whose rows are padded to a multiple of 16 bytes."""
    per = 16 // t.element_size()
    if t.shape[1] % per == 0:
        return t
    return t.new_zeros(t.shape[0], t.shape[1] + (-t.shape[1] % per))[:, :t.shape[1]].copy_(t)

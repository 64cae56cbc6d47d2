"""`Recipe.backward()`: the recipes a training step runs for a fused forward (`ir.autodiff`).

    bwd = bias_gelu.backward()
    bwd.forward   # bias_gelu, also writing its accumulator (aux `saved_acc`) for the backward
    bwd.kernel    # the epilogue for the GEMM whose accumulator is dL/dD (the next layer's dgrad):
                  # D = dL/dacc = g * gelu'(saved_acc + bias), and grad_bias = sum over M of it
    bias_gelu.backward(recompute=True).kernel
                  # the forward's GEMM again, reading dL/dD (`grad_d`): the same outputs

Both are normal recipes, built from IR by replaying it through the DSL (so every check a
declared recipe passes, they pass).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..ir import EpilogueIR, Node, Op, Operand, Output
from ..ir.autodiff import GRAD_PREFIX, RECOMPUTED_D, SAVED_ACC, Derivative, NotDifferentiable, derive
from ..types import DType, Layout, OperandKind, as_dtype, as_layout
from .operands import ColVector, Matrix, OperandDecl, RowVector, Scalar
from .values import Reduced, Value

if TYPE_CHECKING:
    import torch

    from .recipe import Recipe


@dataclass(frozen=True)
class OperandGradient:
    """Where one forward operand's gradient comes from.

    `output`: the backward kernel's aux output holding it; when `reason` says why the kernel
    cannot, the output of `Backward.rest` instead, which the caller evaluates with torch
    (`Backward.rest_gradients`); None when no gradient reaches the operand (it is zero).
    `sum_dims`: the dims of that output still to sum to get the operand's shape: the batch for a
    vector shared by every batch, and the remaining dim of a scalar's per-row or per-column sums."""

    operand: str
    output: str | None
    sum_dims: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class Backward:
    """What `Recipe.backward()` derives (see the module docstring).

    `forward`: the recipe to run in the forward pass (the recipe itself when the backward reads
    nothing of it but its operands; else it also writes aux `saved_acc`). `kernel`: the backward
    GEMM's recipe: its accumulator is dL/dD, its D is dL/dacc, its aux outputs the fused operand
    gradients (`gradients`), and `fwd_d` (the forward's D, recomputed) when asked for.
    `recompute` (always so for a grouped GEMM, whose forward writes D only): the kernel is the
    forward's GEMM again (its A, B and operands), reading dL/dD as the operand `grad_d`: one more
    GEMM, and no M x N tensor kept from the forward. `rest`: the epilogue of the gradients the
    kernel cannot compute (`Derivative.rest`)."""

    forward: Recipe
    kernel: Recipe
    gradients: tuple[OperandGradient, ...]
    recompute: bool = False
    rest: EpilogueIR | None = None

    @property
    def saves_accumulator(self) -> bool:
        return any(o.name == SAVED_ACC for o in self.kernel.operands)

    def rest_gradients(self, acc: torch.Tensor, operands: Mapping[str, torch.Tensor | float],
                       offsets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The gradients the kernel does not compute, with torch in fp32, each in its operand's
        shape: `acc` is the kernel's accumulator, materialized (dL/dD; with `recompute`, the
        forward's A @ B), `operands` the kernel's (saved_acc or grad_d included); a grouped
        recipe's `offsets` as its forward took them."""
        import torch

        from ..ir.reference import evaluate_epilogue, group_bounds

        wanted = [g for g in self.gradients if g.reason and g.output is not None]
        if self.rest is None or not wanted:
            return {}
        rest = self.rest
        kinds = {o.name: o.kind for o in rest.operands}

        def evaluate(g: torch.Tensor, ops: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
            values = evaluate_epilogue(rest, g.float(), ops, round_outputs=False)
            return {o.name: v for o, v in zip(rest.outputs, values, strict=True)}

        if offsets is None:
            by_name = evaluate(acc, dict(operands))
            return {g.operand: by_name[g.output].sum(g.sum_dims) if g.sum_dims else by_name[g.output]  # type: ignore[index]
                    for g in wanted}
        # grouped: each group's rows with its own row vectors; a row vector's gradient per group
        out = {g.operand: torch.zeros_like(torch.as_tensor(operands[g.operand], dtype=torch.float32))
               for g in wanted}
        for i, (start, end) in enumerate(group_bounds(offsets.tolist(), acc.shape[0])):
            ops = {k: v if not isinstance(v, torch.Tensor) or kinds.get(k) is OperandKind.SCALAR else
                   v[i] if kinds.get(k) is OperandKind.ROW else v[start:end] for k, v in operands.items()}
            by_name = evaluate(acc[start:end], ops)
            for g in wanted:
                kind, value = kinds.get(g.operand), by_name[g.output]  # type: ignore[index]
                if kind is OperandKind.ROW:
                    out[g.operand][i] += value
                elif kind is OperandKind.SCALAR:
                    out[g.operand] += value
                else:
                    out[g.operand][start:end] = value
        return out

    def describe(self) -> str:
        """One line per output of the backward kernel, and per gradient it does not compute."""
        g = self.kernel.ir.gemm
        lines = [f"{self.kernel.name}: {g.a.value} x {g.b.value} -> {g.d.value}, reads "
                 f"{', '.join(o.name for o in self.kernel.operands) or 'only its accumulator'}",
                 "  d: dL/dacc (" + ("the accumulator is the forward's, recomputed; dL/dD is grad_d)" if self.recompute
                                 else "the accumulator is dL/dD)")]
        for grad in self.gradients:
            if grad.reason:
                lines.append(f"  {grad.operand}: not in the kernel, computed with torch ({grad.reason})")
            else:
                rest = f", then summed over dims {list(grad.sum_dims)}" if grad.sum_dims else ""
                out = next(o for o in self.kernel.outputs if o.name == grad.output)
                how = "M x N" if out.reduce is None else "sum over " + {None: "M and N", 0: "M", 1: "N"}[out.dim]
                lines.append(f"  {grad.output}: dL/d{grad.operand} ({how}{rest})")
        if any(o.name == RECOMPUTED_D for o in self.kernel.outputs):
            lines.append(f"  {RECOMPUTED_D}: the forward's D, recomputed")
        if self.saves_accumulator:
            lines.append(f"  {SAVED_ACC}: written by {self.forward.name} in the forward")
        return "\n".join(lines)


def derive_backward(recipe: Recipe, *, a: Any = None, b: Any = None, layout_a: Any = None, layout_b: Any = None,
                    d: Any = None, saved: Any = None, wrt: Sequence[str] | None = None,
                    grad_outputs: Sequence[str] = ("d",), recompute: bool = False,
                    recompute_d: bool = False) -> Backward:
    """`Recipe.backward`'s body (its docstring says what the arguments mean)."""
    from .recipe import Recipe

    gemm = recipe.ir.gemm
    where = f"{recipe.name}.backward()"
    if not isinstance(recompute, bool) or not isinstance(recompute_d, bool):
        raise RecipeError(f"{where}: recompute and recompute_d are True or False")
    d_only = ""
    if gemm.grouped:
        d_only = "a grouped GEMM writes D only"
        if recompute_d:
            raise RecipeError(f"{where}: recompute_d=True asks a grouped GEMM for an aux output, and it writes D "
                              "only; keep the forward's D instead")
        recompute = True  # its forward cannot write the accumulator either
    given = [k for k, v in (("a", a), ("b", b), ("layout_a", layout_a), ("layout_b", layout_b)) if v is not None]
    if recompute and given:
        raise RecipeError(f"{where}: {given[0]}= describes the next layer's GEMM, but with recompute=True (always "
                          "for a grouped GEMM) the backward kernel is this recipe's own GEMM again; leave it out")
    grad_default = gemm.a if gemm.a.bits == 16 else DType.BF16
    grad_dtype = as_dtype(d if d is not None else grad_default, "d (dtype of dL/dacc)")
    read_dtype = as_dtype(saved if saved is not None else grad_dtype,
                          "saved (dtype of the saved accumulator, or with recompute of dL/dD)")
    names = {o.name for o in recipe.ir.epilogue.operands}
    outputs = {o.name: o for o in recipe.outputs}
    reserved = {SAVED_ACC, RECOMPUTED_D, *(GRAD_PREFIX + n for n in grad_outputs)}
    taken = sorted((names | set(outputs)) & reserved)
    if taken:
        raise RecipeError(f"{where}: {taken[0]!r} names what the backward reads or writes; rename that operand or "
                          "aux output")
    wrt = tuple(sorted(names) if wrt is None else wrt)
    unknown = sorted(set(wrt) - names)
    if unknown:
        raise RecipeError(f"{recipe.name}.backward(wrt=...): {unknown[0]!r} is not an operand of the epilogue; "
                          f"choose from {sorted(names)}")
    for name in grad_outputs:
        out = outputs.get(name)
        if out is None or out.reduce is not None:
            matrices = [o.name for o in recipe.outputs if o.reduce is None]
            raise RecipeError(f"{recipe.name}.backward(grad_outputs=...): {name!r} is not an M x N output of the "
                              f"recipe; a gradient flows into {matrices}")
    try:
        derived = derive(recipe.ir.epilogue, grad_dtype=grad_dtype, read_dtype=read_dtype, wrt=wrt,
                         grad_outputs=tuple(grad_outputs), recompute=recompute, recompute_d=recompute_d,
                         d_only=d_only)
    except NotDifferentiable:
        raise RecipeError(f"{where}: D does not depend differentiably on the accumulator (it reads it only "
                          "through comparisons, or not at all), so there is no backward GEMM to fuse") from None

    if recompute:
        ab: dict[str, Any] = {"a": gemm.a, "b": gemm.b, "layout_a": gemm.layout_a, "layout_b": gemm.layout_b,
                              "block_scale": gemm.block_scale}
    else:
        dtype_a = as_dtype(a if a is not None else grad_default, "a (dtype of the backward GEMM's A: dL/dY)")
        ab = {"a": dtype_a, "b": as_dtype(b if b is not None else dtype_a, "b (dtype of the backward GEMM's B)"),
              "layout_a": as_layout(layout_a if layout_a is not None else Layout.ROW, "layout_a"),
              "layout_b": as_layout(layout_b if layout_b is not None else Layout.ROW, "layout_b")}
    kernel = Recipe(f"{recipe.name}_bwd", _replay(derived.epilogue), d=grad_dtype, batched=gemm.batched,
                    grouped=gemm.grouped, operands=_declarations(derived.epilogue.operands),
                    aux={o.name: o.dtype for o in derived.epilogue.outputs[1:]}, **ab)
    forward = _with_saved_acc(recipe, read_dtype) if derived.reads_saved_acc else recipe
    return Backward(forward, kernel, _gradients(recipe, derived), recompute, derived.rest)


def _gradients(recipe: Recipe, derived: Derivative) -> tuple[OperandGradient, ...]:
    kinds = {o.name: o.kind for o in recipe.ir.epilogue.operands}
    batch = (0,) if recipe.ir.gemm.batched else ()
    rest = () if derived.rest is None else derived.rest.outputs
    out = []
    for o in (*derived.epilogue.outputs, *rest):
        name = o.name.removeprefix(GRAD_PREFIX)
        if not o.name.startswith(GRAD_PREFIX) or name not in kinds:
            continue
        dims = () if o.reduce is None else (*batch, len(batch)) if o.dim is not None and \
            kinds[name] is OperandKind.SCALAR else batch
        out.append(OperandGradient(name, o.name, dims, derived.unfused.get(name, "")))
    out += [OperandGradient(n, None, reason="no gradient reaches it (it feeds only comparisons): zero")
            for n in derived.zero]
    return tuple(sorted(out, key=lambda g: g.operand))


def _with_saved_acc(recipe: Recipe, dtype: DType) -> Recipe:
    """The recipe, also writing its accumulator as aux output `saved_acc` of `dtype`."""
    from .recipe import Recipe

    ir = recipe.ir.epilogue
    acc = next(i for i, n in enumerate(ir.nodes) if n.op is Op.ACC)
    saved = EpilogueIR(ir.nodes, (*ir.outputs, Output(SAVED_ACC, acc, dtype)), ir.operands)
    g = recipe.ir.gemm
    aux = {o.name: o.dtype for o in saved.outputs[1:]}
    return Recipe(recipe.name + "_train", _replay(saved), a=g.a, b=g.b, d=g.d, layout_a=g.layout_a,
                  layout_b=g.layout_b, batched=g.batched, operands=_declarations(ir.operands), aux=aux,
                  block_scale=g.block_scale, config=recipe.config)


def _declarations(operands: tuple[Operand, ...]) -> dict[str, OperandDecl]:
    make: dict[OperandKind, Callable[[DType], OperandDecl]] = {
        OperandKind.SCALAR: lambda dt: Scalar(), OperandKind.ROW: RowVector, OperandKind.COL: ColVector,
        OperandKind.MATRIX: Matrix}
    return {o.name: make[o.kind](o.dtype) for o in operands}


def _replay(ir: EpilogueIR) -> Callable[..., dict[str, Value | Reduced]]:
    """An epilogue function that records `ir`'s nodes into the trace it is called in."""

    def epilogue(acc: Value, **operands: Value) -> dict[str, Value | Reduced]:
        trace = acc._trace
        values: list[Value] = []
        for node in ir.nodes:
            if node.op is Op.ACC:
                values.append(acc)
            elif node.op is Op.INPUT:
                values.append(operands[node.name])  # type: ignore[index]
            else:
                values.append(trace.add(Node(node.op, tuple(values[i]._index for i in node.args), node.name,
                                             node.attr, node.dtype)))
        return {o.name: values[o.node] if o.reduce is None else Reduced(values[o.node], o.reduce, o.dim)
                for o in ir.outputs}

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY) for o in ir.operands]
    epilogue.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return epilogue


__all__ = ["GRAD_PREFIX", "Backward", "OperandGradient", "derive_backward"]

"""Building blocks of `Recipe.backward()` (`dsl.recipe`): where each operand's gradient is, and
recipes made from IR by replaying it through the DSL (so every check a declared recipe passes,
a derived one passes)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..ir import EpilogueIR, Node, Op, Operand, RecipeIR
from ..ir.autodiff import GRAD_PREFIX, Derivative
from ..types import OperandKind
from .operands import ColVector, Matrix, OperandDecl, RowVector, Scalar, Seed
from .values import Reduced, Value


@dataclass(frozen=True)
class OperandGradient:
    """Where one forward operand's gradient comes from.

    `output`: the backward kernel's aux output holding it; when `reason` says why the kernel
    cannot, the output of `Backward.rest` instead, which the caller evaluates with torch
    (`Backward.rest_gradients`); None when no gradient reaches the operand (it is zero).
    `sum_dims`: the dims of that output still to sum to get the operand's shape: the batch for an
    operand shared by every batch (`Operand.per_batch`: a shared matrix; a vector's and a scalar's
    reductions sum over the batches themselves, `Output.over_batch`), and the remaining dim of a
    scalar's per-row or per-column sums."""

    operand: str
    output: str | None
    sum_dims: tuple[int, ...] = ()
    reason: str = ""


def operand_gradients(forward: RecipeIR, derived: Derivative) -> tuple[OperandGradient, ...]:
    """Per operand of `forward` asked for, where `derived` has its gradient."""
    kinds = {o.name: o.kind for o in forward.epilogue.operands}
    per_batch = {o.name for o in forward.epilogue.operands if o.per_batch}
    batched = (0,) if forward.gemm.batched else ()
    rest = () if derived.rest is None else derived.rest.outputs
    out = []
    for o in (*derived.epilogue.outputs, *rest):
        name = o.name.removeprefix(GRAD_PREFIX)
        if not o.name.startswith(GRAD_PREFIX) or name not in kinds:
            continue
        present = () if o.over_batch else batched  # the output's own batch dim
        batch = () if name in per_batch else present
        dims = batch if o.reduce is None else (*batch, len(present)) if o.dim is not None and \
            kinds[name] is OperandKind.SCALAR else batch
        out.append(OperandGradient(name, o.name, dims, derived.unfused.get(name, "")))
    out += [OperandGradient(n, None, reason="no gradient reaches it (it feeds only comparisons): zero")
            for n in derived.zero]
    return tuple(sorted(out, key=lambda g: g.operand))


def declarations(operands: tuple[Operand, ...]) -> dict[str, OperandDecl]:
    """The DSL declaration of each IR operand, by name."""
    make: dict[OperandKind, Callable[[Operand], OperandDecl]] = {
        OperandKind.SCALAR: lambda o: Scalar(tensor=bool(o.per_batch)),  # (L,) in a batched GEMM
        OperandKind.ROW: lambda o: RowVector(o.dtype, bool(o.per_batch)),
        OperandKind.COL: lambda o: ColVector(o.dtype, bool(o.per_batch)),
        OperandKind.MATRIX: lambda o: Matrix(o.dtype, bool(o.per_batch)),
        OperandKind.SEED: lambda o: Seed()}
    return {o.name: make[o.kind](o) for o in operands}


def replay(ir: EpilogueIR) -> Callable[..., dict[str, Value | Reduced]]:
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
        return {o.name: values[o.node] if o.reduce is None else Reduced(values[o.node], o.reduce, o.dim,
                                                                        o.over_batch) for o in ir.outputs}

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY) for o in ir.operands]
    epilogue.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return epilogue


__all__ = ["OperandGradient", "declarations", "operand_gradients", "replay"]

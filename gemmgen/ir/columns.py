"""Column pairs: which values of an epilogue have a column per accumulator column, and which one
per pair of them.

`gemmgen.pairs(x)` splits a value into its even and odd columns: a gated activation reads the
gate and the up projection from adjacent accumulator columns (2c, 2c+1), as the weights
interleave them, and writes one column per pair. Every epilogue value therefore has a width,
`Columns`: FULL (N, as the accumulator) or HALF (N / 2). The accumulator and row vectors are
FULL; scalars, constants and column vectors are the same in every column and fit either; a
matrix operand takes the width of what it is combined with (FULL when nothing decides).
`gemmgen.interleave(even, odd)` puts a pair back (HALF -> FULL), as a rotary embedding or a
pair's gradient does.

The kernel computes a HALF value in both registers of its pair (each thread holds a row's
adjacent columns: `docs/design/pairs.md`), so elementwise ops need nothing new; only the ops on
pairs, the loads and stores of HALF tensors and reductions over N see the pairing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from ..errors import RecipeError
from ..types import OperandKind
from .ops import Op


class Node(Protocol):
    """What this module reads of an IR node (`graph.Node`: graph imports this module)."""

    @property
    def op(self) -> Op: ...
    @property
    def args(self) -> tuple[int, ...]: ...
    @property
    def name(self) -> str | None: ...


class Operand(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> OperandKind: ...


class Output(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def node(self) -> int: ...
    @property
    def reduce(self) -> object: ...
    @property
    def dim(self) -> int | None: ...


OutputT = TypeVar("OutputT", bound=Output)
OperandT = TypeVar("OperandT", bound=Operand)


class Columns(enum.Enum):
    """A value's columns per accumulator column."""

    FULL = "full"  # one per column of the accumulator: N
    HALF = "half"  # one per adjacent pair of them: N / 2
    DOUBLE = "double"  # a pair per column of the accumulator, interleaved: 2N (a backward's packed tensors)

    @property
    def step(self) -> int:
        return {Columns.FULL: 0, Columns.HALF: -1, Columns.DOUBLE: 1}[self]

    @classmethod
    def of_step(cls, step: int) -> Columns:
        return {0: cls.FULL, -1: cls.HALF, 1: cls.DOUBLE}[step]

    def extent(self, n: int) -> int:
        """A tensor's columns for an accumulator of `n` (even, for a half) columns."""
        return {Columns.FULL: n, Columns.HALF: n // 2, Columns.DOUBLE: 2 * n}[self]

    @property
    def symbol(self) -> str:
        """A tensor's columns in messages: N, N/2 or 2N."""
        return {Columns.FULL: "N", Columns.HALF: "N/2", Columns.DOUBLE: "2N"}[self]


_ANY = "any"  # the same in every column: fits either width


class _Unresolved:
    """A width that depends on matrix operands not yet given one: theirs plus `offset`."""

    __slots__ = ("names", "offset")

    def __init__(self, names: frozenset[str], offset: int) -> None:
        self.names, self.offset = names, offset


_Width = int | str | _Unresolved


def _pair_error(what: str, fix: str) -> RecipeError:
    return RecipeError(f"epilogue: {what}; {fix}")


def infer_columns(nodes: Sequence[Node], operands: Sequence[Operand]) -> tuple[list[_Width], dict[str, int]]:
    """Each node's width step (0 FULL, -1 HALF, or `_ANY`) and each matrix operand's, inferred as
    the module docstring says; a RecipeError where a value mixes widths or leaves the two."""
    kinds = {o.name: o.kind for o in operands}
    fixed: dict[str, int] = {}
    while True:
        steps, decided = _steps(nodes, kinds, fixed)
        if decided:
            fixed.update(decided)
            continue
        left = sorted({n for s in steps if isinstance(s, _Unresolved) for n in s.names})
        if not left:
            break
        fixed[left[0]] = 0  # nothing decides: an operand as wide as the accumulator
    widths: list[_Width] = []
    for s in steps:
        assert not isinstance(s, _Unresolved)
        widths.append(s)
    return widths, fixed


def _steps(nodes: Sequence[Node], kinds: dict[str, OperandKind], fixed: dict[str, int]
           ) -> tuple[list[_Width], dict[str, int]]:
    """One pass in node order; the first operand widths a known width decides, if any."""
    steps: list[_Width] = []
    for node in nodes:
        op = node.op
        if op is Op.ACC:
            steps.append(0)
        elif op is Op.CONST:
            steps.append(_ANY)
        elif op is Op.INPUT:
            kind = kinds[node.name]  # type: ignore[index]
            if kind is OperandKind.MATRIX:
                name: str = node.name  # type: ignore[assignment]
                steps.append(fixed[name] if name in fixed else _Unresolved(frozenset({name}), 0))
            else:  # a row vector has a value per accumulator column; the others one per row or call
                steps.append(0 if kind is OperandKind.ROW else _ANY)
        else:
            args = [steps[a] for a in node.args]
            rows = [nodes[a].name for a in node.args if nodes[a].op is Op.INPUT and kinds[nodes[a].name] is  # type: ignore[index]
                    OperandKind.ROW]
            if rows and -1 in args:
                raise _pair_error(f"{op.key} combines the row vector {rows[0]!r} (a value per accumulator column, N) "
                                  "with a pair's half (N/2)", f"apply {rows[0]!r} before gg.pairs, its values "
                                  "interleaved as the accumulator's columns are (torch.stack((v_even, v_odd), "
                                  "-1).flatten(-2))")
            joined = _join(op, args)
            if isinstance(joined, dict):
                return steps, joined
            steps.append(_shifted(op, joined))
    return steps, {}


def _join(op: Op, args: list[_Width]) -> _Width | dict[str, int]:
    """The width the args share, or the operand widths a known one decides."""
    known = {a for a in args if isinstance(a, int)}
    if len(known) > 1:
        raise _pair_error(f"{op.key} combines values of {_describe(0)} and of {_describe(-1)}",
                          "take the pairs of the full-width value first (gg.pairs(x)), or put the pair back "
                          "(gg.interleave(even, odd))")
    pending = [a for a in args if isinstance(a, _Unresolved)]
    if known:
        k = next(iter(known))
        if pending:
            return {n: k - p.offset for p in pending for n in p.names}
        return k
    if pending:
        return _Unresolved(frozenset(n for p in pending for n in p.names), pending[0].offset) if all(
            p.offset == pending[0].offset for p in pending) else {n: 0 for n in pending[0].names}
    return _ANY


def _shifted(op: Op, w: _Width) -> _Width:
    """The width of an op's result from its args' shared width."""
    if op in (Op.PAIR_EVEN, Op.PAIR_ODD):
        if w == _ANY:
            return _ANY  # the same in every column: its own half
        if isinstance(w, _Unresolved):
            return _Unresolved(w.names, w.offset - 1)
        if w == -1:
            raise _pair_error("gg.pairs of a value that is already a pair's half",
                              "pairs of pairs are not supported: take gg.pairs of a full-width value once")
        assert isinstance(w, int)
        return w - 1
    if op is Op.INTERLEAVE:
        if w == _ANY:
            raise _pair_error("gg.interleave of two values that are the same in every column",
                              "its width is undetermined: interleave values of a pair's half (from gg.pairs)")
        if isinstance(w, _Unresolved):
            return _Unresolved(w.names, w.offset + 1)
        if w == 1:
            raise _pair_error("gg.interleave of values of 2N columns", "interleave a pair's halves once")
        assert isinstance(w, int)
        return w + 1
    return w


def _describe(step: int) -> str:
    return {0: "the accumulator's width (N)", -1: "a pair's half (N/2)", 1: "pairs of 2N columns"}[step]


def annotate(nodes: Sequence[Node], outputs: Sequence[OutputT], operands: Sequence[OperandT]
             ) -> tuple[tuple[OutputT, ...], tuple[OperandT, ...]]:
    """The outputs and operands with their widths (`Output.columns`, `Operand.columns`); a
    RecipeError for what the kernel cannot do with them."""
    widths, fixed = infer_columns(nodes, operands)
    _check_double(nodes, widths, outputs)
    outs = []
    for o in outputs:
        w = widths[o.node]
        step = 0 if w == _ANY else w
        assert isinstance(step, int)
        outs.append(replace(o, columns=Columns.of_step(step)))  # type: ignore[type-var]
    ops = [replace(op, columns=Columns.of_step(fixed.get(op.name, 0))) for op in operands]  # type: ignore[type-var]
    return tuple(outs), tuple(ops)


def _check_double(nodes: Sequence[Node], widths: list[_Width], outputs: Sequence[Output]) -> None:
    """A tensor of 2N columns is read only as its pairs' halves (gg.pairs of a matrix operand: the
    backward GEMM's saved accumulator) and written only as an interleave (its dL/dacc): the
    kernel holds each as two full-width values."""
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for a in n.args:
            users[a].append(i)
    outputs_of = {o.node: o for o in outputs}
    for i, node in enumerate(nodes):
        if widths[i] != 1:
            continue
        if node.op is Op.INPUT:
            if any(nodes[u].op not in (Op.PAIR_EVEN, Op.PAIR_ODD) for u in users[i]):
                raise _pair_error(f"operand {node.name!r} has 2N columns and is used whole",
                                  "read a tensor of 2N columns as its pairs' halves: gg.pairs(x)")
        elif node.op is Op.INTERLEAVE:
            out = outputs_of.get(i)
            if users[i] or out is None or out.reduce is not None:
                raise _pair_error("a value of 2N columns (gg.interleave of full-width values) is used or reduced",
                                  "write it as an output, and compute with its halves before gg.interleave")
        else:
            raise _pair_error(f"{node.op.key} of values of 2N columns",
                              "compute with the pairs' halves, and gg.interleave the results last")

"""Reverse-mode differentiation of an epilogue: the epilogue a backward GEMM runs.

For a forward D = f(acc, operands), the backward GEMM's accumulator is the incoming gradient
g = dL/dD (the next layer's dgrad, dY @ W). Its epilogue recomputes f's intermediate values from
the forward's accumulator, saved as the M x N operand `saved_acc`, and the operands, then walks
the graph backwards with each op's rule (`Op.derivative`, torch's derivatives) to give
dL/dacc (its D) and the operands' gradients: a row vector's as a sum over M, a column vector's
over N, a scalar's over both (finished by the caller), a matrix's as an M x N output.

With `recompute`, the roles trade places: the kernel is the forward's own GEMM again, its
accumulator the forward's, and dL/dD is the M x N operand `grad_d` (one more GEMM than reading
a saved accumulator, and nothing kept from the forward).

Everything is an IR of existing ops, so the backward is a normal recipe: compiled, cached,
bundled and checked like any other, with no device code of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..types import DType, OperandKind
from .graph import EpilogueIR, Node, Operand, Output, Reduction, f32, normalize
from .ops import Op, Param

#: The backward's operand holding the forward's accumulator (an aux output of the forward).
SAVED_ACC = "saved_acc"
#: Gradients are named after what they are the gradient of: `grad_bias`, and the backward's
#: operand `grad_<aux>` for a forward aux output that receives a gradient.
GRAD_PREFIX = "grad_"
#: The backward's output holding the forward's D, recomputed (`recompute_d`).
RECOMPUTED_D = "fwd_d"


class _Graph:
    """The nodes a derivation records, in the order it makes them (`normalize` then tidies)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, node: Node) -> Sym:
        self.nodes.append(node)
        return Sym(self, len(self.nodes) - 1)

    def const(self, value: float) -> Sym:
        return self.add(Node(Op.CONST, attr=f32(value)))


class Sym:
    """A value of the derived epilogue, with the arithmetic the op table's rules are written in."""

    __slots__ = ("graph", "index")

    def __init__(self, graph: _Graph, index: int) -> None:
        self.graph, self.index = graph, index

    @property
    def is_const(self) -> bool:
        return self.graph.nodes[self.index].op is Op.CONST

    def _lift(self, x: Sym | float) -> Sym:
        return x if isinstance(x, Sym) else self.graph.const(x)

    def _op(self, op: Op, *args: Sym | float, attr: float | None = None, dtype: DType | None = None) -> Sym:
        return self.graph.add(Node(op, tuple(self._lift(a).index for a in args), attr=attr, dtype=dtype))

    def __add__(self, o: Sym | float) -> Sym:
        return self._op(Op.ADD, self, o)

    def __radd__(self, o: float) -> Sym:
        return self._op(Op.ADD, o, self)

    def __sub__(self, o: Sym | float) -> Sym:
        return self._op(Op.SUB, self, o)

    def __rsub__(self, o: float) -> Sym:
        return self._op(Op.SUB, o, self)

    def __mul__(self, o: Sym | float) -> Sym:
        return self if isinstance(o, float) and o == 1.0 else self._op(Op.MUL, self, o)

    def __rmul__(self, o: float) -> Sym:
        return self if o == 1.0 else self._op(Op.MUL, o, self)

    def __truediv__(self, o: Sym | float) -> Sym:
        return self._op(Op.DIV, self, o)

    def __neg__(self) -> Sym:
        return self._op(Op.NEG, self)

    def lt(self, o: Sym | float) -> Sym:
        return self._op(Op.LT, self, o)

    def le(self, o: Sym | float) -> Sym:
        return self._op(Op.LE, self, o)

    def gt(self, o: Sym | float) -> Sym:
        return self._op(Op.GT, self, o)

    def ge(self, o: Sym | float) -> Sym:
        return self._op(Op.GE, self, o)

    def eq(self, o: Sym | float) -> Sym:
        return self._op(Op.EQ, self, o)

    def select(self, x: Sym | float, y: Sym | float) -> Sym:
        """x where this value is non-zero, else y (`Op.WHERE`)."""
        return self._op(Op.WHERE, self, x, y)

    def abs(self) -> Sym:
        return self._op(Op.ABS, self)

    def exp(self) -> Sym:
        return self._op(Op.EXP, self)

    def erf(self) -> Sym:
        return self._op(Op.ERF, self)

    def sin(self) -> Sym:
        return self._op(Op.SIN, self)

    def cos(self) -> Sym:
        return self._op(Op.COS, self)

    def tanh(self) -> Sym:
        return self._op(Op.TANH, self)

    def sigmoid(self) -> Sym:
        return self._op(Op.SIGMOID, self)

    def cast(self, dtype: DType) -> Sym:
        return self._op(Op.CAST, self, dtype=dtype)

    def pair_even(self) -> Sym:
        return self._op(Op.PAIR_EVEN, self)

    def pair_odd(self) -> Sym:
        return self._op(Op.PAIR_ODD, self)

    def interleave(self, other: Sym | float, odd: bool = False) -> Sym:
        """The pair with this value at the even columns and `other` at the odd (`odd`: the reverse)."""
        return self._op(Op.INTERLEAVE, other, self) if odd else self._op(Op.INTERLEAVE, self, other)


def _sum(terms: list[Sym]) -> Sym:
    """The adjoints reaching one value, summed; those of a value read as column pairs (gg.pairs'
    two halves: interleaves, each with a zero side) summed pair by pair, into one interleave, which
    a backward kernel writes as a tensor of 2N columns (`ir.columns`)."""
    nodes = terms[0].graph.nodes
    if len(terms) > 1 and all(nodes[t.index].op is Op.INTERLEAVE for t in terms):
        halves = [[Sym(terms[0].graph, nodes[t.index].args[k]) for t in terms] for k in (0, 1)]
        even, odd = (_sum([h for h in side if not _is_zero(h)] or side[:1]) for side in halves)
        return even.interleave(odd)
    g = terms[0]
    for t in terms[1:]:
        g = g + t
    return g


def _is_zero(x: Sym) -> bool:
    node = x.graph.nodes[x.index]
    return node.op is Op.CONST and node.attr == 0.0


@dataclass(frozen=True)
class Derivative:
    """A derived backward epilogue and where each operand's gradient is.

    `epilogue`: the kernel's; its outputs after D are the gradients it computes, `grad_<operand>`.
    `rest`: the gradients a kernel cannot compute, on the same inputs (its D is dL/dacc again),
    for the caller to evaluate with torch; `unfused` says why, per operand. `zero`: the operands
    no gradient reaches (they feed only comparisons)."""

    epilogue: EpilogueIR
    rest: EpilogueIR | None
    unfused: dict[str, str]
    zero: tuple[str, ...]

    @property
    def reads_saved_acc(self) -> bool:
        """Whether the kernel or the rest reads the forward's accumulator."""
        irs = (self.epilogue,) if self.rest is None else (self.epilogue, self.rest)
        return any(o.name == SAVED_ACC for ir in irs for o in ir.operands)


class NotDifferentiable(ValueError):
    """The forward's D does not depend differentiably on the accumulator."""


def derive(ir: EpilogueIR, *, grad_dtype: DType, read_dtype: DType, wrt: Sequence[str],
           grad_outputs: Sequence[str] = ("d",), recompute: bool = False, recompute_d: bool = False,
           d_only: str = "", batched: bool = False) -> Derivative:
    """The backward epilogue of `ir` (module docstring). `read_dtype`: the type of the M x N tensor
    the kernel reads, the saved accumulator (`saved_acc`), or with `recompute` the incoming
    gradient (`grad_d`: the kernel's accumulator is then the forward's own, recomputed by the
    same GEMM). `wrt`: the operands whose gradients are wanted; `grad_outputs`: the forward
    outputs receiving a gradient (an M x N aux output's from the operand `grad_<name>`);
    `recompute_d`: also write the forward's D; `d_only`: why the kernel can write D only (a
    grouped GEMM's), or empty; `batched`: the GEMM is, so that a shared vector's or scalar's
    gradient sums over the batches too."""
    graph = _Graph()
    acc = graph.add(Node(Op.ACC))
    primal: list[Sym] = []
    for node in ir.nodes:  # the forward, recomputed from its accumulator: the kernel's, or read back
        if node.op is Op.ACC:
            primal.append(acc if recompute else graph.add(Node(Op.INPUT, name=SAVED_ACC, dtype=read_dtype)))
        elif node.op.is_leaf:
            primal.append(graph.add(node))
        else:
            primal.append(graph.add(Node(node.op, tuple(primal[a].index for a in node.args), node.name, node.attr,
                                         node.dtype)))

    operands = [] if recompute else [Operand(SAVED_ACC, OperandKind.MATRIX, read_dtype)]
    operands += ir.operands
    adjoints: dict[int, list[Sym]] = {}
    for name in grad_outputs:
        out = next(o for o in ir.outputs if o.name == name)
        if name == "d" and not recompute:
            seed = acc
        else:
            dtype = read_dtype if name == "d" else out.dtype if out.dtype.bits >= 16 else grad_dtype  # not fp8
            seed = graph.add(Node(Op.INPUT, name=GRAD_PREFIX + name, dtype=dtype))
            operands.append(Operand(GRAD_PREFIX + name, OperandKind.MATRIX, dtype))
        adjoints.setdefault(out.node, []).append(seed)

    d_acc: Sym | None = None
    d_operand: dict[str, Sym] = {}
    for i in reversed(range(len(ir.nodes))):
        terms = adjoints.get(i)
        if not terms:
            continue
        g = _sum(terms)
        node = ir.nodes[i]
        if node.op is Op.ACC:
            d_acc = g
        elif node.op is Op.INPUT:
            d_operand[node.name] = g  # type: ignore[index]
        elif not node.op.is_leaf:
            rule = node.op.derivative
            assert rule is not None, node.op
            param = {Param.SLOPE: (node.attr,), Param.DTYPE: (node.dtype,)}.get(node.op.param, ())
            for a, term in zip(node.args, rule(g, primal[i], *(primal[a] for a in node.args), *param), strict=True):
                if term is not None:
                    adjoints.setdefault(a, []).append(term)
    if d_acc is None:
        raise NotDifferentiable("no gradient reaches the accumulator")

    kinds = {o.name: o for o in ir.operands}
    wanted = [n for n in wrt if n in d_operand]
    # a derived kernel reduces over M or over N, not both (sm_100a kernels reduce over their N only, a
    # swapped one over the recipe's M); over M not at all over column pairs (never swapped)
    over_m = not ir.pairs and any(kinds[n].kind is OperandKind.ROW for n in wanted)
    dim = 0 if over_m else 1
    outputs = [Output("d", d_acc.index, grad_dtype)]
    rest: list[Output] = []
    unfused: dict[str, str] = {}
    for name in wanted:
        kind, value, grad_name = kinds[name].kind, d_operand[name], GRAD_PREFIX + name
        if kind is OperandKind.MATRIX:  # a shared one's per batch in fp32, for the sum over the batch
            gradient = Output(grad_name, value.index, kinds[name].dtype if kinds[name].per_batch else DType.F32)
        else:  # a batched GEMM's shared vector or scalar: summed over the batches too (`Output.over_batch`)
            over = {OperandKind.ROW: 0, OperandKind.COL: 1}.get(kind, dim)
            gradient = Output(grad_name, value.index, DType.F32, Reduction.SUM, over,
                              over_batch=batched and not kinds[name].per_batch)
        over_m_in_pairs = ir.pairs and gradient.dim == 0
        if d_only or gradient.dim == 1 - dim or over_m_in_pairs:
            unfused[name] = d_only or ("a sum over M, which a kernel over column pairs does not run (it is never "
                                       "swapped)" if over_m_in_pairs else
                                       "a column vector's gradient is a sum over N, and the kernel sums the row "
                                       "vectors' over M: a kernel reduces over one of them")
            if kind is OperandKind.SCALAR:  # outside a kernel, over M and N at once
                gradient = replace(gradient, dim=None)
            rest.append(gradient)
        else:
            outputs.append(gradient)
    if recompute_d:
        outputs.append(Output(RECOMPUTED_D, primal[ir.outputs[0].node].index, ir.outputs[0].dtype))
    zero = tuple(n for n in wrt if n not in d_operand)
    epilogue = normalize(graph.nodes, outputs, tuple(operands))
    rest_ir = normalize(graph.nodes, [outputs[0], *rest], tuple(operands)) if rest else None
    return Derivative(epilogue, rest_ir, unfused, zero)

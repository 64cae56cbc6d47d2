"""IR -> a direct epilogue's functor (gemmgen/include/gemmgen/direct_epilogue.hpp).

A direct epilogue computes the recipe one output element at a time, in registers: the generated
struct's call operator loads the element's operands through direct.hpp's views, applies the op
table's functors in fp32, one statement per IR node (as an elementwise region's functor reads:
`evt._region_functor`), and stores every output; an output reduced over M and N (gemmgen.amax,
reduce_max, reduce_min) is reduced in the thread's `Partials` and finished per tile (a warp's
shuffles, one atomic: direct.hpp's ScalarReduction). It is what a kernel compiles instead of
CUTLASS's visitor tree and TMA epilogue collective under `EpilogueCollective.DIRECT`, for the
epilogues it can express (`unsupported` says which it cannot, by name).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Columns, Op, RecipeIR, Reduction, post_order
from ..ir.ops import RANDOM_OPS
from ..types import DType, Layout, OperandKind
from .visitor_types import EPI, SCALAR_REDUCTIONS, functor_of, scalar_reduction_functors

#: The generated functor's struct name.
FUNCTOR = "DirectFunctor"
#: Where its views and collective live (gemmgen/include/gemmgen/direct*.hpp).
DIRECT = "gemmgen::direct"


@dataclass(frozen=True)
class DirectOperand:
    """One view in the functor's Arguments: an operand it reads or an output it writes."""

    kind: str  # "scalar" | "row" | "col" | "matrix" | "amax" (an output reduced over M and N)
    name: str  # the recipe's operand or output name
    dtype: DType
    per_batch: bool
    output: bool = False
    reduce: Reduction | None = None  # how an "amax" output reduces

    @property
    def member(self) -> str:
        """Its member of Arguments: `in_<operand>` or `out_<output>` (never a C++ keyword)."""
        return f"{'out' if self.output else 'in'}_{self.name}"


@dataclass(frozen=True)
class DirectEpilogue:
    source: str  # the functor's C++ struct
    operands: tuple[DirectOperand, ...]  # Arguments' members, in declaration order


def unsupported(recipe: RecipeIR) -> list[str]:
    """What in the recipe (the kernel's view) a direct epilogue does not compute: everything but
    loads of scalars, vectors and M x N tensors, elementwise ops, casts, M x N stores and max-like
    reductions over M and N (gemmgen.amax, max, min: exact in any order, so atomics keep them
    deterministic)."""
    ir = recipe.epilogue
    out = []
    if recipe.gemm.grouped:
        out.append("a grouped GEMM (its per-group pointers live in the TMA collective's arrays)")
    for n in ir.nodes:
        if n.op in RANDOM_OPS or n.op in (Op.ROW_INDEX, Op.COLUMN_INDEX):
            out.append(f"gemmgen.{n.op.key} (a coordinate leaf)")
        elif n.op.pairs:
            out.append(f"gemmgen.{n.op.dsl} (column pairs)")
    out += [f"operand {o.name!r} of N/2 or 2N columns" for o in ir.operands if o.columns is not Columns.FULL]
    for o in ir.outputs:
        if o.reduce is not None and o.reduce not in SCALAR_REDUCTIONS:
            out.append(f"output {o.name!r}: a reduction ({o.reduce.value})")
        elif o.reduce is not None and o.dim is not None:
            out.append(f"output {o.name!r}: a reduction per {'column' if o.dim == 0 else 'row'} ({o.reduce.value})")
        elif o.blocks is not None:
            out.append(f"output {o.name!r}: per block of its columns (gemmgen.{o.blocks.op.value})")
        elif o.column_blocks is not None:
            out.append(f"output {o.name!r}: per block of its rows (gemmgen.quantize_columns)")
        elif o.columns is not Columns.FULL:
            out.append(f"output {o.name!r} of N/2 or 2N columns")
    return list(dict.fromkeys(out))


def build_direct_epilogue(recipe: RecipeIR) -> DirectEpilogue:
    """The functor of `recipe` (the kernel's view: transposed under swap_ab); `unsupported` must be empty."""
    problems = unsupported(recipe)
    assert not problems, problems
    ir = recipe.epilogue
    column_major = str(recipe.gemm.layout_d is Layout.COL).lower()
    kinds = {OperandKind.SCALAR: "scalar", OperandKind.ROW: "row", OperandKind.COL: "col",
             OperandKind.MATRIX: "matrix"}
    used = {n.name for n in ir.nodes if n.op is Op.INPUT}
    operands = [DirectOperand(kinds[o.kind], o.name, o.dtype, bool(o.per_batch)) for o in ir.operands
                if o.name in used]
    d = ir.outputs[0]
    outputs = [DirectOperand("matrix" if o.reduce is None else "amax", o.name, recipe.gemm.d if o is d else o.dtype,
                             True, output=True, reduce=o.reduce) for o in ir.outputs]
    reduced = [o for o in outputs if o.reduce is not None]

    def view(o: DirectOperand) -> str:
        if o.kind == "scalar":
            return f"{DIRECT}::Scalar"
        if o.kind == "matrix":
            return f"{DIRECT}::Matrix<{o.dtype.cutlass}, {column_major}>"
        if o.reduce is not None:
            functors = ", ".join(f"{fn}<float>" for fn in scalar_reduction_functors(o.reduce))
            return f"{DIRECT}::ScalarReduction<{functors}>"
        return f"{DIRECT}::Vector<{o.dtype.cutlass}>"

    index = {"scalar": "l", "row": "n, l", "col": "m, l", "matrix": "m, n, l"}
    by_name = {o.name: o for o in operands}
    label: dict[int, str] = {}
    body: list[str] = []
    for i in post_order([o.node for o in ir.outputs], lambda i: ir.nodes[i].args):
        n = ir.nodes[i]
        if n.op is Op.CONST:  # built into its users' functors (`functor_of`)
            continue
        if n.op is Op.ACC:
            label[i] = "acc"
            continue
        if n.op is Op.INPUT:
            o = by_name[n.name]  # type: ignore[index]
            label[i] = o.member
            body.append(f"    float const {o.member} = args.{o.member}.load({index[o.kind]});")
            continue
        label[i] = f"{n.op.key}{i}"
        if n.op is Op.CAST:
            call = f"{DIRECT}::RoundTo<{n.dtype.cutlass}>{{}}({label[n.args[0]]})"  # type: ignore[union-attr]
        else:
            fn, args = functor_of(n, ir.nodes)
            call = f"{fn.removeprefix(EPI + '::')}{{}}({', '.join(label[a] for a in args)})"
        body.append(f"    float const {label[i]} = {call};")
    stores = [f"    args.{o.member}.store(m, n, l, {label[out.node]});" if o.reduce is None else
              f"    partials.{o.member} = args.{o.member}.reduce(partials.{o.member}, {label[out.node]});"
              for o, out in zip(outputs, ir.outputs, strict=True)]
    members = [f"    {view(o)} {o.member};" for o in (*operands, *outputs)]
    start = ", ".join(f"args.{o.member}.identity" for o in reduced)
    finish = (["  CUTLASS_DEVICE void finish(Arguments const& args, Partials const& partials, int l) const {",
               *(f"    args.{o.member}.store(partials.{o.member}, l);" for o in reduced), "  }"] if reduced else
              ["  CUTLASS_DEVICE void finish(Arguments const&, Partials const&, int) const {}"])
    source = "\n".join([
        f"// {recipe.name}'s epilogue, one output element at a time (gemmgen/direct_epilogue.hpp)",
        f"struct {FUNCTOR} {{", "  struct Arguments {", *members, "  };",
        "  struct Partials {  // this thread's values of the outputs reduced over M and N",
        *(f"    float {o.member};" for o in reduced), "  };",
        f"  CUTLASS_HOST_DEVICE Partials start({'Arguments const& args' if reduced else 'Arguments const&'}) const "
        f"{{ return {{{start}}}; }}",
        "  CUTLASS_DEVICE void operator()(Arguments const& args, Partials& partials, float acc, int m, int n, int l) "
        "const {", f"    using namespace {EPI};", *body, *stores, "  }", *finish, "};"])
    return DirectEpilogue(source, (*operands, *outputs))

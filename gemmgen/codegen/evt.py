"""IR -> CUTLASS sm90 epilogue visitor tree (EVT) type declarations.

The result is a list of `using Name = Type;` declarations and the name of the callbacks type
handed to the epilogue CollectiveBuilder. A tree (Sm90EVT) is emitted when every value has one
consumer; a graph with shared values or side outputs becomes one Sm90TopologicalVisitor.

sm100 kernels use the same visitors: `TileShape` is then the CTA's tile (half the MMA's under a
2-SM schedule, what each SM's epilogue covers), and aux tensors take their shared-memory layout
from the sm100 builder's descriptors (`AUX_DESCRIPTORS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..config import Arch
from ..ir import BlockOp, Columns, EpilogueIR, Node, Op, RecipeIR, Reduction, f32_bits, post_order
from ..ir.ops import FP8_MAX, RANDOM_OPS
from ..types import DType, Layout, OperandKind
from .fields import REGISTER_LOADS, REGISTER_STORES, sinks_d
from .visitor_types import (
    AUX_DESCRIPTORS,
    COMPUTE,
    EPI,
    FUSION,
    HALF_STRIDE,
    REDUCTION_KIND,
    ROUND,
    aux_store_type,
    aux_stride_type,
    column_blocks_type,
    functor_of,
    load_type,
    register_element,
    scalar_reduction_type,
    vector_reduction_type,
)

if TYPE_CHECKING:
    from .direct import DirectEpilogue


@dataclass
class _VNode:
    """A visitor node: a leaf load, aux store or reduction (`load_store`), or a compute node (`fn`, `out`)."""

    label: str
    load_store: str | None = None
    children: list[int] = field(default_factory=list)
    fn: str | None = None
    out: str = COMPUTE
    binding: ParamBinding | None = None  # runtime data this node reads (operand) or writes (aux output)
    scalar: str | None = None  # fn's F where fn is Map<F>::Fn: an elementwise op, which a region may inline

    @property
    def is_compute(self) -> bool:
        return self.fn is not None

    @property
    def type(self) -> str:
        if self.fn is not None:
            return f"{FUSION}::Sm90Compute<{self.fn}, {self.out}, {COMPUTE}, {ROUND}>"
        return self.load_store  # type: ignore[return-value]


@dataclass(frozen=True)
class ParamBinding:
    """A visitor node that carries runtime arguments, and where its Params sit in the callbacks'
    Params: `path` holds (index, sibling count) per level of nested Sm90VisitorImplBase Params."""

    kind: str  # "row" | "col" | "scalar" | "aux_load" | "shared_load" | "aux_store" | "amax" | "row_reduction"
    #          | "col_reduction" | "seed" (coordinates.hpp's Random: a seed operand's SeedArguments)
    #          | "row_blocks" (row_blocks.hpp: D per block of its rows, writing the blocks' factors)
    #          | "column_blocks" (column_blocks.hpp: a transposed copy per block of rows, and its scales)
    #          | fields.PAIR_BINDINGS (N/2- and 2N-column tensors: gemmgen/include/gemmgen/pairs.hpp)
    name: str  # operand or aux output name
    dtype: DType
    path: tuple[tuple[int, int], ...] = ()
    per_batch: bool = False  # one per batch (`Operand.per_batch`): a row or column vector's batch stride is a field
    column_major: bool = False  # a shared matrix's layout (D's): which of its strides is a field
    log_sum_exp: bool = False  # a vector reduction whose state, and identity, is a pair (`LSE_STATE`)
    stream: int = 0  # a seed's: which of its streams the node draws (each Random node has its own Params)

    def member(self, root: str) -> str:
        """C++ lvalue of this node's Params under `root`. Sm90VisitorImplBase names members op_0..op_3
        for up to four ops and is a cute::tuple beyond that."""
        for i, n in self.path:
            root = f"{root}.op_{i}" if n <= 4 else f"cute::get<{i}>({root})"
        return root


@dataclass(frozen=True)
class RegionFunctor:
    """An elementwise region's functor (`_fuse_regions`): its struct's name and C++ definition."""

    name: str
    source: str


@dataclass(frozen=True)
class EpilogueCode:
    decls: tuple[tuple[str, str], ...]  # (name, C++ type), in dependency order
    callbacks: str  # the type passed to the epilogue CollectiveBuilder
    element_c: str  # the source (C) element, or "void"
    source: str | None  # the operand loaded as C, if any
    layout: str  # "tree" or "dag"; "direct" under EpilogueCollective.DIRECT (its decls unused)
    bindings: tuple[ParamBinding, ...]  # nodes with runtime arguments, in declaration order
    arguments: tuple  # the callbacks' Arguments nesting: tuples of sub-trees, ParamBinding or None
    element_d: str = ""  # the collective's D element: D's, or "void" where a PairStore writes D
    d_sink: bool = False  # registers write D and the collective's D store goes to a sink (`fields.sinks_d`)
    functors: tuple[RegionFunctor, ...] = ()  # each elementwise region's straight-line functor (`_fuse_regions`)
    direct: DirectEpilogue | None = None  # the kernel's functor instead, under EpilogueCollective.DIRECT (`direct`)

    @property
    def stores_d(self) -> bool:
        """Whether the collective's TMA store writes D: not when D has N/2 or 2N columns (`ir.columns`),
        which registers write, the collective storing no D (void) or into a sink."""
        return self.element_d != "void" and not self.d_sink


def _compute_node(label: str, node: Node, nodes: tuple[Node, ...], of_ir: dict[int, int]) -> _VNode:
    """A compute node of `node`: a fragment functor of pairs.hpp, or an elementwise functor F as
    Map<F>::Fn (`scalar` F), its remaining args as children."""
    fn, args = functor_of(node, nodes)
    out = node.dtype.cutlass if node.op is Op.CAST else COMPUTE  # type: ignore[union-attr]
    children = [of_ir[a] for a in args]
    if node.op.pairs:
        return _VNode(label, children=children, fn=fn, out=out)
    return _scalar_node(label, children, fn, out)


def _scalar_node(label: str, children: list[int], scalar: str, out: str = COMPUTE) -> _VNode:
    return _VNode(label, children=children, fn=f"{EPI}::Map<{scalar}>::Fn", out=out, scalar=scalar)





def build_epilogue(recipe: RecipeIR, arch: Arch = Arch.SM90A) -> EpilogueCode:
    ir = recipe.epilogue
    load_desc, store_desc = AUX_DESCRIPTORS[arch]
    d = recipe.gemm.d
    aux_stride = aux_stride_type(recipe.gemm.layout_d)
    source = ir.source
    element_c = ir.operand(source).dtype.cutlass if source else "void"

    vnodes: list[_VNode] = []
    of_ir: dict[int, int] = {}  # IR node -> visitor node producing its value
    # 2N-column tensors (`ir.columns`): read as their halves (DoubleLoad), written from two values
    double = _double_nodes(ir) if ir.pairs else set()
    for i, n in enumerate(ir.nodes):
        if n.op is Op.CONST or i in double:
            continue
        if n.op in (Op.PAIR_EVEN, Op.PAIR_ODD) and n.args[0] in double:
            operand = ir.operand(ir.nodes[n.args[0]].name)  # type: ignore[arg-type]
            parity = int(n.op is Op.PAIR_ODD)
            of_ir[i] = len(vnodes)
            load = f"{EPI}::DoubleLoad<{register_element(operand.dtype, recipe)}, {HALF_STRIDE}, {parity}>"
            kind = REGISTER_LOADS[Columns.DOUBLE][parity]
            half = ParamBinding(kind, operand.name, operand.dtype)
            vnodes.append(_VNode(f"{kind}_{operand.name}", load, binding=half))
            continue
        if n.op is Op.ACC:
            v = _VNode("acc", f"{FUSION}::Sm90AccFetch")
        elif n.op in (Op.ROW_INDEX, Op.COLUMN_INDEX):  # coordinates.hpp: mode 0 a register's row, 1 its column
            v = _VNode(n.op.key, f"{EPI}::Coordinate<{int(n.op is Op.COLUMN_INDEX)}>")
        elif n.op in RANDOM_OPS:  # coordinates.hpp: the uniform numbers of a seed and stream
            stream, transposed = int(n.attr), str(n.op is Op.RANDOM_T).lower()  # type: ignore[arg-type]
            v = _VNode(f"rand_{n.name}_{stream}", f"{EPI}::Random<{transposed}, {stream}u>",
                       binding=ParamBinding("seed", n.name, DType.I64, stream=stream))  # type: ignore[arg-type]
        elif n.op is Op.INPUT:
            operand = ir.operand(n.name)  # type: ignore[arg-type]
            kind = {OperandKind.SCALAR: "scalar", OperandKind.ROW: "row", OperandKind.COL: "col",
                    OperandKind.MATRIX: "aux_load" if operand.per_batch else "shared_load"}[operand.kind]
            if operand.columns is Columns.HALF:
                load = f"{EPI}::PairLoad<{register_element(operand.dtype, recipe)}, {HALF_STRIDE}>"
                v = _VNode(f"in_{n.name}", load,
                           binding=ParamBinding(REGISTER_LOADS[Columns.HALF][0], operand.name, operand.dtype))
            else:
                binding = None if n.name == source else ParamBinding(
                    kind, operand.name, operand.dtype, per_batch=bool(operand.per_batch),
                    column_major=recipe.gemm.layout_d is Layout.COL)
                v = _VNode(f"in_{n.name}", load_type(operand, n.name == source, aux_stride, load_desc,
                                                      _grouping(recipe), _rows_in_place(recipe, arch)),
                           binding=binding)
        else:
            v = _compute_node(f"{n.op.key}{i}", n, ir.nodes, of_ir)
        of_ir[i] = len(vnodes)
        vnodes.append(v)

    # Aux stores and reductions pass their input through, so they sit in-line: consumers of the
    # stored value read it from the last store in its chain.
    for o in ir.outputs[1:]:
        if o.reduce in (Reduction.BLOCK_SCALE, Reduction.COLUMN_BLOCK_SCALE):  # written by their blocks' node
            continue
        if o.columns is Columns.DOUBLE:  # off any chain: nothing reads a 2N-column value
            vnodes.append(_double_store(o.name, o.dtype, recipe, o.node, of_ir, vnodes))
            continue
        src = of_ir[o.node]
        if o.columns is Columns.HALF and o.reduce is Reduction.SUM:
            # a pair's half sits in both registers of its pair: sum it once, off the value's chain
            mask = _VNode(f"once_{o.name}", children=[src], fn=f"{EPI}::PairSumMask")
            vnodes.append(mask)
            kind = REDUCTION_KIND[o.dim]  # type: ignore[index]  # a sum is over M or N (`Reduced`)
            vnodes.append(_VNode(f"{o.reduce.value}_{o.name}", vector_reduction_type(kind, o.reduce, arch),
                                 [len(vnodes) - 1], binding=ParamBinding(kind, o.name, o.dtype)))
            continue
        if o.reduce is None and o.columns is Columns.HALF:
            store = _VNode(f"aux_{o.name}", f"{EPI}::PairStore<{register_element(o.dtype, recipe)}, {HALF_STRIDE}>",
                           [src],
                           binding=ParamBinding(REGISTER_STORES[Columns.HALF], o.name, o.dtype))
        elif o.reduce is not None and o.dim is None:
            store = _VNode(f"{o.reduce.value}_{o.name}", scalar_reduction_type(o.reduce), [src],
                           binding=ParamBinding("amax", o.name, o.dtype))
        elif o.reduce is not None:
            kind = REDUCTION_KIND[o.dim]  # type: ignore[index]
            store = _VNode(f"{o.reduce.value}_{o.name}", vector_reduction_type(kind, o.reduce, arch), [src],
                           binding=ParamBinding(kind, o.name, o.dtype, log_sum_exp=o.reduce is Reduction.LSE))
        elif o.column_blocks is not None:  # column_blocks.hpp: the copy and its scales
            store = _VNode(f"columns_{o.name}", column_blocks_type(o.column_blocks), [src],
                           binding=ParamBinding("column_blocks", o.name, o.dtype))
        else:
            store = _VNode(f"aux_{o.name}", aux_store_type(o.dtype, aux_stride, store_desc), [src],
                           binding=ParamBinding("aux_store", o.name, o.dtype))
        vnodes.append(store)
        for v in vnodes[:-1]:
            v.children = [len(vnodes) - 1 if c == src else c for c in v.children]
        of_ir[o.node] = len(vnodes) - 1

    d_columns = ir.outputs[0].columns
    paired_d = d_columns is not Columns.FULL
    if d_columns is Columns.HALF:  # D has N/2 columns: written by a PairStore at the root, not by the collective
        vnodes.append(_VNode("pair_d", f"{EPI}::PairStore<{register_element(d, recipe)}, {HALF_STRIDE}>",
                             [of_ir[ir.outputs[0].node]],
                             binding=ParamBinding(REGISTER_STORES[Columns.HALF], "d", d)))
    elif d_columns is Columns.DOUBLE:  # 2N: by a DoubleStore at the root
        vnodes.append(_double_store("d", d, recipe, ir.outputs[0].node, of_ir, vnodes))
    root = len(vnodes) - 1 if paired_d else of_ir[ir.outputs[0].node]
    sink = sinks_d(recipe, arch)  # a collective that stores D regardless (into a sink)
    # sm100's collectives take the root's value in D's element, even where registers write D
    root_gives_d = not paired_d or arch is Arch.SM100A
    blocked = ir.row_blocks is not None
    if blocked:  # row_blocks.hpp at the root: D per block of its rows, and the blocks' factors
        vnodes.append(_row_blocks_root(recipe, root, of_ir, arch))
        root = len(vnodes) - 1
    consumers = [0] * len(vnodes)
    for v in vnodes:
        for c in v.children:
            consumers[c] += 1
    converts = vnodes[root].is_compute and vnodes[root].out == COMPUTE and consumers[root] == 0
    if root_gives_d and not blocked and not converts:
        # D's value is shared, stored, cast or loaded: give D a node of its own that converts.
        vnodes.append(_scalar_node("to_d", [root], f"{EPI}::Identity"))
        consumers.append(0)
        consumers[root] += 1
        root = len(vnodes) - 1
    if root_gives_d and not blocked:
        vnodes[root].out = d.cutlass  # the root writes ElementD directly (no extra conversion pass)
    void_d = paired_d and not sink
    element_d = "void" if void_d else d.cutlass

    vnodes, root, functors = _fuse_regions(vnodes, root)
    consumers = [0] * len(vnodes)
    for v in vnodes:
        for c in v.children:
            consumers[c] += 1
    reachable = _reachable(vnodes, root)
    is_tree = all(consumers[i] == (0 if i == root else 1) for i in range(len(vnodes))) and \
        len(reachable) == len(vnodes)
    names = [_type_name(v.label) for v in vnodes]
    decls: list[tuple[str, str]] = [(names[i], v.type) for i, v in enumerate(vnodes)]
    if is_tree:
        paths = _tree_paths(vnodes, root)
        evt_name: dict[int, str] = {}
        for i in _post_order(vnodes, root):
            v = vnodes[i]
            if not v.children:
                evt_name[i] = names[i]
                continue
            evt_name[i] = f"EVT{names[i]}"
            kids = ", ".join(evt_name[c] for c in v.children)
            decls.append((evt_name[i], f"{FUSION}::Sm90EVT<{names[i]}, {kids}>"))
        bindings = _bindings(vnodes, paths)
        return EpilogueCode(tuple(decls), _callbacks(evt_name[root], d, void_d), element_c, source, "tree",
                            bindings, _tree_arguments(vnodes, root, {b.path: b for b in bindings}, paths), element_d,
                            sink, functors)

    order = _topological(vnodes, root)
    pos = {n: k for k, n in enumerate(order)}
    edges = ", ".join(f"cute::seq<{', '.join(str(pos[c]) for c in vnodes[n].children)}>" for n in order)
    ops = ", ".join(names[n] for n in order)
    decls.append(("EpilogueDag", f"{FUSION}::Sm90TopologicalVisitor<{COMPUTE}, cute::tuple<{edges}>, {ops}>"))
    bindings = _bindings(vnodes, {n: ((k, len(order)),) for k, n in enumerate(order)})
    by_path = {b.path: b for b in bindings}
    return EpilogueCode(tuple(decls), _callbacks("EpilogueDag", d, void_d), element_c, source, "dag", bindings,
                        tuple(by_path.get(((k, len(order)),)) for k in range(len(order))), element_d, sink, functors)


def _type_name(label: str) -> str:
    """A visitor node's C++ type name: its label in CamelCase (`in_bias` -> `InBias`)."""
    return label.title().replace("_", "")


def _fuse_regions(vnodes: list[_VNode], root: int) -> tuple[list[_VNode], int, tuple[RegionFunctor, ...]]:
    """Each maximal region of elementwise compute nodes as one Sm90Compute over a generated
    straight-line functor. Every level of an Sm90EVT tree costs the compiler's front end seconds
    (docs/design/measurements.md); one N-ary compute node per region keeps loads, stores, reductions, pair
    functors and values with several consumers as visitor nodes, and nothing else.

    A node is inlined into the region of its consumers when it and they are elementwise
    (`_VNode.scalar`), they all lie in one region, and it gives fp32 (a cast's rounding is its
    node's output conversion, so a cast ends a region). A region computes such a value once and
    reads each input once, so a value it uses twice (x * sigmoid(1.702 x)) no longer makes the
    epilogue a DAG. The result: the nodes left, re-indexed; the root's new index; the regions'
    functors."""
    users: list[list[int]] = [[] for _ in vnodes]
    for i, v in enumerate(vnodes):
        for c in v.children:
            users[c].append(i)
    region = list(range(len(vnodes)))  # the node whose region each node's value is computed in
    inlined: set[int] = set()
    for i in reversed(_topological(vnodes, root)):  # users before the values they read
        v = vnodes[i]
        regions = {region[u] for u in users[i]}
        if i != root and v.scalar is not None and v.out == COMPUTE and len(regions) == 1 and \
                all(vnodes[u].scalar is not None for u in users[i]):
            inlined.add(i)
            region[i] = regions.pop()
    kept = [i for i in range(len(vnodes)) if i not in inlined]
    index = {old: new for new, old in enumerate(kept)}
    out: list[_VNode] = []
    functors: list[RegionFunctor] = []
    for i in kept:
        v = vnodes[i]
        if v.scalar is not None and any(c in inlined for c in v.children):
            name = f"Fused{_type_name(v.label)}"
            struct, inputs = _region_functor(name, vnodes, i, inlined)
            functors.append(RegionFunctor(name, struct))
            out.append(replace(v, children=[index[c] for c in inputs], fn=f"{EPI}::Map<{name}>::Fn", scalar=None))
        else:
            out.append(replace(v, children=[index[c] for c in v.children]))
    return out, index[root], tuple(functors)


def _region_functor(name: str, vnodes: list[_VNode], top: int, inlined: set[int]) -> tuple[str, list[int]]:
    """The C++ struct of the region ending at `top`: one statement per op, named as the op's
    visitor node would be, each input a parameter (once), as the emulation
    (`testing.visitors`) parses it back. Its inputs, in parameter order."""
    def inside(i: int) -> bool:
        return i == top or i in inlined

    order = post_order([top], lambda i: tuple(vnodes[i].children) if inside(i) else ())
    inputs = [i for i in order if not inside(i)]

    def call(i: int) -> str:
        scalar = vnodes[i].scalar
        assert scalar is not None
        return f"{scalar.replace(EPI + '::', '')}{{}}({', '.join(vnodes[c].label for c in vnodes[i].children)})"

    body = [f"    float const {vnodes[i].label} = {call(i)};" for i in order if i in inlined]
    params = ", ".join(f"float {vnodes[i].label}" for i in inputs)
    ops = len(body) + 1
    comment = f"// {_type_name(vnodes[top].label)}'s elementwise region: {ops} ops in one compute node, in fp32"
    struct = "\n".join([comment, f"struct {name} {{", f"  CUTLASS_DEVICE float operator()({params}) const {{",
                        f"    using namespace {EPI};", *body, f"    return {call(top)};", "  }", "};"])
    return struct, inputs


def _double_nodes(ir: EpilogueIR) -> set[int]:
    """The nodes of 2N columns (`ir.columns` annotated them): matrix operands read as pairs'
    halves, interleaves written whole."""
    double = {o.name for o in ir.operands if o.columns is Columns.DOUBLE}
    return {i for i, n in enumerate(ir.nodes) if n.op is Op.INPUT and n.name in double} | {
        o.node for o in ir.outputs if o.columns is Columns.DOUBLE}


def _double_store(name: str, dtype: DType, recipe: RecipeIR, node: int, of_ir: dict[int, int],
                  vnodes: list[_VNode]) -> _VNode:
    """A DoubleStore of an interleave's two values; a constant side is made a value (a select of
    the constant on either branch, from the other side)."""
    children = []
    args = recipe.epilogue.nodes[node].args
    for k, a in enumerate(args):
        arg = recipe.epilogue.nodes[a]
        if arg.op is Op.CONST:
            bits = f"{f32_bits(arg.attr):#010x}u"  # type: ignore[arg-type]
            vnodes.append(_scalar_node(f"const_{name}_{k}", [of_ir[args[1 - k]]],
                                       f"{EPI}::SelectConstXY<{bits}, {bits}>"))
            children.append(len(vnodes) - 1)
        else:
            children.append(of_ir[a])
    binding = ParamBinding(REGISTER_STORES[Columns.DOUBLE], name, dtype)
    store = f"{EPI}::DoubleStore<{register_element(dtype, recipe)}, {HALF_STRIDE}>"
    return _VNode(f"double_{name}", store, children, binding=binding)


def _row_blocks_root(recipe: RecipeIR, value: int, of_ir: dict[int, int], arch: Arch) -> _VNode:
    """gemmgen::epi's row blocks node over D's value (and the value whose statistic it takes, where
    that is another): its policy, its block, and the tiles it reduces a block within (the epilogue
    subtile holds whole blocks: each arch's `geometry.epilogue_tile`); it writes the factors' output,
    if any. sm_90a's node reduces a block across a quad's lanes and leaves D's conversion to the
    collective; sm_100a's reduces within a thread's row and converts to D itself (row_blocks.hpp)."""
    ir = recipe.epilogue
    blocks = ir.row_blocks
    assert blocks is not None
    if blocks.op is BlockOp.QUANTIZE:
        policy = f"{EPI}::QuantizeBlock<{f32_bits(FP8_MAX[recipe.gemm.d]):#010x}u{', true' * blocks.power_of_two}>"
    elif blocks.op is BlockOp.EXP:
        policy = f"{EPI}::ExpMinusMaxBlock<{f32_bits(blocks.constant):#010x}u>"
    else:
        policy = f"{EPI}::RmsNormBlock<{blocks.block}, {f32_bits(blocks.constant):#010x}u>"
    fragment = "EpilogueDescriptor::DispatchPolicy::FragmentSize"
    node = (f"{EPI}::Sm100RowBlocks<{policy}, {blocks.block}, {fragment}, {recipe.gemm.d.cutlass}, "
            "TileShape, EpilogueTile>" if arch is Arch.SM100A else
            f"{EPI}::Sm90RowBlocks<{policy}, {blocks.block}, {fragment}, TileShape, EpilogueTile>")
    stat = of_ir[blocks.stat]
    factors = next((o for o in ir.outputs if o.reduce is Reduction.BLOCK_SCALE), None)
    binding = ParamBinding("row_blocks", factors.name, DType.F32) if factors else None
    return _VNode("row_blocks_d", node, [value] if stat == value else [value, stat], binding=binding)


def _callbacks(root: str, d: DType, void_d: bool) -> str:
    """The collective's callbacks: the visitor, named with D's element where the collective's D is void."""
    return f"{EPI}::WithElementAux<{d.cutlass}, {root}>" if void_d else root


def _tree_arguments(vnodes: list[_VNode], root: int, by_path: dict, paths: dict) -> tuple:
    """Sm90EVT's nested Arguments: each node's children's, then its own (built bottom-up)."""
    built: dict[int, tuple | ParamBinding | None] = {}
    for i in _post_order(vnodes, root):
        kids, own = vnodes[i].children, by_path.get(paths[i])
        built[i] = tuple([*(built[c] for c in kids), own]) if kids else own
    arguments = built[root]
    assert isinstance(arguments, tuple), "the root is a compute node, so it has children"
    return arguments


def _tree_paths(vnodes: list[_VNode], root: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """Sm90EVT<Node, C0..Cn-1>::Params holds C0::Params, ..., Cn-1::Params, Node::Params in order."""
    paths: dict[int, tuple[tuple[int, int], ...]] = {}
    stack: list[tuple[int, tuple[tuple[int, int], ...]]] = [(root, ())]
    while stack:
        i, at = stack.pop()
        kids = vnodes[i].children
        n = len(kids) + 1
        paths[i] = (*at, (len(kids), n)) if kids else at
        stack.extend((c, (*at, (k, n))) for k, c in enumerate(kids))
    return paths


def _bindings(vnodes: list[_VNode], paths: dict[int, tuple[tuple[int, int], ...]]) -> tuple[ParamBinding, ...]:
    return tuple(replace(v.binding, path=paths[i]) for i, v in enumerate(vnodes) if v.binding is not None)


def _grouping(recipe: RecipeIR) -> str | None:
    """Which of the kernel's modes a grouped kernel's groups split: its M (the rows of A), or its
    N when swapped (D_g^T = B_g^T A_g^T: D column-major in the kernel's terms); None ungrouped."""
    if not recipe.gemm.grouped:
        return None
    return "N" if recipe.gemm.layout_d is Layout.COL else "M"


def _rows_in_place(recipe: RecipeIR, arch: Arch) -> bool:
    """Whether the kernel's row vectors are read from shared memory where they are used
    (row_blocks.hpp's Sm100RowBroadcastInPlace) rather than copied into registers per subtile: in
    an sm_100a kernel with D's row blocks, where each thread holds a 128-column row of a subtile
    beside the accumulator's (copied, a 128-column fp32 row spilled: docs/design/blackwell.md)."""
    return arch is Arch.SM100A and recipe.epilogue.row_blocks is not None



def _reachable(vnodes: list[_VNode], root: int) -> set[int]:
    seen: set[int] = set()
    stack = [root]
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(vnodes[i].children)
    return seen


def _post_order(vnodes: list[_VNode], root: int) -> list[int]:
    return post_order([root], lambda i: tuple(vnodes[i].children))


def _topological(vnodes: list[_VNode], root: int) -> list[int]:
    """Every node in dependency order, with the root (D's value) last."""
    return post_order([*(i for i in range(len(vnodes)) if i != root), root], lambda i: tuple(vnodes[i].children))

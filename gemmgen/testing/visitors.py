"""The epilogue a generated kernel compiles, read from its C++ source and run on the CPU (tests only).

gemmgen's IR decides what an epilogue computes; codegen turns it into CUTLASS visitor types
(Sm90EVT trees, an Sm90TopologicalVisitor, Sm90Compute nodes over gemmgen::epi functors, loads and
stores), and the runtime writes each operand's pointer or tensor map at the place in Params that
one visitor reads. This module checks that chain from the far end: it parses the `using`
declarations of the kernel source NVRTC compiles, finds the callbacks the CollectiveEpilogue is
given, and evaluates them as CUTLASS's sm90 visitors do, each leaf reading the Params field at its
own position in the callbacks' Params (Sm90VisitorImpl nests them: `op_0`..`op_3`, a tuple past
four). Nothing here consults the IR: a child out of order, a constant on the wrong side, a
wrong element type, or an operand's arguments at another visitor's place shows up as a wrong
output. It also reads the element types and layouts the source gives A, B, C and D, so that
emulate.py reads every tensor map as the kernel would.

Semantics, from CUTLASS 4.2's sm90 visitors: Sm90Compute converts its inputs to ElementCompute,
applies the functor and converts to ElementOutput (round to nearest; fp8 saturating); an Sm90TopologicalVisitor
converts each op's output but the last to ElementCompute; loads and broadcasts give their element
type; Sm90AuxStore stores its input converted to its element and passes the input on unchanged;
Sm90ScalarReduction (max |x|, NaNs skipped) atomically max-combines into its pointer per batch and
passes its input on; gemmgen's Sm90RowReduction and Sm90ColReduction (sum, or max |x| with NaNs skipped)
reduce their input over M or over N per batch on their deterministic path (partials per tile in
the workspace, whose tile counters must start at 0), store the vector and pass the input on.
The functors are gemmgen/include/gemmgen/epilogue.hpp's formulas, here in fp32 torch.

Column pairs (gemmgen/include/gemmgen/pairs.hpp): a pair's half is held in both columns of its
pair (PairEven / PairOdd copy one into both, Interleave takes one input's even column and the
other's odd, PairSumMask zeroes the odd); PairLoad / PairStore read and write N/2-column tensors,
DoubleLoad / DoubleStore 2N-column ones, at a pointer and strides (per group in grouped kernels);
WithElementAux<E, Callbacks> is Callbacks (the collective's D is void). Coordinate<0> and
Coordinate<1> (coordinates.hpp) give each register its row or column in fp32, Random<Transposed,
Stream> its uniform random number.
"""

from __future__ import annotations

import dataclasses
import struct

import torch

from ..codegen.fields import D_SINK_HEADER
from ..ir import LSE_IDENTITY
from .cpp_types import CppType, EpilogueSourceError, declarations, parse_type, split_arguments
from .functors import compute_function, region_functors
from .register_nodes import ParamsView, column_blocks, coordinate, random_numbers, row_blocks

_FUSION = "cutlass::epilogue::fusion::"
_EPI = "gemmgen::epi::"
_D_MAP = "(*{p}.epilogue.tma_store_d.get_tma_descriptor())"
_ELEMENT = {"cutlass::bfloat16_t": torch.bfloat16, "cutlass::half_t": torch.float16, "float": torch.float32,
            "cutlass::float_e4m3_t": torch.float8_e4m3fn, "cutlass::float_e5m2_t": torch.float8_e5m2,
            "cutlass::float_e2m1_t": torch.float4_e2m1fn_x2,
            "int32_t": torch.int32}
_COMPUTE = "float"
_ROUND = "cutlass::FloatRoundStyle::round_to_nearest"
_COLLECTIVE_EPILOGUE = "cutlass::epilogue::collective::CollectiveEpilogue"
#: CollectiveEpilogue<DispatchPolicy, Tile, EpilogueTile, C, StrideC, D, StrideD, FusionCallbacks, ...>
_CALLBACKS_ARG = 7
_EPILOGUE_BUILDER = "typename cutlass::epilogue::collective::CollectiveBuilder"
#: CollectiveBuilder<Arch, OpClass, MmaTile, Cluster, EpilogueTile, Acc, Compute, C, LayoutC, AlignC, D,
#: LayoutD, AlignD, Schedule, FusionCallbacks>
_BUILDER_CALLBACKS_ARG = 14
_THREAD = "{p}.epilogue.thread"  # the callbacks' Params inside the kernel's Params


#: (per element, into global memory) functors of the reductions over M and N gemmgen emits.
_SCALAR_REDUCTIONS = {("cutlass::maximum_absolute_value_reduction", "cutlass::atomic_maximum"): "amax",
                      ("cutlass::maximum", "cutlass::atomic_maximum"): "max",
                      ("cutlass::minimum", "gemmgen::epi::AtomicMinimum"): "min"}

#: (per element, across lanes, across warps and tiles) functors of the vector reductions gemmgen emits.
_VECTOR_REDUCTIONS = {
    ("cutlass::plus", "cutlass::plus", "cutlass::plus"): "sum",
    ("cutlass::maximum_absolute_value_reduction", "cutlass::maximum", "cutlass::maximum"): "amax",
    ("cutlass::maximum", "cutlass::maximum", "cutlass::maximum"): "max",
    ("cutlass::minimum", "cutlass::minimum", "cutlass::minimum"): "min",
    (f"{_EPI}LseCombine",) * 3: "lse",  # lse.hpp: in the state {max, sum of exp(x - max)}
}


def scalar_reduction_of(functors: tuple[CppType, ...], what: str) -> str:
    """"amax", "max" or "min": the reduction over M and N whose (per element[, across lanes], into
    global memory) functors these are, as Sm90ScalarReduction's template arguments or the direct
    epilogue's ScalarReduction's (each `<float>`) name them."""
    names = [f.name for f in functors if f.member == "" and [str(a) for a in f.args] in ([], ["float"])]
    fn = _SCALAR_REDUCTIONS.get((names[0], names[-1])) if len(names) == len(functors) in (2, 3) else None
    if fn is None or (len(names) == 3 and names[1] != ("cutlass::minimum" if fn == "min" else "cutlass::maximum")):
        raise EpilogueSourceError(f"{what}: a reduction over M and N with functors {', '.join(map(str, functors))}")
    return fn


def reduce_into(fn: str, x: torch.Tensor, identity: float, target: torch.Tensor, batch_stride: int) -> None:
    """A reduction over M and N of x (L, M, N): each batch's values reduced from `identity`
    (maximum / minimum<float> skip NaN, as fmaxf / fminf), then combined, as the atomic does, with
    what `target` (L fp32, stride `batch_stride`; 0: one value for every batch) holds."""
    x = x.to(torch.float32)
    value = x.abs() if fn == "amax" else x
    reduced = torch.where(torch.isnan(value), identity, value).flatten(1)  # NaNs skipped
    combine = torch.minimum if fn == "min" else torch.maximum
    if not batch_stride:  # every batch combines into the one value
        reduced, target = reduced.reshape(1, -1), target[:1]
    part = combine(reduced.amin(dim=1) if fn == "min" else reduced.amax(dim=1), torch.tensor(identity))
    target.copy_(combine(target, part.to(target.dtype)))


def element_of(t: CppType) -> torch.dtype:
    if str(t) not in _ELEMENT:
        raise EpilogueSourceError(f"element type {t} is not one gemmgen uses")
    return _ELEMENT[str(t)]


def values_of(t: CppType) -> CppType:
    """The element of A or B: a microscaled kernel's (`mx_float8_t<E>`, `nv_float4_t<E>`) names it
    with its scales."""
    return t.args[0] if t.name in ("cutlass::mx_float8_t", "cutlass::nv_float4_t") else t


def _member(lvalue: str, index: int, count: int) -> str:
    """Op `index` of `count` in Sm90VisitorImplBase's Params: members op_0..op_3 up to four, a tuple beyond."""
    return f"{lvalue}.op_{index}" if count <= 4 else f"cute::get<{index}>({lvalue})"


def convert_to(x: torch.Tensor, element: torch.dtype) -> torch.Tensor:
    """fp32 to `element` as CUTLASS's NumericConverter does on sm_90: round to nearest even; to fp8
    with cvt.rn.satfinite, which clamps to the largest finite value (torch's cast to e5m2 gives inf)."""
    if element in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(element).max
        x = x.clamp(-limit, limit)
    return x.to(element)


def _element_bits(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    """An element's raw bytes as a 0-d tensor of `dtype`."""
    return torch.frombuffer(bytearray(raw), dtype=dtype)[0].clone()


def _aux_column_major(stride: CppType) -> bool:
    """An aux tensor's (M, N, L) stride type: N contiguous (row-major) or M contiguous."""
    spelled = str(stride)
    if spelled not in (_ROW_MAJOR_AUX, _COLUMN_MAJOR_AUX):
        raise EpilogueSourceError(f"aux stride {spelled}")
    return spelled == _COLUMN_MAJOR_AUX


_ROW_MAJOR_AUX = "cute::Stride<int64_t, cute::_1, int64_t>"
_COLUMN_MAJOR_AUX = "cute::Stride<cute::_1, int64_t, int64_t>"


def _matrix(params: ParamsView, lvalue: str, dtype: torch.dtype, column_major: bool, acc: torch.Tensor) -> torch.Tensor:
    """The M x N (x L) tensor a map addresses, which must be the problem's shape."""
    t = params.mapped(lvalue, dtype, column_major)
    if t.shape != acc.shape:
        raise AssertionError(f"the tensor map at {lvalue} addresses {tuple(t.shape)}, "
                             f"the problem is {tuple(acc.shape)}")
    return t


class EpilogueInterpreter:
    """The fusion callbacks of one generated kernel, parsed once, evaluated per problem."""

    def __init__(self, source: str) -> None:
        self.decls = declarations(source)
        self.regions = region_functors(source)
        collective = next((v for v in self.decls.values() if v.startswith(_COLLECTIVE_EPILOGUE + "<")), None)
        built = self.decls.get("CollectiveEpilogue", "")
        if collective is not None:
            callbacks = split_arguments(collective)[_CALLBACKS_ARG]
        elif built.startswith(_EPILOGUE_BUILDER + "<"):  # sm100: named through the builder
            callbacks = split_arguments(built.removeprefix("typename ").removesuffix("::CollectiveOp"))[
                _BUILDER_CALLBACKS_ARG]
        else:
            raise EpilogueSourceError("no CollectiveEpilogue declaration in the source")
        self.callbacks = self._resolve(parse_type(callbacks))
        self.element_a = element_of(values_of(parse_type(self.decls["ElementA"])))
        self.element_b = element_of(values_of(parse_type(self.decls["ElementB"])))
        # void: a PairStore among the callbacks writes D (pairs.hpp)
        self.element_d = None if self.decls["ElementD"] == "void" else element_of(parse_type(self.decls["ElementD"]))
        # ...or it does, and the collective's own store of D goes to the module's sink (`fields.sinks_d`)
        self.d_sink = f"#include <{D_SINK_HEADER}>" in source
        c = self.decls["ElementC"]
        self.element_c = None if c == "void" else element_of(parse_type(c))
        self.column_major = {name: self._column_major(name) for name in ("LayoutA", "LayoutB", "LayoutC", "LayoutD")}

        # a grouped kernel names its layouts as pointers: strides per group (pointer-array kernels)
        self.grouped = self.decls["LayoutD"].endswith("*")
        # row_blocks.hpp's sm_90a root gives fp32, which the collective converts to ElementD
        self.root_gives_fp32 = any(v.startswith(f"{_EPI}Sm90RowBlocks<") for v in self.decls.values())

    def _column_major(self, name: str) -> bool:
        layout = self.decls[name].removesuffix("*").strip()
        if layout not in ("cutlass::layout::RowMajor", "cutlass::layout::ColumnMajor"):
            raise EpilogueSourceError(f"{name} is {layout}")
        return layout == "cutlass::layout::ColumnMajor"

    def _resolve(self, t: CppType) -> CppType:
        """A declared name replaced by its declaration, until a template-id remains."""
        while not t.args and not t.member and t.name in self.decls:
            t = parse_type(self.decls[t.name])
        return t

    def run(self, acc: torch.Tensor, params: ParamsView) -> None:
        """Evaluate the callbacks on the (L, M, N) fp32 accumulator, storing D and the aux outputs
        through the tensor maps the Params hold."""
        d = self._visit(self.callbacks, _THREAD, acc, params, ())
        if self.element_d is None:
            return
        if self.root_gives_fp32 and d.dtype == torch.float32:  # the collective converts the root's fp32 to ElementD
            d = convert_to(d, self.element_d)
        if d.dtype != self.element_d:
            raise EpilogueSourceError(f"the callbacks give {d.dtype}, ElementD is {self.element_d}")
        if self.d_sink:  # the map of one element must lie outside every tensor of the call
            sink = params.encoded(_D_MAP)
            if tuple(sink.dims) != (1, 1, 1) or params.holds(sink.addr):
                raise AssertionError(f"the collective's store of D goes to {sink.addr:#x}, a map of {sink.dims} "
                                     "elements: not a sink outside the call's tensors")
            return
        if self.grouped:  # the current group's D, through the kernel's pointer and stride arrays
            target = params.group_matrix("{p}.epilogue.ptr_D", "{p}.epilogue.dD", self.element_d, acc,
                                         self.column_major["LayoutD"])
        else:
            target = _matrix(params, _D_MAP, self.element_d, self.column_major["LayoutD"], acc)
        target.copy_(d.expand(acc.shape))

    def _visit(self, t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView,
               inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        t = self._resolve(t)
        if t.name == f"{_EPI}WithElementAux":
            if self.element_d is not None or len(t.args) != 2:
                raise EpilogueSourceError(f"{t} with ElementD {self.element_d}")
            return self._visit(t.args[1], lvalue, acc, params, inputs)
        if t.name in (f"{_EPI}PairLoad", f"{_EPI}PairStore", f"{_EPI}DoubleLoad", f"{_EPI}DoubleStore"):
            return self._registers(t, lvalue, acc, params, inputs)
        if t.name == f"{_EPI}Coordinate":
            return coordinate(t, acc, inputs)
        if t.name == f"{_EPI}Random":
            return random_numbers(t, lvalue, acc, params, inputs)
        if t.name == f"{_EPI}Sm90RowBlocks":
            return row_blocks(t, lvalue, acc, params, inputs, self._resolve)
        if t.name == f"{_EPI}Sm90ColumnBlocksStore":
            if len(t.args) not in (5, 6):
                raise EpilogueSourceError(f"column blocks node {t}")
            return column_blocks(t, lvalue, acc, params, inputs, element_of(t.args[2]), self._tile(t.args[3])[0])
        if t.name == f"{_EPI}Sm100RowBroadcastInPlace":  # the same row broadcast, read from shared memory in place
            if len(t.args) != 1 or self._resolve(t.args[0]).name != f"{_FUSION}Sm90RowBroadcast":
                raise EpilogueSourceError(f"in-place row broadcast {t}")
            return self._visit(t.args[0], lvalue, acc, params, inputs)
        if t.name == f"{_EPI}Sm100RowBlocks":  # sm_100a's: the same blocks, converted to its element by the node
            if len(t.args) != 6:
                raise EpilogueSourceError(f"row blocks node {t}")
            sm90_form = dataclasses.replace(t, args=t.args[:3] + t.args[4:])
            return convert_to(row_blocks(sm90_form, lvalue, acc, params, inputs, self._resolve), element_of(t.args[3]))
        kind = t.name.removeprefix(_FUSION)
        if kind == "Sm90EVT":
            node, *children = t.args
            n = len(t.args)  # Sm90TreeVisitor : Sm90VisitorImpl<ChildOps..., NodeOp>
            kids = tuple(self._visit(c, _member(lvalue, i, n), acc, params, ()) for i, c in enumerate(children))
            return self._visit(node, _member(lvalue, n - 1, n), acc, params, kids)
        if kind == "Sm90TopologicalVisitor":
            compute, edges, *ops = t.args
            if str(compute) != _COMPUTE or self._resolve(edges).name != "cute::tuple":
                raise EpilogueSourceError(f"topological visitor {t}")
            seqs = [[int(i.name) for i in s.args] for s in self._resolve(edges).args]
            if len(seqs) != len(ops):
                raise EpilogueSourceError(f"{len(ops)} ops and {len(seqs)} edge lists in {t}")
            outs: list[torch.Tensor] = []
            for k, (op, seq) in enumerate(zip(ops, seqs, strict=True)):
                if any(i >= k for i in seq):
                    raise EpilogueSourceError(f"op {k} of {t} reads a later op ({seq})")
                out = self._visit(op, _member(lvalue, k, len(ops)), acc, params, tuple(outs[i] for i in seq))
                outs.append(out if k == len(ops) - 1 else out.to(torch.float32))
            return outs[-1]
        if kind == "Sm90Compute":
            fn, element_out, element_compute, rounding = t.args
            if str(element_compute) != _COMPUTE or str(rounding) != _ROUND:
                raise EpilogueSourceError(f"compute node {t}")
            if not inputs:
                raise EpilogueSourceError(f"compute node {t} without inputs")
            fn_of = compute_function(fn, self.regions)
            return convert_to(fn_of(*(x.to(torch.float32) for x in inputs)), element_of(element_out))
        if t.name == f"{_EPI}Sm90RowReduction" or kind in ("Sm90RowReduction", "Sm90ColReduction"):
            return self._vector_reduction(kind != "Sm90ColReduction", t, lvalue, acc, params, inputs)
        if inputs and kind not in ("Sm90AuxStore", "Sm90ScalarReduction"):
            raise EpilogueSourceError(f"{kind} is given inputs")
        return self._leaf(kind, t, lvalue, acc, params, inputs)

    def _vector_reduction(self, row: bool, t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView,
                          inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """gemmgen's Sm90RowReduction (over M, to an N vector: row_reduction.hpp, CUTLASS's Params and
        workspace), CUTLASS's (sm_100a's) or CUTLASS's Sm90ColReduction (over N, to an M vector),
        each batch to its own vector (a batch stride of 0 reduces over the batches too)."""
        if len(t.args) != 9 or len(inputs) != 1:
            raise EpilogueSourceError(f"vector reduction {t} with {len(inputs)} inputs")
        if t.name == f"{_EPI}Sm90RowReduction":  # <Reg, Shuffle, Gmem, CtaTileShapeMNK, EpilogueSchedule, ...>
            reg, shuffle, gmem, tile, schedule, element_t, compute, rounding, stride = t.args
            if schedule.name != "EpilogueSchedule":
                raise EpilogueSourceError(f"vector reduction {t}: not the kernel's epilogue schedule")
        else:
            reg, shuffle, gmem, stages, tile, element_t, compute, rounding, stride = t.args
            if stages.name != "0":
                raise EpilogueSourceError(f"vector reduction {t}")
        op = _VECTOR_REDUCTIONS.get((str(reg), str(shuffle), str(gmem)))
        want = "cute::Stride<cute::_0, cute::_1, int64_t>" if row else "cute::Stride<cute::_1, cute::_0, int64_t>"
        state = f"{_EPI}LseState" if op == "lse" else _COMPUTE
        if op is None or (str(compute), str(rounding), str(stride)) != (state, _ROUND, want):
            raise EpilogueSourceError(f"vector reduction {t}")
        element = element_of(element_t)
        l_, m, n = acc.shape
        vec = "row" if row else "col"
        batch_stride = struct.unpack("<q", params.raw(f"cute::get<2>({lvalue}.d{vec.title()})"))[0]
        length = n if row else m
        ptr = params.pointer(f"{lvalue}.ptr_{vec}", element, (l_ - 1) * batch_stride + length)
        if ptr is None:  # EnableNullptr: a null pointer skips the reduction
            return inputs[0]
        tm, tn = self._tile(tile)
        tiles_m, tiles_n = -(-m // tm), -(-n // tn)
        words = 2 if op == "lse" else 1  # fp32 words of each partial value
        partials = params.inside(f"{lvalue}.reduction_buffer", torch.float32,
                                 tiles_m * tiles_n * l_ * (tn if row else tm) * words)
        counters = params.inside(f"{lvalue}.tile_counters", torch.int32, tiles_n if row else tiles_m)
        if partials.data_ptr() < counters.data_ptr() + 4 * counters.numel() and \
                counters.data_ptr() < partials.data_ptr() + 4 * partials.numel():
            raise AssertionError(f"{lvalue}: the tiles' partial values overlap their tile counters")
        if counters.any():
            raise AssertionError(f"{lvalue}.tile_counters: not 0 at launch, so no tile would finish the reduction")
        x = inputs[0].to(torch.float32).expand(acc.shape)
        dims = (1 if row else 2,) if batch_stride else (0, 1 if row else 2)
        value = _vector_value(op, x, dims, params, lvalue)
        target = ptr.as_strided((l_ if batch_stride else 1, length), (batch_stride, 1))
        target.copy_(convert_to(value.reshape(target.shape), element))
        return inputs[0]

    def _register_tensor(self, t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView, columns: int
                         ) -> torch.Tensor:
        """The (L, M, columns) tensor a register visitor of pairs.hpp reads or writes, at its
        HalfTensor's pointer and strides; in a grouped kernel (its element `E*`: per-group
        pointers) the current group's (1, M, columns), from its pointer, rows the M stride apart."""
        element_t = str(t.args[0])
        grouped = element_t.endswith("*")
        if grouped != self.grouped:
            raise EpilogueSourceError(f"{t} in a {'grouped' if self.grouped else 'dense'} kernel")
        element = element_of(parse_type(element_t.removesuffix("*").strip()))
        l_, m, _ = acc.shape
        stride_m, stride_l = (struct.unpack("<q", params.raw(f"cute::get<{i}>({lvalue}.dHalf)"))[0] for i in (0, 2))
        if grouped:
            ptr = params.group_pointer(f"{lvalue}.ptr", element, max((m - 1) * stride_m + columns, 0))
            shape, strides = (1, m, columns), (0, stride_m, 1)
        else:
            ptr = params.pointer(f"{lvalue}.ptr", element, (l_ - 1) * stride_l + (m - 1) * stride_m + columns)
            shape, strides = (l_, m, columns), (stride_l, stride_m, 1)
        if ptr is None:
            raise AssertionError(f"{lvalue}.ptr: null")
        return ptr.as_strided(shape, strides)

    def _registers(self, t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView,
                   inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """PairLoad / PairStore: an N/2-column tensor, a pair's value in both its registers (stored
        from the even one); DoubleLoad<E, S, parity> / DoubleStore: a 2N-column tensor, its even or
        odd columns read, both written from two inputs (each at `_register_tensor`'s)."""
        store, double = t.name.endswith("Store"), t.name.startswith(f"{_EPI}Double")
        if len(t.args) != (3 if double and not store else 2) or str(t.args[1]) != _ROW_MAJOR_AUX or \
                len(inputs) != int(store) * (1 + int(double)):
            raise EpilogueSourceError(f"{t} with {len(inputs)} inputs")
        tensor = self._register_tensor(t, lvalue, acc, params, 2 * acc.shape[-1] if double else acc.shape[-1] // 2)
        if not store and not double:
            return tensor.to(torch.float32).repeat_interleave(2, dim=-1)
        if not store:
            parity = int(t.args[2].name)
            if parity not in (0, 1):
                raise EpilogueSourceError(f"{t}")
            return tensor[..., parity::2].to(torch.float32)
        values = [x.to(torch.float32).expand(acc.shape) for x in inputs]
        if double:
            for parity, x in enumerate(values):
                tensor[..., parity::2] = convert_to(x, tensor.dtype)
        else:
            tensor.copy_(convert_to(values[0][..., 0::2], tensor.dtype))
        return inputs[0]

    def _tile(self, t: CppType) -> tuple[int, int]:
        """(M, N) of a CTA tile shape, `Shape<_128, _128, _64>` (in `namespace cute`)."""
        shape = self._resolve(t)
        if shape.name.removeprefix("cute::") != "Shape" or len(shape.args) != 3:
            raise EpilogueSourceError(f"tile shape {t} is {shape}")
        m, n, _ = (int(a.name.removeprefix("cute::").removeprefix("_")) for a in shape.args)
        return m, n

    @staticmethod
    def _scalar_reduction(t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView,
                          inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Sm90ScalarReduction: each batch's values reduced from the Params' identity in registers
        (maximum / minimum<float> skip NaN, as fmaxf / fminf), then combined atomically into the
        batch's fp32 (a max, or gemmgen's AtomicMinimum); its input passes on."""
        reg, gmem, element_t, compute, round_style, stride = t.args
        fn = _SCALAR_REDUCTIONS.get((str(reg), str(gmem)))
        if fn is None or (str(compute), str(round_style), str(stride), len(inputs)) != (
                _COMPUTE, _ROUND, "cute::Stride<cute::_0, cute::_0, int64_t>", 1):
            raise EpilogueSourceError(f"scalar reduction {t} with {len(inputs)} inputs")
        l_ = acc.shape[0]
        element = element_of(element_t)
        batch_stride = struct.unpack("<q", params.raw(f"cute::get<2>({lvalue}.dScalar)"))[0]
        ptr = params.pointer(f"{lvalue}.ptr_scalar", element, (l_ - 1) * batch_stride + 1)
        if ptr is not None:  # EnableNullptr: a null pointer skips the reduction
            identity = float(_element_bits(params.raw(f"{lvalue}.reduction_identity"), torch.float32))
            reduce_into(fn, inputs[0].expand(acc.shape), identity, ptr.as_strided((l_,), (batch_stride,)),
                        batch_stride)
        return inputs[0]

    @staticmethod
    def _shared_load(t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView) -> torch.Tensor:
        """Sm90AuxLoad<0, _, Element, Stride>: an M x N matrix read through `ptr_aux` with D's layout's
        strides, the batch's static 0 (the other template arguments are unused)."""
        element, stride = element_of(t.args[2]), str(t.args[3])
        _, m, n = acc.shape
        column_major = {"cute::Stride<int64_t, cute::_1, cute::_0>": False,
                        "cute::Stride<cute::_1, int64_t, cute::_0>": True}.get(stride)
        if column_major is None or len(t.args) != 6:
            raise EpilogueSourceError(f"shared load {t}")
        ld = struct.unpack("<q", params.raw(f"cute::get<{int(column_major)}>({lvalue}.dAux)"))[0]
        ptr = params.pointer(f"{lvalue}.ptr_aux", element, (n - 1) * ld + m if column_major else (m - 1) * ld + n)
        if ptr is None:
            return _element_bits(params.raw(f"{lvalue}.null_default"), element).reshape(1, 1, 1)
        return ptr.as_strided((1, m, n), (0, 1, ld) if column_major else (0, ld, 1)).to(torch.float32)

    def _leaf(self, kind: str, t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView,
              inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        l_, m, n = acc.shape
        if kind == "Sm90AccFetch":
            return acc
        if kind == "Sm90SrcFetch":
            element = element_of(t.args[0])
            if element != self.element_c:
                raise EpilogueSourceError(f"Sm90SrcFetch<{element}> with ElementC {self.element_c}")
            if self.grouped:
                return params.group_matrix("{p}.epilogue.ptr_C", "{p}.epilogue.dC", element, acc,
                                           self.column_major["LayoutC"])
            return _matrix(params, "(*{p}.epilogue.tma_load_c.get_tma_descriptor())", element,
                           self.column_major["LayoutC"], acc)
        if kind in ("Sm90RowBroadcast", "Sm90ColBroadcast"):
            stages, _, element_t, compute, stride = t.args[:5]
            row = kind == "Sm90RowBroadcast"
            modes = "cute::_0, cute::_1" if row else "cute::_1, cute::_0"
            per_batch = str(stride) == f"cute::Stride<{modes}, int64_t>"  # a vector per batch: its batch stride
            if stages.name != "0" or str(compute) != _COMPUTE or str(stride) not in (
                    f"cute::Stride<{modes}, cute::_0>", f"cute::Stride<{modes}, int64_t>"):
                raise EpilogueSourceError(f"broadcast {t}")
            per_group = str(element_t).endswith("*")  # Sm90RowBroadcast<..., Element*>: a pointer per group
            if per_group != self.grouped or (per_group and per_batch):
                raise EpilogueSourceError(f"broadcast {t} in a {'grouped' if self.grouped else 'dense'} kernel")
            element = element_of(parse_type(str(element_t).removesuffix("*").strip()))
            field, length = f"{lvalue}.ptr_{'row' if row else 'col'}", n if row else m
            batch_stride = struct.unpack("<q", params.raw(f"cute::get<2>({lvalue}.d{'Row' if row else 'Col'})"))[0] \
                if per_batch else 0
            v = params.group_pointer(field, element, length) if per_group else \
                params.pointer(field, element, (l_ - 1) * batch_stride + length if l_ and length else 0)
            if v is None:  # Sm90ColBroadcast's Params hold null_default as ElementCompute
                default = _element_bits(params.raw(f"{lvalue}.null_default"), element if row else torch.float32)
                v = default.expand(1, length)
            else:
                v = v.as_strided((l_, length), (batch_stride, 1)) if per_batch else v.reshape(1, length)
            return v.to(torch.float32).reshape((-1, 1, n) if row else (-1, m, 1))
        if kind == "Sm90ScalarBroadcast":
            element_t, stride = t.args[:2]
            if str(stride) != "cute::Stride<cute::_0, cute::_0, int64_t>" or len(t.args) > 2:
                raise EpilogueSourceError(f"scalar broadcast {t}")
            element = element_of(element_t)
            batch_stride = struct.unpack("<q", params.raw(f"cute::get<2>({lvalue}.dScalar[0])"))[0]
            first = max(getattr(params, "group", -1), 0)  # a grouped kernel's L coordinate is its group
            ptr = params.pointer(f"{lvalue}.scalar_ptrs[0]", element, (first + l_ - 1) * batch_stride + 1)
            if ptr is None:
                return _element_bits(params.raw(f"{lvalue}.scalars[0]"), element).reshape(1, 1, 1)
            return ptr[(first + torch.arange(l_)) * batch_stride].reshape(l_, 1, 1)
        if kind == "Sm90AuxLoad" and t.args[0].name == "0":  # one matrix for every batch, from a pointer
            return self._shared_load(t, lvalue, acc, params)
        if kind == "Sm90AuxLoad":
            element = element_of(t.args[2])
            if params.raw(f"{lvalue}.use_default") != b"\x00":
                return _element_bits(params.raw(f"{lvalue}.null_default"), element).reshape(1, 1, 1)
            return _matrix(params, f"(*{lvalue}.tma_load_aux.get_tma_descriptor())", element,
                           _aux_column_major(t.args[3]), acc)
        if kind == "Sm90AuxStore":
            element, rounding = element_of(t.args[2]), str(t.args[3])
            if len(inputs) != 1 or rounding != _ROUND:
                raise EpilogueSourceError(f"aux store {t} with {len(inputs)} inputs")
            if params.raw(f"{lvalue}.is_nullptr") == b"\x00":
                target = _matrix(params, f"(*{lvalue}.tma_store_aux.get_tma_descriptor())", element,
                                 _aux_column_major(t.args[4]), acc)
                target.copy_(convert_to(inputs[0].to(torch.float32), element).expand(acc.shape))
            return inputs[0]
        if kind == "Sm90ScalarReduction":
            return self._scalar_reduction(t, lvalue, acc, params, inputs)
        raise EpilogueSourceError(f"visitor {t} is not one this interpreter models")


def _vector_value(op: str, x: torch.Tensor, dims: tuple[int, ...], params: ParamsView, lvalue: str) -> torch.Tensor:
    """A vector reduction of x over `dims`, each thread's state starting at the Params' identity
    (which must leave the value unchanged: a thread's state enters the combine once per thread)."""
    if op == "lse":  # lse.hpp: every element enters as {x, 1}, the identity is the pair {-inf, 0}
        start = tuple(float(_element_bits(params.raw(f"{lvalue}.reduction_identity.{part}"), torch.float32))
                      for part in ("max", "sum"))
        if start != LSE_IDENTITY:
            raise AssertionError(f"{lvalue}: a log-sum-exp's reduction_identity is {start}, not {LSE_IDENTITY}")
        return x.logsumexp(dim=dims)
    identity = _element_bits(params.raw(f"{lvalue}.reduction_identity"), torch.float32)
    if op == "sum":
        if identity != 0:
            raise AssertionError(f"{lvalue}: a sum's reduction_identity is {float(identity)}, not 0")
        return x.sum(dim=dims)
    if op == "amax":  # maximum<float> (fmaxf) skips NaN; the running value starts at the identity
        return torch.maximum(torch.where(torch.isnan(x), 0.0, x.abs()).amax(dim=dims), identity)
    if op == "max":  # fmaxf from the identity: NaN skipped, the identity where nothing is left
        return torch.maximum(torch.where(torch.isnan(x), identity, x).amax(dim=dims), identity)
    return torch.minimum(torch.where(torch.isnan(x), identity, x).amin(dim=dims), identity)  # fminf likewise

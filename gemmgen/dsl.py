"""What a user writes: a GEMM declaration plus an epilogue traced from a plain Python function.

    bias_gelu = gg.Recipe("bias_gelu", lambda acc, bias: gg.gelu(acc + bias),
                          a=gg.bf16, b=gg.bf16, operands={"bias": gg.RowVector(gg.bf16)})

The epilogue function is called once with symbolic `Value`s; operator overloading records
the graph, which `ir.normalize` turns into the IR. Nothing is parsed from source.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import RecipeError, UnknownOpError
from .ir import (
    BLOCK_SCALE_OPERANDS,
    EpilogueIR,
    GemmSpec,
    Node,
    Op,
    Operand,
    Output,
    RecipeIR,
    Reduction,
    f32,
    normalize,
)
from .types import DType, Layout, OperandKind, as_dtype, as_layout

if TYPE_CHECKING:
    import torch

    from .config import KernelConfig


# ----------------------------------------------------------------------------- operand declarations

_VECTOR_DTYPES = (DType.BF16, DType.F16, DType.F32)


@dataclass(frozen=True)
class Scalar:
    """A scalar operand: a runtime fp32 value, or a compile-time constant when `value` is given."""

    value: float | None = None
    dtype: DType = DType.F32
    kind = OperandKind.SCALAR


@dataclass(frozen=True)
class RowVector:
    """One value per output column (length N), e.g. a bias. Shared by every batch."""

    dtype: DType
    kind = OperandKind.ROW


@dataclass(frozen=True)
class ColVector:
    """One value per output row (length M), e.g. a per-token scale. Shared by every batch."""

    dtype: DType
    kind = OperandKind.COL


@dataclass(frozen=True)
class Matrix:
    """A full M x N input (C, a residual), batched like D."""

    dtype: DType
    kind = OperandKind.MATRIX


OperandDecl = Scalar | RowVector | ColVector | Matrix


# ----------------------------------------------------------------------------- tracing


class _Trace:
    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, node: Node) -> Value:
        self.nodes.append(node)
        return Value(self, len(self.nodes) - 1)


_ACTIVE: list[_Trace] = []


class Value:
    """A symbolic epilogue value (fp32 in the kernel). Supports + - * /, unary -, abs()."""

    __slots__ = ("_index", "_trace")

    def __init__(self, trace: _Trace, index: int) -> None:
        self._trace = trace
        self._index = index

    def __add__(self, o: Any) -> Value:
        return _binary(Op.ADD, self, o, "+")

    def __radd__(self, o: Any) -> Value:
        return _binary(Op.ADD, o, self, "+")

    def __sub__(self, o: Any) -> Value:
        return _binary(Op.SUB, self, o, "-")

    def __rsub__(self, o: Any) -> Value:
        return _binary(Op.SUB, o, self, "-")

    def __mul__(self, o: Any) -> Value:
        return _binary(Op.MUL, self, o, "*")

    def __rmul__(self, o: Any) -> Value:
        return _binary(Op.MUL, o, self, "*")

    def __truediv__(self, o: Any) -> Value:
        return _binary(Op.DIV, self, o, "/")

    def __rtruediv__(self, o: Any) -> Value:
        return _binary(Op.DIV, o, self, "/")

    def __neg__(self) -> Value:
        return _unary(Op.NEG, self, "-")

    def __pos__(self) -> Value:
        return self

    def __abs__(self) -> Value:
        return _unary(Op.ABS, self, "abs")

    def _unsupported(self, what: str, hint: str) -> RecipeError:
        return RecipeError(f"epilogue: {what} is not supported on traced values; {hint}")

    def __pow__(self, o: Any) -> Value:
        raise self._unsupported("operator '**'", "write the product out (x * x)")

    __rpow__ = __pow__

    def __matmul__(self, o: Any) -> Value:
        raise self._unsupported("operator '@'", "the GEMM is the recipe itself; the epilogue is elementwise")

    def __floordiv__(self, o: Any) -> Value:
        raise self._unsupported("operator '//'", "use '/'")

    def __mod__(self, o: Any) -> Value:
        raise self._unsupported("operator '%'", "use gemmgen ops (gg.min, gg.max, gg.clamp, ...)")

    def _compare(self, o: Any) -> Value:
        raise self._unsupported("comparison", "use gg.max / gg.min / gg.clamp / gg.relu instead of branches")

    __lt__ = __le__ = __gt__ = __ge__ = _compare

    def __eq__(self, o: object) -> bool:
        raise self._unsupported("comparison", "use gg.max / gg.min / gg.clamp / gg.relu instead of branches")

    __ne__ = __eq__
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise self._unsupported("a truth test (if/and/or)", "the epilogue must be branch-free; use gg.max / gg.min")

    def __float__(self) -> float:
        raise self._unsupported("float() / math.* functions", "use gemmgen ops (gg.exp, gg.tanh, ...)")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        raise RecipeError(f"epilogue: torch.{name} is not traceable; use the gemmgen op of the same meaning "
                          f"(gg.{name} if it exists; see gemmgen.OPS)")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnknownOpError(f"epilogue: traced values have no method {name!r}; use the gemmgen op "
                             f"(gg.{name}(x)) if it exists. Available ops: {', '.join(OPS)}")

    def __repr__(self) -> str:
        return f"<gemmgen traced value #{self._index}>"


class Reduced:
    """`gg.amax(x)`, `gg.amax(x, dim)`, `gg.sum(x, dim)`, `gg.reduce_max(x, dim)`,
    `gg.reduce_min(x, dim)`: an output holding a reduction of x in
    fp32, per batch: over M and N (one value), over M (`dim=0`: one value per column of D) or over
    N (`dim=1`: one value per row). Returned from the epilogue under an aux name declared
    `gg.f32`; it is not a value to compute with."""

    __slots__ = ("dim", "reduce", "value")

    def __init__(self, value: Value, reduce: Reduction, dim: int | None) -> None:
        self.value, self.reduce, self.dim = value, reduce, dim

    def _misuse(self, *args: Any) -> Any:
        raise _reduced_misuse()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __neg__ = __pos__ = __abs__ = __pow__ = _misuse

    def __repr__(self) -> str:
        dim = "" if self.dim is None else f", dim={self.dim}"
        name = {Reduction.MAX: "reduce_max", Reduction.MIN: "reduce_min"}.get(self.reduce, self.reduce.value)
        return f"gemmgen.{name}({self.value!r}{dim})"


def _reduced_misuse() -> RecipeError:
    return RecipeError("gg.amax(...), gg.sum(...) and gg.reduce_max/min(...) are outputs, not values to compute "
                       "with: return them from the epilogue, e.g. {'d': y, 'amax_y': gg.amax(y)}, declared with "
                       "aux={'amax_y': gg.f32}")


def _lift(x: Any, op_name: str) -> Value:
    """Turn a Python number into a constant of the current trace; reject anything else."""
    if isinstance(x, Value):
        return x
    if isinstance(x, Reduced):
        raise _reduced_misuse()
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        if not _ACTIVE:
            raise RecipeError(f"{op_name}: gemmgen ops can only be used inside an epilogue being traced")
        return _ACTIVE[-1].add(Node(Op.CONST, attr=f32(x)))
    raise RecipeError(f"epilogue op '{op_name}': expected a traced value or a Python number, got {type(x).__name__} "
                      f"({x!r}); tensors are passed at call time, not captured by the epilogue")


def _same_trace(values: list[Value], op_name: str) -> _Trace:
    traces = {id(v._trace): v._trace for v in values}
    if len(traces) != 1 or not _ACTIVE or _ACTIVE[-1] is not values[0]._trace:
        raise RecipeError(f"epilogue op '{op_name}': a value from another (or finished) trace was used; "
                          "build every value inside the epilogue function")
    return values[0]._trace


def _binary(op: Op, x: Any, y: Any, op_name: str) -> Value:
    if not isinstance(x, Value) and not isinstance(y, Value):
        _lift(x, op_name)  # raises for non-numbers
    a, b = _lift(x, op_name), _lift(y, op_name)
    return _same_trace([a, b], op_name).add(Node(op, (a._index, b._index)))


def _unary(op: Op, x: Any, op_name: str, attr: float | None = None, dtype: DType | None = None) -> Value:
    a = _lift(x, op_name)
    return _same_trace([a], op_name).add(Node(op, (a._index,), attr=attr, dtype=dtype))


def _constant(x: Any, what: str) -> float:
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return f32(x)
    raise RecipeError(f"{what}: expected a compile-time constant (a Python number), got {type(x).__name__}; "
                      "runtime values cannot be used here")


# ----------------------------------------------------------------------------- ops


def minimum(x: Any, y: Any) -> Value:
    """Elementwise minimum (NaN-propagating, like torch.minimum)."""
    return _binary(Op.MIN, x, y, "min")


def maximum(x: Any, y: Any) -> Value:
    """Elementwise maximum (NaN-propagating, like torch.maximum)."""
    return _binary(Op.MAX, x, y, "max")


min = minimum  # noqa: A001
max = maximum  # noqa: A001


def clamp(x: Any, lo: Any = None, hi: Any = None) -> Value:
    if lo is None and hi is None:
        raise RecipeError("epilogue op 'clamp': give at least one of lo, hi")
    v = _lift(x, "clamp")
    if lo is not None:
        v = maximum(v, lo)
    if hi is not None:
        v = minimum(v, hi)
    return v


def abs(x: Any) -> Value:  # noqa: A001
    return _unary(Op.ABS, x, "abs")


def exp(x: Any) -> Value:
    return _unary(Op.EXP, x, "exp")


def tanh(x: Any) -> Value:
    return _unary(Op.TANH, x, "tanh")


def sigmoid(x: Any) -> Value:
    return _unary(Op.SIGMOID, x, "sigmoid")


def relu(x: Any) -> Value:
    return _unary(Op.RELU, x, "relu")


def gelu(x: Any) -> Value:
    """GELU with the exact erf form (torch's approximate='none')."""
    return _unary(Op.GELU, x, "gelu")


def gelu_tanh(x: Any) -> Value:
    """GELU with the tanh approximation (torch's approximate='tanh')."""
    return _unary(Op.GELU_TANH, x, "gelu_tanh")


def silu(x: Any) -> Value:
    return _unary(Op.SILU, x, "silu")


def leaky_relu(x: Any, slope: float = 0.01) -> Value:
    return _unary(Op.LEAKY_RELU, x, "leaky_relu", attr=_constant(slope, "leaky_relu slope"))


def cast(x: Any, dtype: Any) -> Value:
    """Round to `dtype` (then computation continues in fp32), as storing and reloading would; to
    fp8 saturating at its largest finite value (NaN stays NaN), as the kernel converts (PTX
    cvt.rn.satfinite): a quantize-dequantize inside the epilogue."""
    d = as_dtype(dtype, "cast dtype")
    if d not in _D_DTYPES:
        raise RecipeError(f"epilogue op 'cast': cannot cast to {d.value}; supported: bf16, f16, f32, e4m3, e5m2")
    return _unary(Op.CAST, x, "cast", dtype=d)


def amax(x: Any, dim: int | None = None) -> Reduced:
    """An output of max |x| (NaNs skipped): over M and N per batch, which fp8 scaling needs for its
    next scale; or per column (`dim=0`) or per row (`dim=1`, a per-token scale). See `Reduced`."""
    return Reduced(_reduced_value(x, "amax"), Reduction.AMAX, _reduce_dim(dim, "amax", optional=True))


def sum(x: Any, dim: int) -> Reduced:  # noqa: A001
    """An output of the sum of x over M (`dim=0`: one value per column of D, e.g. a bias gradient)
    or over N (`dim=1`: one value per row, e.g. a norm's statistics). Summed in fp32 in a fixed
    order, so the result is the same from run to run. See `Reduced`."""
    return Reduced(_reduced_value(x, "sum"), Reduction.SUM, _reduce_dim(dim, "sum", optional=False))


def reduce_max(x: Any, dim: int) -> Reduced:
    """An output of the largest value of x over M (`dim=0`: one per column of D) or over N (`dim=1`:
    one per row, e.g. a row's max logit), NaNs skipped, -inf where a row or column has no value.
    (`gg.max(x, y)` is the elementwise maximum.) See `Reduced`."""
    return Reduced(_reduced_value(x, "reduce_max"), Reduction.MAX, _reduce_dim(dim, "reduce_max", optional=False))


def reduce_min(x: Any, dim: int) -> Reduced:
    """An output of the smallest value of x over M (`dim=0`) or over N (`dim=1`), NaNs skipped,
    +inf where a row or column has no value. (`gg.min(x, y)` is the elementwise minimum.)"""
    return Reduced(_reduced_value(x, "reduce_min"), Reduction.MIN, _reduce_dim(dim, "reduce_min", optional=False))


def _reduced_value(x: Any, op_name: str) -> Value:
    a = _lift(x, op_name)
    _same_trace([a], op_name)
    return a


def _reduce_dim(dim: Any, op_name: str, optional: bool) -> int | None:
    """0 (over M) or 1 (over N) of the M x N value, as torch numbers the dims of a matrix."""
    if dim is None and optional:
        return None
    if isinstance(dim, int) and not isinstance(dim, bool) and dim in (0, 1, -1, -2):
        return dim % 2
    over_all = " or None (over M and N)" if optional else ""
    raise RecipeError(f"{op_name}: dim={dim!r}; expected 0 (over M: one value per column of D), 1 or -1 "
                      f"(over N: one value per row){over_all}")


OPS = ("+", "-", "*", "/", "unary -", "min", "max", "clamp", "abs", "exp", "tanh", "sigmoid", "relu", "gelu",
       "gelu_tanh", "silu", "leaky_relu", "cast", "amax", "sum", "reduce_max", "reduce_min")


# ----------------------------------------------------------------------------- the recipe

_AB_16BIT = (DType.BF16, DType.F16)
_AB_FP8 = (DType.E4M3, DType.E5M2)
_D_DTYPES = (DType.BF16, DType.F16, DType.F32, DType.E4M3, DType.E5M2)


def _check_operand(name: str, decl: Any) -> Operand | float:
    if not name.isidentifier() or name in ("acc", "a", "b", "d", "out", "offsets"):
        raise RecipeError(f"operand {name!r}: names must be Python identifiers other than acc, a, b, d, out, "
                          "offsets")
    if not isinstance(decl, Scalar | RowVector | ColVector | Matrix):
        raise RecipeError(f"operand {name!r}: expected gg.Scalar(), gg.RowVector(dtype), gg.ColVector(dtype) or "
                          f"gg.Matrix(dtype), got {decl!r}")
    if isinstance(decl, Scalar):
        if decl.value is not None:
            return _constant(decl.value, f"operand {name!r} constant value")
        if as_dtype(decl.dtype, f"operand {name!r} dtype") is not DType.F32:
            raise RecipeError(f"operand {name!r}: runtime scalars are fp32; declare gg.Scalar() (dtype f32)")
        return Operand(name, OperandKind.SCALAR, DType.F32)
    dtype = as_dtype(decl.dtype, f"operand {name!r} dtype")
    if dtype not in _VECTOR_DTYPES:
        raise RecipeError(f"operand {name!r}: {decl.kind.value} operands may be bf16, f16 or f32, not {dtype.value}")
    return Operand(name, decl.kind, dtype)


def _check_gemm(a: Any, b: Any, d: Any, layout_a: Any, layout_b: Any, batched: bool, grouped: bool,
                block_scale: Any = None) -> GemmSpec:
    da, db = as_dtype(a, "a (dtype of A)"), as_dtype(b, "b (dtype of B)")
    la, lb = as_layout(layout_a, "layout_a"), as_layout(layout_b, "layout_b")
    for what, dt in (("a", da), ("b", db)):
        if dt not in _AB_16BIT + _AB_FP8:
            raise RecipeError(f"{what}: A and B may be bf16, f16, e4m3 or e5m2, not {dt.value}")
    fp8 = da in _AB_FP8
    if fp8 != (db in _AB_FP8) or (not fp8 and da is not db):
        raise RecipeError(f"a/b: mixed input types ({da.value} x {db.value}) are not supported; give A and B the "
                          "same 16-bit dtype, or make both fp8 (e4m3 and e5m2 may be mixed)")
    if fp8 and (la, lb) != (Layout.ROW, Layout.COL):
        raise RecipeError(f"layout_a/layout_b: fp8 WGMMA reads A and B K-major only, so an fp8 GEMM needs "
                          f"layout_a=RowMajor and layout_b=ColMajor (got {la.value}/{lb.value}); store the "
                          "operand transposed (e.g. the weight as N x K, passed as its .t())")
    # an fp8 D is asked for, not a default: it needs a scale in the epilogue to be useful
    dd = as_dtype(d if d is not None else (DType.BF16 if fp8 else da), "d (dtype of D)")
    if dd not in _D_DTYPES:
        raise RecipeError(f"d: D may be bf16, f16, f32, e4m3 or e5m2, not {dd.value}")
    if not isinstance(batched, bool):
        raise RecipeError(f"batched: expected True or False, got {batched!r}")
    if not isinstance(grouped, bool):
        raise RecipeError(f"grouped: expected True or False, got {grouped!r}")
    if grouped and batched:
        raise RecipeError("grouped/batched: a grouped GEMM's groups take the place of the batch; declare one of them")
    if grouped and la is not Layout.ROW:
        raise RecipeError("layout_a: a grouped GEMM's A holds each group's rows one after another (T x K), so "
                          f"it must be RowMajor, not {la.value}")
    scale = _check_block_scale(block_scale, fp8, grouped)
    return GemmSpec(da, db, dd, la, lb, batched, grouped=grouped, block_scale=scale)


#: DeepSeek-V3's fp8 block scaling: activations per row and 128 K, weights per 128 x 128 block.
DEEPSEEK_BLOCK_SCALE = (1, 128, 128)


def _check_block_scale(value: Any, fp8: bool, grouped: bool) -> tuple[int, int, int] | None:
    """`block_scale=(M, N, K)`: powers of two, M and N up to 128 (they must divide the tile), K a
    multiple of 128 (the main loop rescales once per K tile, and an fp8 K tile is 128)."""
    if value is None:
        return None
    if not (isinstance(value, tuple | list) and len(value) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        raise RecipeError(f"block_scale: expected (M, N, K) granularity ints such as {DEEPSEEK_BLOCK_SCALE}, "
                          f"got {value!r}")
    m, n, k = value
    for what, x in (("M", m), ("N", n)):
        if x < 1 or x > 128 or x & (x - 1):
            raise RecipeError(f"block_scale: {what} granularity {x} must be a power of two from 1 to 128 (it "
                              "must divide the kernel's tile)")
    if k != 128:
        raise RecipeError(f"block_scale: K granularity {k} must be 128 (CUTLASS's blockwise main loop rescales "
                          "once per K tile, and an fp8 K tile is 128)")
    if not fp8:
        raise RecipeError("block_scale: block scaling is for fp8 A and B (e4m3/e5m2); bf16/f16 need no scales")
    if grouped and m != 1:
        raise RecipeError(f"block_scale: M granularity {m} in a grouped GEMM: its groups start at any row of A, so "
                          "its activations' scales must be per row (M granularity 1, as DeepSeek-V3's "
                          "(1, 128, 128)); quantize the tokens per row and 128 values of K")
    return (m, n, k)


def _check_grouped_epilogue(ir: EpilogueIR) -> None:
    """What a grouped kernel's epilogue can read and write: CUTLASS's grouped (pointer-array)
    epilogue addresses C, D and the broadcast vectors per group, but not the extra tensor maps of
    auxiliary loads and stores."""
    matrices = [o.name for o in ir.operands if o.kind is OperandKind.MATRIX]
    if len(matrices) > 1:
        raise RecipeError(f"operands {matrices}: a grouped GEMM's epilogue reads at most one M x N matrix "
                          "(it is loaded as C); combine the others before the GEMM")
    vectors = [o.name for o in ir.operands if o.kind in (OperandKind.ROW, OperandKind.COL)]
    if len(vectors) > 8:  # each is a per-group pointer array the setup kernel fills (grouped.hpp's MaxColumns)
        raise RecipeError(f"operands {vectors}: a grouped GEMM's epilogue reads at most 8 row or column vectors; "
                          "combine some before the GEMM")
    extra = [o.name for o in ir.outputs[1:]]
    if extra:
        raise RecipeError(f"aux output {extra[0]!r}: a grouped GEMM writes D only (auxiliary outputs and "
                          "reductions are not supported there yet); return D's value alone")


def _check_reductions(ir: EpilogueIR) -> None:
    """Reductions over M (dim=0) and over N (dim=1) cannot share a kernel: gemmgen builds vector
    reductions over the kernel's N only, so one over M needs a swapped kernel, whose N is M
    (`config.reduction_violations`)."""
    over = {o.dim: o.name for o in ir.outputs if o.dim is not None}
    if len(over) == 2:
        raise RecipeError(f"aux outputs {over[0]!r} (dim=0) and {over[1]!r} (dim=1): a kernel reduces over M or "
                          "over N, not both; split them into two recipes")


class Recipe:
    """A fused GEMM: D = epilogue(A @ B, operands...), plus optional auxiliary outputs.

    Args:
        name: a C identifier naming the kernel.
        epilogue: `f(acc, **operands)` returning D's value, or a dict `{"d": ..., "<aux>": ...}`.
            Defaults to `lambda acc: acc`.
        a, b, d: element types of A, B and D (D defaults to A's type, and to bf16 for fp8 A and B).
        layout_a, layout_b: gg.RowMajor or gg.ColMajor (A is M x K, B is K x N).
        batched: whether tensors carry a leading batch dimension L.
        grouped: a grouped (MoE) GEMM: A is T x K with the rows of G groups one after another, B is
            G x K x N, and the kernel takes `offsets` (int32, G): where each group's rows end.
            Row vectors are per group (G x N); column vectors and matrices are per row of A.
        operands: name -> gg.Scalar / gg.RowVector / gg.ColVector / gg.Matrix declaration.
        aux: name -> dtype of each auxiliary output: an M x N tensor, or gg.f32 for a reduction
            (`gg.amax(x)`, `gg.amax(x, dim)`, `gg.sum(x, dim)`, `gg.reduce_max(x, dim)`,
            `gg.reduce_min(x, dim)`).
        block_scale: (M, N, K) granularity of fp8 block scaling, e.g. (1, 128, 128) as DeepSeek-V3
            (gg.DEEPSEEK_BLOCK_SCALE): the call then takes `scale_a`, fp32 (ceil(M/M_g), ceil(K/128)),
            and `scale_b`, fp32 (ceil(K/128), ceil(N/N_g)), first among its operands, and
            acc = sum over K blocks of (A_kb @ B_kb) * scale_a * scale_b. Grouped: M_g is 1,
            `scale_a` is (T, ceil(K/128)) and `scale_b` (G, ceil(K/128), ceil(N/N_g)), both K-major.
        config: the default KernelConfig for this recipe.
    """

    def __init__(self, name: str, epilogue: Callable[..., Any] | None = None, *, a: Any = DType.BF16,
                 b: Any = DType.BF16, d: Any = None, layout_a: Any = Layout.ROW, layout_b: Any = Layout.COL,
                 batched: bool = False, grouped: bool = False, operands: Mapping[str, OperandDecl] | None = None,
                 aux: Mapping[str, Any] | None = None, block_scale: Any = None,
                 config: KernelConfig | None = None) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise RecipeError(f"name: expected a C identifier such as 'bias_gelu', got {name!r}")
        self.name = name
        self.gemm = _check_gemm(a, b, d, layout_a, layout_b, batched, grouped, block_scale)
        self._fn = epilogue if epilogue is not None else (lambda acc: acc)
        self._decls = dict(operands or {})
        if self.gemm.block_scale:
            taken = sorted({o.name for o in BLOCK_SCALE_OPERANDS} & set(self._decls))
            if taken:
                raise RecipeError(f"operand {taken[0]!r}: a block-scaled recipe's call takes scale_a and scale_b "
                                  "for its main loop; give the epilogue operand another name")
        self._aux = {k: as_dtype(v, f"aux output {k!r} dtype") for k, v in (aux or {}).items()}
        for k, v in self._aux.items():
            if not k.isidentifier() or k == "d":
                raise RecipeError(f"aux output {k!r}: names must be Python identifiers other than 'd'")
            if v not in _D_DTYPES:
                raise RecipeError(f"aux output {k!r}: may be bf16, f16, f32, e4m3 or e5m2, not {v.value}")
        self.ir = RecipeIR(name, self.gemm, self._trace())
        _check_reductions(self.ir.epilogue)
        if grouped:
            _check_grouped_epilogue(self.ir.epilogue)
        if config is not None:
            from .config import validate

            validate(config, self.ir)
        self.config = config

    # ---- tracing

    def _trace(self) -> EpilogueIR:
        checked = {k: _check_operand(k, v) for k, v in self._decls.items()}
        params = self._epilogue_params()
        missing = [p for p in params[1:] if p not in checked]
        if missing:
            raise RecipeError(f"epilogue parameter {missing[0]!r} has no declaration; add it to operands=, e.g. "
                              f"operands={{{missing[0]!r}: gg.RowVector(gg.bf16)}}")
        unused = [k for k in checked if k not in params[1:]]
        if unused:
            raise RecipeError(f"operand {unused[0]!r} is declared but is not a parameter of the epilogue; "
                              "add it to the function's parameters or remove the declaration")
        trace = _Trace()
        acc = trace.add(Node(Op.ACC))
        args: dict[str, Value] = {}
        for k, v in checked.items():
            args[k] = trace.add(Node(Op.CONST, attr=v)) if isinstance(v, float) else trace.add(
                Node(Op.INPUT, name=k, dtype=v.dtype))
        _ACTIVE.append(trace)
        try:
            result = self._fn(acc, **{p: args[p] for p in params[1:]})
        finally:
            _ACTIVE.pop()
        outputs = self._outputs(trace, result)
        operands = tuple(v for v in checked.values() if isinstance(v, Operand))
        ir = normalize(trace.nodes, outputs, operands)
        for o in ir.outputs:
            if ir.nodes[o.node].op is Op.CONST:
                raise RecipeError(f"output {o.name!r} is a constant; an output must depend on the accumulator "
                                  "or an operand")
        for decl in operands:
            if decl not in ir.operands:
                raise RecipeError(f"operand {decl.name!r} is declared but no output depends on it; "
                                  "use it or remove it")
        return ir

    def _epilogue_params(self) -> list[str]:
        try:
            sig = inspect.signature(self._fn)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"epilogue: expected a Python function f(acc, ...), got {self._fn!r}") from e
        params = list(sig.parameters.values())
        if not params or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise RecipeError("epilogue: expected a function with named parameters f(acc, op1, op2, ...), "
                              "the first being the accumulator")
        return [p.name for p in params]

    def _outputs(self, trace: _Trace, result: Any) -> list[Output]:
        if isinstance(result, Mapping):
            values = dict(result)
        else:
            values = {"d": result}
        if "d" not in values:
            raise RecipeError("epilogue: the returned dict has no 'd' entry; D must always be written")
        extra = [k for k in values if k != "d" and k not in self._aux]
        if extra:
            raise RecipeError(f"epilogue returned output {extra[0]!r} that is not declared; declare it with "
                              f"aux={{{extra[0]!r}: gg.bf16}}")
        never = [k for k in self._aux if k not in values]
        if never:
            raise RecipeError(f"aux output {never[0]!r} is declared but never written; return it from the "
                              f"epilogue as {{'d': ..., {never[0]!r}: ...}}")
        outs = []
        for name in ["d", *self._aux]:
            v = values[name]
            reduce, dim = None, None
            if isinstance(v, Reduced):
                if name == "d":
                    raise RecipeError(f"output 'd': D is the M x N result; return gg.{v.reduce.value}(...) under an "
                                      f"aux name, e.g. {{'d': y, 'r': gg.{v.reduce.value}(y, ...)}} with "
                                      "aux={'r': gg.f32}")
                if self._aux[name] is not DType.F32:
                    raise RecipeError(f"aux output {name!r}: a reduction ({v!r}) is fp32; declare "
                                      f"aux={{{name!r}: gg.f32}}")
                v, reduce, dim = v.value, v.reduce, v.dim
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                raise RecipeError(f"output {name!r} is a constant; an output must depend on the accumulator "
                                  "or an operand")
            if not isinstance(v, Value) or v._trace is not trace:
                raise RecipeError(f"output {name!r}: expected a traced value, got {type(v).__name__}")
            outs.append(Output(name, v._index, self.gemm.d if name == "d" else self._aux[name], reduce, dim))
        return outs

    # ---- what other layers read

    @property
    def key(self) -> str:
        return self.ir.key

    @property
    def operands(self) -> tuple[Operand, ...]:
        """What a call takes after A and B, in order (`RecipeIR.operands`)."""
        return self.ir.operands

    @property
    def outputs(self) -> tuple[Output, ...]:
        return self.ir.epilogue.outputs

    def reference(self, a: torch.Tensor, b: torch.Tensor, *args: Any, **operands: Any) -> Any:
        """The fused op in fp32 on the CPU. Returns D, or (D, aux...) when the recipe has aux outputs.
        A grouped recipe takes `reference(a, b, offsets, **operands)`."""
        from .reference import reference

        offsets = None
        if self.gemm.grouped:
            if len(args) != 1:
                raise RecipeError("reference: a grouped recipe takes (a, b, offsets, **operands), offsets an int "
                                  "tensor of G entries: where each group's rows of A end")
            offsets = args[0]
        elif args:
            raise RecipeError("reference: operands are passed by name, e.g. reference(a, b, bias=bias)")

        names = {o.name for o in self.operands}
        unknown = set(operands) - names
        if unknown:
            raise RecipeError(f"reference: unknown operand(s) {sorted(unknown)}; this recipe takes {sorted(names)}")
        if names - set(operands):
            raise RecipeError(f"reference: missing operand(s) {sorted(names - set(operands))}")
        outs = reference(self.ir, a, b, operands, offsets)
        return outs[0] if len(outs) == 1 else outs

    def default_config(self) -> KernelConfig:
        from .config import default_config

        return self.config if self.config is not None else default_config(self.ir)

    def source(self, config: KernelConfig | None = None) -> str:
        """The generated CUTLASS C++ for this recipe under `config`."""
        from .codegen import render_kernel

        return render_kernel(self.ir, config or self.default_config()).source

    def compile(self, config: KernelConfig | None = None, *, cache: Any = None) -> Any:
        """The kernel as a callable on torch tensors (a gemmgen.Kernel, or a GroupedKernel for a grouped
        recipe); compiles or loads from cache."""
        if self.gemm.grouped:
            from .runtime.grouped import GroupedKernel

            return GroupedKernel(self.build(config, cache=cache))
        from .runtime.kernel import Kernel

        return Kernel(self.build(config, cache=cache))

    def build(self, config: KernelConfig | None = None, *, cache: Any = None) -> Any:
        """Compile (or load from cache) the kernel for `config`; returns a gemmgen.CompiledKernel."""
        from .build import build_kernel

        return build_kernel(self, config or self.default_config(), cache=cache)

    def __repr__(self) -> str:
        g = self.gemm
        return (f"Recipe({self.name!r}, {g.a.value}x{g.b.value}->{g.d.value}, "
                f"{g.layout_a.value}/{g.layout_b.value}, outputs={[o.name for o in self.outputs]})")

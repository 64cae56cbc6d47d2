"""Tracing: the epilogue function is called once with symbolic `Value`s, whose operators and the
`gemmgen.<op>` functions record the graph that `ir.normalize` turns into the IR.

The functions are the op table's DSL spellings (`ir.Op.dsl`), one line each; `OPS` lists them.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import RecipeError, UnknownOpError
from ..ir import Node, Op, Reduction, f32
from ..types import DType, as_dtype
from .operands import constant

#: What D, aux outputs and casts may be.
OUTPUT_DTYPES = (DType.BF16, DType.F16, DType.F32, DType.E4M3, DType.E5M2)

class Trace:
    """The nodes one epilogue function records, in the order it computes them."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, node: Node) -> Value:
        self.nodes.append(node)
        return Value(self, len(self.nodes) - 1)


_ACTIVE: list[Trace] = []


@contextlib.contextmanager
def tracing(trace: Trace) -> Iterator[Trace]:
    """Record into `trace` while the epilogue function runs (Python numbers become its constants)."""
    _ACTIVE.append(trace)
    try:
        yield trace
    finally:
        _ACTIVE.pop()


class Value:
    """A symbolic epilogue value (fp32 in the kernel). Supports + - * /, unary -, abs()."""

    __slots__ = ("_index", "_trace")

    def __init__(self, trace: Trace, index: int) -> None:
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

    # Comparisons are values (1.0 or 0.0) for gg.where; `==` and `!=` keep their Python meaning
    # (traced values are hashed), so equality is gg.eq / gg.ne.
    def __lt__(self, o: Any) -> Value:
        return _binary(Op.LT, self, o, "<")

    def __le__(self, o: Any) -> Value:
        return _binary(Op.LE, self, o, "<=")

    def __gt__(self, o: Any) -> Value:
        return _binary(Op.GT, self, o, ">")

    def __ge__(self, o: Any) -> Value:
        return _binary(Op.GE, self, o, ">=")

    def __eq__(self, o: object) -> bool:
        raise self._unsupported("'==' / '!='", "use gg.eq(x, y) / gg.ne(x, y), which give 1.0 or 0.0 for gg.where")

    __ne__ = __eq__
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise self._unsupported("a truth test (if/and/or)", "the epilogue must be branch-free; use "
                                "gg.where(cond, x, y) (cond such as acc > 0), gg.max or gg.min")

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
    N (`dim=1`: one value per row); with `over_batch=True`, over a batched GEMM's batches too (a
    shared bias's gradient: one value per column, summed over every batch's rows). Returned from
    the epilogue under an aux name declared `gg.f32`; it is not a value to compute with."""

    __slots__ = ("dim", "over_batch", "reduce", "value")

    def __init__(self, value: Value, reduce: Reduction, dim: int | None, over_batch: bool = False) -> None:
        if not isinstance(over_batch, bool):
            raise RecipeError(f"over_batch: expected True or False, got {over_batch!r}")
        self.value, self.reduce, self.dim, self.over_batch = value, reduce, dim, over_batch

    def _misuse(self, *args: Any) -> Any:
        raise _reduced_misuse()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __neg__ = __pos__ = __abs__ = __pow__ = _misuse

    def __repr__(self) -> str:
        dim = ("" if self.dim is None else f", dim={self.dim}") + (", over_batch=True" if self.over_batch else "")
        name = {Reduction.MAX: "reduce_max", Reduction.MIN: "reduce_min"}.get(self.reduce, self.reduce.value)
        return f"gemmgen.{name}({self.value!r}{dim})"


def _reduced_misuse() -> RecipeError:
    return RecipeError("gg.amax(...), gg.sum(...) and gg.reduce_max/min(...) are outputs, not values to compute "
                       "with: return them from the epilogue, e.g. {'d': y, 'amax_y': gg.amax(y)}, declared with "
                       "aux={'amax_y': gg.f32}")


class SeedValue:
    """A `gg.Seed()` operand in the epilogue: not a value to compute with, but what `gg.rand`
    and `gg.stochastic_round` draw their numbers from."""

    __slots__ = ("name", "trace")

    def __init__(self, trace: Trace, name: str) -> None:
        self.trace, self.name = trace, name

    def _misuse(self, *args: Any) -> Any:
        raise _seed_misuse(self.name)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __neg__ = __pos__ = __abs__ = __pow__ = _misuse
    __lt__ = __le__ = __gt__ = __ge__ = _misuse

    def __repr__(self) -> str:
        return f"<gemmgen seed {self.name!r}>"


def _seed_misuse(name: str) -> RecipeError:
    return RecipeError(f"operand {name!r}: a gg.Seed() is not a value to compute with; draw numbers from it: "
                       f"gg.rand({name}) (uniform in [0, 1)) or gg.stochastic_round(x, {name})")


class OutputOnly:
    """An epilogue output that is not a value to compute with (blocks.BlockOutput): an op given one
    raises its `_error()`, which names how to return it."""

    __slots__ = ()

    def _error(self) -> RecipeError:
        raise NotImplementedError


def _lift(x: Any, op_name: str) -> Value:
    """Turn a Python number into a constant of the current trace; reject anything else."""
    if isinstance(x, Value):
        return x
    if isinstance(x, Reduced):
        raise _reduced_misuse()
    if isinstance(x, OutputOnly):
        raise x._error()
    if isinstance(x, SeedValue):
        raise _seed_misuse(x.name)
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        if not _ACTIVE:
            raise RecipeError(f"{op_name}: gemmgen ops can only be used inside an epilogue being traced")
        return _ACTIVE[-1].add(Node(Op.CONST, attr=f32(x)))
    raise RecipeError(f"epilogue op '{op_name}': expected a traced value or a Python number, got {type(x).__name__} "
                      f"({x!r}); tensors are passed at call time, not captured by the epilogue")


def _same_trace(values: list[Value], op_name: str) -> Trace:
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


def _ternary(op: Op, x: Any, y: Any, z: Any, op_name: str) -> Value:
    if not any(isinstance(v, Value) for v in (x, y, z)):
        _lift(x, op_name)  # raises for non-numbers
    a, b, c = _lift(x, op_name), _lift(y, op_name), _lift(z, op_name)
    return _same_trace([a, b, c], op_name).add(Node(op, (a._index, b._index, c._index)))


def _unary(op: Op, x: Any, op_name: str, attr: float | None = None, dtype: DType | None = None) -> Value:
    a = _lift(x, op_name)
    return _same_trace([a], op_name).add(Node(op, (a._index,), attr=attr, dtype=dtype))


# ----------------------------------------------------------------------------- ops: the op table's DSL spellings


def _elementwise(op: Op, doc: str) -> Callable[..., Value]:
    """The `gemmgen.<op.dsl>` function of a table row: records `op` on its inputs."""
    name = op.dsl
    assert name is not None

    def binary(x: Any, y: Any) -> Value:
        return _binary(op, x, y, name)

    def unary(x: Any) -> Value:
        return _unary(op, x, name)

    fn = binary if op.arity == 2 else unary
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


minimum = _elementwise(Op.MIN, "Elementwise minimum (NaN-propagating, like torch.minimum).")
maximum = _elementwise(Op.MAX, "Elementwise maximum (NaN-propagating, like torch.maximum).")
min = minimum  # noqa: A001
max = maximum  # noqa: A001
abs = _elementwise(Op.ABS, "|x|.")  # noqa: A001
exp = _elementwise(Op.EXP, "e^x.")
erf = _elementwise(Op.ERF, "The error function, as torch.erf.")
sin = _elementwise(Op.SIN, "sin(x), x in radians (accurate sinf, not the fast-math approximation).")
cos = _elementwise(Op.COS, "cos(x), x in radians (accurate cosf).")
lt = _elementwise(Op.LT, "1.0 where x < y, else 0.0 (also spelt x < y).")
le = _elementwise(Op.LE, "1.0 where x <= y, else 0.0 (also spelt x <= y).")
gt = _elementwise(Op.GT, "1.0 where x > y, else 0.0 (also spelt x > y).")
ge = _elementwise(Op.GE, "1.0 where x >= y, else 0.0 (also spelt x >= y).")
eq = _elementwise(Op.EQ, "1.0 where x == y, else 0.0 (NaN equals nothing).")
ne = _elementwise(Op.NE, "1.0 where x != y, else 0.0 (NaN differs from everything).")


def where(cond: Any, x: Any, y: Any) -> Value:
    """x where cond is non-zero (a comparison: acc > 0, gg.eq(...)), else y, as torch.where; the
    side not taken never reaches the result, so a NaN or inf there is harmless."""
    return _ternary(Op.WHERE, cond, x, y, "where")
tanh = _elementwise(Op.TANH, "tanh(x).")
sigmoid = _elementwise(Op.SIGMOID, "1 / (1 + e^-x).")
relu = _elementwise(Op.RELU, "max(x, 0).")
gelu = _elementwise(Op.GELU, "GELU with the exact erf form (torch's approximate='none').")
gelu_tanh = _elementwise(Op.GELU_TANH, "GELU with the tanh approximation (torch's approximate='tanh').")
silu = _elementwise(Op.SILU, "x * sigmoid(x).")


def row_index() -> Value:
    """Each element's row in its batch's M x N output (0 to M - 1), in fp32 (exact below 2^24):
    what a mask compares with, e.g. ``gg.where(gg.row_index() < valid_rows, acc, 0.0)``."""
    return _index(Op.ROW_INDEX, "row_index")


def column_index() -> Value:
    """Each element's column in its batch's M x N output (0 to N - 1, the accumulator's columns),
    in fp32 (exact below 2^24): a vocabulary mask's ``gg.where(gg.column_index() < vocab, acc,
    -math.inf)``, or what `gather` compares with."""
    return _index(Op.COLUMN_INDEX, "column_index")


def _index(op: Op, op_name: str) -> Value:
    if not _ACTIVE:
        raise RecipeError(f"{op_name}: gemmgen ops can only be used inside an epilogue being traced")
    return _ACTIVE[-1].add(Node(op))


#: How many independent streams of random numbers one seed gives (`rand`'s `stream`).
RANDOM_STREAMS = 1 << 16


def rand(seed: Any, stream: int = 0) -> Value:
    """A uniform random fp32 in [0, 1) per element (multiples of 2^-24), a hash of the seed (a
    `gg.Seed()` operand), the stream number (a compile-time int below 2^16) and the element's
    batch, row and column: the same numbers whatever kernel computes them, independent from
    element to element and from stream to stream. A dropout mask: ``gg.where(gg.rand(seed) < p,
    0.0, acc / (1 - p))``. Two draws of one stream are the same number: give draws that must be
    independent streams of their own."""
    if not isinstance(seed, SeedValue):
        raise RecipeError(f"rand: expected a gg.Seed() operand, got {seed!r}; declare operands={{'seed': "
                          "gg.Seed()} and pass the function's parameter")
    if not _ACTIVE or _ACTIVE[-1] is not seed.trace:
        raise RecipeError("rand: gemmgen ops can only be used inside an epilogue being traced")
    if not isinstance(stream, int) or isinstance(stream, bool) or not 0 <= stream < RANDOM_STREAMS:
        raise RecipeError(f"rand: stream={stream!r}; expected a Python int in [0, {RANDOM_STREAMS}), e.g. "
                          "stream=1 for a second independent draw")
    return seed.trace.add(Node(Op.RANDOM, name=seed.name, attr=float(stream)))


def stochastic_round(x: Any, seed: Any, stream: int = 1) -> Value:
    """x rounded to bf16 at random: to one of its two bf16 neighbours, the farther one with
    probability its nearness (unbiased: the expected result is x), from `gg.rand(seed, stream)`
    (stream 1 by default, independent of a `gg.rand(seed)` dropout in the same epilogue). The value
    continues in fp32 and is a bf16 value, which a bf16 output stores exactly. NaN stays NaN; past
    bf16's largest finite value it rounds to inf at that rate."""
    return _binary(Op.STOCHASTIC_ROUND, x, rand(seed, stream), "stochastic_round")


def pairs(x: Any) -> tuple[Value, Value]:
    """(even, odd): x's columns 0, 2, 4, ... and 1, 3, 5, ..., each N/2 wide (`ir.columns`).

    A gated activation reads its gate and up projection from adjacent accumulator columns, as
    weights interleaved row by row put them (`gemmgen.nn.interleave_rows`), and writes N/2
    columns: ``gate, up = gg.pairs(acc); return gg.silu(gate) * up`` (SwiGLU)."""
    return _unary(Op.PAIR_EVEN, x, "pairs"), _unary(Op.PAIR_ODD, x, "pairs")


def interleave(even: Any, odd: Any) -> Value:
    """The pair put back: columns even0, odd0, even1, odd1, ... (N/2 + N/2 -> N), as
    gg.pairs undoes; a rotary embedding rotates each pair and interleaves it."""
    return _binary(Op.INTERLEAVE, even, odd, "interleave")


def leaky_relu(x: Any, slope: float = 0.01) -> Value:
    """x where x >= 0, else x * slope (a compile-time constant)."""
    return _unary(Op.LEAKY_RELU, x, "leaky_relu", attr=constant(slope, "leaky_relu slope"))


def cast(x: Any, dtype: Any) -> Value:
    """Round to `dtype` (then computation continues in fp32), as storing and reloading would; to
    fp8 saturating at its largest finite value (NaN stays NaN), as the kernel converts (PTX
    cvt.rn.satfinite): a quantize-dequantize inside the epilogue."""
    d = as_dtype(dtype, "cast dtype")
    if d not in OUTPUT_DTYPES:
        raise RecipeError(f"epilogue op 'cast': cannot cast to {d.value}; supported: bf16, f16, f32, e4m3, e5m2")
    return _unary(Op.CAST, x, "cast", dtype=d)


def clamp(x: Any, lo: Any = None, hi: Any = None) -> Value:
    """max(x, lo), then min(., hi): either bound may be left out."""
    if lo is None and hi is None:
        raise RecipeError("epilogue op 'clamp': give at least one of lo, hi")
    v = _lift(x, "clamp")
    if lo is not None:
        v = maximum(v, lo)
    if hi is not None:
        v = minimum(v, hi)
    return v


def amax(x: Any, dim: int | None = None, *, over_batch: bool = False) -> Reduced:
    """An output of max |x| (NaNs skipped): over M and N per batch, which fp8 scaling needs for its
    next scale; or per column (`dim=0`) or per row (`dim=1`, a per-token scale). See `Reduced`."""
    return Reduced(_reduced_value(x, "amax"), Reduction.AMAX, _reduce_dim(dim, "amax", optional=True), over_batch)


def sum(x: Any, dim: int, *, over_batch: bool = False) -> Reduced:  # noqa: A001
    """An output of the sum of x over M (`dim=0`: one value per column of D, e.g. a bias gradient)
    or over N (`dim=1`: one value per row, e.g. a norm's statistics). Summed in fp32 in a fixed
    order, so the result is the same from run to run. See `Reduced`."""
    return Reduced(_reduced_value(x, "sum"), Reduction.SUM, _reduce_dim(dim, "sum", optional=False), over_batch)


def reduce_max(x: Any, dim: int | None = None, *, over_batch: bool = False) -> Reduced:
    """An output of the largest value of x over M and N per batch (`dim=None`), over M (`dim=0`:
    one per column of D) or over N (`dim=1`: one per row, e.g. a row's max logit), NaNs skipped,
    -inf where there is no value. (`gg.max(x, y)` is the elementwise maximum.) See `Reduced`."""
    return Reduced(_reduced_value(x, "reduce_max"), Reduction.MAX, _reduce_dim(dim, "reduce_max", optional=True),
                   over_batch)


def reduce_min(x: Any, dim: int | None = None, *, over_batch: bool = False) -> Reduced:
    """An output of the smallest value of x over M and N per batch (`dim=None`), over M (`dim=0`)
    or over N (`dim=1`), NaNs skipped, +inf where there is no value. (`gg.min(x, y)` is the
    elementwise minimum.)"""
    return Reduced(_reduced_value(x, "reduce_min"), Reduction.MIN, _reduce_dim(dim, "reduce_min", optional=True),
                   over_batch)


def logsumexp(x: Any, dim: int, *, over_batch: bool = False) -> Reduced:
    """An output of log(sum(exp(x))) over M (`dim=0`) or over N (`dim=1`: one value per row, the
    log-normalizer a cross-entropy over the vocabulary needs), as torch.logsumexp computes it: safe
    from overflow (an online max and rescaled sum per row, combined in a fixed order), NaN
    propagated, -inf where there is no value. See `Reduced`."""
    return Reduced(_reduced_value(x, "logsumexp"), Reduction.LSE, _reduce_dim(dim, "logsumexp", optional=False),
                   over_batch)


def gather(x: Any, index: Any, dim: int = 1) -> Reduced:
    """An output of x at one column per row (`dim=1`: x[m, index[m]], index a gg.ColVector, as
    torch.gather(x, 1, index[:, None]) gives; a cross-entropy's target logit) or at one row per
    column (`dim=0`: x[index[n], n], index a gg.RowVector), per batch. It is the sum over that
    dimension of gg.where(column == index, x, 0): exact, NaN or inf elsewhere in the row harmless,
    and 0 where the index is outside the row (an ignore_index such as -100). Declare its aux name
    gg.f32; an integer index is declared gg.i32 (pass `index.int()`). See `Reduced`."""
    d = _reduce_dim(dim, "gather", optional=False)
    at = column_index() if d == 1 else row_index()
    picked = where(eq(at, _lift(index, "gather")), x, 0.0)
    return Reduced(picked, Reduction.SUM, d)


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


#: Every way an epilogue can compute: the table's operators and functions, `clamp` (min and max), and the
#: reductions.
OPS: tuple[str, ...] = (*(op.symbol for op in Op if op.symbol), *dict.fromkeys(op.dsl for op in Op if op.dsl),
                        "clamp", "amax", "sum", "reduce_max", "reduce_min", "logsumexp", "gather", "quantize",
                        "quantize_columns", "rms_norm", "exp_minus_max", "row_index", "column_index", "rand")


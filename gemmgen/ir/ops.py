"""The op table: every epilogue op declared once.

A row gives the op's stable key (it enters IR keys and generated names), its arity, its meaning
as an fp32 formula on torch tensors (what the reference evaluates, what constant folding and the
CPU emulation compute), the `gemmgen::epi` functor that implements the same formula on the GPU
(gemmgen/include/gemmgen/epilogue.hpp; a test runs each functor on the host against the formula),
and how the DSL spells it: a Python operator, or the `gemmgen.<name>` function. Adding an op is a
row here, its functor in epilogue.hpp and its one-line DSL export.

Formulas use tensor methods only, so this module imports no torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..types import DType

if TYPE_CHECKING:
    import torch

#: The largest finite fp8 values: conversions to fp8 saturate there (PTX cvt.rn.satfinite, as CUTLASS
#: converts on sm_90), where torch's cast to e5m2 gives inf (its e4m3 cast saturates already, in 2.13).
FP8_MAX = {DType.E4M3: 448.0, DType.E5M2: 57344.0}


def round_to(x: torch.Tensor, dtype: DType) -> torch.Tensor:
    """An fp32 value stored as `dtype`: round to nearest even, fp8 saturating (NaN stays NaN)."""
    limit = FP8_MAX.get(dtype)
    return (x if limit is None else x.clamp(-limit, limit)).to(dtype.torch)


def power_of_two_above(scale: torch.Tensor) -> torch.Tensor:
    """Each (positive) scale rounded up to a power of two, as Transformer Engine's blockwise recipe
    rounds its scales: scale = m * 2^e with m in [0.5, 1) gives 2^e, or 2^(e - 1) where m is 0.5."""
    mantissa, exponent = scale.frexp()
    return scale.new_ones(scale.shape).ldexp(exponent - (mantissa == 0.5).int())


def fp8_scale(amax: torch.Tensor, dtype: DType) -> torch.Tensor:
    """The scale an fp8 `dtype` tensor (or block) with largest magnitude `amax` is stored over:
    amax over the type's largest value, so its values span the range; 1 where amax is not above 0
    (zeros, or a NaN: NaN > 0 is false). Every fp8 quantizer's rule, per block or per tensor."""
    return (amax / FP8_MAX[dtype]).where(amax > 0, 1.0)


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], dtype: DType, power_of_two: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / its block's scale in fp32, the scales (..., ceil(R / block[0]), ceil(C / block[1]))) for x
    (..., R, C): each block's scale is its largest magnitude over fp8 `dtype`'s largest value, so its
    values span the fp8 range, and 1 for a block of zeros or one holding a NaN (NaN > 0 is false);
    a partial block at an edge is the rest of its values. What gg.quantize_blockwise returns and what
    an epilogue's gg.quantize stores, one formula for both. With `power_of_two`, each scale is that
    one rounded up to a power of two (so the division is exact and nothing saturates), as
    Transformer Engine's blockwise recipe rounds its scales."""
    br, bc = block
    rows, cols = x.shape[-2], x.shape[-1]
    nr, nc = -(-rows // br), -(-cols // bc)
    values = x.float()
    if (nr * br, nc * bc) != (rows, cols):  # partial blocks: zeros leave their amax as it is
        padded = values.new_zeros((*x.shape[:-2], nr * br, nc * bc))
        padded[..., :rows, :cols] = values
        values = padded
    blocks = values.unflatten(-1, (nc, bc)).unflatten(-3, (nr, br))  # (..., nr, br, nc, bc): views
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = fp8_scale(amax, dtype)
    if power_of_two:
        scale = power_of_two_above(scale)
    scaled = (blocks / scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return scaled, scale


_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class Param(enum.Enum):
    """A compile-time parameter an op takes besides its inputs (held by the IR node)."""

    NONE = "none"
    SLOPE = "slope"  # Node.attr: an fp32 constant (leaky_relu's negative slope), a functor template argument
    DTYPE = "dtype"  # Node.dtype: the target type (cast), the compute node's output element


class Op(enum.Enum):
    """An epilogue IR op: one row of the op table (see the module docstring).

    Row: (key, arity, functor, formula, dsl name, Python operator, commutative, param).
    """

    key: str
    arity: int
    functor: str | None
    formula: Callable[..., Any] | None
    dsl: str | None
    symbol: str | None
    commutative: bool
    param: Param

    # leaves: the accumulator, an operand, a constant, and each element's row or column in its
    # batch's M x N problem in fp32 (gemmgen/include/gemmgen/coordinates.hpp): what masks and
    # gathers compare with
    ACC = ("acc", 0)
    INPUT = ("input", 0)
    CONST = ("const", 0)
    ROW_INDEX = ("row_index", 0)
    COLUMN_INDEX = ("column_index", 0)
    # a uniform fp32 in [0, 1) hashed from a seed operand (Node.name), a stream number (Node.attr)
    # and each element's batch, row and column (`random_uniform`; coordinates.hpp's Random); RANDOM_T
    # is the same numbers seen from a swapped kernel, whose rows are the recipe's columns
    RANDOM = ("rand", 0)
    RANDOM_T = ("rand_transposed", 0)
    # binary
    ADD = ("add", 2, "Add", lambda x, y: x + y, None, "+", True)
    SUB = ("sub", 2, "Sub", lambda x, y: x - y, None, "-")
    MUL = ("mul", 2, "Mul", lambda x, y: x * y, None, "*", True)
    DIV = ("div", 2, "Div", lambda x, y: x / y, None, "/")
    MIN = ("min", 2, "Min", lambda x, y: x.minimum(y), "min", None, True)  # NaN-propagating, as torch.minimum
    MAX = ("max", 2, "Max", lambda x, y: x.maximum(y), "max", None, True)
    # comparisons: 1.0 where true, else 0.0 (false against NaN, as in torch; `ne` true)
    LT = ("lt", 2, "Less", lambda x, y: (x < y).float(), "lt", "<")
    LE = ("le", 2, "LessEqual", lambda x, y: (x <= y).float(), "le", "<=")
    GT = ("gt", 2, "Greater", lambda x, y: (x > y).float(), "gt", ">")
    GE = ("ge", 2, "GreaterEqual", lambda x, y: (x >= y).float(), "ge", ">=")
    EQ = ("eq", 2, "Equal", lambda x, y: (x == y).float(), "eq", None, True)
    NE = ("ne", 2, "NotEqual", lambda x, y: (x != y).float(), "ne", None, True)
    # ternary: x where cond is non-zero (a comparison's 1.0; NaN counts as true, as bool(nan) in torch), else y
    WHERE = ("where", 3, "Select", lambda c, x, y: x.where(c != 0, y), "where")
    # unary
    NEG = ("neg", 1, "Neg", lambda x: -x, None, "unary -")
    ABS = ("abs", 1, "Abs", lambda x: x.abs(), "abs")
    EXP = ("exp", 1, "Exp", lambda x: x.exp(), "exp")
    ERF = ("erf", 1, "Erf", lambda x: x.erf(), "erf")
    SIN = ("sin", 1, "Sin", lambda x: x.sin(), "sin")
    COS = ("cos", 1, "Cos", lambda x: x.cos(), "cos")
    TANH = ("tanh", 1, "Tanh", lambda x: x.tanh(), "tanh")
    SIGMOID = ("sigmoid", 1, "Sigmoid", lambda x: x.sigmoid(), "sigmoid")
    RELU = ("relu", 1, "Relu", lambda x: x.relu(), "relu")
    GELU = ("gelu", 1, "Gelu", lambda x: 0.5 * x * (1.0 + (x * _SQRT_HALF).erf()), "gelu")  # erf form
    GELU_TANH = ("gelu_tanh", 1, "GeluTanh",
                 lambda x: 0.5 * x * (1.0 + (_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()), "gelu_tanh")
    SILU = ("silu", 1, "Silu", lambda x: x * x.sigmoid(), "silu")
    LEAKY_RELU = ("leaky_relu", 1, "LeakyRelu", lambda x, slope: (x * slope).where(x < 0, x), "leaky_relu", None,
                  False, Param.SLOPE)
    # x rounded to one of its two bf16 neighbours at random, up with probability (x - lo) / (hi - lo),
    # from a uniform u in [0, 1) (gemmgen.stochastic_round gives it gemmgen.rand's); continues in fp32
    STOCHASTIC_ROUND = ("stochastic_round", 2, "StochasticRoundBf16", lambda x, u: stochastic_round_bf16(x, u),
                        "stochastic_round")
    # rounds and continues in fp32; the conversion is the compute node's output type
    CAST = ("cast", 1, "Identity", lambda x, dtype: round_to(x, dtype).float(), "cast", None, False, Param.DTYPE)
    # adjacent column pairs (`ir.columns`): a value's even or odd columns (N -> N/2), and the pair
    # (even, odd) put back side by side (N/2 -> N). Their functors act on a whole fragment
    # (gemmgen/include/gemmgen/pair_functors.hpp); `gemmgen.pairs` gives both halves at once.
    PAIR_EVEN = ("pair_even", 1, "PairEven", lambda x: _columns(x, 0), "pairs")
    PAIR_ODD = ("pair_odd", 1, "PairOdd", lambda x: _columns(x, 1), "pairs")
    INTERLEAVE = ("interleave", 2, "Interleave", lambda x, y: _interleave(x, y), "interleave")

    def __init__(self, key: str, arity: int, functor: str | None = None, formula: Callable[..., Any] | None = None,
                 dsl: str | None = None, symbol: str | None = None, commutative: bool = False,
                 param: Param = Param.NONE) -> None:
        self.key, self.arity, self.functor, self.formula = key, arity, functor, formula
        self.dsl, self.symbol, self.commutative, self.param = dsl, symbol, commutative, param

    @classmethod
    def by_key(cls, key: str) -> Op:
        """The op whose stable key this is (what IR canonical forms hold)."""
        return _BY_KEY[key]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickled by name (the value holds the formula), as the compile workers receive IRs."""
        return getattr, (Op, self.name)

    def __repr__(self) -> str:
        return f"<Op.{self.name}>"

    @property
    def is_leaf(self) -> bool:
        return self.arity == 0

    def apply(self, args: tuple[torch.Tensor, ...], attr: float | None = None, dtype: DType | None = None
              ) -> torch.Tensor:
        """The formula on fp32 tensors, with the node's parameter."""
        assert self.formula is not None, f"{self} is a leaf"
        if self.param is Param.SLOPE:
            return self.formula(*args, attr)
        if self.param is Param.DTYPE:
            return self.formula(*args, dtype)
        return self.formula(*args)

    @property
    def transposed(self) -> Op:
        """The op of the transposed problem (`RecipeIR.transposed`): a row's index is a column's."""
        return {Op.ROW_INDEX: Op.COLUMN_INDEX, Op.COLUMN_INDEX: Op.ROW_INDEX, Op.RANDOM: Op.RANDOM_T,
                Op.RANDOM_T: Op.RANDOM}.get(self, self)

    @property
    def pairs(self) -> bool:
        """An op on adjacent column pairs: its functor takes the fragment (`ir.columns`)."""
        return self in (Op.PAIR_EVEN, Op.PAIR_ODD, Op.INTERLEAVE)

    @property
    def derivative(self) -> Callable[..., tuple[Any, ...]] | None:
        """The op's reverse-mode rule (`_DERIVATIVES`); None for leaves."""
        return _DERIVATIVES.get(self)


def _columns(x: torch.Tensor, parity: int) -> torch.Tensor:
    """Every other column of x from `parity` on; a value the same in every column (a scalar, a
    column vector) is its own half."""
    return x if x.dim() == 0 or x.shape[-1] == 1 else x[..., parity::2]


def _interleave(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Columns x0 y0 x1 y1 ...: each a pair's even and odd element (`_columns` undone)."""
    import torch

    x, y = torch.broadcast_tensors(x, y)
    if x.dim() == 0:
        x, y = x.reshape(1), y.reshape(1)
    return torch.stack((x, y), dim=-1).flatten(-2)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), with no product past 2^49 (int64 never wraps)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """epilogue.hpp's mix32 (lowbias32, from Chris Wellons' hash prospector) on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_uniform(seed: int, stream: int, batch: torch.Tensor, row: torch.Tensor, column: torch.Tensor
                   ) -> torch.Tensor:
    """What gemmgen.rand gives at each (batch, row, column) (int64 tensors that broadcast): a
    uniform fp32 k / 2^24, k the top 24 bits of a hash of the seed, the stream number and the
    coordinates, as epilogue.hpp's random_stream and random_uniform compute it."""
    s = seed & ((1 << 64) - 1)
    start = _mix32(_mix32(_mix32(batch.new_tensor(s & _MASK32)) ^ (s >> 32)) ^ stream)
    tile = _mix32(start ^ (batch & _MASK32))  # random_stream: what a tile's elements share
    h = _mix32(_mix32(tile ^ (row & _MASK32)) ^ (column & _MASK32))
    return (h >> 8).float() * 2.0**-24


def stochastic_round_bf16(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x's bits plus floor(u * 2^16) (clamped to [0, 2^16 - 1]; 0 for NaN), the low 16 bits then
    cut: one of x's two bf16 neighbours, the farther with probability its nearness when u is
    uniform (NaN stays NaN; past bf16's largest finite value, +-inf at that rate)."""
    import torch

    x, u = torch.broadcast_tensors(x.float(), u.float())
    bits = x.contiguous().view(torch.int32).long() & _MASK32
    r = (u * 65536.0).floor().nan_to_num(0.0).clamp(0.0, 65535.0).long()
    cut = (bits + r) & 0xFFFF0000
    rounded = (cut - ((cut >> 31) << 32)).int().view(torch.float32)
    return rounded.where(~x.isnan(), x)


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _d_extremum(smallest: bool) -> Callable[..., tuple[Any, Any]]:
    """torch.minimum's rule (`smallest`) or torch.maximum's: the gradient goes to the side taken,
    half to each on a tie; against a constant, torch.clamp's (the bound inclusive: the whole
    gradient where x <= hi for a min, x >= lo for a max)."""

    def rule(g: Any, y: Any, a: Any, b: Any) -> tuple[Any, Any]:
        if b.is_const or a.is_const:
            x, c = (a, b) if b.is_const else (b, a)
            gx = (x.le(c) if smallest else x.ge(c)).select(g, 0.0)
            return (gx, None) if b.is_const else (None, gx)
        tie = a.eq(b)
        loses_a, loses_b = (a.gt(b), a.lt(b)) if smallest else (a.lt(b), a.gt(b))
        return tie.select(g * 0.5, loses_a.select(0.0, g)), tie.select(g * 0.5, loses_b.select(0.0, g))

    return rule


def _d_gelu_tanh(g: Any, y: Any, x: Any) -> tuple[Any]:
    """torch's gelu_backward(approximate='tanh'), term by term."""
    t = (_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()
    inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
    return (g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner),)


def _d_cast(g: Any, y: Any, x: Any, dtype: DType) -> tuple[Any]:
    """Straight through, the gradient rounded to the cast's type, as torch's autograd of `.to()`
    rounds it (each element's: every epilogue value is per element of D); an fp8 cast saturates,
    so no gradient passes where it clamped."""
    limit = FP8_MAX.get(dtype)
    rounded = g.cast(dtype)
    return (rounded if limit is None else x.abs().le(limit).select(rounded, 0.0),)


#: The leaves of random numbers: their node's name is a seed operand's, its attr the stream.
RANDOM_OPS = frozenset((Op.RANDOM, Op.RANDOM_T))

#: The ops that give 1.0 or 0.0: no gradient flows through them.
COMPARISONS = frozenset((Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE))

#: Reverse mode, one rule per op: rule(g, y, *xs[, param]) gives the adjoint of each argument
#: (None where no gradient flows) from the output's adjoint g, the output y and the arguments,
#: with torch's derivative at every point (tools/autograd/derivatives.yaml: ties, 0 and NaN
#: included). The values are `ir.autodiff`'s symbolic ones: + - * / and the methods used here.
_DERIVATIVES: dict[Op, Callable[..., tuple[Any, ...]]] = {
    Op.ADD: lambda g, y, a, b: (g, g),
    Op.SUB: lambda g, y, a, b: (g, -g),
    Op.MUL: lambda g, y, a, b: (g * b, g * a),
    Op.DIV: lambda g, y, a, b: (g / b, -g * a / (b * b)),
    Op.MIN: _d_extremum(smallest=True),
    Op.MAX: _d_extremum(smallest=False),
    **{op: (lambda g, y, a, b: (None, None)) for op in COMPARISONS},
    Op.WHERE: lambda g, y, c, a, b: (None, c.select(g, 0.0), c.select(0.0, g)),
    Op.NEG: lambda g, y, x: (-g,),
    Op.ABS: lambda g, y, x: (g * (x.gt(0.0) - x.lt(0.0)),),  # sign(x): 0 at 0
    Op.EXP: lambda g, y, x: (g * y,),
    Op.ERF: lambda g, y, x: (g * _TWO_OVER_SQRT_PI * (-(x * x)).exp(),),
    Op.SIN: lambda g, y, x: (g * x.cos(),),
    Op.COS: lambda g, y, x: (-(g * x.sin()),),
    Op.TANH: lambda g, y, x: (g * (1.0 - y * y),),
    Op.SIGMOID: lambda g, y, x: (g * (1.0 - y) * y,),
    Op.RELU: lambda g, y, x: (y.gt(0.0).select(g, 0.0),),  # threshold_backward: none at 0
    Op.GELU: lambda g, y, x: (g * (0.5 * (1.0 + (x * _SQRT_HALF).erf()) + x * (-0.5 * x * x).exp() * _INV_SQRT_2PI),),
    Op.GELU_TANH: _d_gelu_tanh,
    Op.SILU: lambda g, y, x: (g * x.sigmoid() * (1.0 + x * (1.0 - x.sigmoid())),),
    Op.LEAKY_RELU: lambda g, y, x, slope: (x.gt(0.0).select(g, g * slope),),  # the slope at 0, as torch
    Op.CAST: _d_cast,
    Op.STOCHASTIC_ROUND: lambda g, y, x, u: (g, None),  # straight through, as a rounding's gradient
    Op.PAIR_EVEN: lambda g, y, x: (g.interleave(0.0),),
    Op.PAIR_ODD: lambda g, y, x: (g.interleave(0.0, odd=True),),
    Op.INTERLEAVE: lambda g, y, a, b: (g.pair_even(), g.pair_odd()),
}


_BY_KEY = {op.key: op for op in Op}
BINARY_OPS = frozenset(o for o in Op if o.arity == 2 and not o.pairs)
TERNARY_OPS = frozenset(o for o in Op if o.arity == 3)
UNARY_OPS = frozenset(o for o in Op if o.arity == 1 and not o.pairs)

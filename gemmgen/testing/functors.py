"""What each compute node of a generated kernel's epilogue computes, read from its C++ spelling
(tests only): epilogue.hpp's scalar functors under Map<F>::Fn as their ops' formulas in the op
table, pairs.hpp's fragment functors on whole tensors, and the straight-line functors of the
elementwise regions (`codegen.evt._fuse_regions`) parsed from the source and run statement by
statement. The emulation (`visitors`) applies them as CUTLASS's Sm90Compute does."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

import torch

from ..ir import Op, Param
from .cpp_types import CppType, EpilogueSourceError, parse_type

_EPI = "gemmgen::epi::"


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


#: The ops by the functor a kernel's source names (`ir.Op.functor`; Identity: D's own conversion node).
_BY_FUNCTOR = {op.functor: op for op in Op if op.functor is not None and op.functor != "Identity"}


def scalar_function(name: str) -> Callable[..., torch.Tensor]:
    """What `gemmgen::epi::<name>` computes: its op's formula in the op table."""
    if name == "Identity":
        return lambda x: x
    op = _BY_FUNCTOR.get(name)
    if op is None or op.param is not Param.NONE:
        raise EpilogueSourceError(f"unknown functor gemmgen::epi::{name}")
    return lambda *args: op.apply(args)


def _even(x: torch.Tensor) -> torch.Tensor:
    """Each pair's even column in both of its columns (a column-constant value is its own)."""
    return x if x.shape[-1] == 1 else x[..., 0::2].repeat_interleave(2, dim=-1)


def _odd(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] == 1 else x[..., 1::2].repeat_interleave(2, dim=-1)


def _interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    even, odd = torch.broadcast_tensors(even, odd)
    if even.shape[-1] == 1:
        raise EpilogueSourceError("Interleave of two column-constant values")
    out = odd.clone()
    out[..., 0::2] = even[..., 0::2]
    return out


def _sum_once(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] == 1:
        raise EpilogueSourceError("PairSumMask of a column-constant value")
    out = x.clone()
    out[..., 1::2] = 0.0
    return out


#: pairs.hpp's fragment functors, on whole (L, M, N) tensors.
_PAIR_FUNCTORS: dict[str, Callable[..., torch.Tensor]] = {
    "PairEven": _even, "PairOdd": _odd, "Interleave": _interleave, "PairSumMask": _sum_once}


def compute_function(t: CppType, regions: dict[str, Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """The ComputeFn of an Sm90Compute: `gemmgen::epi::Map<F>::Fn` (F one of epilogue.hpp's functors
    or a region's functor the source defines, `regions`), or one of pairs.hpp's."""
    base = t.name.removeprefix(_EPI)
    if not t.args and not t.member and base in _PAIR_FUNCTORS:
        return _PAIR_FUNCTORS[base]
    if base == "InterleaveConst" and t.member == "::Fn" and len(t.args) == 2:
        constant, const_even = _constant(t.args[0]), t.args[1].name
        if const_even not in ("true", "false"):
            raise EpilogueSourceError(f"compute function {t}")
        return (lambda x: _interleave(constant, x)) if const_even == "true" else (lambda x: _interleave(x, constant))
    if t.name != f"{_EPI}Map" or t.member != "::Fn" or len(t.args) != 1:
        raise EpilogueSourceError(f"compute function {t} is not a gemmgen::epi::Map<F>::Fn")
    f = t.args[0]
    if not f.args and f.name in regions:
        return regions[f.name]
    return scalar_functor(f)


def scalar_functor(f: CppType) -> Callable[..., torch.Tensor]:
    """What one of epilogue.hpp's scalar functors computes, spelled with or without its namespace
    (a region's functor calls them under `using namespace gemmgen::epi`)."""
    base = f.name.removeprefix(_EPI)
    if base in ("WithRhs", "WithLhs"):
        fn, constant = scalar_function(f.args[0].name.removeprefix(_EPI)), _constant(f.args[1])
        if base == "WithRhs":
            return lambda x: fn(x, constant)
        return lambda x: fn(constant, x)
    if base.startswith("SelectConst"):  # where() with constant branches: SelectConst{X,Y,XY}<bits...>
        which, consts = base.removeprefix("SelectConst"), [_constant(a) for a in f.args]
        select = scalar_function("Select")
        if which == "X":
            return lambda c, y: select(c, consts[0], y)
        if which == "Y":
            return lambda c, x: select(c, x, consts[0])
        return lambda c: select(c, consts[0], consts[1])
    op = _BY_FUNCTOR.get(base)
    if op is not None and op.param is Param.SLOPE:
        slope = float(_constant(f.args[0]))
        return lambda x: op.apply((x,), slope)
    if f.args:
        raise EpilogueSourceError(f"functor {f} takes no template arguments")
    return scalar_function(base)


#: An elementwise region's functor as codegen.evt writes it: fp32 parameters, a using-directive,
#: one `float const name = F{}(names);` per op, and `return F{}(names);`.
_REGION = re.compile(r"^struct (\w+) \{\n  CUTLASS_DEVICE float operator\(\)\(([^)]*)\) const \{\n"
                     r"    using namespace gemmgen::epi;\n((?:    float const \w+ = [^\n]*;\n)*)"
                     r"    return ([^\n]*);\n  \}\n\};$", re.M)


def region_functors(source: str) -> dict[str, Callable[..., torch.Tensor]]:
    """Every elementwise region's functor a kernel's source defines, by name, as a function of its
    parameters that runs its statements in order (each op's formula in fp32, as `scalar_functor`).
    A statement that reads a name neither a parameter nor an earlier statement defines, or a body
    of another shape, is an error, not a guess."""
    out: dict[str, Callable[..., torch.Tensor]] = {}
    for m in _REGION.finditer(source):
        params = [p.removeprefix("float ") for p in m.group(2).split(", ")] if m.group(2) else []
        if any(not re.fullmatch(r"\w+", p) for p in params):
            raise EpilogueSourceError(f"region functor {m.group(1)}'s parameters: {m.group(2)}")
        steps = [(re.fullmatch(r"    float const (\w+) = (.*);", line).groups())  # type: ignore[union-attr]
                 for line in m.group(3).splitlines()]
        program, known = [], set(params)
        for target, expr in [*steps, ("", m.group(4))]:
            call = re.fullmatch(r"(.+)\{\}\((\w+(?:, \w+)*)\)", expr)
            if call is None:
                raise EpilogueSourceError(f"region functor {m.group(1)}: {expr}")
            args = call.group(2).split(", ")
            if not set(args) <= known:
                raise EpilogueSourceError(f"region functor {m.group(1)} reads {sorted(set(args) - known)} undefined")
            program.append((target, scalar_functor(parse_type(call.group(1))), args))
            known.add(target)
        out[m.group(1)] = _region_program(params, program)
    return out


def _region_program(params: list[str], program: list[tuple[str, Callable[..., torch.Tensor], list[str]]]
                    ) -> Callable[..., torch.Tensor]:
    def run(*inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(params):
            raise EpilogueSourceError(f"a region functor of {len(params)} parameters given {len(inputs)} inputs")
        env = dict(zip(params, inputs, strict=True))
        for target, fn, args in program:
            env[target] = fn(*(env[a] for a in args))
        return env[""]

    return run


def _constant(t: CppType) -> torch.Tensor:
    """A functor's constant: its fp32 bits as an unsigned literal (`0x3fd9db23u`)."""
    m = re.fullmatch(r"0x([0-9a-f]{8})u", t.name)
    if not m:
        raise EpilogueSourceError(f"constant {t} is not fp32 bits")
    return torch.tensor(_f32(int(m.group(1), 16)), dtype=torch.float32)

"""What a direct epilogue's generated functor computes (`codegen.direct`), read from the kernel's
source and run on whole tensors (tests only): the emulation's counterpart of `visitors` for
kernels built with EpilogueCollective.DIRECT.

Each view member of the functor's Arguments is read through the Params fields at its own place
(its pointer, strides and value, as the device reads them); each statement applies its op's
formula in fp32 (`functors`); each store writes through its Matrix's pointer and strides. A wrong
stride, pointer, member or statement shows up as a wrong or unwritten (NaN) element.
"""

from __future__ import annotations

import re
import struct
from typing import Protocol

import torch

from .cpp_types import EpilogueSourceError, declarations, parse_type
from .functors import scalar_functor
from .visitors import convert_to, element_of, reduce_into, scalar_reduction_of, values_of

_STRUCT = re.compile(
    r"^struct DirectFunctor \{\n  struct Arguments \{\n((?:    [^\n]*;\n)*)  \};\n"
    r"  struct Partials \{  // [^\n]*\n((?:    float \w+;\n)*)  \};\n"
    r"  CUTLASS_HOST_DEVICE Partials start\(Arguments const&(?: args)?\) const \{ return \{([\w., ]*)\}; \}\n"
    r"  CUTLASS_DEVICE void operator\(\)\(Arguments const& args, Partials& partials, float acc, int m, int n, "
    r"int l\) const \{\n    using namespace gemmgen::epi;\n((?:    [^\n]*;\n)*)  \}\n"
    r"  CUTLASS_DEVICE void finish\(Arguments const&(?: args)?, Partials const&(?: partials)?, int(?: l)?\) const "
    r"\{(?:\n((?:    [^\n]*;\n)*)  )?\}\n\};$", re.M)
_MEMBER = re.compile(r"    gemmgen::direct::(?:(Scalar)|Vector<(.+)>|Matrix<(.+), (true|false)>|"
                     r"ScalarReduction<(.+)>) (\w+);")
_INDEX = {"l": "scalar", "n, l": "row", "m, l": "col", "m, n, l": "matrix"}


class DirectParams(Protocol):
    """What the interpreter reads the Params through (`emulate._ParamsBytes`)."""

    def raw(self, lvalue: str) -> bytes: ...

    def at(self, addr: int, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], what: str
           ) -> torch.Tensor: ...


class DirectInterpreter:
    """One kernel's DirectFunctor, parsed once, evaluated per problem on the (L, M, N) accumulator."""

    def __init__(self, source: str) -> None:
        decls = declarations(source)
        self.element_a = element_of(values_of(parse_type(decls["ElementA"])))
        self.element_b = element_of(values_of(parse_type(decls["ElementB"])))
        self.column_major = {name: decls[name] == "cutlass::layout::ColumnMajor" for name in ("LayoutA", "LayoutB")}
        m = _STRUCT.search(source)
        if m is None:
            raise EpilogueSourceError("no DirectFunctor of the expected shape in the source")
        # member -> (kind, element, column-major)
        self.members: dict[str, tuple[str, torch.dtype, bool]] = {}
        self.reductions: dict[str, str] = {}  # member -> "amax", "max" or "min" (visitors' names)
        for line in m.group(1).splitlines():
            v = _MEMBER.fullmatch(line)
            if v is None:
                raise EpilogueSourceError(f"DirectFunctor member {line.strip()}")
            scalar, vector, matrix, column_major, reduction, name = v.groups()
            if scalar:
                self.members[name] = ("scalar", torch.float32, False)
            elif vector:
                self.members[name] = ("vector", element_of(parse_type(vector)), False)
            elif matrix:
                self.members[name] = ("matrix", element_of(parse_type(matrix)), column_major == "true")
            else:
                self.members[name] = ("reduction", torch.float32, False)
                self.reductions[name] = scalar_reduction_of(parse_type(f"R<{reduction}>").args, name)
        partials = re.findall(r"    float (\w+);", m.group(2))
        starts = [x for x in m.group(3).split(", ") if x]
        finishes = (m.group(5) or "").splitlines()
        if not (partials == list(self.reductions) and starts == [f"args.{r}.identity" for r in partials]
                and finishes == [f"    args.{r}.store(partials.{r}, l);" for r in partials]):
            raise EpilogueSourceError(f"DirectFunctor's partials {partials}, start {starts} and finish {finishes} "
                                      f"do not each take its reductions {list(self.reductions)} once, in order")
        self.body = m.group(4).splitlines()

    def run(self, acc: torch.Tensor, params: DirectParams) -> None:
        """Evaluate the functor's statements in order on every element, then its stores; each
        reduction over every element of a batch, then folded into its output, as `finish` does."""
        env = {"acc": acc}
        stored = set()
        for line in self.body:
            if (s := re.fullmatch(r"    float const (\w+) = (.*);", line)) is not None:
                env[s.group(1)] = self._value(s.group(2), env, acc, params)
            elif (s := re.fullmatch(r"    args\.(\w+)\.store\(m, n, l, (\w+)\);", line)) is not None:
                member, value = s.groups()
                _, element, _ = self._member(member, "matrix")
                target = self._view(member, params, acc.shape)
                target.copy_(convert_to(self._read(value, env).expand(acc.shape), element))
                stored.add(member)
            elif (s := re.fullmatch(r"    partials\.(\w+) = args\.(\w+)\.reduce\(partials\.(\w+), (\w+)\);",
                                    line)) is not None and s.group(1) == s.group(2) == s.group(3):
                member, value = s.group(1), s.group(4)
                self._member(member, "reduction")
                at = f"{{p}}.epilogue.{member}"
                batch_stride = _int(params.raw(f"{at}.batch_stride"), signed=True)
                target = params.at(_int(params.raw(f"{at}.ptr")), torch.float32, (acc.shape[0],), (batch_stride,), at)
                identity, = struct.unpack("<f", params.raw(f"{at}.identity"))
                reduce_into(self.reductions[member], self._read(value, env).expand(acc.shape), identity, target,
                            batch_stride)
                stored.add(member)
            else:
                raise EpilogueSourceError(f"DirectFunctor statement {line.strip()}")
        unwritten = [name for name in self.members if name.startswith("out_") and name not in stored]
        if unwritten:
            raise EpilogueSourceError(f"DirectFunctor never stores {unwritten}")

    def _value(self, expr: str, env: dict[str, torch.Tensor], acc: torch.Tensor, params: DirectParams
               ) -> torch.Tensor:
        if (load := re.fullmatch(r"args\.(\w+)\.load\(([mnl, ]+)\)", expr)) is not None:
            member, index = load.groups()
            kind = _INDEX.get(index)
            if kind is None:
                raise EpilogueSourceError(f"DirectFunctor load {expr}")
            self._member(member, "vector" if kind in ("row", "col") else kind)
            return self._load(member, kind, params, acc.shape)
        if (cast := re.fullmatch(r"gemmgen::direct::RoundTo<(.+)>\{\}\((\w+)\)", expr)) is not None:
            return convert_to(self._read(cast.group(2), env), element_of(parse_type(cast.group(1)))).float()
        call = re.fullmatch(r"(.+)\{\}\((\w+(?:, \w+)*)\)", expr)
        if call is None:
            raise EpilogueSourceError(f"DirectFunctor expression {expr}")
        fn = scalar_functor(parse_type(call.group(1)))
        return fn(*(self._read(a, env) for a in call.group(2).split(", ")))

    @staticmethod
    def _read(name: str, env: dict[str, torch.Tensor]) -> torch.Tensor:
        if name not in env:
            raise EpilogueSourceError(f"DirectFunctor reads {name} before defining it")
        return env[name]

    def _member(self, name: str, kind: str) -> tuple[str, torch.dtype, bool]:
        if self.members.get(name, ("",))[0] != kind:
            raise EpilogueSourceError(f"DirectFunctor uses {name} as a {kind}; its Arguments: {self.members.get(name)}")
        return self.members[name]

    def _load(self, member: str, kind: str, params: DirectParams, shape: torch.Size) -> torch.Tensor:
        at = f"{{p}}.epilogue.{member}"
        L, M, N = shape
        if kind == "scalar":
            ptr = _int(params.raw(f"{at}.ptr"))
            if ptr == 0:
                value, = struct.unpack("<f", params.raw(f"{at}.value"))
                return torch.full((1, 1, 1), value)
            batch = _int(params.raw(f"{at}.batch_stride"), signed=True)
            return params.at(ptr, torch.float32, (L, 1, 1), (batch, 0, 0), at).float()
        if kind == "matrix":
            return self._view(member, params, shape).float()
        _, element, _ = self.members[member]
        ptr, batch = _int(params.raw(f"{at}.ptr")), _int(params.raw(f"{at}.batch_stride"), signed=True)
        size, stride = ((L, 1, N), (batch, 0, 1)) if kind == "row" else ((L, M, 1), (batch, 1, 0))
        return params.at(ptr, element, size, stride, at).float()

    def _view(self, member: str, params: DirectParams, shape: torch.Size) -> torch.Tensor:
        """The (L, M, N) tensor a Matrix member addresses, a writable view."""
        _, element, column_major = self.members[member]
        at = f"{{p}}.epilogue.{member}"
        ptr = _int(params.raw(f"{at}.ptr"))
        stride = _int(params.raw(f"{at}.stride"), signed=True)
        batch = _int(params.raw(f"{at}.batch_stride"), signed=True)
        L, M, N = shape
        return params.at(ptr, element, (L, M, N), (batch, 1, stride) if column_major else (batch, stride, 1), at)


def _int(raw: bytes, signed: bool = False) -> int:
    return int.from_bytes(raw, "little", signed=signed)

"""Params fields: what the host writes into a kernel's argument block, named once.

Each architecture's emitter lists its kernel's fields (`sm90.params`); the same list drives the
NVRTC layout probe compiled into every kernel (offset and default value of each field as NVRTC
lays Params out), the nvcc host oracle (the values CUTLASS's own host code produces), and the
Python argument builder (which writes each field at its probed offset). Field names are stable
strings; `expr` is a C++ lvalue with `{p}` standing for the Params object.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes of each field kind. `desc` is a 128-byte TMA descriptor (CUtensorMap).
KIND_SIZE = {"desc": 128, "u32": 4, "i32": 4, "u64": 8, "i64": 8, "f32": 4, "ptr": 8, "bool": 1, "e16": 2}


@dataclass(frozen=True)
class ParamField:
    name: str
    expr: str
    kind: str

    @property
    def size(self) -> int:
        return KIND_SIZE[self.kind]

    def lvalue(self, base: str) -> str:
        return self.expr.format(p=base)


@dataclass(frozen=True)
class ParamsLayout:
    """Where each field sits in Params under NVRTC, and its default value (from the layout probe)."""

    size: int
    fields: tuple[tuple[ParamField, int, int], ...]  # (field, offset, default bits)

"""Reading the layout probe (templates/kernel.cu.j2, `<entry>_layout`) out of NVRTC's PTX.

The probe stores, for field i, its byte offset to out[2i] and its default value to out[2i+1].
NVRTC folds both to immediates, so the PTX is a list of `mov.u64 %rdN, IMM;` and
`st.global.u64 [%rdP+8*k], %rdN;` (or a vector store). This reads them back on the CPU.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..codegen.fields import ParamField
from ..errors import CompileError

_MOV = re.compile(r"mov\.[ubs](?:16|32|64)\s+(%\w+),\s*(-?\d+|0[xX][0-9a-fA-F]+);")
# Element-typed defaults such as `Element(0)` arrive as an int->float or widening conversion.
_CVT = re.compile(r"cvt(?:\.rn)?\.(\w+)\.(\w+)\s+(%\w+),\s*(%\w+);")
_ST = re.compile(r"st\.global(?:\.v(\d))?\.[ub]64\s+\[(%rd\d+)(?:\+(\d+))?\],\s*(\{[^}]*\}|%rd\d+|-?\d+);")


def read_layout_probe(ptx: str, entry: str, n_fields: int) -> list[tuple[int, int]]:
    """[(offset, default_bits)] per field, in the probe's order."""
    m = re.search(rf"\.entry\s+{re.escape(entry)}_layout\s*\((.*?)\n\}}", ptx, re.S)
    if not m:
        raise CompileError(f"layout probe {entry}_layout not found in the PTX")
    body = m.group(1)
    regs: dict[str, int] = {}
    slots: dict[int, int] = {}
    for line in body.splitlines():
        if mv := _MOV.search(line):
            regs[mv.group(1)] = int(mv.group(2), 0) & (2**64 - 1)
            continue
        if cv := _CVT.search(line):
            dst_type, src_type, dst, src = cv.groups()
            value = regs.get(src)
            widening = dst_type.startswith("u") and src_type.startswith("u")
            if value is None or not (value == 0 or widening):
                raise CompileError(f"layout probe of {entry}: cannot fold {line.strip()!r}")
            regs[dst] = value  # zero converts to all-zero bits in every type; widening keeps the value
            continue
        if st := _ST.search(line):
            base = int(st.group(3) or 0)
            srcs = [x.strip() for x in st.group(4).strip("{}").split(",")]
            for k, src in enumerate(srcs):
                if src.startswith("%") and src not in regs:
                    raise CompileError(f"layout probe of {entry}: {src} is not a constant in {line.strip()!r}")
                slots[(base // 8) + k] = regs[src] if src.startswith("%") else int(src, 0) & (2**64 - 1)
    if sorted(slots) != list(range(2 * n_fields)):
        raise CompileError(f"layout probe of {entry}: expected {2 * n_fields} folded stores, found {len(slots)}; "
                           "a field expression was not a compile-time constant")
    return [(slots[2 * i], slots[2 * i + 1]) for i in range(n_fields)]


def check_layout(entry: str, fields: Sequence[ParamField], probe: list[tuple[int, int]], params_size: int) -> None:
    """Before a binary is cached: every probed field lies inside Params, none overlaps another, and
    every tensor map is 64-byte aligned (as TMA requires of a descriptor in kernel parameters)."""
    spans = sorted((offset, offset + f.size, f.name) for f, (offset, _) in zip(fields, probe, strict=True))
    for (lo, hi, name), nxt in zip(spans, [*spans[1:], None], strict=True):
        if hi > params_size:
            raise CompileError(f"{entry}: Params field {name} [{lo}, {hi}) exceeds sizeof(Params) = {params_size}")
        if nxt is not None and nxt[0] < hi:
            raise CompileError(f"{entry}: Params fields {name} and {nxt[2]} overlap")
    for f, (offset, _) in zip(fields, probe, strict=True):
        if f.kind == "desc" and offset % 64:
            raise CompileError(f"{entry}: tensor map {f.name} at offset {offset} is not 64-byte aligned")

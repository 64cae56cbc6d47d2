"""What a cubin says about itself: exported constants (ELF symbols), resources and SASS, read on the CPU."""

from __future__ import annotations

import os
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import ToolchainError


def read_symbol(cubin: bytes, name: str) -> bytes:
    """The initial bytes of global `name` in an ELF64 cubin (e.g. the kernel's `_info` array)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    for sh_type, link, offset, size, entsize in ((s[1], s[6], s[4], s[5], s[9]) for s in sections):
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab_off = sections[link][4]
        for k in range(size // entsize):
            st_name, _info, _other, shndx, value, st_size = struct.unpack_from("<IBBHQQ", cubin, offset + k * entsize)
            end = cubin.index(b"\0", strtab_off + st_name)
            if cubin[strtab_off + st_name:end].decode() == name:
                data_off = sections[shndx][4] + value
                return cubin[data_off:data_off + st_size]
    raise KeyError(f"symbol {name!r} not in cubin")


def read_u64_array(cubin: bytes, name: str) -> tuple[int, ...]:
    raw = read_symbol(cubin, name)
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


@dataclass(frozen=True)
class Resources:
    registers: int
    local_bytes: int
    stack_bytes: int
    static_smem_bytes: int


def _run_cuobjdump(cuobjdump: Path, args: list[str], cubin_path: Path) -> str:
    env = dict(os.environ)
    env["PATH"] = f"{cuobjdump.parent}{os.pathsep}{env.get('PATH', '')}"  # cuobjdump -sass runs nvdisasm
    proc = subprocess.run([str(cuobjdump), *args, str(cubin_path)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ToolchainError(f"cuobjdump {' '.join(args)} failed: {proc.stderr.strip()[:500]} "
                             "(install the test extras: nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)")
    return proc.stdout


def resource_usage(cuobjdump: Path, cubin_path: Path, entry: str) -> Resources:
    text = _run_cuobjdump(cuobjdump, ["-res-usage"], cubin_path)
    m = re.search(rf"Function {re.escape(entry)}:\s*\n\s*(.*)", text)
    if not m:
        raise ToolchainError(f"cuobjdump -res-usage shows no function {entry!r}")
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", m.group(1)))
    return Resources(int(fields.get("REG", 0)), int(fields.get("LOCAL", 0)), int(fields.get("STACK", 0)),
                     int(fields.get("SHARED", 0)))


def sass_counts(cuobjdump: Path, cubin_path: Path, markers: tuple[str, ...]) -> dict[str, int]:
    """How many instructions match each marker: a mnemonic ("UTCHMMA"), or a mnemonic with
    modifiers its instructions carry ("UTCHMMA.2CTA" counts UTCHMMA.2CTA.F16 too)."""
    text = _run_cuobjdump(cuobjdump, ["-sass"], cubin_path)
    return count_markers(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*(?:\.[A-Z0-9_]+)*)", text),
                         markers)


def count_markers(opcodes: list[str], markers: tuple[str, ...]) -> dict[str, int]:
    wanted = [(m, *_split(m)) for m in markers]
    counts = dict.fromkeys(markers, 0)
    for opcode in opcodes:
        mnemonic, modifiers = _split(opcode)
        for marker, m, mods in wanted:
            if mnemonic == m and mods <= modifiers:
                counts[marker] += 1
    return counts


def _split(opcode: str) -> tuple[str, frozenset[str]]:
    mnemonic, *modifiers = opcode.split(".")
    return mnemonic, frozenset(modifiers)

"""The one check every kernel binary passes before it is loaded, wherever it came from.

A store (cache, bundle) proves that its files are the ones written (`digest_problem`); this proves
that what was written is the kernel asked for (`kernel_problem`): the metadata gemmgen reads, a
CUDA ELF64 for the kernel's arch, the entry point as a function symbol, and, where cuobjdump
read the SASS, the instructions that prove the arch's path (`GeneratedKernel.required_sass`:
a plain-sm_100 build, a kernel of traps, has none) and no local memory. A binary whose digests were
rewritten to match it still has to pass. Each returns None, or what is wrong, in words an
operator can act on; the stores report it once (`report_damaged`) and never serve the binary.
"""

from __future__ import annotations

import hashlib
import re
import struct
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from ..codegen import INFO_FIELDS, GeneratedKernel, SassRequirement
from ..errors import GemmgenWarning

CUBIN = "kernel.cubin"
SOURCE = "kernel.cu"
EM_CUDA = 190  # e_machine of a CUDA ELF
#: The metadata `artifact.compiled_kernel` reads, with the type each must have.
META_FIELDS: dict[str, type | tuple[type, ...]] = {
    "entry": str, "config": str, "info": dict, "layout": list, "compile_seconds": (int, float), "phases": dict,
    "epilogue": str, "registers": (int, type(None)), "local_bytes": (int, type(None)),
    "static_smem_bytes": (int, type(None)), "sass": (dict, type(None)),
}


def digest_problem(digests: Mapping[str, str], files: Mapping[str, bytes]) -> str | None:
    """What differs between the files a store holds and the SHA-256 digests it recorded."""
    for name, digest in digests.items():
        if name not in files:
            return f"{name} is missing"
        if hashlib.sha256(files[name]).hexdigest() != digest:
            return f"{name} does not match its recorded digest (truncated or altered)"
    return None


def entry_problem(files: Mapping[str, bytes], meta: Mapping[str, Any], fields: Mapping[str, Any], entry: str,
                  source: str) -> str | None:
    """What a kernel's entry lacks of its files, of the metadata `fields` (name -> type), or of
    being `entry` built from `source`, or None."""
    for name in (CUBIN, SOURCE):
        if name not in files:
            return f"the entry has no {name}"
    for name, kind in fields.items():
        if not isinstance(meta.get(name), kind):
            return f"its metadata has no valid {name!r}"
    if meta["entry"] != entry:
        return f"it holds entry {meta['entry']!r}, not {entry!r}"
    if files[SOURCE] != source.encode():
        return f"its {SOURCE} is not this kernel's generated source"
    return None


def kernel_problem(files: Mapping[str, bytes], meta: Mapping[str, Any], kernel: GeneratedKernel) -> str | None:
    """What makes an artifact's files and metadata unfit to be loaded as `kernel`, or None."""
    if problem := entry_problem(files, meta, META_FIELDS, kernel.entry, kernel.source):
        return problem
    if missing := [f for f, _ in INFO_FIELDS if not isinstance(meta["info"].get(f), int)]:
        return f"its metadata's info lacks {', '.join(missing)}"
    probed = {row[0] for row in meta["layout"] if isinstance(row, list) and len(row) == 3}
    if missing := [f.name for f in kernel.fields if f.name not in probed]:
        return f"its Params layout lacks {', '.join(missing)}"
    return elf_problem(files[CUBIN], kernel.arch.value, kernel.entry) or \
        sass_problem(meta, kernel.required_sass, kernel.arch.value)


def sass_problem(meta: Mapping[str, Any], required: SassRequirement, arch: str) -> str | None:
    """What the recorded SASS counts lack of `required` (the kernel's arch path), or its local
    memory, a stack frame included (None when no cuobjdump read the binary: nothing recorded)."""
    sass = meta["sass"]
    if sass is None:
        return None
    for alternatives in required:
        if not any(isinstance(sass.get(m), int) and sass[m] > 0 for m in alternatives):
            return (f"its SASS has no {' or '.join(alternatives)} instruction: not the {arch} path "
                    "gemmgen generated (a plain-arch build compiles to traps)")
    if meta["local_bytes"]:
        return f"it uses {meta['local_bytes']} bytes of local memory (registers spilled): gemmgen never ships that"
    if meta.get("stack_bytes"):  # the ABI stack frame lives in local memory: where spills land too
        return (f"it keeps a {meta['stack_bytes']}-byte stack frame in local memory (registers spilled): gemmgen "
                "never ships that")
    return None


def elf_problem(cubin: bytes, arch: str, entry: str) -> str | None:
    """What makes `cubin` not a CUDA ELF64 for `arch` defining the function `entry`, or None."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF":
        return f"{CUBIN} is not an ELF file"
    if cubin[4] != 2 or cubin[5] != 1:
        return f"{CUBIN} is not a little-endian ELF64"
    machine, = struct.unpack_from("<H", cubin, 0x12)
    if machine != EM_CUDA:
        return f"{CUBIN} is an ELF for machine {machine}, not CUDA ({EM_CUDA})"
    flags, = struct.unpack_from("<I", cubin, 0x30)
    sm = (flags >> 8) & 0xFF  # the SM version: 0x5a for sm_90a (cubins of NVRTC 13)
    want = _sm_number(arch)
    if sm != want:
        return f"{CUBIN} was compiled for sm_{sm}, not {arch}"
    try:
        functions = _function_symbols(cubin)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return f"{CUBIN}'s section or symbol table is damaged"
    if entry not in functions:
        return f"{CUBIN} defines no function {entry!r}"
    return None


def _sm_number(arch: str) -> int:
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if m is None:
        raise ValueError(f"not an SM architecture: {arch!r}")
    return int(m.group(1))


def _function_symbols(cubin: bytes) -> set[str]:
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    if shoff + shnum * shentsize > len(cubin):
        raise ValueError("section table past the end of the file")
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for sh_type, link, offset, size, entsize in ((s[1], s[6], s[4], s[5], s[9]) for s in sections):
        if sh_type != 2 or entsize == 0:  # SHT_SYMTAB
            continue
        if offset + size > len(cubin):
            raise ValueError("symbol table past the end of the file")
        strtab = sections[link][4]
        for k in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", cubin, offset + k * entsize)
            if st_info & 0xF == 2:  # STT_FUNC
                end = cubin.index(b"\0", strtab + st_name)
                names.add(cubin[strtab + st_name:end].decode())
    return names


_REPORTED: set[tuple[str, str]] = set()
_REPORTED_LOCK = threading.Lock()


def report_damaged(where: str, problem: str, action: str) -> None:
    """Warn once per (place, problem): `where` names the bundle or cache entry, `action` what
    gemmgen does instead (rebuilds it, skips it)."""
    with _REPORTED_LOCK:
        if (where, problem) in _REPORTED:
            return
        _REPORTED.add((where, problem))
    warnings.warn(f"gemmgen: {where}: {problem}; {action}", GemmgenWarning, stacklevel=3)

"""What a build produces: a kernel's binary with the facts gemmgen keeps about it, and its report."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..codegen import EMITTERS, GeneratedKernel, ParamsLayout
from ..config import KernelConfig
from ..ir import RecipeIR
from .cache import Artifact


@dataclass(frozen=True)
class KernelInfo:
    """Facts about the instantiation, exported by the kernel itself (see templates/kernel.cu.j2)."""

    params_size: int
    params_align: int
    smem_bytes: int  # dynamic shared memory: GemmKernel::SharedStorageSize
    max_threads: int
    min_blocks: int
    cluster_size: int


@dataclass(frozen=True)
class KernelReport:
    name: str
    entry: str
    config: str
    cache_key: str
    registers: int | None
    smem_bytes: int
    static_smem_bytes: int | None
    local_bytes: int | None
    stack_bytes: int | None  # the ABI stack frame: where register spills land too (both are local memory)
    sass: dict[str, int] | None
    compile_seconds: float
    phases: dict[str, float]  # front_end / nvvm / ptx seconds (NVRTC --time)
    epilogue: str  # "tree" or "dag"
    cached: bool = False  # not compiled by this call (from the cache or a bundle)
    origin: str = "compiled"  # "compiled", "cache", "bundle", "remote" (the remote tier) or "peer" (another rank)
    arch: str = "sm_90a"  # the GPU architecture it is built for (`gemmgen.Arch` value)
    compile_peak_bytes: int | None = None  # the compiling process's peak resident memory (Linux; None elsewhere)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CompiledKernel:
    """A built kernel: its cubin and generated source, the config it was built under, and its report
    (`report`: registers, shared and local memory, SASS counts, compile time, where it came from)."""

    recipe: RecipeIR  # as declared
    config: KernelConfig
    entry: str
    cache_key: str
    cubin: bytes
    source: str
    info: KernelInfo
    report: KernelReport
    generated: GeneratedKernel
    params_layout: ParamsLayout  # Params fields as NVRTC laid them out (from the layout probe)
    origin: str  # as KernelReport.origin

    def __repr__(self) -> str:  # not the cubin and the source (megabytes)
        return f"CompiledKernel({self.recipe.name!r}, {self.config.name}, entry={self.entry}, " \
               f"{len(self.cubin)} bytes of cubin, from {self.origin})"


def compiled_kernel(recipe: RecipeIR, config: KernelConfig, kernel: GeneratedKernel, art: Artifact, key: str,
                    origin: str) -> CompiledKernel:
    """The kernel `art` holds (from a bundle, the cache or a compile), with its report."""
    meta = art.meta
    info = KernelInfo(**meta["info"])
    report = KernelReport(
        name=recipe.name, entry=meta["entry"], config=meta["config"], cache_key=key, registers=meta["registers"],
        smem_bytes=info.smem_bytes, static_smem_bytes=meta["static_smem_bytes"], local_bytes=meta["local_bytes"],
        stack_bytes=meta.get("stack_bytes"),  # None in entries compiled before gemmgen recorded it
        sass=meta["sass"], compile_seconds=meta["compile_seconds"], phases=meta["phases"], epilogue=meta["epilogue"],
        cached=origin != "compiled", origin=origin, arch=config.arch.value,
        compile_peak_bytes=meta.get("compile_peak_bytes"))  # None in entries compiled before it was recorded
    by_name = {name: (offset, default) for name, offset, default in meta["layout"]}
    layout = ParamsLayout(info.params_size, tuple((f, *by_name[f.name]) for f in kernel.fields))
    return CompiledKernel(recipe, config, kernel.entry, key, art.files["kernel.cubin"], kernel.source, info, report,
                          kernel, layout, origin)


def report_table(reports: list[KernelReport]) -> str:
    """A fixed-width table of kernel reports: the SASS markers of the arches among them."""
    arches = {r.arch for r in reports} or {next(iter(EMITTERS)).value}
    marks = list(dict.fromkeys(m for a, e in EMITTERS.items() if a.value in arches for m in e.sass_markers))
    head = ["kernel", "config", "regs", "smem", "local", "stack", *marks, "compile s", "fe/nvvm/ptx s", "peak GB",
            "status"]
    rows = []
    for r in reports:
        sass = r.sass or {}
        phases = "/".join(f"{r.phases.get(k, 0.0):.1f}" for k in ("front_end", "nvvm", "ptx"))
        rows.append([r.name, r.config, _s(r.registers), str(r.smem_bytes), _s(r.local_bytes), _s(r.stack_bytes),
                     *(_s(sass.get(m)) if r.sass is None or m in sass else "-" for m in marks),  # "-": not its arch's
                     f"{r.compile_seconds:.1f}", phases,
                     "?" if r.compile_peak_bytes is None else f"{r.compile_peak_bytes / 2**30:.2f}", r.origin])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _s(v: object) -> str:
    return "?" if v is None else str(v)


def reports_json(reports: list[KernelReport]) -> str:
    return json.dumps([r.as_json() for r in reports], indent=2)

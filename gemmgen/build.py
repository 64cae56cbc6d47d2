"""Recipe + config -> a compiled, cached, inspected kernel (CompiledKernel)."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .codegen import INFO_FIELDS, GeneratedKernel, render_kernel
from .compile.cache import Artifact, KernelCache
from .compile.cubin import SASS_MARKERS, read_u64_array, resource_usage, sass_counts
from .compile.layout import check_layout, read_layout_probe
from .compile.nvrtc import BASE_OPTIONS, compile_cubin, write_debug_source
from .compile.toolchain import ARCH, toolchain
from .config import KernelConfig
from .errors import CompileError, KernelNotAvailable, ToolchainError
from .ir import content_key
from .runtime.arguments import ParamsLayout

if TYPE_CHECKING:
    from .dsl import Recipe


EXTRA_OPTIONS = ("-diag-suppress=177",)  # CuTe's TMA code declares an unused variable


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
    origin: str = "compiled"  # "compiled", "cache" or "bundle"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CompiledKernel:
    recipe: Recipe
    config: KernelConfig
    entry: str
    cache_key: str
    cubin: bytes
    source: str
    info: KernelInfo
    report: KernelReport
    generated: GeneratedKernel
    params_layout: ParamsLayout  # Params fields as NVRTC laid them out (from the layout probe)
    origin: str  # "compiled", "cache" or "bundle"


def key_material(kernel: GeneratedKernel) -> dict[str, Any]:
    """Everything that can change the binary: source, header contents, compiler, options, arch, gemmgen.

    No paths and no mtimes: a cache (or a machine) moved elsewhere computes the same keys.
    """
    tc = toolchain()
    return {"source": kernel.source, "headers": tc.header_digest, "nvrtc": tc.nvrtc_build,
            "options": [*BASE_OPTIONS, *EXTRA_OPTIONS], "arch": ARCH, "gemmgen": __version__}


def cache_key(kernel: GeneratedKernel) -> str:
    return content_key(key_material(kernel))


@functools.cache
def default_cache() -> KernelCache:
    return KernelCache(arch=ARCH)


def _compile_artifact(kernel: GeneratedKernel, key: str) -> Artifact:
    tc = toolchain()
    try:
        result = compile_cubin(kernel.source, kernel.entry, ARCH, tc.include_dirs, extra_options=EXTRA_OPTIONS)
    except CompileError as e:
        path = write_debug_source(kernel.source, kernel.entry)
        raise CompileError(f"{e}\ngenerated source: {path}") from None
    info = dict(zip((f for f, _ in INFO_FIELDS), read_u64_array(result.cubin, kernel.info_symbol), strict=True))
    probe = read_layout_probe(result.ptx, kernel.entry, len(kernel.fields))
    check_layout(kernel.entry, kernel.fields, probe, info["params_size"])
    meta: dict[str, Any] = {
        "entry": kernel.entry, "recipe": kernel.recipe.name, "config": kernel.config.binary().name, "info": info,
        "compile_seconds": round(result.wall_seconds, 3), "phases": {k: round(v, 3) for k, v in result.phases.items()},
        "layout": [[f.name, offset, default] for f, (offset, default) in zip(kernel.fields, probe, strict=True)],
        "epilogue": kernel.epilogue.layout, "registers": None, "local_bytes": None, "stack_bytes": None,
        "static_smem_bytes": None, "sass": None,
    }
    if tc.cuobjdump is not None:
        with tempfile.TemporaryDirectory(prefix="gemmgen-sass-") as tmp:
            path = Path(tmp) / "kernel.cubin"
            path.write_bytes(result.cubin)
            res = resource_usage(tc.cuobjdump, path, kernel.entry)
            meta.update(registers=res.registers, local_bytes=res.local_bytes, stack_bytes=res.stack_bytes,
                        static_smem_bytes=res.static_smem_bytes, sass=sass_counts(tc.cuobjdump, path))
    return Artifact({"kernel.cubin": result.cubin, "kernel.cu": kernel.source.encode()}, meta)


def jit_enabled() -> bool:
    """GEMMGEN_JIT=0 forbids compiling: every kernel must come from a bundle or the cache."""
    return os.environ.get("GEMMGEN_JIT", "1").strip().lower() not in ("0", "false", "no", "off")


def build_kernel(recipe: Recipe, config: KernelConfig, cache: KernelCache | None = None) -> CompiledKernel:
    """Render, then load from a bundle, the cache, or compile with NVRTC (in that order).

    Config errors are raised before anything is compiled; with GEMMGEN_JIT=0 a kernel found
    in neither a bundle nor the cache raises KernelNotAvailable instead of compiling.
    """
    from . import bundle

    kernel = render_kernel(recipe.ir, config)
    skey = bundle.source_key(kernel)
    art = bundle.find(skey)
    if art is not None:
        return _compiled(recipe, config, kernel, art, skey, "bundle")
    cache = cache or default_cache()
    if not jit_enabled():
        try:
            key = cache_key(kernel)
            art = cache.get(key)
        except ToolchainError:
            art = None
        if art is None:
            raise KernelNotAvailable(
                f"kernel for recipe {recipe.name!r} with config {config.name} is in no bundle and not in the cache "
                f"({cache.root}), and GEMMGEN_JIT=0 forbids compiling it. Build it ahead of time with "
                f"`gemmgen build RECIPES.py --out DIR` and set GEMMGEN_BUNDLE_PATH=DIR, or unset GEMMGEN_JIT")
        return _compiled(recipe, config, kernel, art, key, "cache")
    key = cache_key(kernel)

    def waiting() -> None:
        print(f"gemmgen: waiting for another process compiling {kernel.entry} ({key[:12]})", file=sys.stderr)

    def compile_now() -> Artifact:
        """A lazy first call compiles here: say so, as a silent stall of half a minute per kernel
        looks like a hang."""
        print(f"gemmgen: compiling {recipe.name} ({config.name}) with NVRTC, about 30-45 s; gemmgen.warmup() "
              f"or `gemmgen build` compiles ahead of time, in parallel", file=sys.stderr, flush=True)
        art = _compile_artifact(kernel, key)
        print(f"gemmgen: compiled {recipe.name} ({config.name}) in {art.meta['compile_seconds']:.1f} s",
              file=sys.stderr, flush=True)
        return art

    art, built = cache.get_or_build(key, compile_now, on_wait=waiting)
    return _compiled(recipe, config, kernel, art, key, "compiled" if built else "cache")


def _compiled(recipe: Recipe, config: KernelConfig, kernel: GeneratedKernel, art: Artifact, key: str,
              origin: str) -> CompiledKernel:
    meta = art.meta
    info = KernelInfo(**meta["info"])
    report = KernelReport(
        name=recipe.name, entry=meta["entry"], config=meta["config"], cache_key=key, registers=meta["registers"],
        smem_bytes=info.smem_bytes, static_smem_bytes=meta["static_smem_bytes"], local_bytes=meta["local_bytes"],
        stack_bytes=meta.get("stack_bytes"),  # None in entries compiled before gemmgen recorded it
        sass=meta["sass"], compile_seconds=meta["compile_seconds"], phases=meta["phases"], epilogue=meta["epilogue"],
        cached=origin != "compiled", origin=origin)
    by_name = {name: (offset, default) for name, offset, default in meta["layout"]}
    layout = ParamsLayout(info.params_size, tuple((f, *by_name[f.name]) for f in kernel.fields))
    return CompiledKernel(recipe, config, kernel.entry, key, art.files["kernel.cubin"], kernel.source, info, report,
                          kernel, layout, origin)


def report_table(reports: list[KernelReport]) -> str:
    """A fixed-width table of kernel reports."""
    marks = list(SASS_MARKERS)
    head = ["kernel", "config", "regs", "smem", "local", "stack", *marks, "compile s", "fe/nvvm/ptx s", "status"]
    rows = []
    for r in reports:
        sass = r.sass or {}
        phases = "/".join(f"{r.phases.get(k, 0.0):.1f}" for k in ("front_end", "nvvm", "ptx"))
        rows.append([r.name, r.config, _s(r.registers), str(r.smem_bytes), _s(r.local_bytes), _s(r.stack_bytes),
                     *(_s(sass.get(m)) for m in marks), f"{r.compile_seconds:.1f}", phases,
                     r.origin])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _s(v: object) -> str:
    return "?" if v is None else str(v)


def reports_json(reports: list[KernelReport]) -> str:
    return json.dumps([r.as_json() for r in reports], indent=2)

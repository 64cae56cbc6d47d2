"""The cast-transpose kernel (`codegen.quantize`) compiled and cached as GEMM kernels are: NVRTC,
a key over everything that can change the binary, the local cache (and the remote tier), and the
one binary check before any copy is loaded (`validate`). A second of NVRTC, not half a minute: the
kernel includes no CuTe."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import env
from .._version import __version__
from ..codegen.quantize import QuantizeKernelSource
from ..errors import CompileError, KernelNotAvailable
from ..ir import content_key
from . import bundles
from .build import default_cache, fetch_remote
from .cache import Artifact, Check, KernelCache
from .cubin import resource_usage, sass_counts
from .nvrtc import BASE_OPTIONS, compile_cubin, write_debug_source
from .remote import Filling, remote_tier
from .toolchain import toolchain
from .validate import CUBIN, SOURCE, elf_problem, entry_problem, sass_problem

#: The metadata a cast-transpose binary carries, with the type each must have.
_META: dict[str, type | tuple[type, ...]] = {
    "entry": str, "kind": str, "compile_seconds": (int, float), "registers": (int, type(None)),
    "local_bytes": (int, type(None)), "static_smem_bytes": (int, type(None)), "sass": (dict, type(None))}


@dataclass(frozen=True)
class CompiledQuantizeKernel:
    """A built cast-transpose kernel: its cubin, its source, and what gemmgen read of the binary."""

    kernel: QuantizeKernelSource
    cache_key: str
    cubin: bytes
    meta: dict[str, Any]
    origin: str  # "compiled", "cache" or "remote"

    @property
    def entry(self) -> str:
        return self.kernel.entry


def key_material(kernel: QuantizeKernelSource) -> dict[str, Any]:
    """Everything that can change the binary (no paths, no mtimes), as `build.key_material`."""
    tc = toolchain()
    return {"kind": "cast_transpose", "source": kernel.source, "headers": tc.header_digest, "nvrtc": tc.nvrtc_build,
            "options": list(BASE_OPTIONS), "arch": kernel.arch.value, "gemmgen": __version__}


def quantize_kernel_problem(files: dict[str, bytes], meta: dict[str, Any], kernel: QuantizeKernelSource) -> str | None:
    """What makes an artifact unfit to be loaded as `kernel`, or None (the GEMMs' `kernel_problem`)."""
    if problem := entry_problem(files, meta, _META, kernel.entry, kernel.source):
        return problem
    return elf_problem(files[CUBIN], kernel.arch.value, kernel.entry) or \
        sass_problem(meta, kernel.required_sass, kernel.arch.value)


def compile_quantize_artifact(kernel: QuantizeKernelSource) -> Artifact:
    """NVRTC, then the binary's registers, memory and SASS counts, checked before it is stored."""
    tc = toolchain()
    try:
        result = compile_cubin(kernel.source, kernel.entry, kernel.arch.value, tc.include_dirs)
    except CompileError as e:
        path = write_debug_source(kernel.source, kernel.entry)
        raise CompileError(f"{e}\ngenerated source: {path}") from None
    meta: dict[str, Any] = {"entry": kernel.entry, "kind": "cast_transpose", "spec": kernel.spec.name,
                            "compile_seconds": round(result.wall_seconds, 3), "compile_peak_bytes": result.peak_bytes,
                            "registers": None, "local_bytes": None, "stack_bytes": None, "static_smem_bytes": None,
                            "sass": None}
    if tc.cuobjdump is not None:
        with tempfile.TemporaryDirectory(prefix="gemmgen-sass-") as tmp:
            path = Path(tmp) / CUBIN
            path.write_bytes(result.cubin)
            res = resource_usage(tc.cuobjdump, path, kernel.entry)
            markers = tuple(dict.fromkeys(m for alternatives in kernel.required_sass for m in alternatives))
            meta.update(registers=res.registers, local_bytes=res.local_bytes, stack_bytes=res.stack_bytes,
                        static_smem_bytes=res.static_smem_bytes, sass=sass_counts(tc.cuobjdump, path, markers))
    art = Artifact({CUBIN: result.cubin, SOURCE: kernel.source.encode()}, meta)
    if problem := quantize_kernel_problem(art.files, art.meta, kernel):
        raise CompileError(f"{kernel.entry}: the binary NVRTC produced fails gemmgen's check: {problem}")
    return art


def build_quantize_kernel(kernel: QuantizeKernelSource, cache: KernelCache | None = None,
                          allow_compile: bool | None = None) -> CompiledQuantizeKernel:
    """From a bundle, the cache (or the remote tier), else NVRTC, as `build.build_kernel`; a kernel
    in none of them raises KernelNotAvailable instead of compiling where `allow_compile` is False
    (None: where GEMMGEN_JIT=0)."""
    check: Check = lambda art: quantize_kernel_problem(art.files, art.meta, kernel)  # noqa: E731
    skey = bundles.source_key(kernel)
    art = bundles.find(skey, kernel.arch, check)
    if art is not None:
        return CompiledQuantizeKernel(kernel, skey, art.files[CUBIN], art.meta, "bundle")
    cache = (cache or default_cache()).for_arch(kernel.arch)
    key = content_key(key_material(kernel))
    if not (env.jit_enabled() if allow_compile is None else allow_compile):
        art = cache.get(key, check) or fetch_remote(cache, key, check)
        if art is None:
            raise KernelNotAvailable(f"the {kernel.spec.name} kernel for {kernel.arch.value} is in no bundle and not "
                                     f"in the cache ({cache.root}), and GEMMGEN_JIT=0 forbids compiling it. Build it "
                                     "ahead of time: gemmgen.build_bundle(..., quantize=gemmgen.nn."
                                     "model_quantize_specs(model)) with GEMMGEN_BUNDLE_PATH set to that bundle, or "
                                     "unset GEMMGEN_JIT (it compiles in seconds)")
        return CompiledQuantizeKernel(kernel, key, art.files[CUBIN], art.meta, "cache")
    fill = Filling(remote_tier(cache.arch.value), key, lambda: compile_quantize_artifact(kernel), check)
    art, built = cache.get_or_build(key, fill, check=check)
    origin = "remote" if fill.fetched else "compiled" if built else "cache"
    return CompiledQuantizeKernel(kernel, key, art.files[CUBIN], art.meta, origin)

"""Recipe IR + config -> a compiled, cached, inspected kernel (CompiledKernel).

Binaries come from, in order: the bundles (`bundles.find`, by a key that needs no toolchain), the
local cache (by a key over everything that can change the binary), the remote tier if one is
configured (`remote`, by the same key), or NVRTC, whose result the cache and the tier store.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import env
from .._version import __version__
from ..codegen import INFO_FIELDS, GeneratedKernel, emitter, render_kernel
from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..errors import CompileError, KernelNotAvailable, ToolchainError
from ..ir import RecipeIR, content_key
from . import bundles
from .artifact import CompiledKernel, compiled_kernel
from .cache import Artifact, Check, KernelCache
from .cubin import read_u64_array, resource_usage, sass_counts
from .layout import check_layout, read_layout_probe
from .nvrtc import BASE_OPTIONS, compile_cubin, write_debug_source
from .remote import Filling, remote_tier
from .rtc_headers import generated_digest, generated_headers
from .toolchain import toolchain
from .validate import kernel_problem

EXTRA_OPTIONS = ("-diag-suppress=177",)  # CuTe's TMA code declares an unused variable


def key_material(kernel: GeneratedKernel) -> dict[str, Any]:
    """Everything that can change the binary: source, header contents, compiler, options, arch, gemmgen.

    No paths and no mtimes: a cache (or a machine) moved elsewhere computes the same keys.
    """
    tc = toolchain()
    material = {"source": kernel.source, "headers": tc.header_digest, "nvrtc": tc.nvrtc_build,
                "options": [*BASE_OPTIONS, *EXTRA_OPTIONS], "arch": kernel.config.arch.value, "gemmgen": __version__}
    if _generated(kernel):  # (sm90 kernels include none: their keys are those from before sm100)
        material["generated_headers"] = generated_digest(tc.cutlass_include)
    return material


def _generated(kernel: GeneratedKernel) -> tuple[tuple[str, str], ...]:
    """The generated headers (`rtc_headers`) the kernel's module may include: sm100's."""
    return generated_headers(toolchain().cutlass_include) if kernel.config.arch is Arch.SM100A else ()


def cache_key(kernel: GeneratedKernel) -> str:
    return content_key(key_material(kernel))


@functools.cache
def default_cache() -> KernelCache:
    """The cache at GEMMGEN_CACHE_DIR (or the user's cache folder); `for_arch` gives each arch's."""
    return KernelCache(arch=DEFAULT_ARCH)


def compile_artifact(kernel: GeneratedKernel) -> Artifact:
    """NVRTC, then what gemmgen records of the binary: its exported facts, the probed Params layout,
    registers and local memory, and SASS counts."""
    tc = toolchain()
    try:
        result = compile_cubin(kernel.source, kernel.entry, kernel.config.arch.value, tc.include_dirs,
                               extra_options=EXTRA_OPTIONS, headers=_generated(kernel))
    except CompileError as e:
        path = write_debug_source(kernel.source, kernel.entry)
        raise CompileError(f"{e}\ngenerated source: {path}") from None
    info = dict(zip((f for f, _ in INFO_FIELDS), read_u64_array(result.cubin, kernel.info_symbol), strict=True))
    probe = read_layout_probe(result.ptx, kernel.entry, len(kernel.fields))
    check_layout(kernel.entry, kernel.fields, probe, info["params_size"])
    meta: dict[str, Any] = {
        "entry": kernel.entry, "recipe": kernel.recipe.name, "config": kernel.config.binary().name, "info": info,
        "compile_seconds": round(result.wall_seconds, 3), "phases": {k: round(v, 3) for k, v in result.phases.items()},
        "compile_peak_bytes": result.peak_bytes,
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
                        static_smem_bytes=res.static_smem_bytes,
                        sass=sass_counts(tc.cuobjdump, path, _markers(kernel)))
    art = Artifact({"kernel.cubin": result.cubin, "kernel.cu": kernel.source.encode()}, meta)
    if problem := kernel_problem(art.files, art.meta, kernel):
        raise CompileError(f"{kernel.entry}: the binary NVRTC produced fails gemmgen's check: {problem}")
    return art


def kernel_check(kernel: GeneratedKernel) -> Check:
    """The validation every binary for `kernel` passes before it is loaded, from any store."""
    return lambda art: kernel_problem(art.files, art.meta, kernel)


def build_kernel(recipe: RecipeIR, config: KernelConfig, cache: KernelCache | None = None) -> CompiledKernel:
    """Render, then load from a bundle, the cache, or compile with NVRTC (in that order).

    Config errors are raised before anything is compiled; with GEMMGEN_JIT=0 a kernel found
    in neither a bundle nor the cache raises KernelNotAvailable instead of compiling.
    """
    kernel = render_kernel(recipe, config)
    check = kernel_check(kernel)
    skey = bundles.source_key(kernel)
    art = bundles.find(skey, config.arch, check)
    if art is not None:
        return compiled_kernel(recipe, config, kernel, art, skey, "bundle")
    cache = (cache or default_cache()).for_arch(config.arch)
    if not env.jit_enabled():
        key = None
        origin = "cache"
        try:
            key = cache_key(kernel)
            art = cache.get(key, check)
            if art is None:
                art, origin = fetch_remote(cache, key, check), "remote"
        except ToolchainError:
            art = None
        if art is None:
            raise not_available([(recipe, config)], cache, [*bundles.damaged(skey),
                                                            *([cache.damaged[key]] if key in cache.damaged else [])])
        assert key is not None
        return compiled_kernel(recipe, config, kernel, art, key, origin)
    key = cache_key(kernel)

    def waiting() -> None:
        print(f"gemmgen: waiting for another process compiling {kernel.entry} ({key[:12]})", file=sys.stderr)

    def compile_now() -> Artifact:
        """A lazy first call compiles here: say so, as a silent stall of half a minute per kernel
        looks like a hang."""
        print(f"gemmgen: compiling {recipe.name} ({config.name}) with NVRTC, {compile_estimate(cache)}; "
              "gemmgen.warmup() or `gemmgen build` compiles ahead of time, in parallel", file=sys.stderr, flush=True)
        art = compile_artifact(kernel)
        print(f"gemmgen: compiled {recipe.name} ({config.name}) in {art.meta['compile_seconds']:.1f} s",
              file=sys.stderr, flush=True)
        return art

    fill = Filling(remote_tier(cache.arch.value), key, compile_now, check)
    art, built = cache.get_or_build(key, fill, on_wait=waiting, check=check)
    origin = "remote" if fill.fetched else "compiled" if built else "cache"
    return compiled_kernel(recipe, config, kernel, art, key, origin)


def fetch_remote(cache: KernelCache, key: str, check: Check) -> Artifact | None:
    """The remote tier's valid copy of `key` (no compile: GEMMGEN_JIT=0 allows it), stored in the
    local cache too, with the cache's own handling of read-only folders and full disks."""
    tier = remote_tier(cache.arch.value)
    art = tier.fetch(key, check) if tier is not None else None
    if art is not None:
        cache.get_or_build(key, lambda: art, check=check)
    return art


def not_available(missing: list[tuple[RecipeIR, KernelConfig]], cache: KernelCache,
                  damaged: Sequence[str] = ()) -> KernelNotAvailable:
    """The error for kernels GEMMGEN_JIT=0 forbids compiling: each one, what was damaged, the fix."""
    seen = "".join(f"; a damaged copy was not served ({d})" for d in damaged)
    arches = sorted({c.arch for _, c in missing}, key=lambda a: a.sm)
    flags = "" if arches == [DEFAULT_ARCH] else "".join(f" --arch {a.value}" for a in arches)
    for a in arches:
        for path, held in bundles.other_arches(a):
            seen += f"; bundle {path} holds {'/'.join(h.value for h in held)} kernels only, none for {a.value}"
    fix = f"`gemmgen build RECIPES.py{flags} --out DIR` (or gemmgen.build_bundle(...)) and set " \
          "GEMMGEN_BUNDLE_PATH=DIR, or unset GEMMGEN_JIT"
    where = f"in no bundle and not in the cache ({cache.root})"
    if len(missing) == 1:
        (r, c), = missing
        return KernelNotAvailable(f"the kernel for recipe {r.name!r} with config {c.name} is {where}, and "
                                  f"GEMMGEN_JIT=0 forbids compiling it{seen}. Build it ahead of time with {fix}")
    names = "; ".join(f"recipe {r.name!r} with config {c.name}" for r, c in missing)
    return KernelNotAvailable(f"{len(missing)} kernels are {where}, and GEMMGEN_JIT=0 forbids compiling them: "
                              f"{names}{seen}. Build them ahead of time with {fix}")


def compile_estimate(cache: KernelCache, sample: int = 32) -> str:
    """How long a compile takes here, from the compiles this cache holds; no number without them."""
    seconds = []
    for path in itertools.islice(cache.dir.glob("*/*/meta.json"), sample):
        try:
            value = json.loads(path.read_text())["meta"]["compile_seconds"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(value, int | float) and value > 0:
            seconds.append(float(value))
    if len(seconds) < 2:
        return "which takes tens of seconds or more"
    seconds.sort()
    return f"about {seconds[len(seconds) // 10]:.0f}-{seconds[-1 - len(seconds) // 10]:.0f} s on this machine " \
           f"(past {len(seconds)} compiles)"


def _markers(kernel: GeneratedKernel) -> tuple[str, ...]:
    """The SASS instructions counted into a binary's record: what the arch's report counts, and what
    this kernel's SASS must show (`GeneratedKernel.required_sass`)."""
    required = (m for alternatives in kernel.required_sass for m in alternatives)
    return tuple(dict.fromkeys((*emitter(kernel.arch).sass_markers, *required)))

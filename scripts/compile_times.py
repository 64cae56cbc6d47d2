"""Cold compile seconds (NVRTC phase split) and warm cache-hit times for every example kernel.

    python scripts/compile_times.py [RECIPES.py]

Cold compiles run one at a time in a fresh temporary cache, so each number is one NVRTC
compile with the machine otherwise idle. Warm numbers: a disk hit through a new cache object
(shared lock, read, verify digests) and an in-memory hit, each the median of 20 calls.
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gemmgen import __version__
from gemmgen.aot import load_recipes
from gemmgen.codegen import render_kernel
from gemmgen.compile import build_kernel, cache_key
from gemmgen.compile.cache import KernelCache
from gemmgen.compile.toolchain import toolchain


def _median_ms(fn, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent.parent / "examples" / "recipes.py")
    recipes = load_recipes(path)
    t = time.perf_counter()
    tc = toolchain()  # finds the headers, loads NVRTC and reads its build identity
    toolchain_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    tc.header_digest  # noqa: B018 - computed once per process; reported separately
    digest_ms = (time.perf_counter() - t) * 1e3
    nvrtc = ".".join(map(str, tc.nvrtc_version))
    print(f"# gemmgen {__version__}, NVRTC {nvrtc}, python {platform.python_version()}, {platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}, CPU")
    print(f"# NVRTC build: {tc.nvrtc_build}")
    print(f"# once per process, before the first key: toolchain {toolchain_ms:.0f} ms, "
          f"header digest {digest_ms:.0f} ms")
    print("| kernel | cold s | front end s | NVVM s | PTX s | disk hit ms | memory hit us |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for recipe in recipes.values():
            cfg = recipe.default_config()
            rep = build_kernel(recipe.ir, cfg, KernelCache(root)).report
            key = cache_key(render_kernel(recipe.ir, cfg))
            disk = _median_ms(lambda: KernelCache(root).get(key))  # noqa: B023
            mem_cache = KernelCache(root)
            mem_cache.get(key)
            mem = _median_ms(lambda: mem_cache.get(key)) * 1e3  # noqa: B023
            p = rep.phases
            print(f"| {recipe.name} | {rep.compile_seconds:.1f} | {p['front_end']:.1f} | {p['nvvm']:.1f} | "
                  f"{p['ptx']:.1f} | {disk:.2f} | {mem:.1f} |", flush=True)


if __name__ == "__main__":
    main()

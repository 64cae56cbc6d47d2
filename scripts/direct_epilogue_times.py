"""Compile cost of the direct epilogue against CUTLASS's TMA one, side by side (issue 60).

    python scripts/direct_epilogue_times.py [--rounds N] [KERNEL ...]

KERNEL names an example recipe (examples/recipes.py; default: every one the direct epilogue
computes). Each round compiles every kernel under its default config and under the same config
with `epilogue=EpilogueCollective.DIRECT`, one compile at a time, each in a fresh process (so its
peak memory is its own), TMA and direct interleaved. Prints each compile's CPU seconds, NVRTC's
phase split and peak memory, then the median of the rounds per kernel and the ratio.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(name: str, which: str) -> None:
    """Compile one kernel in this process and print its row: kernel, epilogue, CPU s, front end s,
    NVVM s, PTX s, peak GiB."""
    import gemmgen as gg
    from gemmgen.aot import load_recipes
    from gemmgen.codegen import render_kernel
    from gemmgen.compile.nvrtc import compile_cubin
    from gemmgen.compile.toolchain import toolchain

    recipe = load_recipes(ROOT / "examples" / "recipes.py")[name]
    config = recipe.default_config()
    if which == "direct":
        config = dataclasses.replace(config, epilogue=gg.EpilogueCollective.DIRECT)
    kernel = render_kernel(recipe.ir, config)
    tc = toolchain()
    start = time.process_time()
    result = compile_cubin(kernel.source, kernel.entry, config.arch.value, tc.include_dirs)
    cpu = time.process_time() - start
    p = result.phases
    print(f"{name} {which} {cpu:.1f} {p['front_end']:.1f} {p['nvvm']:.1f} {p['ptx']:.1f} "
          f"{(result.peak_bytes or 0) / 2**30:.2f}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--one"]:
        one(args[1], args[2])
        return
    rounds = 3
    if args[:1] == ["--rounds"]:
        rounds, args = int(args[1]), args[2:]
    import gemmgen as gg
    from gemmgen.aot import load_recipes
    from gemmgen.codegen import is_valid

    recipes = load_recipes(ROOT / "examples" / "recipes.py")
    names = args or [n for n, r in recipes.items() if is_valid(dataclasses.replace(
        r.default_config(), epilogue=gg.EpilogueCollective.DIRECT), r.ir)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, one compile at a time, each in its own process, {rounds} rounds")
    print("| kernel | epilogue | CPU s | front end s | NVVM s | PTX s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for name in names:
            for which in ("tma", "direct"):
                out = subprocess.run([sys.executable, __file__, "--one", name, which], check=True,
                                     capture_output=True, text=True).stdout.split()
                cpu, fe, nvvm, ptx, peak = map(float, out[2:])
                runs.setdefault((name, which), []).append((cpu, peak))
                print(f"| {name} | {which} | {cpu:.1f} | {fe:.1f} | {nvvm:.1f} | {ptx:.1f} | {peak:.2f} |", flush=True)
    print("\n| kernel | TMA CPU s (median) | direct CPU s (median) | ratio | TMA peak GiB | direct peak GiB |")
    print("|---|---|---|---|---|---|")
    for name in names:
        tma, direct = (statistics.median(c for c, _ in runs[name, w]) for w in ("tma", "direct"))
        peaks = (max(p for _, p in runs[name, w]) for w in ("tma", "direct"))
        print(f"| {name} | {tma:.1f} | {direct:.1f} | {tma / direct:.2f}x | {' | '.join(f'{p:.2f}' for p in peaks)} |")


if __name__ == "__main__":
    main()

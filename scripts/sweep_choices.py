"""Compile every config the heuristic chooses for a recipes file over a grid of shapes (a CPU check, slow).

    .venv/bin/python scripts/sweep_choices.py [examples/recipes.py] [--arch sm_100a] [--recipe NAME] [-j 1]
        [--cache-dir DIR] [--list]

The suite compiles representative kernels; the heuristic may choose others (wider tiles, pairs,
stream-K, swapped small-M tiles, grouped kernels), and a config that spills fails its compile
(`compile.validate` refuses local memory and stack frames) only when a call first meets it. This
compiles each distinct (recipe, config) `choose_launch` picks over M in {1, 8, 64, 300, 1024, 8192}
and (N, K) in {(4096, 4096), (1024, 8192), (14336, 4096)}, and each grouped recipe's choices for few
and many rows per group, then prints registers, local and stack bytes per kernel and every
failure (each about 25-50 s and 3.4 GB of NVRTC). Exit status 1 when any failed: a spill found here
becomes a constraint (codegen/<arch>/constraints.py) so that the heuristic never picks it.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemmgen.config import KernelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

M_VALUES = (1, 8, 64, 300, 1024, 8192)
NK_VALUES = ((4096, 4096), (1024, 8192), (14336, 4096))
GROUPED = ((64, 8), (8192, 8))  # (rows, groups): few rows per group (swapped), many (gemmgen's default)


def choices(path: str, arch_name: str, only: str | None = None) -> list[tuple[str, KernelConfig]]:
    """The distinct (recipe name, config) pairs the heuristic picks, in first-seen order."""
    from gemmgen.aot import load_recipes
    from gemmgen.codegen import violations
    from gemmgen.config import Arch
    from gemmgen.tuning.heuristic import grouped_choice
    from gemmgen.tuning.policy import config_for

    arch = Arch(arch_name)
    seen: dict[tuple[str, KernelConfig], None] = {}
    for name, recipe in load_recipes(path).items():
        if violations(recipe.default_config(arch), recipe.ir) or only not in (None, name):  # (not built on arch)
            continue
        if recipe.ir.gemm.grouped:
            configs = [grouped_choice(recipe.ir, rows, groups, arch).config for rows, groups in GROUPED]
        else:
            configs = [config_for(recipe, m, n, k, arch=arch) for m in M_VALUES for n, k in NK_VALUES]
        for config in configs:
            seen.setdefault((name, config), None)
    return list(seen)


def compile_one(path: str, name: str, config: KernelConfig, cache_dir: str) -> str:
    """One line: the kernel's registers, local and stack bytes and compile time, or why it failed."""
    from gemmgen.aot import load_recipes
    from gemmgen.compile import build_kernel
    from gemmgen.compile.cache import KernelCache

    recipe = load_recipes(path)[name]
    start = time.perf_counter()
    try:
        report = build_kernel(recipe.ir, config, KernelCache(cache_dir)).report
    except Exception as e:  # a failed compile is the finding
        return f"FAILED {name} {config.name}: {str(e).splitlines()[0][:400]}"
    return (f"ok     {name} {config.name}: {report.registers} registers, local {report.local_bytes}, "
            f"stack {report.stack_bytes}, {time.perf_counter() - start:.1f} s ({report.origin})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="?", default="examples/recipes.py")
    parser.add_argument("--arch", default="sm_100a")
    parser.add_argument("--recipe", help="only this recipe of the file")
    parser.add_argument("-j", "--jobs", type=int, default=1)
    parser.add_argument("--cache-dir", default="/tmp/gemmgen-sweep")
    parser.add_argument("--list", action="store_true", help="print the pairs and exit")
    args = parser.parse_args()
    pairs = choices(args.recipes, args.arch, args.recipe)
    print(f"{len(pairs)} distinct (recipe, config) pairs on {args.arch}", flush=True)
    if args.list:
        print("\n".join(f"{n} {c.name}" for n, c in pairs))
        return 0
    failed = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(compile_one, args.recipes, n, c, args.cache_dir) for n, c in pairs]
        for future in futures:
            line = future.result()
            failed += line.startswith("FAILED")
            print(line, flush=True)
    print(f"{failed} of {len(pairs)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

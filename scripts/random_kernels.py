"""Compile random recipes with NVRTC and emulate each through its own Params (a CPU check, slow).

    .venv/bin/python scripts/random_kernels.py [N] [--seed S] [--cache-dir DIR] [-j 2]

tests/codegen/test_epilogue_source.py checks random recipes on rendered kernels (no compile) and has NVRTC
accept their types; this goes further for N of them (about 35 s and 3.4 GB of NVRTC each): a
full compile under a random candidate config (every other one swapped), the report (registers,
spills, WGMMA count), then the emulation of the compiled source on the Params laid out as NVRTC's
probe found them, at the test suite's emulation shapes, against the recipe's reference. Run from
the repository root (it uses the test suite's helpers).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def check(seed: int, index: int, cache_dir: str) -> str:
    """Recipe `index` of the draws from `seed`: compiled, reported and emulated, as one line."""
    import torch

    import gemmgen as gg
    from gemmgen.compile import build_kernel
    from gemmgen.compile.cache import KernelCache
    from gemmgen.testing.calls import EMULATED, args_with_nonzero_reference
    from gemmgen.testing.checks import assert_computes
    from gemmgen.testing.random_recipes import random_recipe
    from gemmgen.tuning.heuristic import SWAP_MAX_M, candidate_configs

    rng = random.Random(seed)
    made: list[gg.Recipe] = []
    while len(made) <= index:
        try:
            made.append(random_recipe(rng, len(made)))
        except gg.RecipeError:
            continue
    recipe = made[index]
    config = rng.choice([c for c in candidate_configs(recipe.ir, SWAP_MAX_M)
                         if c.swap_ab == bool(index % 2) and gg.codegen.is_valid(c, recipe.ir)])
    start = time.perf_counter()
    try:
        kernel = build_kernel(recipe.ir, config, KernelCache(cache_dir))
    except Exception as e:  # a compile error is the finding
        return f"{recipe.name} {config.name}: COMPILE FAILED {str(e)[:1000]}"
    seconds = time.perf_counter() - start
    torch.manual_seed(seed + index)
    shapes = 0
    for shape in EMULATED:
        m, n, k, batch = shape
        try:
            drawn = args_with_nonzero_reference(recipe, m, n, k, (batch,) if recipe.ir.gemm.batched else ())
        except AssertionError:  # an output that is zero here for any input checks nothing
            continue
        try:
            assert_computes(kernel, shape, "compiled", drawn)
        except AssertionError as e:
            return f"{recipe.name} {config.name}: EMULATION FAILED {str(e)[:1000]}"
        shapes += 1
    r, epi = kernel.report, kernel.generated.epilogue
    hgmma = r.sass["HGMMA"] if r.sass is not None else "?"
    return (f"{recipe.name:9s} {config.name:40s} {epi.layout:4s} {len(epi.decls):3d} visitor types, "
            f"{len(recipe.outputs) - 1} aux | {seconds:4.0f} s, {r.registers} regs, {r.local_bytes} B local, "
            f"smem {kernel.info.smem_bytes}, HGMMA {hgmma} | emulated at {shapes} shapes")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int, nargs="?", default=6)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cache-dir", default="/tmp/gemmgen-random-kernels")
    p.add_argument("-j", type=int, default=2)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    print(f"seed {seed}", flush=True)
    failed = 0
    with ProcessPoolExecutor(args.j) as pool:
        for line in pool.map(check, [seed] * args.n, range(args.n), [args.cache_dir] * args.n):
            print(line, flush=True)
            failed += "FAILED" in line
    print(f"{args.n - failed} of {args.n} compiled and emulated as their recipes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

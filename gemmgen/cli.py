"""`gemmgen build | inspect | generate RECIPES.py`: compile, report and emit sources from the shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .aot import build, load_recipes, pairs_of, with_tuned_winners, write_bundle
from .compile import KernelCache, report_table, reports_json
from .config import ARCH
from .errors import GemmgenError
from .tuning import (
    DEFAULT_CANDIDATES,
    TuningTable,
    autotune,
    choose_launch,
    launches_for_shapes,
    load_shapes,
    problem_shape,
)


def _cache(args: argparse.Namespace) -> KernelCache:
    return KernelCache(args.cache_dir) if args.cache_dir else KernelCache()


def _recipes(args: argparse.Namespace) -> dict:
    """The file's recipes, or only the one `--recipe NAME` names (an unknown name is an error)."""
    recipes = load_recipes(args.recipes)
    if args.recipe is None:
        return recipes
    chosen = {key: r for key, r in recipes.items() if r.name == args.recipe}
    if not chosen:
        raise GemmgenError(f"--recipe {args.recipe!r}: {args.recipes} declares no recipe of that name; its recipes "
                           f"are {sorted(r.name for r in recipes.values())}")
    return chosen


def cmd_build(args: argparse.Namespace) -> int:
    if args.arch != ARCH:
        raise GemmgenError(f"--arch {args.arch}: gemmgen emits {ARCH} kernels only")
    cache = _cache(args)
    recipes = _recipes(args)
    if args.shapes:
        shapes = load_shapes(args.shapes)
        if args.recipe is not None:
            shapes = {name: rows for name, rows in shapes.items() if name == args.recipe}
        chosen = launches_for_shapes(recipes, shapes)
        by_name = {r.name: r for r in recipes.values()}
        pairs = list(dict.fromkeys((by_name[n], launch.config) for n, rows in chosen.items() for _, launch in rows))
    else:
        chosen, pairs = {}, pairs_of(recipes.values())
    tuning = TuningTable.load(args.tuning) if args.tuning else None
    pairs = with_tuned_winners(pairs, tuning, recipes.values())  # the bundle holds every winner of the file's recipes
    kernels = build(pairs, cache, jobs=args.jobs)
    reports = [k.report for k in kernels]
    if args.out:
        shape_map = {n: [{"shape": list(s), "m_bucket": launch.bucket[0], "config": launch.config.name}
                         for s, launch in rows] for n, rows in chosen.items()}
        out = write_bundle(kernels, args.out, cache, shapes=shape_map, tuning=tuning)
        print(f"gemmgen: wrote a bundle of {len({k.cache_key for k in kernels})} kernel(s) to {out}; use it with "
              f"GEMMGEN_BUNDLE_PATH={out} or gemmgen.add_bundle()", file=sys.stderr)
    print(reports_json(reports) if args.json else report_table(reports))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    shapes = load_shapes(args.shapes)
    by_name = {r.name: r for r in _recipes(args).values()}
    table = TuningTable.load(args.out) if Path(args.out).is_file() else TuningTable()
    for name, problems in shapes.items():
        if name.startswith("_") or (args.recipe and name != args.recipe):
            continue
        if name not in by_name:
            raise GemmgenError(f"--shapes: no recipe named {name!r}; recipes are {sorted(by_name)}")
        autotune(by_name[name], [tuple(p) for p in problems], limit=args.candidates, table=table, out=args.out,
                 jobs=args.jobs)
    for key, entry in sorted(table.entries.items()):
        print(f"{key}: {entry['name']}  ({', '.join(f'{c} {t:.1f} us' for c, t in entry['timings_us'].items())})")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    m, n, k, l = problem_shape(args.shape, "--shape")  # noqa: E741
    for recipe in _recipes(args).values():
        g = recipe.ir.gemm  # L: the batch of a batched recipe, the groups of a grouped one
        launch = choose_launch(recipe, m, n, k, l if g.batched or g.grouped else 1, sm_count=args.sm_count)
        print(f"{recipe.name}: {launch.config.name} ({launch.source.value}): {launch.why}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    reports = [k.report for k in build(pairs_of(_recipes(args).values()), _cache(args), args.jobs, quiet=args.json)]
    print(reports_json(reports) if args.json else report_table(reports))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for recipe in _recipes(args).values():
        path = out / f"{recipe.name}.cu"
        path.write_text(recipe.source())
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gemmgen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("build", cmd_build, "compile every recipe of a file in parallel and print the report"),
                            ("inspect", cmd_inspect, "print the kernel report (compiles what is not cached)"),
                            ("generate", cmd_generate, "write the generated CUTLASS sources"),
                            ("explain", cmd_explain, "which config the heuristic picks for a shape, and why"),
                            ("tune", cmd_tune, "time candidate configs per shape bucket on this GPU, save winners")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("recipes", help="a Python file declaring module-level gemmgen.Recipe objects")
        sp.add_argument("--recipe", default=None, help="only this recipe of the file (by name)")
        sp.set_defaults(fn=fn)
        if name == "generate":
            sp.add_argument("--out", required=True, help="folder for the .cu files")
            continue
        if name == "tune":
            sp.add_argument("--shapes", required=True, help="JSON {recipe name: [[M, N, K] or [M, N, K, L], ...]}")
            sp.add_argument("--out", required=True, help="tuning JSON file (updated if it exists)")
            sp.add_argument("--candidates", type=int, default=DEFAULT_CANDIDATES, help="configs timed per bucket")
            sp.add_argument("-j", "--jobs", type=int, default=None, help="compile workers")
            continue
        if name == "explain":
            sp.add_argument("--shape", type=int, nargs="+", required=True, metavar="M N K [L]",
                            help="the problem: M N K, and L (a batched recipe's batch, a grouped one's groups)")
            sp.add_argument("--sm-count", type=int, default=132)
            continue
        sp.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: fit cores and memory)")
        sp.add_argument("--json", action="store_true", help="print one JSON object per kernel")
        sp.add_argument("--cache-dir", default=None,
                        help="cache root (default: $GEMMGEN_CACHE_DIR or ~/.cache/gemmgen)")
        if name == "build":
            sp.add_argument("--out", default=None, help="also write the kernels as a relocatable bundle here")
            sp.add_argument("--arch", default=ARCH, help=f"target architecture (only {ARCH})")
            sp.add_argument("--shapes", default=None,
                            help="JSON {recipe name: [[M, N, K], ...]}: build the config the heuristic picks per shape")
            sp.add_argument("--tuning", default=None,
                            help="autotune results (`gemmgen tune`): build each winner, ship the file in the bundle")
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except GemmgenError as e:
        print(f"gemmgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`gemmgen build | inspect | generate RECIPES.py`: compile, report and emit sources from the shell."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from . import env
from ._version import __version__
from .aot import build, load_recipes, pairs_of, with_tuned_winners, write_bundle
from .compile import KernelCache, report_table, reports_json
from .config import ARCH
from .dsl import Recipe
from .errors import GemmgenError, RecipeError
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
    kernels = build(pairs, cache, jobs=args.jobs, allow_compile=True)
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
    table = TuningTable.load_or_new(args.out)
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

    def explain(recipe: Recipe) -> str:
        g = recipe.ir.gemm  # L: the batch of a batched recipe, the groups of a grouped one
        launch = choose_launch(recipe, m, n, k, l if g.batched or g.grouped else 1, sm_count=args.sm_count)
        return f"{recipe.name}: {launch.config.name} ({launch.source.value}): {launch.why}"

    for recipe in _recipes(args).values():
        print(explain(recipe))
        if not args.backward:
            continue
        try:
            backward = recipe.backward()
        except RecipeError as e:
            print(f"  no backward: {e}")
            continue
        print(textwrap.indent(backward.describe(), "  "))
        for derived in (backward.forward, backward.kernel):
            if derived is not recipe:
                print(textwrap.indent(explain(derived), "  "))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    reports = [k.report for k in build(pairs_of(_recipes(args).values()), _cache(args), args.jobs, quiet=args.json,
                                       allow_compile=True)]
    print(reports_json(reports) if args.json else report_table(reports))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise GemmgenError(f"--out {args.out}: a file is in the way; --out names a folder for the .cu files")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for recipe in _recipes(args).values():
            path = out / f"{recipe.name}.cu"
            path.write_text(recipe.source())
            print(path)
    except OSError as e:
        raise GemmgenError(f"--out {args.out}: cannot write there ({e.strerror}); choose a writable folder") from None
    return 0


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (>= 1)")
    return value


def _environment_epilog() -> str:
    lines = ["environment variables (docs/deployment.md):"]
    for v in env.VARIABLES:
        lines += textwrap.wrap(f"{v.meaning} (default: {v.default})", 100, initial_indent=f"  {v.name:<22}",
                               subsequent_indent=" " * 24, break_on_hyphens=False)
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemmgen", description=__doc__, epilog=_environment_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"gemmgen {__version__} ({ARCH})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn, help_ in (("build", cmd_build, "compile every recipe of a file in parallel and print the report"),
                            ("inspect", cmd_inspect, "print the kernel report (compiles what is not cached)"),
                            ("generate", cmd_generate, "write the generated CUTLASS sources"),
                            ("explain", cmd_explain, "which config a call of a shape launches, and why"),
                            ("tune", cmd_tune, "time candidate configs per shape bucket on this GPU, save winners")):
        sp = sub.add_parser(name, help=help_, description=help_, epilog=_environment_epilog(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("recipes", help="a Python file declaring module-level gemmgen.Recipe objects")
        sp.add_argument("--recipe", default=None, help="only this recipe of the file (by name)")
        sp.set_defaults(fn=fn)
        if name == "generate":
            sp.add_argument("--out", required=True, help="folder for the .cu files (created if missing)")
            continue
        if name == "tune":
            sp.add_argument("--shapes", required=True, help="JSON {recipe name: [[M, N, K] or [M, N, K, L], ...]}")
            sp.add_argument("--out", required=True, help="tuning JSON file, or remote:NAME for a table in the "
                            "remote cache tier (GEMMGEN_REMOTE_CACHE); updated if it exists")
            sp.add_argument("--candidates", type=_positive, default=DEFAULT_CANDIDATES,
                            help=f"configs timed per bucket (default {DEFAULT_CANDIDATES})")
            sp.add_argument("-j", "--jobs", type=_positive, default=None,
                            help="compile workers (default: fit cores and memory)")
            continue
        if name == "explain":
            sp.add_argument("--shape", type=_positive, nargs="+", required=True, metavar="M N K [L]",
                            help="the problem: M N K, and L (a batched recipe's batch, a grouped one's groups)")
            sp.add_argument("--sm-count", type=_positive, default=132,
                            help="SMs of the target GPU, for the heuristic's wave count (default 132: H100/H200 SXM)")
            sp.add_argument("--backward", action="store_true",
                            help="also derive each recipe's backward (Recipe.backward): what its kernel computes, "
                            "and which configs it and the forward that saves for it launch (the backward GEMM at "
                            "the same M N K)")
            continue
        sp.add_argument("-j", "--jobs", type=_positive, default=None,
                        help="compile workers (default: fit cores and memory)")
        sp.add_argument("--json", action="store_true", help="print one JSON object per kernel")
        sp.add_argument("--cache-dir", default=None,
                        help="cache root (default: $GEMMGEN_CACHE_DIR or ~/.cache/gemmgen)")
        if name == "build":
            sp.add_argument("--out", default=None,
                            help="also write the kernels as a relocatable bundle to this folder (replaced whole)")
            sp.add_argument("--arch", default=ARCH, help=f"target architecture (only {ARCH})")
            sp.add_argument("--shapes", default=None,
                            help="JSON {recipe name: [[M, N, K], ...]}: build the config each shape launches")
            sp.add_argument("--tuning", default=None,
                            help="autotune results (`gemmgen tune`): build each winner, ship the file in the bundle")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except GemmgenError as e:
        print(f"gemmgen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gemmgen: interrupted (what was compiled is cached)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

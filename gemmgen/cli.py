"""`gemmgen build | inspect | generate RECIPES.py`: compile, report and emit sources from the shell."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

from . import env
from ._version import __version__
from .aot import build, load_recipes, with_tuned_winners, write_bundle
from .codegen import violations
from .compile import KernelCache, report_table, reports_json
from .config import DEFAULT_ARCH, Arch, KernelConfig
from .dsl import Recipe
from .errors import ConfigError, GemmgenError, RecipeError
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


def _arches(args: argparse.Namespace) -> list[Arch]:
    """The `--arch` values, each once, in order (default: sm_90a)."""
    return list(dict.fromkeys(args.arch or [DEFAULT_ARCH]))


def _pairs(args: argparse.Namespace, recipes: Iterable[Recipe], arch: Arch) -> list[tuple[Recipe, KernelConfig]]:
    """Each recipe with its default config on `arch`. Over a whole file, a recipe whose family the
    arch's emitter does not build yet (a grouped recipe on sm_100a) is left out with a line saying
    why; a recipe named by --recipe, or whose own config is broken, is an error."""
    out = []
    for recipe in recipes:
        config = recipe.default_config(arch)
        problems = violations(config, recipe.ir)
        if problems and args.recipe is None and config is not recipe.config:
            print(f"gemmgen: {recipe.name}: not built for {arch.value}: {problems[0]}", file=sys.stderr)
            continue
        out.append((recipe, config))
    return out


def cmd_build(args: argparse.Namespace) -> int:
    cache = _cache(args)
    recipes = _recipes(args)
    chosen: dict = {}
    pairs = []
    for arch in _arches(args):
        if args.shapes:
            shapes = load_shapes(args.shapes)
            if args.recipe is not None:
                shapes = {name: rows for name, rows in shapes.items() if name == args.recipe}
            launches = launches_for_shapes(recipes, shapes, arch=arch)
            by_name = {r.name: r for r in recipes.values()}
            pairs += [(by_name[n], launch.config) for n, rows in launches.items() for _, launch in rows]
            for n, rows in launches.items():
                chosen.setdefault(n, []).extend(rows)
        else:
            pairs += _pairs(args, recipes.values(), arch)
    pairs = list(dict.fromkeys(pairs))
    tuning = TuningTable.load(args.tuning) if args.tuning else None
    pairs = with_tuned_winners(pairs, tuning, recipes.values())  # the bundle holds every winner of the file's recipes
    kernels = build(pairs, cache, jobs=args.jobs, allow_compile=True)
    reports = [k.report for k in kernels]
    if args.out:
        shape_map = {n: [{"shape": list(s), "m_bucket": launch.bucket[0], "config": launch.config.name,
                          "arch": launch.config.arch.value} for s, launch in rows] for n, rows in chosen.items()}
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

    arches = _arches(args)

    def explain(recipe: Recipe, arch: Arch) -> str:
        """The launch and why; over a whole file, a recipe whose family the arch does not build
        says so (as `build` leaves it out); a recipe named by --recipe is an error."""
        g = recipe.ir.gemm  # L: the batch of a batched recipe, the groups of a grouped one
        on = f" on {arch.value} ({args.sm_count or arch.sm_count} SMs)" if len(arches) > 1 else ""
        try:
            launch = choose_launch(recipe, m, n, k, l if g.batched or g.grouped else 1, sm_count=args.sm_count,
                                   arch=arch)
        except ConfigError:
            problems = violations(recipe.default_config(arch), recipe.ir)
            if args.recipe is not None or not problems:
                raise
            return f"{recipe.name}{on}: not built for {arch.value}: {problems[0]}"
        return f"{recipe.name}{on}: {launch.config.name} ({launch.source.value}): {launch.why}"

    for recipe in _recipes(args).values():
        for arch in arches:
            print(explain(recipe, arch))
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
                for arch in arches:
                    print(textwrap.indent(explain(derived, arch), "  "))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    recipes = _recipes(args).values()
    pairs = [pair for arch in _arches(args) for pair in _pairs(args, recipes, arch)]
    reports = [k.report for k in build(pairs, _cache(args), args.jobs, quiet=args.json, allow_compile=True)]
    print(reports_json(reports) if args.json else report_table(reports))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise GemmgenError(f"--out {args.out}: a file is in the way; --out names a folder for the .cu files")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for recipe in _recipes(args).values():
            for r, config in (p for arch in _arches(args) for p in _pairs(args, [recipe], arch)):
                # sm_90a's as NAME.cu, another arch's as NAME.sm_100a.cu
                path = out / (f"{r.name}.cu" if config.arch is DEFAULT_ARCH else f"{r.name}.{config.arch.value}.cu")
                path.write_text(r.source(config))
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


def _arch(text: str) -> Arch:
    """argparse type: an architecture gemmgen builds for."""
    try:
        return Arch.parse(text, "--arch")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_arch(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--arch", type=_arch, action="append", default=None, metavar="ARCH",
                    help=f"target architecture, repeatable: {', '.join(a.value for a in Arch)} (default "
                    f"{DEFAULT_ARCH.value})")


def _environment_epilog() -> str:
    lines = ["environment variables (docs/deployment.md):"]
    for v in env.VARIABLES:
        lines += textwrap.wrap(f"{v.meaning} (default: {v.default})", 100, initial_indent=f"  {v.name:<22}",
                               subsequent_indent=" " * 24, break_on_hyphens=False)
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemmgen", description=__doc__, epilog=_environment_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"gemmgen {__version__} ({', '.join(a.value for a in Arch)})")
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
        if name != "tune":
            _add_arch(sp)
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
            sp.add_argument("--sm-count", type=_positive, default=None,
                            help="SMs of the target GPU, for the heuristic's wave count (default: the arch's "
                            "reference GPU, 132 for sm_90a (H100/H200 SXM), 148 for sm_100a (B200))")
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

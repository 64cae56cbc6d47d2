"""`gemmgen build | inspect | generate | explain | tune RECIPES.py`: compile a file's recipes, report
their kernels, write their CUTLASS sources, explain which config a call launches, and autotune;
`gemmgen advise CONFIG.json`: a model's training step as GEMMs, their kernels, waves and time;
`gemmgen profile -- python train.py`: gemmgen's launches measured by Nsight Compute, beside that model."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import env
from ._version import __version__
from .aot import build, load_recipes, with_tuned_winners, write_bundle
from .codegen import violations
from .compile import KernelCache, KernelReport, report_table, reports_json
from .compile.cache import META
from .config import DEFAULT_ARCH, Arch, EpilogueCollective, KernelConfig
from .dsl import Recipe
from .errors import ConfigError, GemmgenError, RecipeError, did_you_mean
from .tuning import (
    DEFAULT_CANDIDATES,
    Source,
    TuningTable,
    autotune,
    choose_launch,
    launches_for_shapes,
    load_shapes,
    problem_shape,
    ranked,
)
from .tuning.heuristic import TIE_BREAK, tie_summary, ties

#: `explain --json`'s format number: raised when a key changes meaning or goes (docs/config-selection.md).
EXPLAIN_FORMAT = 1
#: The best candidates `explain` lists by default (`--top`).
DEFAULT_TOP = 5
#: A fix the API spells that a command has a flag for: `arch=Arch.SM100A` is `--arch sm_100a` here.
_API_ARCH = re.compile(r"\barch=(?:gemmgen\.|gg\.)?Arch\.(\w+)")


def _cache(args: argparse.Namespace) -> KernelCache:
    return KernelCache(args.cache_dir) if args.cache_dir else KernelCache()


def _recipes(args: argparse.Namespace) -> dict:
    """The file's recipes, or only the one `--recipe NAME` names (an unknown name is an error)."""
    recipes = load_recipes(args.recipes)
    if args.recipe is None:
        return recipes
    chosen = {key: r for key, r in recipes.items() if r.name == args.recipe}
    if not chosen:
        names = sorted(r.name for r in recipes.values())
        raise GemmgenError(f"--recipe {args.recipe!r}: {args.recipes} declares no recipe of that name"
                           f"{did_you_mean(args.recipe, names)}; its recipes are {names}")
    return chosen


def _arches(args: argparse.Namespace) -> list[Arch]:
    """The `--arch` values, each once, in order (default: sm_90a)."""
    return list(dict.fromkeys(args.arch or [DEFAULT_ARCH]))


def _pairs(args: argparse.Namespace, recipes: Iterable[Recipe], arch: Arch,
           skipped: list[tuple[str, Arch]] | None = None) -> list[tuple[Recipe, KernelConfig]]:
    """Each recipe with its default config on `arch`. Over a whole file, a recipe whose family the
    arch's emitter does not build (a microscaled recipe on sm_90a) is left out with a line saying
    why (and added to `skipped`); a recipe named by --recipe, or whose own config is broken, is an error."""
    out = []
    for recipe in recipes:
        config = _with_epilogue(args, recipe, recipe.default_config(arch))
        problems = violations(config, recipe.ir)
        if problems and args.recipe is None and config is not recipe.config:
            print(f"gemmgen: {recipe.name}: not built for {arch.value}: {_as_typed(problems[0], args)}",
                  file=sys.stderr)
            if skipped is not None:
                skipped.append((recipe.name, arch))
            continue
        out.append((recipe, config))
    return out


def _with_epilogue(args: argparse.Namespace, recipe: Recipe, config: KernelConfig) -> KernelConfig:
    """`config` with the epilogue collective `--epilogue` names (none: the config's own). Where the
    direct epilogue does not compute a recipe, its TMA kernel is built instead, with a line saying
    why; a recipe named by --recipe is an error instead."""
    wanted = getattr(args, "epilogue", None)
    if wanted is None or config.epilogue is EpilogueCollective(wanted):
        return config
    changed = dataclasses.replace(config, epilogue=EpilogueCollective(wanted))
    problems = [p for p in violations(changed, recipe.ir) if p.startswith("epilogue ")]
    if not problems:
        return changed
    reason = problems[0].removeprefix(f"epilogue {wanted}: ").rsplit("; use ", 1)[0]
    if args.recipe is not None:
        raise GemmgenError(f"--epilogue {wanted}: recipe {recipe.name!r}: {reason}; leave out --epilogue")
    print(f"gemmgen: {recipe.name}: --epilogue {wanted}: {reason}; building its {config.epilogue.value} epilogue",
          file=sys.stderr)
    return config


def _as_typed(text: str, args: argparse.Namespace) -> str:
    """`text` (an error, a reason) with each fix the API spells rewritten as this command takes it:
    `arch=Arch.SM100A` is `--arch sm_100a` for a command with --arch. Errors are raised by the API,
    which cannot know how it was called; the CLI knows its flags."""
    if not hasattr(args, "arch"):
        return text
    return _API_ARCH.sub(lambda m: f"--arch {Arch[m.group(1)].value}" if m.group(1) in Arch.__members__
                         else m.group(0), text)


def _status(r: KernelReport, cache: KernelCache) -> str:
    """What a report's origin means: compiled by this command, or found, with when it was compiled
    (a cache entry's date) and how long that took, so an old compile time does not read as new."""
    if r.origin == "compiled":
        return "compiled now"
    took = f"compiled in {r.compile_seconds:.1f} s"
    if r.origin == "cache":
        meta = cache.for_arch(Arch(r.arch)).entry_dir(r.cache_key) / META
        try:
            took += f" on {datetime.date.fromtimestamp(meta.stat().st_mtime).isoformat()}"
        except (OSError, ValueError):  # the fallback folder's, or gone since: the date is unknown
            pass
        return f"cached ({took})"
    where = {"bundle": "from a bundle", "remote": "from the remote tier", "peer": "from another rank"}
    return f"{where.get(r.origin, r.origin)} ({took})"


def _table(reports: list[KernelReport], cache: KernelCache) -> str:
    """The report table, its last column (status) saying what each origin means (`_status`)."""
    lines = report_table(reports).splitlines()
    if not reports or not lines[0].rstrip().endswith("status"):
        return "\n".join(lines)
    at = lines[0].rindex("status")
    statuses = [_status(r, cache) for r in reports]
    lines[0] = lines[0].rstrip()
    lines[1] = lines[1][:at] + "-" * max(len("status"), *map(len, statuses))
    lines[2:] = [line[:at] + status for line, status in zip(lines[2:], statuses, strict=True)]
    return "\n".join(lines)


def _print_reports(args: argparse.Namespace, reports: list[KernelReport], cache: KernelCache,
                   skipped: list[tuple[str, Arch]]) -> None:
    """The reports (a table, or a JSON array), then one summary line on stderr: built, found,
    skipped and why."""
    print(reports_json(reports) if args.json else _table(reports, cache))
    built = sum(r.origin == "compiled" for r in reports)
    line = f"gemmgen: {args.command}: built {built}, cached {len(reports) - built}, skipped {len(skipped)}"
    if skipped:
        by_arch: dict[Arch, list[str]] = {}
        for name, arch in skipped:
            by_arch.setdefault(arch, []).append(name)
        line += (" (not built for the arch: "
                 + "; ".join(f"{', '.join(names)} on {arch.value}" for arch, names in by_arch.items()) + ")")
    print(line, file=sys.stderr)


def cmd_build(args: argparse.Namespace) -> int:
    cache = _cache(args)
    recipes = _recipes(args)
    chosen: dict = {}
    pairs = []
    skipped: list[tuple[str, Arch]] = []
    for arch in _arches(args):
        if args.shapes:
            shapes = load_shapes(args.shapes)
            if args.recipe is not None:
                shapes = {name: rows for name, rows in shapes.items() if name == args.recipe}
            launches = launches_for_shapes(recipes, shapes, arch=arch)
            by_name = {r.name: r for r in recipes.values()}
            pairs += [(by_name[n], _with_epilogue(args, by_name[n], launch.config))
                      for n, rows in launches.items() for _, launch in rows]
            for n, rows in launches.items():
                chosen.setdefault(n, []).extend(rows)
        else:
            pairs += _pairs(args, recipes.values(), arch, skipped)
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
    _print_reports(args, reports, cache, skipped)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    shapes = load_shapes(args.shapes)
    by_name = {r.name: r for r in _recipes(args).values()}
    table = TuningTable.load_or_new(args.out)
    for name, problems in shapes.items():
        if name.startswith("_") or (args.recipe and name != args.recipe):
            continue
        if name not in by_name:
            raise GemmgenError(f"--shapes: no recipe named {name!r}{did_you_mean(name, by_name)}; recipes are "
                               f"{sorted(by_name)}")
        autotune(by_name[name], [tuple(p) for p in problems], limit=args.candidates, table=table, out=args.out,
                 jobs=args.jobs)
    for key, entry in sorted(table.entries.items()):
        print(f"{key}: {entry['name']}  ({', '.join(f'{c} {t:.1f} us' for c, t in entry['timings_us'].items())})")
    return 0


def _launch(args: argparse.Namespace, recipe: Recipe, shape: tuple[int, int, int, int], arch: Arch
            ) -> dict[str, Any]:
    """One launch of `explain --json` (docs/config-selection.md): the config a call of `shape`
    launches on `arch`, and why; the heuristic's best `--top` candidates and any tie at the top.
    Over a whole file, a recipe whose family the arch does not build says so (`built`: false, as
    `build` leaves it out); a recipe named by --recipe is an error."""
    m, n, k, l = shape  # noqa: E741
    g = recipe.ir.gemm
    l = l if g.batched or g.grouped else 1  # noqa: E741  (L: a batched recipe's batch, a grouped one's groups)
    out: dict[str, Any] = {"shape": [m, n, k, l], "arch": arch.value, "sm_count": args.sm_count or arch.sm_count,
                           "built": True, "config": None, "source": None, "bucket": None, "why": "", "tie": None,
                           "candidates": [], "candidates_total": 0}
    try:
        launch = choose_launch(recipe, m, n, k, l, sm_count=args.sm_count, arch=arch)
    except ConfigError:
        problems = violations(recipe.default_config(arch), recipe.ir)
        if args.recipe is not None or not problems:
            raise
        return {**out, "built": False, "why": _as_typed(problems[0], args)}
    order = ranked(recipe.ir, m, n, k, l, args.sm_count, arch) \
        if launch.source is Source.HEURISTIC and not g.grouped else []
    tied = ties(order) if order else []
    return {**out, "config": launch.config.name, "source": launch.source.value, "bucket": list(launch.bucket),
            "why": launch.why.splitlines()[0],
            "tie": {"configs": [c.name for c in tied], "score": order[0][0], "rule": TIE_BREAK} if len(tied) > 1
            else None,
            "candidates": [{"config": c.name, "score": score, "detail": why} for score, c, why in order[:args.top]],
            "candidates_total": len(order)}


def _launch_text(name: str, launch: dict[str, Any], shapes: int, arches: int) -> str:
    """A launch as `explain` prints it: the config and why, the tie, the best candidates."""
    m, n, k, l = launch["shape"]  # noqa: E741
    at = f" at {m}x{n}x{k}" + (f"x{l}" if l != 1 else "") if shapes > 1 else ""
    on = f" on {launch['arch']} ({launch['sm_count']} SMs)" if arches > 1 else ""
    if not launch["built"]:
        return f"{name}{at}{on}: not built for {launch['arch']}: {launch['why']}"
    lines = [f"{name}{at}{on}: {launch['config']} ({launch['source']}): {launch['why']}"]
    if launch["tie"]:
        lines.append(f"  tie: {tie_summary(launch['tie']['configs'], launch['tie']['score'])}")
    if launch["candidates"]:
        shown, total = len(launch["candidates"]), launch["candidates_total"]
        lines.append(f"  best {shown} of {total} candidates:" if shown < total else f"  all {total} candidates:")
        lines += [f"    {c['detail']}" for c in launch["candidates"]]
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace) -> int:
    shapes = list(dict.fromkeys(problem_shape(shape, "--shape") for shape in args.shape))
    arches = _arches(args)

    def launches(recipe: Recipe) -> list[dict[str, Any]]:
        return [_launch(args, recipe, shape, arch) for shape in shapes for arch in arches]

    def text(recipe: Recipe, found: list[dict[str, Any]]) -> str:
        return "\n".join(_launch_text(recipe.name, launch, len(shapes), len(arches)) for launch in found)

    explained = []
    for recipe in _recipes(args).values():
        entry: dict[str, Any] = {"name": recipe.name, "launches": launches(recipe), "backward": None}
        explained.append(entry)
        if not args.json:
            print(text(recipe, entry["launches"]))
        if not args.backward:
            continue
        try:
            backward = recipe.backward()
        except RecipeError as e:
            entry["backward"] = {"error": str(e)}
            if not args.json:
                print(f"  no backward: {e}")
            continue
        derived = [r for r in (backward.forward, backward.kernel) if r is not recipe]
        entry["backward"] = {"description": backward.describe(),
                             "recipes": [{"name": r.name, "launches": launches(r)} for r in derived]}
        if not args.json:
            print(textwrap.indent(backward.describe(), "  "))
            for r, found in zip(derived, entry["backward"]["recipes"], strict=True):
                print(textwrap.indent(text(r, found["launches"]), "  "))
    if args.json:
        print(json.dumps({"format": EXPLAIN_FORMAT, "recipes": explained}, indent=2))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    recipes = _recipes(args).values()
    cache = _cache(args)
    skipped: list[tuple[str, Arch]] = []
    pairs = [pair for arch in _arches(args) for pair in _pairs(args, recipes, arch, skipped)]
    reports = [k.report for k in build(pairs, cache, args.jobs, quiet=args.json, allow_compile=True)]
    _print_reports(args, reports, cache, skipped)
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


def _at_least(minimum: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum` (`what` names such a number in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not {what} (>= {minimum})")
        return value

    return parse


_positive = _at_least(1, "a positive integer")
_count = _at_least(0, "a count")


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
    """The environment variables, for `gemmgen --help` only (each command's help points there): a
    column of names as wide as the longest, then what each does and its default, wrapped to the
    terminal as argparse wraps the rest."""
    width = max(len(v.name) for v in env.VARIABLES) + 2
    columns = max(width + 40, shutil.get_terminal_size().columns - 2)
    lines = ["environment variables (docs/deployment.md):"]
    for v in env.VARIABLES:
        default = v.default[1:-1] if v.default.startswith("(") and v.default.endswith(")") else v.default
        lines += textwrap.wrap(f"{v.meaning} (default: {default})", columns, initial_indent="  " + v.name.ljust(width),
                               subsequent_indent=" " * (width + 2), break_on_hyphens=False)
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemmgen", description=__doc__, epilog=_environment_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"gemmgen {__version__} ({', '.join(a.value for a in Arch)})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_advise(sub)
    _add_profile(sub)
    for name, fn, help_ in (("build", cmd_build, "compile every recipe of a file in parallel and print the report"),
                            ("inspect", cmd_inspect, "print the kernel report (compiles what is not cached)"),
                            ("generate", cmd_generate, "write the generated CUTLASS sources"),
                            ("explain", cmd_explain, "which config a call of a shape launches, and why"),
                            ("tune", cmd_tune, "time candidate configs per shape bucket on this GPU, save winners")):
        sp = sub.add_parser(name, help=help_, description=help_,
                            epilog="environment variables: `gemmgen --help` lists them")
        sp.add_argument("recipes", help="a Python file declaring module-level gemmgen.Recipe objects")
        sp.add_argument("--recipe", default=None, help="only this recipe of the file (by name)")
        sp.set_defaults(fn=fn)
        if name != "tune":
            _add_arch(sp)
        if name in ("build", "inspect", "generate"):
            sp.add_argument("--epilogue", choices=[e.value for e in EpilogueCollective], default=None,
                            help="the epilogue collective (default: each config's own, tma unless a recipe says "
                            "otherwise); direct compiles in less than half the time (sm_90a, elementwise "
                            "epilogues and amax; others keep tma)")
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
            sp.add_argument("--shape", type=_positive, nargs="+", action="append", required=True, metavar="M N K [L]",
                            help="the problem: M N K, and L (a batched recipe's batch, a grouped one's groups); "
                            "repeat it to explain several problems")
            sp.add_argument("--sm-count", type=_positive, default=None,
                            help="SMs of the target GPU, for the heuristic's wave count (default: the arch's "
                            "reference GPU, 132 for sm_90a (H100/H200 SXM), 148 for sm_100a (B200))")
            sp.add_argument("--top", type=_count, default=DEFAULT_TOP, metavar="N",
                            help=f"list the heuristic's best N candidates, best first (default {DEFAULT_TOP}; "
                            "0: none)")
            sp.add_argument("--json", action="store_true",
                            help=f"print one JSON object, format {EXPLAIN_FORMAT} (docs/config-selection.md): "
                            "{\"format\", \"recipes\": [{\"name\", \"launches\", \"backward\"}, ...]}")
            sp.add_argument("--backward", action="store_true",
                            help="also derive each recipe's backward (Recipe.backward): what its kernel computes, "
                            "and which configs it and the forward that saves for it launch (the backward GEMM at "
                            "the same M N K)")
            continue
        sp.add_argument("-j", "--jobs", type=_positive, default=None,
                        help="compile workers (default: fit cores and memory)")
        sp.add_argument("--json", action="store_true",
                        help="print the report as one JSON array, an object per kernel (the summary line goes "
                        "to stderr)")
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


def _add_advise(sub: Any) -> None:
    help_ = "a model's training step as GEMMs: each one's kernel, tiles, waves and modelled time, advice and cliffs"
    sp = sub.add_parser("advise", help=help_, description=help_ + " (docs/advise.md)",
                        epilog="environment variables: `gemmgen --help` lists them")
    sp.add_argument("config", help="a Hugging Face config.json (examples/models/ has four)")
    sp.add_argument("--tokens", type=_positive, required=True, help="tokens per step and rank: micro-batch x sequence")
    sp.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree (default 1)")
    sp.add_argument("--cp", type=_positive, default=1, help="context-parallel degree: divides the sequence (default 1)")
    sp.add_argument("--ep", type=_positive, default=1, help="expert-parallel degree (default 1)")
    sp.add_argument("--sp", action="store_true", help="sequence parallelism (communication only: same GEMMs)")
    sp.add_argument("--precision", default="bf16", help="bf16 (default), fp8-blockwise, fp8-tensorwise, mxfp8")
    sp.add_argument("--gpu", default="h100", help="h100 (default), h200 or b200")
    sp.add_argument("--json", action="store_true", help="print one JSON object (docs/advise.md has the schema)")
    sp.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the waves and the roofline")
    sp.add_argument("--no-scan", action="store_true", help="leave out the FFN and hidden size scans and the plans")
    sp.set_defaults(fn=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    from . import advise  # torch and the layers: loaded by this command alone, not by `gemmgen --help`

    gpu = advise.gpu(args.gpu)
    spec = advise.load_config(args.config)
    plan = advise.ParallelPlan(tp=args.tp, cp=args.cp, ep=args.ep, sp=args.sp)
    found = advise.advise(spec, args.tokens, gpu, plan, advise.precision(args.precision, gpu), args.precision,
                          scan=not args.no_scan)
    print(json.dumps(advise.to_json(found), indent=2) if args.json else advise.table(found))
    if args.plot:
        print(f"gemmgen: wrote {advise.plot(found, args.plot)}", file=sys.stderr)
    return 0


def _add_profile(sub: Any) -> None:
    help_ = "measure gemmgen's launches in a script with Nsight Compute, beside advise's model of each"
    sp = sub.add_parser("profile", help=help_, description=help_ + " (docs/advise.md)",
                        epilog="environment variables: `gemmgen --help` lists them")
    sp.add_argument("--recipe", default=None, help="only this recipe's kernels (default: every gemmgen kernel)")
    sp.add_argument("--launch-skip", type=int, default=0, help="launches of those kernels to pass over (default 0)")
    sp.add_argument("--launch-count", type=_positive, default=1, help="launches to profile (default 1)")
    sp.add_argument("--clock-control", default="base", choices=("base", "none"),
                    help="base (default): locked base clocks, repeatable; none: the GPU's own boost")
    sp.add_argument("--gpu", default=None, help="h100, h200 or b200 (default: this machine's GPU)")
    sp.add_argument("--ncu", default=None, metavar="PATH", help="Nsight Compute's ncu (default: on PATH)")
    sp.add_argument("--out", default="gemmgen-profile", metavar="DIR",
                    help="where the report, the launch log and profile.json go (default ./gemmgen-profile)")
    sp.add_argument("--json", action="store_true", help="print the JSON (also written to DIR/profile.json)")
    sp.add_argument("command", nargs=argparse.REMAINDER, help="-- then the script, e.g. -- python train.py")
    sp.set_defaults(fn=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from .advise import profile  # torch: loaded by this command alone

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    out = Path(args.out)
    result = profile.profile(command, out, gpu=args.gpu or profile.detect_gpu(), recipe=args.recipe,
                             skip=args.launch_skip, count=args.launch_count, clock_control=args.clock_control,
                             ncu=args.ncu)
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else profile.table(result))
    print(f"gemmgen: wrote {out / 'profile.json'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        status = _run(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled, not at the interpreter's exit
        return status
    except BrokenPipeError:
        # the reader went away (`gemmgen explain ... | head`): stop quietly, with the status of a tool
        # SIGPIPE ended, and point stdout at /dev/null so that the exit's flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file descriptor (captured)
            pass
        return 141


def _run(args: argparse.Namespace) -> int:
    """The command; a gemmgen error is one line on stderr, its fix as this command takes it."""
    try:
        return args.fn(args)
    except GemmgenError as e:
        print(f"gemmgen: error: {_as_typed(str(e), args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gemmgen: interrupted (what was compiled is cached)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

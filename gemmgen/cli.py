"""`gemmgen build | inspect | generate RECIPES.py`: compile, report and emit sources from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .build import build_kernel, report_table, reports_json
from .compile.cache import KernelCache
from .errors import GemmgenError


def _cache(args: argparse.Namespace) -> KernelCache:
    return KernelCache(args.cache_dir) if args.cache_dir else KernelCache()


def cmd_build(args: argparse.Namespace) -> int:
    from .parallel import build_file
    from .recipes_file import load_recipes

    reports = build_file(args.recipes, _cache(args), jobs=args.jobs)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        cache = _cache(args)
        manifest = []
        for attr, recipe in load_recipes(args.recipes).items():
            k = build_kernel(recipe, recipe.default_config(), cache)
            (out / f"{recipe.name}.cu").write_text(k.source)
            (out / f"{recipe.name}.cubin").write_bytes(k.cubin)
            manifest.append({"recipe": recipe.name, "attr": attr, "recipe_key": recipe.key, "entry": k.entry,
                             "config": k.config.name, "cache_key": k.cache_key, "cubin": f"{recipe.name}.cubin"})
        (out / "manifest.json").write_text(json.dumps({"arch": cache.arch, "kernels": manifest}, indent=2) + "\n")
    print(reports_json(reports) if args.json else report_table(reports))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .parallel import build_file

    reports = build_file(args.recipes, _cache(args), jobs=args.jobs, quiet=args.json)
    print(reports_json(reports) if args.json else report_table(reports))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .recipes_file import load_recipes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for recipe in load_recipes(args.recipes).values():
        path = out / f"{recipe.name}.cu"
        path.write_text(recipe.source())
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gemmgen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("build", cmd_build, "compile every recipe of a file in parallel and print the report"),
                            ("inspect", cmd_inspect, "print the kernel report (compiles what is not cached)"),
                            ("generate", cmd_generate, "write the generated CUTLASS sources")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("recipes", help="a Python file declaring module-level gemmgen.Recipe objects")
        sp.set_defaults(fn=fn)
        if name == "generate":
            sp.add_argument("--out", required=True, help="folder for the .cu files")
            continue
        sp.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: fit cores and memory)")
        sp.add_argument("--json", action="store_true", help="print one JSON object per kernel")
        sp.add_argument("--cache-dir", default=None,
                        help="cache root (default: $GEMMGEN_CACHE_DIR or ~/.cache/gemmgen)")
        if name == "build":
            sp.add_argument("--out", default=None, help="also write sources, cubins and manifest.json here")
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except GemmgenError as e:
        print(f"gemmgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Building ahead of time: warm-up at model load, a recipes file, a bundle of the kernels a program names.

Each takes recipes, or (recipe, config) pairs such as `gemmgen.nn.model_launches` lists, and
compiles what no bundle, cache or remote tier holds in worker processes (`compile.build_many`);
a warm-up in a torch.distributed job splits those compiles across ranks (`distributed`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import env
from ..codegen.quantize import AmaxSpec, CastTransposeSpec, QuantizeSpec, render_cast_transpose
from ..compile import CompiledKernel, KernelCache, KernelReport, build_many, default_cache, report_table
from ..compile.background import BACKGROUND
from ..compile.parallel import with_origin
from ..compile.quantize import CompiledQuantizeKernel, build_quantize_kernel
from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..dsl import Recipe
from ..errors import InvalidArgument
from ..runtime.driver import current_arch
from ..tuning import TuningTable, launches_for_shapes
from .bundle import write_bundle
from .distributed import process_group, share_kernels
from .recipes_file import load_recipes

Items = Iterable[Recipe | tuple[Recipe, KernelConfig]]


def pairs_of(items: Items, arch: Arch = DEFAULT_ARCH) -> list[tuple[Recipe, KernelConfig]]:
    """(recipe, config) pairs: a recipe alone stands for its default config on `arch`."""
    out = []
    for item in items:
        recipe, config = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
        if not isinstance(recipe, Recipe):
            raise InvalidArgument(f"items: expected gemmgen.Recipe objects or (Recipe, KernelConfig) pairs, "
                                  f"got {item!r}")
        out.append((recipe, config or recipe.default_config(arch)))
    return out


def build(pairs: Iterable[tuple[Recipe, KernelConfig]], cache: KernelCache | None = None, jobs: int | None = None,
          quiet: bool = False, allow_compile: bool | None = None) -> list[CompiledKernel]:
    """`compile.build_many` for DSL recipes (`allow_compile=None`: as GEMMGEN_JIT says)."""
    return build_many([(r.ir, c) for r, c in pairs], cache, jobs, quiet, allow_compile)


def build_file(recipes_path: str | Path, cache: KernelCache, jobs: int | None = None,
               quiet: bool = False) -> list[KernelReport]:
    """Build every recipe of a file in parallel; return reports in the file's order."""
    return [k.report for k in build(pairs_of(load_recipes(recipes_path).values()), cache, jobs, quiet,
                                    allow_compile=True)]


def warmup(items: Items, shapes: dict | None = None, jobs: int | None = None, cache: KernelCache | None = None,
           quiet: bool = False, group: Any = None, distributed: bool | None = None,
           arch: Arch | str | None = None, quantize: Iterable[QuantizeSpec] = ()) -> list[CompiledKernel]:
    """Make every kernel loadable before the first call (at model load): compile what no bundle,
    cache or remote tier holds, in parallel, and print a table of what was compiled and what was
    found. Under GEMMGEN_JIT=0 it compiles nothing: a kernel missing from all of them raises
    KernelNotAvailable naming every missing kernel and the command that builds them.

    `shapes` ({recipe name: [[M, N, K], ...]}) builds, per recipe, the config each of those problems
    launches (`tuning.choose_launch`, ahead of time) instead of each recipe's default config.

    In a torch.distributed job (`group`, else the default group once initialised) every rank must
    call it: the kernels no rank has are compiled once in the job, split across ranks, and sent to
    the ranks that lack them (`aot.distributed`). `distributed=False` (or GEMMGEN_DISTRIBUTED=0)
    warms up each process alone.

    The kernels are `arch`'s: by default the current CUDA device's (`Arch.of_device`), sm_90a
    without one. A recipe's own config serves its arch only; on another, gemmgen's default does.

    Under GEMMGEN_JIT=async a warm-up in one process returns at once: the kernels found are loaded
    and returned, the others compile in background workers while calls run their recipes unfused
    (`unfused_report` says for how long). A distributed warm-up compiles as under GEMMGEN_JIT=1.

    `quantize` (`gemmgen.nn.model_quantize_specs(model)`) are the quantize kernels a low-precision
    training step launches beside its GEMMs, loaded or compiled here too (seconds each; in this
    process alone; under GEMMGEN_JIT=async at their first use), for `arch` whatever arch each spec
    names."""
    items = list(items)
    target = Arch.parse(arch) if arch is not None else current_arch()
    if env.jit_mode() is not env.JitMode.ASYNC:  # else each compiles in the background at its first use
        quantize_kernels(quantize, target, cache, allow_compile=env.jit_enabled())
    if shapes is not None:
        if not isinstance(shapes, dict):
            raise InvalidArgument(f"shapes: expected {{recipe name: [[M, N, K], ...]}}, got {type(shapes).__name__}")
        recipes = {r.name: r for r in items if isinstance(r, Recipe)}
        chosen = launches_for_shapes(recipes, shapes, arch=target)
        pairs = list(dict.fromkeys((recipes[n], launch.config) for n, rows in chosen.items() for _, launch in rows))
    else:
        pairs = pairs_of(items, target)
    cache = cache or default_cache()
    pg = process_group(group, distributed)
    if pg is None and env.jit_mode() is env.JitMode.ASYNC:
        return _warmup_in_background(pairs, cache, quiet)
    if pg is None:
        kernels = build(pairs, cache, jobs, quiet)
        if not quiet:
            print(report_table([k.report for k in kernels]), file=sys.stderr, flush=True)
        return kernels
    share = share_kernels([(r.ir, c) for r, c in pairs], pg, cache, jobs, quiet)
    kernels = [with_origin(k, share.origin(k.cache_key, k.origin)) for k in build(pairs, cache, jobs, quiet)]
    if not quiet and share.rank == 0:
        print(report_table([k.report for k in kernels]), file=sys.stderr)
        print(share.summary(), file=sys.stderr, flush=True)
    return kernels


def quantize_kernels(specs: Iterable[QuantizeSpec], arch: Arch, cache: KernelCache | None,
                     allow_compile: bool | None) -> list[CompiledQuantizeKernel]:
    """Each quantize kernel of `specs`, for `arch`, from a bundle or the cache, else compiled where
    `allow_compile` (None: as GEMMGEN_JIT says; KernelNotAvailable otherwise)."""
    out = []
    for spec in dict.fromkeys(specs):
        if not isinstance(spec, CastTransposeSpec | AmaxSpec):
            raise InvalidArgument(f"quantize: expected quantize kernel specs (gemmgen.nn.model_quantize_specs), "
                                  f"got {spec!r}")
        kernel = render_cast_transpose(dataclasses.replace(spec, arch=arch))
        out.append(build_quantize_kernel(kernel, cache, allow_compile))
    return out


def _warmup_in_background(pairs: list[tuple[Recipe, KernelConfig]], cache: KernelCache, quiet: bool
                          ) -> list[CompiledKernel]:
    """GEMMGEN_JIT=async: what a bundle, the cache or the remote tier holds, loaded; the rest
    requested from the background builds (each once: a call of the op later finds it pending)."""
    found = [(r, c) for r, c in pairs if BACKGROUND.request(r.ir, c, cache, r.name) is None]
    kernels = build(found, cache, quiet=True)
    if not quiet:
        pending = len(dict.fromkeys(pairs)) - len(dict.fromkeys(found))
        print(f"gemmgen: {len(kernels)} kernel(s) loaded, {pending} compiling in the background (GEMMGEN_JIT="
              "async): calls run their recipes unfused until each is ready; gemmgen.unfused_report() says how long",
              file=sys.stderr, flush=True)
    return kernels


def unfused_report() -> str:
    """Under GEMMGEN_JIT=async: each kernel compiled in the background by this process, its state
    (compiling, ready, failed), how long calls ran its recipe unfused (from the request until it
    was ready, or until now) and how many calls did."""
    builds = BACKGROUND.builds()
    rows = [["recipe", "config", "state", "unfused s", "unfused calls"]]
    rows += [[b.name, b.config.name, b.state, f"{b.unfused_seconds:.1f}", str(b.unfused_calls)] for b in builds]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) if builds else "gemmgen: no kernel was compiled in the background by this process"


def with_tuned_winners(pairs: list[tuple[Recipe, KernelConfig]], tuning: TuningTable | None,
                       recipes: Iterable[Recipe] | None = None) -> list[tuple[Recipe, KernelConfig]]:
    """`pairs` plus the binary of every config `tuning` records as a winner (on any device) for one
    of `recipes` (default: the pairs' recipes), each once: what a bundle shipping those results
    must hold."""
    if tuning is None:
        return pairs
    recipes = list(dict.fromkeys(recipes if recipes is not None else (r for r, _ in pairs)))
    return list(dict.fromkeys([*pairs, *((r, c.binary()) for r in recipes for c in tuning.configs(r.key))]))


def build_bundle(items: Items, out: str | Path, tuning: str | Path | TuningTable | None = None,
                 jobs: int | None = None, cache: KernelCache | None = None, quiet: bool = False,
                 arches: Iterable[Arch | str] = (DEFAULT_ARCH,), quantize: Iterable[QuantizeSpec] = ()
                 ) -> list[CompiledKernel]:
    """Build `items` (recipes, or (recipe, config) pairs) and write them to `out` as a bundle: the
    ahead-of-time path for a model's kernels, as `gemmgen build --out` is for a recipes file, e.g.
    `gemmgen.build_bundle(gemmgen.nn.model_launches(model, (1, 16, 4096)), "dist/gemmgen")`.
    `tuning` (autotune results: a file or a table) ships in the bundle, with every winner it
    records for the items' recipes built in. It compiles even under GEMMGEN_JIT=0, which governs
    run time, not the build step. `arches` are the architectures it holds kernels for (one bundle
    serves H100s and B200s with `arches=("sm_90a", "sm_100a")`): a recipe alone stands for its
    default config on each, a (recipe, config) pair for that config only. `quantize`
    (`gemmgen.nn.model_quantize_specs(model)`) adds the quantize kernels a low-precision training
    step launches, built for each of `arches`."""
    table = TuningTable.load(tuning) if isinstance(tuning, str | Path) else tuning
    cache = cache or default_cache()
    items, targets = list(items), list(dict.fromkeys(Arch.parse(a, "arches") for a in arches))
    pairs = list(dict.fromkeys(p for a in targets for p in pairs_of(items, a)))
    kernels = build(with_tuned_winners(pairs, table), cache, jobs, quiet, allow_compile=True)
    specs = list(quantize)
    casts = [k for a in targets for k in quantize_kernels(specs, a, cache, allow_compile=True)]
    where = write_bundle(kernels, out, cache, tuning=table, quantize_kernels=casts)
    if not quiet:
        print(report_table([k.report for k in kernels]), file=sys.stderr)
        print(f"gemmgen: wrote a bundle of {len({k.cache_key for k in kernels})} kernel(s) to {where}; use it with "
              f"GEMMGEN_BUNDLE_PATH={where} or gemmgen.add_bundle()", file=sys.stderr, flush=True)
    return kernels

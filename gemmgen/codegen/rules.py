"""Constraints that hold on every architecture, and how a config is checked against its own.

Each rule is a function of (config, kernel-side recipe) returning what the config breaks, in
words that name the fix; each architecture's `constraints` module lists its rules (`CONSTRAINTS`)
and may include these. `violations` applies an architecture's list to the kernel's view of the
recipe (`config.kernel_recipe`: transposed under swap_ab).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config import KernelConfig, Schedule, kernel_recipe
from ..errors import ConfigError
from ..ir import RecipeIR

Rule = Callable[[KernelConfig, RecipeIR], list[str]]


def arch_schedule_violations(cfg: KernelConfig) -> list[str]:
    """A schedule belongs to one architecture's kernels (`Schedule.arch`)."""
    own = " or ".join(f"Schedule.{s.name}" for s in Schedule if s.arch is cfg.arch)
    return [f"schedule {cfg.schedule.value}: an {cfg.schedule.arch.value} schedule, and the config targets "
            f"{cfg.arch.value}; use {own}"]


def reduction_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Vector reductions are built over the kernel's N only (CUTLASS's Sm90ColReduction, which the
    sm100 epilogue reuses): its Sm90RowReduction, over the kernel's M, spilled its state to local
    memory in most configs compiled with it, where the column form never did (docs/measurements.md,
    "Reductions over M"). A reduction over the recipe's M (dim=0) is therefore computed by a
    swapped kernel, in which it is a reduction over the kernel's N."""
    over_m = [o.name for o in recipe.epilogue.outputs if o.dim == 0]
    if over_m:
        dim, swap = (1, "False") if cfg.swap_ab else (0, "True")
        return [f"aux output {over_m[0]!r}: its reduction (dim={dim}) is over the kernel's M, and gemmgen builds "
                f"reductions over the kernel's N only (CUTLASS's reduction over M spills to local memory); "
                f"use swap_ab={swap}"]
    return []


def violations(rules: Sequence[Rule], cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Every rule `cfg` breaks for the recipe as declared."""
    view = kernel_recipe(cfg, recipe)
    return [v for rule in rules for v in rule(cfg, view)]


def raise_violations(problems: list[str], cfg: KernelConfig, recipe: RecipeIR) -> None:
    """One ConfigError listing every broken rule, before anything is rendered or compiled."""
    if problems:
        raise ConfigError(f"config {cfg.name} is invalid for recipe {recipe.name!r}:\n  - " + "\n  - ".join(problems))

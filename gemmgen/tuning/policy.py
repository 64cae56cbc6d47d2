"""Which config a call launches: one policy, for every path that needs the answer.

The torch op (dense and grouped), the modules' `launches`, `gemmgen.nn.model_launches`, warm-up
by shapes, bundles' shape maps and `gemmgen explain` all ask `choose_launch`, which decides, for
a recipe and a problem (M, N, K, L; a grouped recipe's M is the rows of A and L its groups):

1. an autotune result registered for the device and the problem's bucket (`table.tuned_config`);
   autotune times the recipe's own config among its candidates, so a result is never slower than
   the config the recipe declares;
2. else the recipe's own `config=`, at every shape: the user said which kernel they want (on the
   architecture it names; on another, step 3);
3. else the heuristic's choice for the problem (`heuristic.choose`).

The architecture is the device's (`Arch.of_device`), or the one a build names.

Without a device (ahead of time, on a machine without the GPU) step 1 is skipped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..dsl import Recipe
from ..errors import GemmgenError, did_you_mean
from .heuristic import choose
from .shapes import problem_shape
from .table import Device, problem_bucket, tuned_config


class Source(enum.Enum):
    """Where a launch's config came from, in the policy's order."""

    TUNED = "tuned"
    RECIPE = "recipe"
    HEURISTIC = "heuristic"


@dataclass(frozen=True)
class Launch:
    """What `choose_launch` answers: the config a call launches, which step of the launch policy chose
    it (`source`: an autotune result, the recipe's `config=`, or the heuristic), the problem's tuning
    bucket, and why, in one line."""

    config: KernelConfig
    source: Source
    bucket: tuple[int, int, int, int]  # the tuning bucket of the problem (`table.problem_bucket`)
    why: str


def choose_launch(recipe: Recipe, m: int, n: int, k: int, l: int = 1, *,  # noqa: E741
                  device: Device | None = None, sm_count: int | None = None, arch: Arch = DEFAULT_ARCH) -> Launch:
    """The config a call of this problem launches on `arch`, and why (see the module docstring);
    `sm_count` defaults to the arch's reference GPU's."""
    bucket = problem_bucket(recipe.ir, m, n, k, l)
    tuned = tuned_config(recipe.ir, device, m, n, k, l) if device is not None else None
    if tuned is not None and tuned.arch is arch:
        assert device is not None
        return Launch(tuned, Source.TUNED, bucket, f"tuned on {device.name} (driver {device.driver}) for bucket "
                                                   f"{'x'.join(map(str, bucket))}: {tuned.name}")
    if recipe.config is not None and recipe.config.arch is arch:
        return Launch(recipe.config, Source.RECIPE, bucket,
                      f"the recipe declares config={recipe.config.name}: used at every shape no autotune result "
                      "covers")
    choice = choose(recipe.ir, m, n, k, l, sm_count, arch)
    return Launch(choice.config, Source.HEURISTIC, bucket, choice.why)


def config_for(recipe: Recipe, m: int, n: int, k: int, l: int = 1, *,  # noqa: E741
               device: Device | None = None, sm_count: int | None = None, arch: Arch = DEFAULT_ARCH
               ) -> KernelConfig:
    """`choose_launch(...).config`."""
    return choose_launch(recipe, m, n, k, l, device=device, sm_count=sm_count, arch=arch).config


def launches_for_shapes(recipes: dict[str, Recipe], shapes: dict, sm_count: int | None = None,
                        arch: Arch = DEFAULT_ARCH) -> dict[str, list[tuple[tuple[int, ...], Launch]]]:
    """{recipe name: [(shape, launch), ...]} for a shapes file's {name: [[M, N, K] or [M, N, K, L], ...]}
    (keys starting with '_' are comments), ahead of time on `arch`: no device."""
    by_name = {r.name: r for r in recipes.values()}
    out: dict[str, list[tuple[tuple[int, ...], Launch]]] = {}
    for name, problems in shapes.items():
        if name.startswith("_"):
            continue
        if name not in by_name:
            raise GemmgenError(f"shapes: no recipe named {name!r}{did_you_mean(name, by_name)}; recipes are "
                               f"{sorted(by_name)}")
        out[name] = [(tuple(p), choose_launch(by_name[name], *problem_shape(p, f"shapes[{name!r}]"),
                                              sm_count=sm_count, arch=arch)) for p in problems]
    return out

"""Default configs pass their own rules (issue 59 item 6): for random recipes and their derived
backward kernels, the grouped layers' recipes and derived kernels (gated ones included), and every
example and coverage recipe, on both arches, the recipe's default config and the config the
heuristic chooses for few and many tokens are valid, so that no call is refused for a config
gemmgen picked itself. A random draw's seed is printed with any failure."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen import violations
from gemmgen.integrations.grouped import GroupedOp
from gemmgen.testing.random_recipes import random_recipes
from gemmgen.tuning.heuristic import candidate_configs, choose, m_bucket

ARCHES = (gg.Arch.SM90A, gg.Arch.SM100A)
TOKENS = (1, 8, 200, 4096)


def _random_recipes(seed: int, count: int) -> list[gg.Recipe]:
    """`count` random recipes (tests/codegen's generator) and each one's derived backward where it has one."""
    recipes = random_recipes(random.Random(seed), count)
    derived = []
    for r in recipes:
        try:
            backward = r.backward()
        except (gg.RecipeError, gg.InvalidArgument):  # not differentiable (fp8 A or B, a reduction's grad ...)
            continue
        derived += [backward.forward, backward.kernel]
    return recipes + derived


def _grouped_recipes() -> list[gg.Recipe]:
    """GroupedLinear's recipes and derived kernels: plain and gated activations, with and without bias."""
    out = []
    for activation in ("silu", "gelu", "swiglu", None):
        for bias in (True, False):
            recipe = gg.nn.grouped_linear_recipe(activation, bias, torch.bfloat16)
            derived = GroupedOp(recipe).derived
            out += [recipe] + ([derived.kernel] if derived is not None else [])
    return out


def _problems(recipe: gg.Recipe, arch: gg.Arch) -> list[str]:
    """What the default config and the heuristic's choices break on `arch`, where a config the
    heuristic lists (or the default), or one of them with 2 stages, can run the recipe there. Where
    none can (microscaled A and B on sm_90a, a log-sum-exp over M beside a reduction over N on
    sm_100a ...) the call is refused with a ConfigError naming the rule, which is what must happen."""
    default = recipe.default_config(arch)
    listed = {c for m in TOKENS for c in candidate_configs(recipe.ir, m_bucket(m), arch)} | {default}
    listed |= {dataclasses.replace(c, stages=2) for c in listed}  # the least shared memory each tile can take
    if not any(gg.codegen.is_valid(c, recipe.ir) for c in listed):
        with pytest.raises(gg.ConfigError):
            choose(recipe.ir, 8, 4096, 4096, arch=arch)
        return []
    out = [f"default {v}" for v in violations(default, recipe.ir)]
    for m in TOKENS:
        config = choose(recipe.ir, m, 4096, 4096, arch=arch).config
        out += [f"M = {m}: {config.name}: {v}" for v in violations(config, recipe.ir)]
    return out


def _refused_on(recipe: gg.Recipe) -> set[gg.Arch]:
    """Arches that refuse the recipe whatever the config: gg.quantize_columns has no sm_100a node."""
    return {gg.Arch.SM100A} if recipe.ir.epilogue.column_blocks is not None else set()


def test_random_recipes_and_their_backward_get_valid_configs():
    seed = int(os.environ.get("GEMMGEN_PROPERTY_SEED", random.randrange(2**32)))
    recipes = _random_recipes(seed, 48)
    bad = {(r.name, arch.value): p for r in recipes for arch in ARCHES if (p := _problems(r, arch))}
    assert not bad, f"seed {seed} (GEMMGEN_PROPERTY_SEED={seed} repeats it): {bad}"
    assert len(recipes) > 48  # some derived backward kernels among them


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.value)
def test_grouped_layers_and_their_derived_kernels_get_valid_configs(arch):
    bad = {r.name: p for r in _grouped_recipes() if (p := _problems(r, arch))}
    assert not bad, bad


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.value)
def test_every_example_and_coverage_recipe_gets_valid_configs(sm100_examples, extra, arch):
    recipes = [r for r in [*sm100_examples.values(), *extra.values()] if arch not in _refused_on(r)]
    bad = {r.name: p for r in recipes if (p := _problems(r, arch))}
    assert not bad, bad


def test_a_default_whose_epilogue_crowds_out_the_main_loop_is_narrowed():
    """Seed 1023's random44 (two fp32 matrices read, two aux outputs): the 128 x 128 x 64 default
    leaves its main loop one stage; gemmgen's default is then the same tile at half its N, valid,
    and the launch policy's grouped and fallback paths take the same (codegen.fitting_default)."""
    recipe = next(r for r in _random_recipes(1023, 48) if r.name == "random44")
    plain = gg.config.default_config(recipe.ir)
    assert any("leaves room for 1 mainloop stage" in v for v in gg.codegen.violations(plain, recipe.ir))
    chosen = recipe.default_config()
    assert chosen.tile == (128, 64, 64) and gg.codegen.is_valid(chosen, recipe.ir)
    assert dataclasses.replace(chosen, tile=plain.tile) == plain  # only the tile changed

"""Declaring grouped (MoE) recipes: what the DSL refuses, with the fix."""

from __future__ import annotations

import pytest

import gemmgen as gg
from gemmgen.errors import RecipeError
from gemmgen.testing.grouped import moe_recipe


def test_grouped_recipe_mistakes():
    with pytest.raises(RecipeError, match="layout_a"):
        moe_recipe(layout_a=gg.ColMajor)
    with pytest.raises(RecipeError, match="batched"):
        moe_recipe(batched=True)
    with pytest.raises(RecipeError, match="aux output"):
        gg.Recipe("g", lambda acc: {"d": acc, "pre": acc}, grouped=True, aux={"pre": gg.bf16})
    with pytest.raises(RecipeError, match="at most one"):
        gg.Recipe("g", lambda acc, x, y: acc + x + y, grouped=True,
                  operands={"x": gg.Matrix(gg.bf16), "y": gg.Matrix(gg.bf16)})
    with pytest.raises(gg.ConfigError, match=r"tile M = 64: must be a multiple of the block scales' granularity "
                                            r"128 along the kernel's M \(swapped: the kernel's M is the recipe's N\)"):
        gg.Recipe("g", lambda acc: acc, a=gg.e4m3, b=gg.e4m3, d=gg.bf16, grouped=True,
                  block_scale=gg.DEEPSEEK_BLOCK_SCALE,
                  config=gg.KernelConfig(tile=(64, 32, 128), schedule=gg.Schedule.PINGPONG, swap_ab=True))

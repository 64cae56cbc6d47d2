"""Every recipe the sm100 emitter accepts, emulated through its sm_100a kernel on the CPU (no NVRTC):
the epilogue its source declares, its Params fields and the tensor maps the runtime builds for it,
under one SM's MMA, a pair of SMs' (a CTA's half tile) and a swapped kernel. The sm90 kernels of the
same recipes: tests/codegen/test_epilogue_source.py; sm100's arguments against CUTLASS's host code:
test_sm100_oracle.py."""

from __future__ import annotations

import dataclasses

import pytest

import gemmgen as gg
from gemmgen.testing.calls import dense, emulated_shapes
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled

SM100 = gg.Arch.SM100A
PAIR = gg.KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM, arch=SM100)


def _configs(recipe: gg.Recipe) -> list[gg.KernelConfig]:
    """The recipe's sm100 default, the pair's tile (K as deep as the default's where only that one
    is taken: NVFP4) and each swapped (where the emitter takes them)."""
    default = recipe.default_config(SM100)
    pair = PAIR if gg.codegen.is_valid(PAIR, recipe.ir) else \
        dataclasses.replace(PAIR, tile=(*PAIR.tile[:2], default.tile[2]))
    out = [default, pair, dataclasses.replace(default, swap_ab=not default.swap_ab),
           dataclasses.replace(pair, swap_ab=not default.swap_ab)]
    return [c for c in dict.fromkeys(out) if gg.codegen.is_valid(c, recipe.ir)]


def test_every_recipe_sm100_accepts_computes_it_under_each_schedule(sm100_examples, extra):
    """Every example and coverage recipe but those writing a column-quantized copy
    (gg.quantize_columns: sm_90a only, refused on sm_100a by name: tests/runtime/test_column_blocks.py)."""
    recipes = {name: r for name, r in {**dense(sm100_examples), **extra}.items() if r.ir.epilogue.column_blocks is None}
    assert {n for n in extra if n not in recipes} == {"fc1_fp8block_fprop_train_q", "fc1_fp8block_fprop_bwd_q"}
    assert not [name for name, r in recipes.items() if not _configs(r)]
    count = 0
    for name, recipe in recipes.items():
        for config in _configs(recipe):
            ck = uncompiled(recipe, config)
            for shape in emulated_shapes(recipe):
                assert_computes(ck, shape, f"{name} {config.name}")
            count += 1
    assert count >= 40, count


def test_an_mxfp8_training_step_computes_its_recipes():
    """An MXFP8 FusedMLP step's kernels (issue 57: fc1's forward saving its accumulator, fc2's fprop
    and dgrad carrying fc1's derived epilogue, fc1's dgrad, the weight gradients; a SwiGLU MLP's
    forward and dgrad over column pairs, and its fc2 without a bias) under the configs nn launches,
    over the emulation shapes: every output as the reference has it."""
    from tests.data.sm100 import mxfp8_training_kernels

    kernels = mxfp8_training_kernels()
    assert len(kernels) == 9, list(kernels)
    for name, (recipe, config) in kernels.items():
        ck = uncompiled(recipe, config)
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, f"{name} {config.name}")


def _scaled_swiglu(acc, alpha):
    gate, up = gg.pairs(acc * alpha)
    return gg.silu(gate) * up


def test_an_nvfp4_kernel_over_column_pairs_computes_its_recipe():
    """The fp4 MMA's accumulator through silu(gate) * up over its column pairs (an NVFP4 gated
    MLP's fc1; MXFP8's are in the training step above), one SM and a pair of SMs."""
    recipe = gg.Recipe("nvfp4_swiglu", _scaled_swiglu, a=gg.e2m1, b=gg.e2m1, d=gg.bf16, block_scale=gg.NVFP4,
                       operands={"alpha": gg.Scalar()})
    one = recipe.default_config(gg.Arch.SM100A)
    pair = dataclasses.replace(one, tile=(256, 128, one.tile[2]), cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM)
    for config in (one, pair):
        ck = uncompiled(recipe, config)
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, f"nvfp4_swiglu {config.name}")


@pytest.mark.parametrize("mistake", ["per-batch bias read as shared", "shared matrix read per batch",
                                     "column-major D read row-major"])
def test_a_wrong_stride_in_an_sm100_kernel_fails_the_check(mistake):
    """The check is sensitive to sm100's batch strides and D's layout (the unchanged kernel passes)."""
    recipe = gg.Recipe("t", lambda acc, bias, w: acc + bias + w, batched=True, layout_d=gg.ColMajor,
                       operands={"bias": gg.RowVector(gg.bf16, per_batch=True),
                                 "w": gg.Matrix(gg.f32, per_batch=False)})
    shape = (33, 70, 40, 3)
    assert_computes(uncompiled(recipe, PAIR), shape, "unchanged")
    swap = {"per-batch bias read as shared": ("cute::_0, cute::_1, int64_t>", "cute::_0, cute::_1, cute::_0>"),
            "shared matrix read per batch": ("cute::_1, int64_t, cute::_0>, void", "cute::_1, int64_t, int64_t>, void"),
            "column-major D read row-major": ("LayoutD = cutlass::layout::ColumnMajor;",
                                              "LayoutD = cutlass::layout::RowMajor;")}[mistake]
    ck = uncompiled(recipe, PAIR, source_replaced(*swap))
    with pytest.raises(AssertionError):
        assert_computes(ck, shape, mistake)

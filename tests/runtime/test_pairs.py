"""Calls of kernels over adjacent column pairs on the CPU: the checks of their arguments, and the
emulation of their data flow through the Params the runtime builds (the PairLoad / PairStore
pointers and strides, the void D) against the recipe's reference; and that the check fails when
the source or the arguments are wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gemmgen as gg
from gemmgen.runtime import arguments
from gemmgen.testing.calls import args_with_nonzero_reference, dense, given_outputs
from gemmgen.testing.checks import assert_computes, uncompiled, uncompiled_kernel


def _swiglu(acc):
    gate, up = gg.pairs(acc)
    return gg.silu(gate) * up


def _gated_rms(acc, residual, gain):
    """GEGLU plus a half-width residual, its rows' sums of squares (an RMSNorm's statistic) and
    max |h|, and an fp8 copy scaled per row; batched."""
    gate, up = gg.pairs(acc)
    h = gg.gelu_tanh(gate) * up + residual
    return {"d": h, "ss": gg.sum(h * h, dim=1), "amax": gg.amax(h), "q": gg.cast(h * gain, gg.e4m3)}


def _rotary(acc, cos, sin):
    """Each pair (x, y) rotated by an angle per row and pair: full width again."""
    x, y = gg.pairs(acc)
    return gg.interleave(x * cos - y * sin, x * sin + y * cos)


def _widen(acc, s):
    """D of 2N columns from two full-width values (a DoubleStore), and a 2N-column operand read as
    its halves (DoubleLoad)."""
    even, odd = gg.pairs(s)
    return gg.interleave(acc * even, gg.relu(acc) + odd)


RECIPES = {
    "swiglu": gg.Recipe("swiglu", _swiglu),
    "swiglu_bwd": gg.Recipe("swiglu", _swiglu).backward().kernel,
    "widen": gg.Recipe("widen", _widen, batched=True, operands={"s": gg.Matrix(gg.f32)}),
    "gated_rms": gg.Recipe("gated_rms", _gated_rms, batched=True, layout_a=gg.ColMajor,
                           operands={"residual": gg.Matrix(gg.bf16), "gain": gg.ColVector(gg.f32)},
                           aux={"ss": gg.f32, "amax": gg.f32, "q": gg.e4m3}),
    "rotary": gg.Recipe("rotary", _rotary, d=gg.f32,
                        operands={"cos": gg.Matrix(gg.f32), "sin": gg.Matrix(gg.f32)}),
}
CONFIGS = [gg.KernelConfig(tile=(128, 128, 64)), gg.KernelConfig(tile=(64, 64, 64), schedule=gg.Schedule.PINGPONG),
           gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1)),
           gg.KernelConfig(tile=(128, 256, 64), cluster=(1, 2, 1), tile_scheduler=gg.TileScheduler.STREAM_K)]
# (M, N, K, batch): M = 1, K tails, N not a multiple of any tile, the smallest pair, a batch of 3
SHAPES = [(1, 2, 8, 1), (37, 130, 72, 3), (129, 264, 200, 2), (5, 18, 24, 1), (300, 6, 129, 2)]


@pytest.mark.parametrize("name", RECIPES)
def test_emulated_calls_compute_the_recipe(name):
    recipe = RECIPES[name]
    for config in CONFIGS:
        ck = uncompiled(recipe, config)
        for shape in SHAPES:
            assert_computes(ck, shape, f"{name} {config.name}")


def test_compiled_kernels_over_pairs_compute_their_recipes(compiled):
    """The examples' and coverage recipes' kernels over pairs as NVRTC compiled them (their real
    sources and Params layouts)."""
    over_pairs = [k for k in dense(compiled).values() if k.recipe.epilogue.pairs]
    assert {k.recipe.name for k in over_pairs} >= {"pair_ops", "swiglu_bwd"}
    for kernel in over_pairs:
        for shape in SHAPES:
            assert_computes(kernel, shape, kernel.recipe.name)


def _swap(source: str, a: str, b: str) -> str:
    return source.replace(a, "\0").replace(b, a).replace("\0", b)


@pytest.mark.parametrize("mistake", ["even and odd exchanged", "interleave made a sum",
                                     "each pair summed twice", "half strides of the full width"])
def test_a_wrong_pairing_fails_the_check(mistake, monkeypatch):
    recipe = gg.Recipe("t", lambda acc, r: {"d": gg.interleave(*reversed(gg.pairs(acc))),
                                            "h": _swiglu(acc) + r, "ss": gg.sum(_swiglu(acc) * r, dim=1)},
                       operands={"r": gg.Matrix(gg.bf16)}, aux={"h": gg.bf16, "ss": gg.f32})
    config = gg.KernelConfig(tile=(128, 128, 64))
    assert_computes(uncompiled(recipe, config), (33, 70, 40, 1), "unchanged")

    def edit(change):
        return lambda g: dataclasses.replace(g, source=change(g.source))

    if mistake == "even and odd exchanged":
        ck = uncompiled(recipe, config, edit(lambda s: _swap(s, "epi::PairEven,", "epi::PairOdd,")))
    elif mistake == "interleave made a sum":
        ck = uncompiled(recipe, config, edit(lambda s: s.replace("epi::Interleave,",
                                                                 "epi::Map<gemmgen::epi::Add>::Fn,")))
    elif mistake == "each pair summed twice":
        ck = uncompiled(recipe, config, edit(lambda s: s.replace("gemmgen::epi::PairSumMask",
                                                                 "gemmgen::epi::Map<gemmgen::epi::Identity>::Fn")))
    else:
        real = arguments._half_tensor
        monkeypatch.setattr(arguments, "_half_tensor",
                            lambda prefix, t: {**real(prefix, t), f"{prefix}.stride_m": 2 * t.strides[0]})
        ck = uncompiled(recipe, config)
    with pytest.raises(AssertionError):
        assert_computes(ck, (33, 70, 40, 1), mistake)


def test_an_odd_n_is_refused_with_a_fix_that_works():
    kernel = uncompiled_kernel(RECIPES["swiglu"])
    a, b = torch.randn(8, 64).bfloat16(), torch.randn(64, 31).bfloat16().t().contiguous().t()
    with pytest.raises(gg.InvalidArgument, match=r"b: 31 columns; .* pass B with 32 or 30 columns"):
        kernel.prepare(a, b)
    fixed = torch.randn(64, 32).bfloat16().t().contiguous().t()
    prep = kernel.prepare(a, fixed)
    assert prep.outputs[0].shape == (8, 16)


def test_half_width_operands_and_outputs_are_checked_at_n_over_2():
    recipe = gg.Recipe("t", lambda acc, r: _swiglu(acc) + r, operands={"r": gg.Matrix(gg.bf16)})
    kernel = uncompiled_kernel(recipe)
    a, b = torch.randn(8, 64).bfloat16(), torch.randn(64, 48).bfloat16().t().contiguous().t()
    with pytest.raises(gg.InvalidArgument, match=r"r: expected shape \(8, 24\)"):
        kernel.prepare(a, b, r=torch.randn(8, 48).bfloat16())
    with pytest.raises(gg.InvalidArgument, match=r"out: expected shape \(8, 24\)"):
        kernel.prepare(a, b, r=torch.randn(8, 24).bfloat16(), out=torch.empty(8, 48, dtype=torch.bfloat16))
    out = torch.empty(8, 24, dtype=torch.bfloat16)
    prep = kernel.prepare(a, b, r=torch.randn(8, 24).bfloat16(), out=out)
    assert prep.outputs[0] is out


def test_given_outputs_with_padded_rows_are_written_where_they_are():
    """A caller's D of N/2 columns with rows padded: the PairStore's row stride is the tensor's."""
    recipe = RECIPES["gated_rms"]
    ck = uncompiled(recipe, recipe.default_config())
    a, b, ops, want = args_with_nonzero_reference(recipe, 20, 36, 40, (2,))
    outs = given_outputs(recipe, 20, 36, (2,))
    assert outs[0].stride(-2) > outs[0].shape[-1]  # padded: 18 bf16 per row take 24
    assert_computes(ck, (20, 36, 40, 2), "padded", (a, b, ops, want))


def test_a_wrong_2n_read_or_write_fails_the_check():
    """The saved accumulator's halves exchanged (DoubleLoad's parity), or dL/dacc's (DoubleStore's
    inputs, by exchanging the two values' nodes in the graph's op list), make the emulation fail."""
    recipe = RECIPES["swiglu_bwd"]
    config = gg.KernelConfig(tile=(128, 128, 64))
    assert_computes(uncompiled(recipe, config), (33, 70, 40, 1), "unchanged")
    even = "cute::Stride<int64_t, cute::_1, int64_t>, 0>"
    odd = "cute::Stride<int64_t, cute::_1, int64_t>, 1>"
    parity = uncompiled(recipe, config, lambda g: dataclasses.replace(g, source=_swap(g.source, even, odd)))
    with pytest.raises(AssertionError):
        assert_computes(parity, (33, 70, 40, 1), "halves exchanged")
    source = uncompiled(recipe, config).generated.source
    line = next(x for x in source.splitlines() if x.startswith("using EpilogueDag"))
    edges = line.split("cute::seq<")[-1].split(">")[0]  # the DoubleStore's two inputs, last
    a, b = edges.split(", ")
    swapped = source.replace(f"cute::seq<{a}, {b}>>, ", f"cute::seq<{b}, {a}>>, ")
    assert swapped != source
    stores = uncompiled(recipe, config, lambda g: dataclasses.replace(g, source=swapped))
    with pytest.raises(AssertionError):
        assert_computes(stores, (33, 70, 40, 1), "stores exchanged")

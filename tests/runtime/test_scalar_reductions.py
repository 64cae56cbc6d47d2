"""Reductions over M and N (one fp32 per batch): max |x|, the signed max and the signed min, on the
CPU: the emulation of each kernel's Sm90ScalarReduction (registers from the identity the runtime
writes into the Params, then the atomic combine into the output the runtime fills with it) against
the recipe's reference under plain, pingpong, stream-K and swapped kernels, on values of one sign
and of both; and that the check fails when the identity in the Params or in the output is wrong."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.ir.reference import reference
from gemmgen.runtime import arguments
from gemmgen.testing.calls import args_with_nonzero_reference
from gemmgen.testing.checks import assert_computes, uncompiled


def _extrema(acc, shift):
    y = acc + shift
    return {"d": y, "max": gg.reduce_max(y), "min": gg.reduce_min(y), "amax": gg.amax(y)}


RECIPE = gg.Recipe("extrema", _extrema, batched=True, operands={"shift": gg.Scalar(per_batch=True)},
                   aux={"max": gg.f32, "min": gg.f32, "amax": gg.f32})
CONFIGS = [gg.KernelConfig(tile=(128, 128, 64)), gg.KernelConfig(tile=(64, 64, 64), schedule=gg.Schedule.PINGPONG),
           gg.KernelConfig(tile=(128, 128, 64), cluster=(1, 2, 1), tile_scheduler=gg.TileScheduler.STREAM_K),
           gg.KernelConfig(tile=(64, 16, 64), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG, swap_ab=True)]
SHAPES = [(1, 8, 16, 3), (37, 50, 72, 2), (129, 264, 200, 3)]


def _drawn(shape, shifts):
    """Inputs whose batches are shifted far below 0, far above, and around it (one sign, the other,
    both), with their reference."""
    m, n, k, batch = shape
    a, b, ops, _ = args_with_nonzero_reference(RECIPE, m, n, k, (batch,))
    ops = {**ops, "shift": torch.tensor(shifts[:batch])}
    return a, b, ops, reference(RECIPE.ir, a, b, ops)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_max_and_min_over_m_and_n_compute_the_recipe(config):
    ck = uncompiled(RECIPE, config)
    for shape in SHAPES:
        drawn = _drawn(shape, [-1000.0, 1000.0, 0.0])
        want = drawn[3]
        assert want[1][0] < 0 and want[2][0] < 0 and want[1][1] > 0 and want[2][1] > 0  # one sign per batch
        assert_computes(ck, shape, f"extrema {config.name}", drawn)


@pytest.mark.parametrize("mistake", ["max from 0 in the Params", "min from 0 in the Params",
                                     "outputs filled with 0"])
def test_a_wrong_identity_fails_the_check(mistake, monkeypatch):
    """All-negative values (batch 0) need the max to start at -inf, all-positive ones (batch 1)
    the min at +inf: an identity of 0 in the Params or in the output makes the call wrong."""
    from gemmgen.runtime import kernel

    shape = (37, 50, 72, 2)
    drawn = _drawn(shape, [-1000.0, 1000.0])
    config = CONFIGS[0]
    assert_computes(uncompiled(RECIPE, config), shape, "unchanged", drawn)
    if mistake == "outputs filled with 0":
        real_init = kernel.Kernel.__init__

        def zero_identities(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            self._identities = tuple(0.0 for _ in self._identities)
        monkeypatch.setattr(kernel.Kernel, "__init__", zero_identities)
    else:
        name = "max" if mistake.startswith("max") else "min"
        real = arguments.ArgumentBuilder.shape_values

        def values(self, p):
            v, grid = real(self, p)
            v[f"epilogue.amax.{name}.identity"] = 0.0
            return v, grid
        monkeypatch.setattr(arguments.ArgumentBuilder, "shape_values", values)
    with pytest.raises(AssertionError):
        assert_computes(uncompiled(RECIPE, config), shape, mistake, drawn)

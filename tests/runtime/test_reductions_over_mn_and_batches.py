"""Reductions over M and N (one fp32 per batch: max |x|, the signed max and the signed min) and
over the batches (`over_batch=True`), on the CPU: the emulation of each kernel's
Sm90ScalarReduction (registers from the identity the runtime writes into the Params, then the
atomic combine into the output the runtime fills with it) and of its vector reductions with a
batch stride of 0 (CUTLASS's last tile of a row of tiles combines every batch's partials) against
the recipe's reference and independent torch, under plain, pingpong, stream-K and swapped kernels,
on values of one sign and of both; and that the check fails when an identity or a batch stride is
wrong."""

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


def _batch_sums(acc, bias):
    """A shared bias's gradient in a batched GEMM (summed over every batch's rows), each row's sum
    over N and the batches, and the max over everything."""
    y = acc + bias
    return {"d": y, "rows": gg.sum(y, dim=1, over_batch=True), "max": gg.reduce_max(y, over_batch=True)}


OVER_BATCH = {
    "rows": gg.Recipe("batch_rows", _batch_sums, batched=True, operands={"bias": gg.RowVector(gg.bf16)},
                      aux={"rows": gg.f32, "max": gg.f32}),
    "columns": gg.Recipe("batch_columns", lambda acc, bias: {"d": acc + bias, "cols": gg.sum(acc + bias, dim=0,
                                                                                              over_batch=True)},
                         batched=True, operands={"bias": gg.RowVector(gg.bf16)}, aux={"cols": gg.f32}),
}


@pytest.mark.parametrize("name", OVER_BATCH)
def test_reductions_over_the_batches_compute_the_recipe(name):
    recipe = OVER_BATCH[name]
    configs = [c for c in CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert {c.swap_ab for c in configs} == {False, True}  # sm_90a kernels reduce over their M and their N
    for config in configs:
        ck = uncompiled(recipe, config)
        for shape in SHAPES:
            assert_computes(ck, shape, f"{name} {config.name}")


def test_over_batch_outputs_drop_the_batch_as_torch_sums_it():
    a, b = torch.randn(3, 7, 32), torch.randn(3, 32, 5)
    bias = torch.randn(5)
    rows, columns = OVER_BATCH["rows"], OVER_BATCH["columns"]
    _, row_sums, largest = rows.reference(a.bfloat16(), b.bfloat16(), bias=bias.bfloat16())
    assert row_sums.shape == (7,) and largest.shape == ()
    y = a.bfloat16().float() @ b.bfloat16().float() + bias.bfloat16().float()
    torch.testing.assert_close(row_sums, y.sum(dim=(0, 2)), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(largest, y.amax(), rtol=0, atol=0)
    _, column_sums = columns.reference(a.bfloat16(), b.bfloat16(), bias=bias.bfloat16())
    assert column_sums.shape == (5,)
    torch.testing.assert_close(column_sums, y.sum(dim=(0, 1)), rtol=1e-5, atol=1e-4)
    assert rows.ir.canonical()["outputs"][1][-1] == ["over_batch", True]
    with pytest.raises(gg.RecipeError, match=r"aux output 'rows': over_batch=True reduces over a batched GEMM's "
                                             r"batches, and this recipe is not batched; declare batched=True"):
        gg.Recipe("t", _batch_sums, operands={"bias": gg.RowVector(gg.bf16)}, aux={"rows": gg.f32, "max": gg.f32})
    with pytest.raises(gg.RecipeError, match=r"over_batch: expected True or False, got 1"):
        gg.Recipe("t", lambda acc: {"d": acc, "s": gg.sum(acc, 1, over_batch=1)}, batched=True,  # type: ignore[arg-type]
                  aux={"s": gg.f32})


def test_a_per_batch_stride_for_an_over_batch_output_fails_the_check(monkeypatch):
    """Written with each batch's stride, the reductions would land past their (M,) and () outputs."""
    recipe, config, shape = OVER_BATCH["rows"], CONFIGS[0], (37, 50, 72, 3)
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    real = arguments.ArgumentBuilder.shape_values

    def values(self, p):
        v, grid = real(self, p)
        v["epilogue.col_reduction.rows.batch_stride"] = p.m
        return v, grid
    monkeypatch.setattr(arguments.ArgumentBuilder, "shape_values", values)
    with pytest.raises(AssertionError):
        assert_computes(uncompiled(recipe, config), shape, "per-batch stride")

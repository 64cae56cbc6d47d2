"""Real launches of sm_100a kernels on a B200/GB200 (marker `gpu_sm100`; skipped with a reason
elsewhere): each example the sm100 emitter builds at its sm_100a default, on a pair of SMs and
swapped for a decode step (`tests/data/gpu_matrix.py`'s `sm100_gpu_matrix`), against the recipe's
reference on exact and random tiers, odd sizes with K tails, M = 1, a batch, padded leading
dimensions and NaN-filled outputs; the grouped example under the same configs; and the op choosing
sm_100a kernels on the device. Kernels come from the GPU check's bundle on the GPU machine
(scripts/prepare_gpu_check.sh with GEMMGEN_GPU_ARCHES="sm_90a sm_100a")."""

from __future__ import annotations

import os

import pytest
import torch

import gemmgen as gg
from gemmgen.integrations.ops import kernel_for
from gemmgen.runtime.driver import current_arch
from gemmgen.testing.grouped import moe_recipe
from tests.data.gpu_matrix import SM100_OP_PROBLEM, sm100_gpu_matrix
from tests.gpu.common import as_tuple, check_kernels, compare, inputs

pytestmark = pytest.mark.gpu_sm100

SHAPES = [(128, 256, 64), (1, 8, 16), (7, 129, 1000), (129, 1000, 4097), (1000, 7, 129)]


@pytest.fixture(scope="session")
def kernels():
    out = [(recipe, config, recipe.compile(config)) for recipe, config in sm100_gpu_matrix()
           if not recipe.ir.gemm.grouped]
    assert all(kernel.compiled.config.arch is gg.Arch.SM100A for _, _, kernel in out)
    return out


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "random"])
def test_matches_reference(kernels, gen, shape, exact):
    m, n, k = shape
    check_kernels(kernels, gen, m, n, k, exact)


def test_padded_leading_dims_and_batch(kernels, gen):
    check_kernels(kernels, gen, 200, 136, 72, exact=False, pad_bytes=48, prefilled=False)


@pytest.mark.parametrize("rows, offsets", [(37, (5, 5, 20, 30)), (300, (1, 129, 200, 300))])
def test_grouped_matches_reference(gen, rows, offsets):
    """Each grouped sm_100a kernel (one SM, a pair, swapped) on groups that are empty, of one row
    and over several tiles; rows in no group stay NaN."""
    recipe = moe_recipe()
    groups, n, k = len(offsets), 136, 264
    for config in (c for r, c in sm100_gpu_matrix() if r.ir.gemm.grouped):
        kernel = recipe.compile(config)
        a = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
        b = torch.randn(groups, n, k, device="cuda", generator=gen).bfloat16().transpose(1, 2)
        offs = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        bias = torch.randn(groups, n, device="cuda", generator=gen).bfloat16()
        weight = torch.rand(rows, device="cuda", generator=gen)
        out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
        kernel(a, b, offs, bias=bias, weight=weight, out=out)
        torch.cuda.synchronize()
        want = recipe.reference(a, b, offs, bias=bias, weight=weight).float()
        assert want.nan_to_num().abs().max() > 0
        torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True, msg=config.name)


def test_the_op_launches_sm100_kernels_on_the_device(gen):
    """The op asks the launch policy for the device's arch: an sm_100a kernel, not sm_90a's."""
    recipe = next(r for r, _ in sm100_gpu_matrix() if r.name == "bias_gelu")
    a, b, ops = inputs(recipe, *SM100_OP_PROBLEM, gen, exact=False)
    got = as_tuple(gg.op(recipe)(a, b, **ops))
    torch.cuda.synchronize()
    compare(recipe, got, a, b, ops, exact=False)
    assert current_arch() is gg.Arch.SM100A
    assert kernel_for(recipe, a, b).compiled.config.arch is gg.Arch.SM100A

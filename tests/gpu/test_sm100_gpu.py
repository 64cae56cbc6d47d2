"""Real launches of sm_100a kernels on a B200/GB200 (marker `gpu_sm100`; skipped with a reason
elsewhere): each example the sm100 emitter builds at its sm_100a default, on a pair of SMs and
swapped for a decode step (`tests/data/gpu_matrix.py`'s `sm100_gpu_matrix`), against the recipe's
reference on exact and random tiers, odd sizes with K tails, M = 1, a batch, padded leading
dimensions and NaN-filled outputs; the grouped examples (moe_up, block-scaled moe_fp8_block) under
the same configs; the op choosing sm_100a kernels on the device; and an MXFP8 FusedMLP's step
(GELU and SwiGLU) against its CPU step. Kernels come from the GPU check's bundle on the GPU machine
(scripts/prepare_gpu_check.sh with GEMMGEN_GPU_ARCHES="sm_90a sm_100a")."""

from __future__ import annotations

import os

import pytest
import torch

import gemmgen as gg
from gemmgen.integrations.ops import kernel_for
from gemmgen.runtime.driver import current_arch
from gemmgen.testing.grouped import block_grouped_inputs, moe_recipe, mx_grouped_inputs
from tests.data.gpu_matrix import SM100_OP_PROBLEM, sm100_example_kernels, sm100_gpu_matrix
from tests.gpu.common import as_tuple, check_kernels, compare, inputs

pytestmark = pytest.mark.gpu_sm100

SHAPES = [(128, 256, 64), (1, 8, 16), (7, 129, 1000), (129, 1000, 4097), (1000, 7, 129)]


@pytest.fixture(scope="session")
def kernels():
    out = [(recipe, config, recipe.compile(config)) for recipe, config in sm100_example_kernels()
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
    for config in (c for r, c in sm100_gpu_matrix() if r.name == "moe_up"):
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


@pytest.mark.parametrize("shape, offsets", [
    ((37, 304, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last; K and N tails
    ((1000, 528, 264, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # tiles per group, M = 1
], ids=["gaps", "large"])
def test_block_scaled_groups_match_reference(shape, offsets):
    """moe_fp8_block's sm_100a kernels (one SM, a pair, swapped; each group's scale layouts written
    by the setup kernel) against the reference (fp32 on the CPU), output pre-filled with NaN."""
    rows, k, n, groups = shape
    for recipe, config in ((r, c) for r, c in sm100_gpu_matrix() if r.name == "moe_fp8_block"):
        kernel = recipe.compile(config)
        a, b, offs, ops, _, _ = block_grouped_inputs(rows, k, n, groups, offsets)
        a, b, offs = a.cuda(), b.cuda(), offs.cuda()
        ops = {name: v.cuda() for name, v in ops.items()}
        want = recipe.reference(a, b, offs, **ops).float().cpu()
        assert want.nan_to_num().abs().sum() > 0
        out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
        kernel(a, b, offs, **ops, out=out)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True, msg=config.name)


@pytest.mark.parametrize("shape, offsets", [
    ((37, 256, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last; an N tail
    ((1000, 512, 264, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # groups inside blocks of 128 rows, M = 1
], ids=["gaps", "large"])
def test_nvfp4_groups_match_reference(shape, offsets):
    """moe_nvfp4's sm_100a kernels (one SM, a pair, swapped; the tokens' scales in the grouped
    blocked order, each group's scale layouts written by the setup kernel) against the reference
    (fp32 on the CPU), output pre-filled with NaN."""
    rows, k, n, groups = shape
    for recipe, config in ((r, c) for r, c in sm100_gpu_matrix() if r.name == "moe_nvfp4"):
        kernel = recipe.compile(config)
        a, b, offs, ops = mx_grouped_inputs(gg.NVFP4, rows, k, n, groups, offsets)
        ops = {**ops, "scale": torch.rand(rows) * 0.5 + 0.5}
        want = recipe.reference(a, b, offs, **ops).float()
        assert want.nan_to_num().abs().sum() > 0
        a, b, offs = a.cuda(), b.cuda(), offs.cuda()
        ops = {name: v.cuda() for name, v in ops.items()}
        out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
        kernel(a, b, offs, **ops, out=out)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True, msg=config.name)


def test_the_op_launches_sm100_kernels_on_the_device(gen):
    """The op asks the launch policy for the device's arch: an sm_100a kernel, not sm_90a's."""
    recipe = next(r for r, _ in sm100_gpu_matrix() if r.name == "bias_gelu")
    a, b, ops = inputs(recipe, *SM100_OP_PROBLEM, gen, exact=False)
    got = as_tuple(gg.op(recipe)(a, b, **ops))
    torch.cuda.synchronize()
    compare(recipe, got, a, b, ops, exact=False)
    assert current_arch() is gg.Arch.SM100A
    assert kernel_for(recipe, a, b).compiled.config.arch is gg.Arch.SM100A


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_an_mxfp8_mlp_matches_its_cpu_reference(activation):
    """A FusedMLP in MXFP8 on the B200 (its 6 kernels, from the bundle; SwiGLU's fc1 and fc2's dgrad
    over column pairs) against the same module's step on the CPU (the kernels' recipes evaluated by
    their references, which tests/training checks against the recipe's definition); 300 tokens."""
    import copy

    from tests.data.gpu_matrix import TRAINING_FP8_MLP

    tokens, n_in, hidden, n_out = TRAINING_FP8_MLP
    torch.manual_seed(0)
    gated = activation == "swiglu"
    gpu = gg.nn.FusedMLP(n_in, hidden, n_out, activation, bias=not gated, precision=gg.training.MXFP8()).cuda()
    cpu = copy.deepcopy(gpu).cpu()
    x, g = torch.randn(tokens, n_in).bfloat16(), torch.randn(tokens, n_out).bfloat16()
    got, want = _grads(gpu, x.cuda(), g.cuda()), _grads(cpu, x, g)
    for a, b in zip(got, want, strict=True):
        assert not a.isnan().any()
        b = b.double()
        snr = float(20 * torch.log10(b.norm() / (a.cpu().double() - b).norm()))
        assert snr >= 40, snr  # the same quantized operands: only the fp32 sums' order differs


def _grads(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    model(x).backward(g)
    assert x.grad is not None
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return [x.grad, *grads]  # type: ignore[list-item]

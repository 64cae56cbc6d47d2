"""gg.rand, gg.stochastic_round and gg.Seed (issue 32 item 6, stochastic rounding): uniform numbers
hashed from a seed, a stream and each element's batch, row and column (coordinates.hpp's Random),
the same in every kernel of a recipe; stochastic rounding to bf16 from them. The reference's
statistics (uniform, independent streams, unbiased rounding to a bf16 neighbour), the emulated
kernels bit for bit on exact inputs (sm90 and sm100, swapped), a seed as an int and as a device
int64, the call's checks, and mistakes that must fail."""

from __future__ import annotations

import math

import pytest
import torch

import gemmgen as gg
from gemmgen.ir.ops import random_uniform, stochastic_round_bf16
from gemmgen.testing.calls import EMULATED_CONFIGS, emulated_shapes, padded
from gemmgen.testing.checks import emulated_call, source_replaced, uncompiled, uncompiled_kernel


def _dropout_rounded(acc, bias, seed):
    kept = gg.where(gg.rand(seed) < 0.25, 0.0, acc * (4.0 / 3.0))  # stream 0
    return {"d": gg.stochastic_round(kept + bias, seed), "u": gg.rand(seed, stream=3)}  # streams 1 and 3


RECIPES = {
    # a dropout, then the result stochastically rounded to bf16; a third stream's numbers as an output
    "dropout": gg.Recipe("dropout_rounded", _dropout_rounded, batched=True, aux={"u": gg.f32},
                         operands={"bias": gg.RowVector(gg.f32), "seed": gg.Seed()}),
    # rounding alone, D in fp32 (the bf16 value stored as it is)
    "rounded": gg.Recipe("rounded", lambda acc, seed: gg.stochastic_round(acc, seed), d=gg.f32,
                         operands={"seed": gg.Seed()}),
}
SEED = 0x1234_5678_9ABC_DEF0


def _grid(batches: int, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.arange(batches).reshape(-1, 1, 1), torch.arange(m).reshape(1, -1, 1),
            torch.arange(n).reshape(1, 1, -1))


def test_the_numbers_are_uniform_and_independent():
    """Multiples of 2^-24 in [0, 1); each of 16 bins within 5 sigma of its share; streams, seeds
    and batches uncorrelated; the same seed gives the same numbers."""
    u = random_uniform(SEED, 0, *_grid(2, 300, 500))
    assert u.min() >= 0 and u.max() < 1 and torch.equal(u * 2**24, (u * 2**24).floor())
    counts = torch.bincount((u * 16).long().flatten(), minlength=16).float()
    share = u.numel() / 16
    assert (counts - share).abs().max() < 5 * math.sqrt(share), counts
    for other in (random_uniform(SEED, 1, *_grid(2, 300, 500)), random_uniform(SEED + 1, 0, *_grid(2, 300, 500)),
                  random_uniform(SEED, 0, *_grid(2, 300, 500)).roll(1, 0)):
        r = torch.corrcoef(torch.stack((u.flatten(), other.flatten())))[0, 1]
        assert abs(r) < 5 / math.sqrt(u.numel()), r
    assert torch.equal(u, random_uniform(SEED, 0, *_grid(2, 300, 500)))
    neighbours = torch.corrcoef(torch.stack((u[:, :, :-1].flatten(), u[:, :, 1:].flatten())))[0, 1]
    assert abs(neighbours) < 5 / math.sqrt(u.numel())


def test_stochastic_rounding_is_unbiased_to_a_bf16_neighbour():
    """Every result is x's bf16 value below or above (x itself when it is one); the share rounded
    away from zero is x's distance from the lower one, within 5 sigma (so the mean is x); NaN, inf
    and bf16 values pass unchanged; a value past bf16's largest finite rounds to inf at its rate."""
    x = torch.randn(64).float() * torch.logspace(-30, 30, 64)
    u = random_uniform(7, 0, *_grid(1, 64, 20000))[0]
    y = stochastic_round_bf16(x[:, None], u)
    toward = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # bf16 toward zero
    away = torch.nextafter(toward.bfloat16(), toward.sign().bfloat16() * math.inf).float()
    assert ((y == toward[:, None]) | (y == away[:, None])).all()
    share = (y == away[:, None]).float().mean(1)
    p = ((x - toward) / (away - toward)).double()
    assert ((share - p).abs() <= 5 * (p * (1 - p) / u.shape[1]).sqrt() + 1e-12).all(), (share - p).abs().max()
    exact = torch.tensor([0.0, -0.0, 1.0, -3.5, math.inf, -math.inf, 2.0**-130, torch.finfo(torch.bfloat16).max])
    assert torch.equal(stochastic_round_bf16(exact, torch.full_like(exact, 0.999)), exact)
    assert stochastic_round_bf16(torch.tensor(math.nan), torch.tensor(0.5)).isnan()
    big = torch.full((20000,), 3.4e38)
    up = stochastic_round_bf16(big, u[0]) == math.inf
    rate = float((big[0] - torch.finfo(torch.bfloat16).max) / 2.0**120)  # the step from bf16's max to 2^128
    assert abs(up.float().mean() - rate) < 5 * math.sqrt(rate * (1 - rate) / up.numel())


def test_the_reference_draws_by_element_and_the_swapped_view_agrees():
    """The recipe's dropout keeps 3/4 of the elements, scaled by 4/3, and rounds them to bf16;
    each batch draws its own numbers; the transposed IR (a swapped kernel's) computes the
    transpose from the same numbers."""
    recipe = RECIPES["dropout"]
    a, b = torch.randn(3, 70, 40).bfloat16(), torch.randn(3, 40, 90).bfloat16()
    bias = torch.randn(90)
    d, u = recipe.reference(a, b, bias=bias, seed=SEED)
    acc = a.float() @ b.float()
    grid = _grid(*acc.shape)
    assert torch.equal(u, random_uniform(SEED, 3, *grid))
    dropped = random_uniform(SEED, 0, *grid) < 0.25
    want = torch.where(dropped, 0.0, acc * gg.ir.f32(4.0 / 3.0)) + bias
    assert torch.equal(d.float(), stochastic_round_bf16(want, random_uniform(SEED, 1, *grid)))
    assert abs(dropped.float().mean() - 0.25) < 0.01 and not torch.equal(u[0], u[1])
    assert not torch.equal(d.float(), want.bfloat16().float())  # not rounded to nearest
    from gemmgen.ir.reference import evaluate_epilogue

    transposed = recipe.ir.transposed()
    assert {n.op for n in transposed.epilogue.nodes} >= {gg.ir.Op.RANDOM_T}
    d_t, u_t = evaluate_epilogue(transposed.epilogue, acc.mT, {"bias": bias, "seed": SEED})
    assert torch.equal(d_t.mT, d) and torch.equal(u_t.mT, u)


def _exact_inputs(recipe: gg.ir.RecipeIR, shape: tuple[int, int, int, int], seed: int | torch.Tensor) -> tuple:
    """Integer A and B in padded layouts (every accumulator exact in fp32, most of them not bf16
    values) and a bias of quarters: the kernel and the reference compute the same fp32 values, so
    they round them alike."""
    m, n, k, batch = shape
    lead = (batch,) if recipe.gemm.batched else ()
    g = recipe.gemm
    a = padded(m, k, g.a.torch, g.layout_a is gg.RowMajor, lead).copy_(torch.randint(-16, 17, (*lead, m, k)))
    b = padded(k, n, g.b.torch, g.layout_b is gg.RowMajor, lead).copy_(torch.randint(-16, 17, (*lead, k, n)))
    ops: dict = {"seed": seed}
    if "bias" in {o.name for o in recipe.operands}:
        ops["bias"] = torch.randint(-40, 41, (n,)).float() / 4
    return a, b, ops


@pytest.mark.parametrize("name", RECIPES)
def test_emulated_kernels_draw_the_recipes_numbers(name):
    """Every kernel (sm90 cooperative, ping-pong, swapped; sm100 one SM, a pair, swapped) on exact
    inputs gives the reference's outputs bit for bit, from a seed passed as an int and as an int64
    tensor (read through its pointer)."""
    recipe = RECIPES[name]
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert {c.arch for c in configs} == {gg.Arch.SM90A, gg.Arch.SM100A} and any(c.swap_ab for c in configs)
    for config in configs:
        ck = uncompiled(recipe, config)
        assert "gemmgen::epi::Random<" in ck.generated.source
        for shape in emulated_shapes(recipe):
            for seed in (SEED, torch.tensor([SEED ^ 0x5555])):
                _assert_exact(ck, shape, seed, f"{name} {config.name} {shape}")


def _assert_exact(ck, shape, seed, what: str) -> None:
    a, b, ops = _exact_inputs(ck.recipe, shape, seed)
    want = gg.ir.reference.reference(ck.recipe, a, b, ops)
    outs, _, _ = emulated_call(ck, shape, (a, b, ops, want))
    for o, got, ref in zip(ck.recipe.epilogue.outputs, outs, want, strict=True):
        assert torch.equal(got.float(), ref.float()), f"{what}: {o.name} differs from the reference"


@pytest.mark.parametrize("mistake", ["not transposed", "stream", "seed unread", "seed pointer"])
def test_mistakes_fail_the_check(mistake, monkeypatch):
    """A swapped kernel drawing by its own rows and columns, a node drawing another stream, a seed
    the Params do not carry, or a seed tensor's pointer not written: the emulated call differs."""
    recipe, shape = RECIPES["dropout"], (130, 72, 24, 2)
    config = EMULATED_CONFIGS[2] if mistake == "not transposed" else EMULATED_CONFIGS[0]
    seed: int | torch.Tensor = torch.tensor([SEED]) if mistake == "seed pointer" else SEED
    _assert_exact(uncompiled(recipe, config), shape, seed, "unchanged")
    if mistake == "not transposed":
        ck = uncompiled(recipe, config, source_replaced("Random<true,", "Random<false,"))
    elif mistake == "stream":
        ck = uncompiled(recipe, config, source_replaced("Random<false, 3u>", "Random<false, 1u>"))
    else:
        from gemmgen.runtime import arguments

        original = arguments.ArgumentBuilder.input_values

        def dropped(self, p, encode):
            v = original(self, p, encode)
            for prefix, _ in self.seeds:
                v[f"{prefix}.value" if mistake == "seed unread" else f"{prefix}.ptr"] = 0
            return v

        monkeypatch.setattr(arguments.ArgumentBuilder, "input_values", dropped)
        ck = uncompiled(recipe, config)
    with pytest.raises(AssertionError, match="differs from the reference"):
        _assert_exact(ck, shape, seed, mistake)


def test_the_call_refuses_what_is_not_a_seed():
    k = uncompiled_kernel(RECIPES["rounded"])
    a, b = torch.randn(5, 8).bfloat16(), torch.randn(6, 8).bfloat16().T  # B column-major, the default
    for seed, message in ((2**63, r"seed: seed 9223372036854775808 is outside \[0, 2\^63\); pass seed % 2\*\*63"),
                          (-1, r"seed: seed -1 is outside"), (1.5, r"seed: expected a seed, a Python int or a "
                                                               r"one-element torch.int64 tensor .* got float"),
                          (torch.tensor([1, 2]), r"seed: a seed tensor holds one torch.int64, got torch.int64 "
                                                 r"of shape \(2,\)"),
                          (torch.tensor([1], dtype=torch.int32), r"got torch.int32")):
        with pytest.raises(gg.InvalidArgument, match=message):
            k.prepare(a, b, seed=seed)
    with pytest.raises(gg.InvalidArgument, match=r"seed: missing operand; pass seed=... \(a Python int or a "
                                                 r"one-element int64 tensor\)"):
        k.prepare(a, b)
    assert k.prepare(a, b, seed=2**63 - 1).params is not None


def test_misuse_is_refused_naming_the_fix():
    seed = {"seed": gg.Seed()}
    with pytest.raises(gg.RecipeError, match=r"operand 'seed': a gg.Seed\(\) is not a value to compute with; .* "
                                             r"gg.rand\(seed\)"):
        gg.Recipe("t", lambda acc, seed: acc + seed, operands=seed)
    with pytest.raises(gg.RecipeError, match=r"rand: expected a gg.Seed\(\) operand, got .*; declare "
                                             r"operands=\{'seed': gg.Seed\(\)\}"):
        gg.Recipe("t", lambda acc, s: acc * gg.rand(s), operands={"s": gg.Scalar()})
    with pytest.raises(gg.RecipeError, match=r"rand: stream=65536; expected a Python int in \[0, 65536\)"):
        gg.Recipe("t", lambda acc, seed: acc * gg.rand(seed, stream=65536), operands=seed)
    with pytest.raises(gg.RecipeError, match=r"random numbers \(gg.Seed\) in a grouped GEMM are not supported yet"):
        gg.Recipe("t", lambda acc, seed: acc * gg.rand(seed), operands=seed, grouped=True)
    with pytest.raises(gg.RecipeError, match=r"operand 'seed' is declared but no output depends on it"):
        gg.Recipe("t", lambda acc, seed: acc, operands=seed)


def test_the_backward_draws_the_forwards_numbers():
    """recipe.backward() of a dropout reads the same seed and takes no gradient for it: its mask is
    the forward's (torch.autograd of the forward reference)."""
    forward = gg.Recipe("drop", lambda acc, seed: gg.where(gg.rand(seed) < 0.5, 0.0, 2.0 * acc),
                        operands={"seed": gg.Seed()})
    backward = forward.backward()
    assert [o.name for o in backward.kernel.operands] == ["seed"] and "seed:" not in backward.describe()
    g, a, b = torch.randn(40, 24).bfloat16(), torch.randn(40, 16).bfloat16(), torch.randn(16, 24).bfloat16()
    d_acc = backward.kernel.reference(g, torch.eye(24).bfloat16(), seed=SEED)  # its accumulator: dL/dD
    x = (a.float() @ b.float()).requires_grad_()
    (y,) = gg.ir.reference.evaluate_epilogue(forward.ir.epilogue, x, {"seed": SEED}, round_outputs=False)
    (grad,) = torch.autograd.grad(y, x, g.float())
    assert torch.equal(d_acc.float(), grad.bfloat16().float()) and (grad == 0).float().mean() > 0.4


def test_the_op_takes_a_seed_tensor_and_its_backward_the_same_mask():
    """gg.op(recipe) (CPU dispatch: the reference) with the seed as an int64 tensor; its backward
    against torch autograd of the same dropout, the mask drawn by random_uniform."""
    recipe = gg.Recipe("drop_op", lambda acc, seed: gg.where(gg.rand(seed) < 0.5, 0.0, 2.0 * acc),
                       operands={"seed": gg.Seed()})
    a = torch.randn(9, 16).bfloat16().requires_grad_()
    b = torch.randn(13, 16).bfloat16().T.requires_grad_()  # column-major, the default
    y = gg.op(recipe)(a, b, torch.tensor([99]))
    y.float().sum().backward()
    mask = random_uniform(99, 0, *_grid(1, 9, 13))[0] < 0.5
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    torch.where(mask, 0.0, 2.0 * (a64 @ b64)).sum().backward()
    assert torch.equal(y == 0, mask | (a64 @ b64 == 0))
    for got, want in ((a.grad, a64.grad), (b.grad, b64.grad)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))


def test_a_seed_tensor_at_another_address_is_rebound():
    """The Params of a call whose seed tensor moved (the cached plan rebound to new addresses)
    point at the new tensor; a seed sliced at an unaligned offset gets the alignment error."""
    k = uncompiled_kernel(RECIPES["rounded"])
    a, b = torch.randn(5, 8).bfloat16(), torch.randn(6, 8).bfloat16().T
    seeds = torch.tensor([3, 4, 5], dtype=torch.int64)
    first, second = torch.tensor([3]), torch.tensor([4])
    for s in (first, second):
        prep = k.prepare(a, b, seed=s)
        assert prep.params is not None and s.data_ptr().to_bytes(8, "little") in prep.params
    with pytest.raises(gg.LayoutMismatch, match=r"seed: data pointer .* is not 16-byte aligned"):
        k.prepare(a, b, seed=seeds[1:2])


def test_a_new_int_seed_rebinds_the_plan():
    """A training step's new Python int seed is keyed as an address: the cached plan is rebound
    (the output maps are not encoded again), its Params hold the new seed, and the seed's range is
    still checked."""
    from gemmgen.testing.calls import cpu_kernel
    from gemmgen.testing.recording import RecordingEncoder

    enc = RecordingEncoder()
    k = cpu_kernel(uncompiled(RECIPES["rounded"], RECIPES["rounded"].default_config()), enc)
    a, b = torch.randn(5, 8).bfloat16(), torch.randn(6, 8).bfloat16().T
    out = torch.empty(5, 8)[:, :6]  # rows padded to 16 bytes
    k.prepare(a, b, out=out, seed=11)
    before = len(enc.calls)
    for seed in (12, 2**63 - 1):
        prep = k.prepare(a, b, out=out, seed=seed)
        assert prep.params is not None and seed.to_bytes(8, "little") in prep.params
    assert len(enc.calls) == before + 4  # A's and B's maps per new seed, D's map kept
    with pytest.raises(gg.InvalidArgument, match=r"seed: seed -3 is outside"):
        k.prepare(a, b, out=out, seed=-3)

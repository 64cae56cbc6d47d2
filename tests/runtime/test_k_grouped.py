"""The K-grouped GEMM (`gg.Grouping.K`, issue 58 item 1): the experts' weight gradient
dW_e = dY_e^T X_e over each expert's tokens, with no token padded. The recipe and its refusals,
the reference against per-expert fp64 torch, the setup's groups (grouped.hpp's `fill`, run on
the host in test_grouped_oracle), the kernel's data flow emulated through its tensor maps on both
arches (an empty group included: K = 1 over zeros); the compiled kernel against CUTLASS's host code
is test_grouped_oracle's."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.integrations.grouped import grouped_weight_grad_recipe
from gemmgen.runtime.grouped import SETUP, SETUP_FIELDS
from gemmgen.testing.checks import uncompiled
from gemmgen.testing.emulate import emulate_grouped
from gemmgen.testing.grouped import cpu_grouped_kernel
from gemmgen.tuning.heuristic import candidate_configs

#: Expert sizes of the issue's bar: empty experts, a group of 1, 127 and 129 (a K tile's tail either side).
SIZES = (0, 1, 127, 129, 0, 40)


def _inputs(sizes=SIZES, m: int = 136, n: int = 72, seed: int = 0):
    """dY (tokens x M), X (tokens x N), the experts' ends and a main_grad (G x M x N), fresh values."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(sizes)
    dy = torch.randn(tokens, m, generator=gen).bfloat16()
    x = torch.randn(tokens, n, generator=gen).bfloat16()
    offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).int()
    main_grad = torch.randn(len(sizes), m, n, generator=gen)
    return dy, x, offsets, main_grad


def _per_expert(dy: torch.Tensor, x: torch.Tensor, sizes, main_grad: torch.Tensor | None) -> torch.Tensor:
    """fp64 torch, one expert at a time."""
    out, start = [], 0
    for g, size in enumerate(sizes):
        w = dy[start:start + size].double().t() @ x[start:start + size].double()
        out.append(w + main_grad[g].double() if main_grad is not None else w)
        start += size
    return torch.stack(out)


def zero_buffer(kernel, prepared) -> torch.Tensor:
    """The call's zeros that its setup block names (Setup::zero), from the kernel's plans."""
    at = SETUP.unpack(prepared.setup)[SETUP_FIELDS - 1]
    return next(p.zero for p in kernel._plans.values() if p.zero is not None and p.zero.data_ptr() == at)


def test_the_recipe_and_what_it_refuses():
    r = grouped_weight_grad_recipe(torch.bfloat16, accumulate=True)
    assert r.gemm.k_grouped and r.gemm.grouped and "K-grouped" in repr(r)
    assert ["k_grouped", True] in r.ir.canonical()["gemm"]  # in the cache key
    with pytest.raises(gg.RecipeError, match=r"layout_a=gg\.ColMajor, layout_b=gg\.RowMajor"):
        gg.Recipe("w", grouped=gg.Grouping.K)
    with pytest.raises(gg.RecipeError, match=r"fp8 WGMMA reads A and B K-major only.*layout_a=gg\.RowMajor"):
        gg.Recipe("w", a=gg.e4m3, b=gg.e4m3, layout_a=gg.ColMajor, layout_b=gg.RowMajor, grouped="k")
    with pytest.raises(gg.RecipeError, match=r"block_scale=\(1, 1, 128\)"):
        gg.Recipe("w", a=gg.e4m3, b=gg.e4m3, grouped="k", block_scale=gg.DEEPSEEK_BLOCK_SCALE)
    with pytest.raises(gg.RecipeError, match="bf16/f16 need no scales"):
        gg.Recipe("w", layout_a=gg.ColMajor, layout_b=gg.RowMajor, grouped="k", block_scale=(1, 1, 128))
    with pytest.raises(gg.RecipeError, match="operand 'bias'"):
        gg.Recipe("w", lambda acc, bias: acc + bias, layout_a=gg.ColMajor, layout_b=gg.RowMajor, grouped="k",
                  operands={"bias": gg.RowVector(gg.bf16)})
    with pytest.raises(gg.RecipeError, match=r"gg\.Grouping\.K"):
        gg.Recipe("w", grouped="tokens")
    with pytest.raises(gg.ConfigError, match="swap_ab=True: a K-grouped GEMM"):
        r.source(gg.KernelConfig(tile=(128, 32, 64), swap_ab=True))
    assert not any(c.swap_ab for c in candidate_configs(r.ir, 16) if gg.codegen.is_valid(c, r.ir))


@pytest.mark.parametrize("accumulate", [True, False])
def test_the_reference_is_each_expert_in_fp64(accumulate):
    sizes = (0, 1, 127, 129, 4096, 0)
    dy, x, offsets, main_grad = _inputs(sizes, m=24, n=40)
    r = grouped_weight_grad_recipe(torch.bfloat16, accumulate)
    got = r.reference(dy.t(), x, offsets, **({"main_grad": main_grad} if accumulate else {}))
    want = _per_expert(dy, x, sizes, main_grad if accumulate else None)
    assert got.shape == (6, 24, 40) and got.dtype == (torch.float32 if accumulate else torch.bfloat16)
    rtol, atol = (1e-5, 1e-4) if accumulate else (1.6e-2, 1e-2)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def test_bad_calls_are_refused_naming_the_argument():
    k = cpu_grouped_kernel(uncompiled(grouped_weight_grad_recipe(torch.bfloat16, True),
                                      gg.KernelConfig(tile=(128, 128, 64))))
    dy, x, offsets, main_grad = _inputs()
    with pytest.raises(gg.InvalidArgument, match=r"a/b: a K-grouped GEMM takes a \(M, tokens\)"):
        k.prepare(dy, x, offsets, main_grad=main_grad)  # dY itself, not its .t()
    with pytest.raises(gg.LayoutMismatch, match="a: expected a column-major tensor"):
        k.prepare(dy.t().contiguous(), x, offsets, main_grad=main_grad)
    with pytest.raises(gg.InvalidArgument, match=r"main_grad: expected a \(groups, M, N\) = \(6, 136, 72\)"):
        k.prepare(dy.t(), x, offsets, main_grad=main_grad[:5])
    with pytest.raises(gg.InvalidArgument, match="offsets: expected an int32 tensor of one entry per group"):
        k.prepare(dy.t(), x, offsets.long(), main_grad=main_grad)


@pytest.mark.parametrize("arch", [gg.Arch.SM90A, gg.Arch.SM100A])
def test_the_kernel_computes_each_expert_through_its_tensor_maps(arch):
    """The rendered kernel's Params and setup block, emulated: each expert's M x N from its own
    tokens' columns of dY^T and rows of X (127 and 129: K tiles' tails), main_grad added; an
    empty expert gets main_grad alone, through K = 1 over the call's zero buffer. Made to fail
    once: with that buffer filled with ones the empty experts' D is off by one."""
    r = grouped_weight_grad_recipe(torch.bfloat16, accumulate=True)
    ck = uncompiled(r, r.default_config(arch))
    k = cpu_grouped_kernel(ck, 148 if arch is gg.Arch.SM100A else 132)
    dy, x, offsets, main_grad = _inputs()
    want = _per_expert(dy, x, SIZES, main_grad)
    for zeros in (True, False):
        out = torch.full((len(SIZES), 136, 72), float("nan"))
        p = k.prepare(dy.t(), x, offsets, main_grad=main_grad, out=out)
        zero = zero_buffer(k, p)
        assert zero.numel() == 136 and not zero.any()
        zero.fill_(0.0 if zeros else 1.0)
        emulate_grouped(ck, p.setup, p.params, k._encode, [dy, x, offsets, main_grad, out, p.buffer, zero])
        if zeros:
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
        else:
            assert (out[0].double() - want[0] - 1.0).abs().max() < 1e-4  # the empty expert read the buffer
            torch.testing.assert_close(out[1:4].double(), want[1:4], rtol=1e-5, atol=1e-4)
        zero.zero_()


def test_the_backwards_grouped_gemms_compute_through_their_tensor_maps():
    """GroupedLinear's backward GEMMs besides the K-grouped one (`integrations.grouped`), rendered
    and emulated: dX_e = dacc_e W_e (the weights G x N x K, read row-major) and the accumulator
    recomputed in fp32, each group's rows through its own expert (an empty group, a row in none)."""
    from gemmgen.integrations.grouped import grouped_accumulator_recipe, grouped_input_grad_recipe

    gen = torch.Generator().manual_seed(1)
    rows, k_in, n_out, sizes = 300, 72, 136, (0, 1, 127, 129, 40)
    offsets = torch.tensor(sizes).cumsum(0).int()
    x = torch.randn(rows, k_in, generator=gen).bfloat16()
    w = torch.randn(len(sizes), n_out, k_in, generator=gen).bfloat16()  # nn.Linear's out x in, per expert
    dacc = torch.randn(rows, n_out, generator=gen).bfloat16()
    for recipe, a, b, width in ((grouped_input_grad_recipe(torch.bfloat16), dacc, w, k_in),
                                (grouped_accumulator_recipe(torch.bfloat16, gg.ColMajor), x, w.transpose(1, 2), n_out)):
        ck = uncompiled(recipe, recipe.default_config())
        k = cpu_grouped_kernel(ck)
        out = torch.full((rows, width), float("nan"), dtype=recipe.gemm.d.torch)
        p = k.prepare(a, b, offsets, out=out)
        emulate_grouped(ck, p.setup, p.params, k._encode, [a, b, offsets, out, p.buffer])
        start = 0
        for g, size in enumerate(sizes):
            want = a[start:start + size].double() @ b[g].double()
            torch.testing.assert_close(out[start:start + size].double(), want, rtol=1.6e-2, atol=2e-2)
            start += size
        assert out[start:].isnan().all()  # a row in no group: not written


def test_512_experts_most_of_them_empty_compute_through_their_tensor_maps():
    """The issue's largest expert count: 512 experts over 700 tokens (most empty, some of 1, a few of
    dozens: a routed batch), both GEMMs a GroupedLinear's backward launches per expert count, rendered
    and emulated: the K-grouped weight gradient (each expert's tokens its K) and the rows-grouped dX
    (each expert's rows through its own weights), against per-expert fp64 torch."""
    from gemmgen.integrations.grouped import grouped_input_grad_recipe

    gen = torch.Generator().manual_seed(512)
    sizes = [0] * 512
    for expert in torch.randint(0, 512, (700,), generator=gen).tolist():  # routing skewed to a few experts
        sizes[expert % 8 if expert % 3 else expert] += 1
    assert sizes.count(0) > 300 and 1 in sizes and max(sizes) > 20
    dy, x, offsets, _ = _inputs(tuple(sizes), m=24, n=40, seed=5)
    r = grouped_weight_grad_recipe(torch.bfloat16, accumulate=False)
    ck = uncompiled(r, r.default_config())
    k = cpu_grouped_kernel(ck)
    out = torch.full((512, 24, 40), float("nan"), dtype=torch.bfloat16)
    p = k.prepare(dy.t(), x, offsets, out=out)
    emulate_grouped(ck, p.setup, p.params, k._encode, [dy, x, offsets, out, p.buffer, zero_buffer(k, p)])
    torch.testing.assert_close(out.double(), _per_expert(dy, x, sizes, None), rtol=1.6e-2, atol=2e-2)
    # dX_e = dY_e W_e, W of 512 experts (out x in, row-major)
    w = torch.randn(512, 24, 40, generator=gen).bfloat16()
    r = grouped_input_grad_recipe(torch.bfloat16)
    ck = uncompiled(r, r.default_config())
    k = cpu_grouped_kernel(ck)
    dx = torch.full((dy.shape[0], 40), float("nan"), dtype=torch.bfloat16)
    p = k.prepare(dy, w, offsets, out=dx)
    emulate_grouped(ck, p.setup, p.params, k._encode, [dy, w, offsets, dx, p.buffer])
    want = torch.cat([dy[s:e].double() @ w[g].double() for g, (s, e) in
                      enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist(), strict=True))])
    torch.testing.assert_close(dx.double(), want, rtol=1.6e-2, atol=2e-2)


# --- fp8 (issue 58 item 1, low precision): DeepSeek-V3's "1D1D" weight gradient per expert -------------


def fp8_weight_grad_recipe(accumulate: bool = True) -> gg.Recipe:
    """dW_e = dY_e^T X_e over fp8 copies, per 128 tokens of each row and column, into main_grad."""
    epilogue = (lambda acc, main_grad: acc + main_grad) if accumulate else (lambda acc: acc)
    return gg.Recipe("k_grouped_fp8", epilogue, a=gg.e4m3, b=gg.e4m3, d=gg.f32, layout_a=gg.RowMajor,
                     layout_b=gg.ColMajor, grouped=gg.Grouping.K, block_scale=(1, 1, 128),
                     operands={"main_grad": gg.Matrix(gg.f32)} if accumulate else {})


def independent_copy(x: torch.Tensor, sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy and scales written from the definition, one group and one 128-token block at a time
    (not gg.quantize_k_grouped's vectorized formula): group g's tokens from column
    16 * (g + ceil(first / 16)) of a zero (C, 16 * (G + ceil(T / 16))) e4m3 copy, each block's scale
    its column's largest magnitude over 448 (1 for zeros) at row g + first // 128 + j of a
    (G + T16 // 128, C) fp32 tensor of ones, T16 = 16 * ceil(T / 16)."""
    tokens, columns = x.shape
    groups = len(sizes)
    copy = torch.zeros(columns, 16 * (groups + -(-tokens // 16)), dtype=torch.float8_e4m3fn)
    scales = torch.ones(groups + 16 * -(-tokens // 16) // 128, columns)
    first = 0
    for g, size in enumerate(sizes):
        at = 16 * (g + -(-first // 16))
        for j in range(0, size, 128):
            block = x[first + j:first + min(j + 128, size)].float()
            amax = block.abs().amax(dim=0)
            scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            scales[g + first // 128 + j // 128] = scale
            copy[:, at + j:at + j + block.shape[0]] = (block / scale).to(torch.float8_e4m3fn).t()
        first += size
    return copy, scales


def dequantized(copy: torch.Tensor, scales: torch.Tensor, sizes, per_token: bool = False):
    """The tokens (T, C) in fp64 that a copy and its scales stand for (`independent_copy`'s inverse);
    with `per_token`, each token's scales too."""
    rows, scale_rows, first = [], [], 0
    for g, size in enumerate(sizes):
        at = 16 * (g + -(-first // 16))
        for j in range(0, size, 128):
            n = min(128, size - j)
            scale = scales[g + first // 128 + j // 128].double()
            rows.append(copy[:, at + j:at + j + n].double().t() * scale)
            scale_rows.append(scale.expand(n, -1))
        first += size
    values = torch.cat(rows)
    return (values, torch.cat(scale_rows)) if per_token else values


FP8_SIZES = (0, 1, 127, 129, 0, 40, 300)  # 300 from token 297: blocks across 128-token boundaries


@pytest.mark.parametrize("sizes", [FP8_SIZES, (0, 120, 7)], ids=["597 tokens", "127 tokens"])
def test_quantize_k_grouped_is_the_definition_bit_for_bit(sizes):
    """gg.quantize_k_grouped against `independent_copy`: every byte of the copy (the zeros between
    groups too) and every scale; then the copy dequantizes to within e4m3's rounding of the tokens.
    Made to fail once: with its column formula's alignment from the group's last token instead of
    its first, the bytes differ."""
    gen = torch.Generator().manual_seed(7)
    tokens, groups = sum(sizes), len(sizes)
    x = (torch.randn(tokens, 72, generator=gen) * torch.logspace(-3, 3, 72)).bfloat16()
    x[100:110] = 0  # a block of zeros in part: its amax from the rest
    offsets = torch.tensor(sizes).cumsum(0).int()
    copy, scales = gg.quantize_k_grouped(x, offsets)
    want_copy, want_scales = independent_copy(x, sizes)
    capacity = 16 * -(-tokens // 16)  # what a copy that wide holds: the kernel sizes the scales by it
    assert copy.shape == (72, 16 * groups + capacity) and scales.shape == (groups + capacity // 128, 72)
    assert torch.equal(copy.view(torch.uint8), want_copy.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    back, scale = dequantized(copy, scales, sizes, per_token=True)
    # e4m3: half an ulp of 3 mantissa bits, or of its subnormals' 2^-9 steps
    assert ((back - x.double()).abs() <= torch.maximum(x.double().abs() * 2**-4, scale * 2**-10)).all()
    with pytest.raises(gg.InvalidArgument, match="offsets: expected the groups' int32 ends"):
        gg.quantize_k_grouped(x, offsets.long())


def _fp8_inputs(sizes=FP8_SIZES, m: int = 136, n: int = 72, seed: int = 3):
    dy, x, offsets, main_grad = _inputs(sizes, m, n, seed)
    (a, scale_a), (b, scale_b) = gg.quantize_k_grouped(dy, offsets), gg.quantize_k_grouped(x, offsets)
    # per-expert fp64 of the values the copies stand for
    want = _per_expert(dequantized(a, scale_a, sizes), dequantized(b, scale_b, sizes), sizes, main_grad)
    return a, b.t(), offsets, scale_a, scale_b, main_grad, want


def test_the_fp8_reference_is_each_expert_in_fp64():
    """The recipe's reference over the copies: each expert's dequantized dY^T X plus main_grad, in
    fp64 per expert; and against the unquantized bf16 product, above the issue's 24 dB floor for dW."""
    a, b, offsets, scale_a, scale_b, main_grad, want = _fp8_inputs()
    got = fp8_weight_grad_recipe().reference(a, b, offsets, scale_a=scale_a, scale_b=scale_b, main_grad=main_grad)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    dy, x, _, _ = _inputs(FP8_SIZES, 136, 72, 3)
    exact = _per_expert(dy, x, FP8_SIZES, None)
    signal = exact.pow(2).sum() / (got.double() - main_grad.double() - exact).pow(2).sum()
    assert 10 * torch.log10(signal) >= 24


@pytest.mark.parametrize("sizes", [FP8_SIZES, (0, 120, 7)], ids=["597 tokens", "127 tokens"])
@pytest.mark.parametrize("arch", [gg.Arch.SM90A, gg.Arch.SM100A])
def test_the_fp8_kernel_computes_each_expert_through_its_tensor_maps(arch, sizes):
    """The rendered kernel's Params and setup block, emulated: each expert's tokens from its aligned
    column of both copies, its scales from row g + first // 128, main_grad added; against per-expert
    fp64. The columns between groups hold garbage here (finite fp8): a group's K extent masks its
    tail, and an empty group reads its own column with the zero buffer's scales. Made to fail
    once: with that buffer's scales ones, the empty experts' D is off."""
    r = fp8_weight_grad_recipe()
    ck = uncompiled(r, r.default_config(arch))
    k = cpu_grouped_kernel(ck, 148 if arch is gg.Arch.SM100A else 132)
    a, b, offsets, scale_a, scale_b, main_grad, want = _fp8_inputs(sizes)
    taken = torch.zeros(a.shape[1], dtype=torch.bool)
    first = 0
    for g, size in enumerate(sizes):
        at = 16 * (g + -(-first // 16))
        taken[at:at + size] = True
        first += size
    for t in (a, b.t()):  # garbage between the groups
        t[:, ~taken] = torch.randn(t.shape[0], int((~taken).sum())).to(torch.float8_e4m3fn)
    empty = [g for g, size in enumerate(sizes) if size == 0]
    for zeros in (True, False):
        out = torch.full((len(sizes), 136, 72), float("nan"))
        p = k.prepare(a, b, offsets, scale_a=scale_a, scale_b=scale_b, main_grad=main_grad, out=out)
        zero = zero_buffer(k, p)
        assert zero.dtype == torch.float32 and zero.numel() == 136 and not zero.any()
        zero.fill_(0.0 if zeros else 1.0)
        emulate_grouped(ck, p.setup, p.params, k._encode,
                        [a, b, offsets, scale_a, scale_b, main_grad, out, p.buffer, zero])
        if zeros:
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
        else:
            assert all((out[g].double() - want[g]).abs().max() > 1e-3 for g in empty)
        zero.zero_()


def test_the_fp8_recipe_takes_the_tiles_that_do_not_spill():
    """sm_90a's default (128 x 128, compiled by hand: 168 registers, 0 local); on sm_100a a CTA tile
    N of 32, the widest that did not spill (docs/design/training.md#moe-in-fp8), and a wider one
    refused by name before any compile."""
    r = fp8_weight_grad_recipe()
    assert r.default_config(gg.Arch.SM90A).tile == (128, 128, 128)
    assert r.default_config(gg.Arch.SM100A).tile == (128, 32, 128)
    with pytest.raises(gg.ConfigError, match=r"K-grouped fp8 kernel .* spills registers .* use tile N = 32"):
        r.source(gg.KernelConfig(tile=(128, 64, 128), schedule=gg.Schedule.ONE_SM, arch=gg.Arch.SM100A))


def test_bad_fp8_calls_are_refused_naming_the_argument():
    r = fp8_weight_grad_recipe()
    k = cpu_grouped_kernel(uncompiled(r, r.default_config()))
    a, b, offsets, scale_a, scale_b, main_grad, _ = _fp8_inputs()
    with pytest.raises(gg.InvalidArgument, match=r"a/b: 8 columns of tokens for 7 groups.*gg\.quantize_k_grouped"):
        k.prepare(a[:, :8], b[:8], offsets, scale_a=scale_a, scale_b=scale_b, main_grad=main_grad)
    with pytest.raises(gg.InvalidArgument, match=r"scale_a: expected fp32 scales of shape \(11, 136\)"):
        k.prepare(a, b, offsets, scale_a=scale_a[:-1], scale_b=scale_b, main_grad=main_grad)
    with pytest.raises(gg.LayoutMismatch, match=r"scale_b: expected contiguous scales"):
        k.prepare(a, b, offsets, scale_a=scale_a, scale_b=scale_b.t().contiguous().t(), main_grad=main_grad)
    with pytest.raises(gg.LayoutMismatch, match="b: expected a column-major tensor"):
        k.prepare(a, b.contiguous(), offsets, scale_a=scale_a, scale_b=scale_b, main_grad=main_grad)


@pytest.mark.parametrize("sizes", [FP8_SIZES, (0, 120, 7)], ids=["597 tokens", "127 tokens"])
def test_k_grouped_copy_lays_out_fp8_values_as_the_definition(sizes):
    """gg.k_grouped_copy (a per-tensor recipe's copy: the fp8 values need no other scale) against a
    copy written group by group: group g's tokens from column 16 * (g + ceil(first / 16)), zeros
    around them, every byte equal; rows past the last group's end are left out. Made to fail once:
    with its columns from the group's last token, the bytes differ."""
    gen = torch.Generator().manual_seed(11)
    tokens = sum(sizes)
    q = (torch.randn(tokens + 5, 40, generator=gen) * 50).to(torch.float8_e5m2)  # 5 rows in no group
    offsets = torch.tensor(sizes).cumsum(0).int()
    want = torch.zeros(40, 16 * (len(sizes) + -(-(tokens + 5) // 16)), dtype=torch.float8_e5m2)
    first = 0
    for g, size in enumerate(sizes):
        at = 16 * (g + -(-first // 16))
        want[:, at:at + size] = q[first:first + size].t()
        first += size
    assert torch.equal(gg.k_grouped_copy(q, offsets).view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(gg.InvalidArgument, match=r"x: expected an fp8 \(tokens, columns\) tensor"):
        gg.k_grouped_copy(q.float(), offsets)

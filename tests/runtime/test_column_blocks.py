"""A copy stored transposed and quantized per block of rows of each column
(gemmgen/include/gemmgen/column_blocks.hpp, gg.quantize_columns: issue 57 item 2, the K-major copy a
weight-gradient GEMM reads, written by the epilogue that produces the tensor). The reference against
quantization written out here with torch alone, the emulated kernel (odd sizes, partial last blocks,
M = 1), mistakes that must fail the emulation, the copy and its scales fed to the wgrad kernel as
they are, and misuse refused naming the fix. The compiled kernel's checks (SASS, local memory, the
oracle) are with the other compiled kernels' (tests/data/extra_recipes.py's fc1_fp8block_fprop_train_q)."""

from __future__ import annotations

import math

import pytest
import torch

import gemmgen as gg
from gemmgen.testing.checks import assert_computes, emulated_call, source_replaced, uncompiled, uncompiled_kernel
from tests.data import extra_recipes


def _dual(copy=gg.e4m3, d=gg.e4m3, power_of_two: bool = False) -> gg.Recipe:
    """gelu(acc + bias) quantized per row (D) and per column (the transposed copy), from bf16 A and B."""
    def epilogue(acc, bias):
        h = gg.gelu(acc + bias)
        q, scale = gg.quantize(h, block=128, power_of_two=power_of_two)
        q_t, scale_t = gg.quantize_columns(h, block=128, power_of_two=power_of_two)
        return {"d": q, "scale": scale, "h_t": q_t, "h_t_scale": scale_t}

    return gg.Recipe("dual", epilogue, d=d, operands={"bias": gg.RowVector(gg.bf16)},
                     aux={"scale": gg.f32, "h_t": copy, "h_t_scale": gg.f32})


def _by_columns(x: torch.Tensor, qmax: float, dtype: torch.dtype, power_of_two: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantization per column and block of 128 rows, written out with torch alone: a block's scale
    is max |x| / qmax (1 for a block of zeros or with a NaN; with `power_of_two` the least power of
    two not below it, found by doubling), its values x / scale, saturated to the fp8 type; the copy
    (N, M), the scales (N, blocks)."""
    m, n = x.shape
    copy = torch.empty(n, m, dtype=dtype)
    scales = torch.empty(n, -(-m // 128))
    for j in range(n):
        for b, i in enumerate(range(0, m, 128)):
            part = x[i:i + 128, j]
            amax = part.abs().max()  # NaN propagates
            scale = amax / qmax if amax > 0 else torch.tensor(1.0)
            if power_of_two and amax > 0:
                scale = _least_power_of_two_not_below(scale)
            copy[j, i:i + 128] = (part / scale).clamp(-qmax, qmax).to(dtype)
            scales[j, b] = scale
    return copy, scales


def _least_power_of_two_not_below(s: torch.Tensor) -> torch.Tensor:
    p = torch.tensor(2.0**-149)  # the least fp32 power of two; every fp32 scale is at least that
    while p < s:
        p = p * 2
    return p


@pytest.mark.parametrize("copy", [gg.e4m3, gg.e5m2])
def test_the_reference_is_columnwise_quantization(copy):
    """Fresh inputs, M not a multiple of 128 (a partial last block), a column of zeros and a NaN:
    the reference's copy and scales bit-equal to quantization written out here, and to
    gg.quantize_blockwise of x^T per row and 128 values."""
    recipe = _dual(copy)
    a, b = torch.randn(200, 64).bfloat16(), torch.randn(64, 150).bfloat16()
    b[:, 7] = 0.0  # a column of zeros
    bias = torch.randn(150).bfloat16()
    bias[7] = -20.0  # gelu(-20) is 0: a block of zeros, scale 1
    a[130, :] = math.nan  # a NaN in the second block of every column: scale 1
    _, _, q_t, scale_t = recipe.reference(a, b, bias=bias)
    y = (a.float() @ b.float()) + bias.float()
    x = 0.5 * y * (1.0 + (y * (1.0 / math.sqrt(2.0))).erf())
    want, scales = _by_columns(x, torch.finfo(copy.torch).max, copy.torch)
    assert q_t.shape == (150, 200) and scale_t.shape == (150, 2) and (scales != 1).any()
    assert torch.equal(scale_t, scales) and (scale_t[:, 1] == 1).all() and (scale_t[7] == 1).all()
    assert torch.equal(q_t.view(torch.uint8), want.view(torch.uint8))
    q, s = gg.quantize_blockwise(x.t().contiguous(), (1, 128), copy, scale_layout=gg.RowMajor)
    assert torch.equal(s, scale_t) and torch.equal(q.view(torch.uint8), q_t.view(torch.uint8))


def test_emulated_kernels_write_the_copy():
    """The cooperative sm_90a kernel (the only config whose epilogue subtile holds 128 rows) on odd
    sizes, partial last blocks of rows, M = 1 and K tails: every output (D, both scales, the copy)
    as the reference has it, through the Params gemmgen builds."""
    recipe = _dual()
    ck = uncompiled(recipe, gg.KernelConfig(tile=(128, 128, 64)))
    src = ck.generated.source
    assert "Sm90ColumnBlocksStore<0x43e00000u, 128, cutlass::float_e4m3_t, TileShape," in src
    for shape in ((1, 128, 16, 1), (200, 272, 72, 1), (257, 16, 24, 1), (129, 200, 8, 1), (7, 40, 129, 1)):
        assert_computes(ck, shape, "dual")


def test_power_of_two_scales_both_ways_bit_for_bit():
    """gg.quantize and gg.quantize_columns with power_of_two (Transformer Engine's blockwise scales:
    Float8Blockwise(power_of_two_scales=True)'s fused epilogues): the emulated kernel, through the
    Params gemmgen builds, writes D, the copy and both scales bit-equal to quantization written out
    here (scales found by doubling from 2^-149), as does the recipe's reference, on a partial last
    block of rows and columns and blocks of zeros; the scales are powers of two, some of them above
    the plain rule's. The kernel spells the rounding in both nodes, and it is another kernel."""
    recipe = _dual(power_of_two=True)
    ck = uncompiled(recipe, gg.KernelConfig(tile=(128, 128, 64)))
    src = ck.generated.source
    assert recipe.ir.key != _dual().ir.key and ck.entry != uncompiled(_dual(), ck.config).entry  # another kernel
    assert "QuantizeBlock<0x43e00000u, true>" in src
    assert "Sm90ColumnBlocksStore<0x43e00000u, 128, cutlass::float_e4m3_t, TileShape, " \
           "typename EpilogueDescriptor::EpilogueTile, true>" in src
    m, n, k = 200, 272, 64
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    b = torch.randn(n, k, generator=torch.Generator().manual_seed(4)).bfloat16().t()  # column-major
    b[:, 5] = 0.0
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).bfloat16()
    bias[5] = -20.0  # gelu(-20) is 0: blocks of zeros, scale 1
    outs, _, _ = emulated_call(ck, (m, n, k, 1), (a, b, {"bias": bias}, None))
    q, scale, q_t, scale_t = outs
    y = (a.float() @ b.float()) + bias.float()
    h = 0.5 * y * (1.0 + (y * (1.0 / math.sqrt(2.0))).erf())
    want_t, want_scale_t = _by_columns(h, 448.0, torch.float8_e4m3fn, power_of_two=True)
    rows_t, rows_scale = _by_columns(h.t().contiguous(), 448.0, torch.float8_e4m3fn, power_of_two=True)
    assert torch.equal(scale_t, want_scale_t) and torch.equal(q_t.view(torch.uint8), want_t.view(torch.uint8))
    assert torch.equal(scale, rows_scale) and torch.equal(q.view(torch.uint8), rows_t.view(torch.uint8))
    for s in (scale, scale_t):
        assert torch.equal(s.frexp().mantissa, torch.full_like(s, 0.5))  # powers of two
    ref = recipe.reference(a, b, bias=bias)  # the recipe's reference (the torch path) agrees bit for bit
    bits = [[t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in ts] for ts in (ref, outs)]
    assert len(ref) == 4 and all(torch.equal(x, y) for x, y in zip(*bits, strict=True))
    plain = torch.where(h.abs().amax(0) > 0, h.abs().amax(0) / 448.0, 1.0)
    assert (want_scale_t[:, 0] > plain).any()


@pytest.mark.parametrize("mistake", ["block", "fp8 maximum", "copy strides", "scale strides"])
def test_mistakes_fail_the_check(mistake, monkeypatch):
    """A kernel quantizing other blocks of rows, scaling to another fp8 type's range, or storing the
    copy (or its scales) through another layout's strides fails the emulated call (the unchanged
    kernel passes)."""
    recipe, shape, config = _dual(), (200, 144, 24, 1), gg.KernelConfig(tile=(128, 128, 64))
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    if mistake == "block":
        ck = uncompiled(recipe, config, source_replaced("Sm90ColumnBlocksStore<0x43e00000u, 128,",
                                                        "Sm90ColumnBlocksStore<0x43e00000u, 64,"))
    elif mistake == "fp8 maximum":
        ck = uncompiled(recipe, config, source_replaced("Sm90ColumnBlocksStore<0x43e00000u,",
                                                        "Sm90ColumnBlocksStore<0x47600000u,"))  # e5m2's 57344
    else:
        from gemmgen.runtime import arguments

        ck = uncompiled(recipe, config)
        real = arguments.ArgumentBuilder.output_map
        template = "column_blocks" if mistake == "copy strides" else "column_scales"

        def swapped(self, index, p, t, encode):
            if self.by_index[index][1] == template:
                t = t._replace(strides=(t.strides[1], t.strides[0], t.strides[2]))
            return real(self, index, p, t, encode)
        monkeypatch.setattr(arguments.ArgumentBuilder, "output_map", swapped)
    with pytest.raises(AssertionError):
        assert_computes(ck, shape, mistake)


def test_the_copy_feeds_the_weight_gradient_gemm():
    """The copy (N, M: M contiguous, rows 16 bytes apart) and its scales (N contiguous, padded to 4),
    as gemmgen allocates them, are the wgrad kernel's B and scale_b as they are (`Float8Blockwise`'s
    wgrad, K the tokens); the copy's values (the emulated kernel's: `test_emulated_kernels_write_the_copy`)
    are bit-equal to what the precision's own quantizer gives that operand."""
    from gemmgen.training import Float8Blockwise, Gemm

    k = uncompiled_kernel(_dual())
    a, b, bias = torch.randn(200, 64).bfloat16(), torch.randn(144, 64).bfloat16().t(), torch.randn(144).bfloat16()
    _, _, q_t, scale_t = k.prepare(a, b, bias=bias).outputs
    assert q_t.shape == (144, 200) and q_t.stride() == (208, 1) and q_t.dtype == torch.float8_e4m3fn
    assert scale_t.shape == (144, 2) and scale_t.stride() == (1, 144)
    precision = Float8Blockwise()
    wgrad = precision.recipe(gg.Recipe("weight_grad", d=gg.f32), Gemm.WGRAD)
    dy_t = precision.operand(torch.randn(200, 96).t(), Gemm.WGRAD, "a", wgrad)  # dY^T (96 x tokens)
    dy_padded = torch.empty(96, 208, dtype=torch.float8_e4m3fn)[:, :200]  # rows 16-byte aligned, as the copy's
    dy_padded.copy_(dy_t.data)
    uncompiled_kernel(wgrad).prepare(dy_padded, q_t.t(), scale_a=dy_t.scale, scale_b=scale_t.t())  # as they are
    _, _, ref_q, ref_scale = _dual().reference(a, b, bias=bias)
    y = (a.float() @ b.float()) + bias.float()
    h = 0.5 * y * (1.0 + (y * (1.0 / math.sqrt(2.0))).erf())
    operand = precision.operand(h.t(), Gemm.WGRAD, "b", wgrad)  # h^T (N x tokens) quantized along the tokens
    assert torch.equal(operand.data.t().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(operand.scale.t(), ref_scale)
    assert extra_recipes.fc1_fp8block_fprop_train_q.ir.epilogue.column_blocks == _dual().ir.epilogue.column_blocks


def test_a_given_copy_must_be_k_major_and_aligned():
    k = uncompiled_kernel(_dual())
    a, b, bias = torch.randn(40, 64).bfloat16(), torch.randn(144, 64).bfloat16().t(), torch.randn(144).bfloat16()
    outs = [torch.empty(40, 144, dtype=torch.float8_e4m3fn), torch.empty(40, 2), None, torch.empty(144, 1)]
    outs[2] = torch.empty(144, 48, dtype=torch.float8_e4m3fn)[:, :40]
    got = k.prepare(a, b, bias=bias, out=tuple(outs)).outputs
    assert got[2] is outs[2]
    with pytest.raises(gg.InvalidArgument, match=r"out\[h_t\]: expected shape \(144, 40\)"):
        k.prepare(a, b, bias=bias, out=(*outs[:2], torch.empty(40, 144, dtype=torch.float8_e4m3fn), outs[3]))
    with pytest.raises(gg.LayoutMismatch, match=r"out\[h_t\]"):
        k.prepare(a, b, bias=bias, out=(*outs[:2], torch.empty(144, 41, dtype=torch.float8_e4m3fn)[:, :40], outs[3]))
    with pytest.raises(gg.LayoutMismatch, match=r"out\[h_t\]"):
        k.prepare(a, b, bias=bias, out=(*outs[:2], torch.empty(40, 144, dtype=torch.float8_e4m3fn).t(), outs[3]))


def _copy_and_scales(y):
    q_t, scale_t = gg.quantize_columns(y)
    return {"d": y, "y_t": q_t, "y_t_scale": scale_t}


@pytest.mark.parametrize("epilogue, kwargs, match", [
    (_copy_and_scales, {"aux": {"y_t": gg.bf16, "y_t_scale": gg.f32}},
     r"aux output 'y_t': gg.quantize_columns stores its copy in an fp8 type, .* declare aux=\{'y_t': gg.e4m3\}"),
    (_copy_and_scales, {"aux": {"y_t": gg.e4m3, "y_t_scale": gg.bf16}},
     r"aux output 'y_t_scale': gg.quantize_columns's scales are fp32; declare aux=\{'y_t_scale': gg.f32\}"),
    (lambda acc: {"d": acc, "y_t": gg.quantize_columns(acc)[0]}, {"aux": {"y_t": gg.e4m3}},
     r"output 'y_t': return both of gg.quantize_columns's values"),
    (lambda acc: {"d": gg.quantize_columns(acc)[0], "y_t_scale": gg.quantize_columns(acc)[1]},
     {"d": gg.e4m3, "aux": {"y_t_scale": gg.f32}}, r"output 'd': gg.quantize_columns's values are a transposed copy"),
    (lambda acc: {"d": acc, "y_t": gg.quantize_columns(acc)[0], "y_t_scale": gg.quantize_columns(acc)[1]}, {},
     r"output 'y_t_scale': one gg.quantize_columns call per recipe"),
    (lambda acc: {"d": acc, "y_t": gg.quantize_columns(acc, block=64)[0]}, {},
     r"quantize_columns: block=64; expected 128 rows"),
    (lambda acc: gg.exp(gg.quantize_columns(acc)[0]), {"aux": {}},
     r"gg.quantize_columns\(...\) gives outputs, not values to compute with: return them, q_t, scale_t ="),
    (_copy_and_scales, {"batched": True}, r"gg.quantize_columns: a batched recipe's tokens are not one K"),
])
def test_misuse_names_the_fix(epilogue, kwargs, match):
    kwargs = {"aux": {"y_t": gg.e4m3, "y_t_scale": gg.f32}} | kwargs
    with pytest.raises(gg.RecipeError, match=match):
        gg.Recipe("t", epilogue, **kwargs)


def test_the_fixes_work():
    """The misuse messages' example, applied, builds the recipe."""
    gg.Recipe("t", lambda acc: {"d": acc, **{k: v for k, v in _copy_and_scales(acc).items() if k != "d"}},
              aux={"y_t": gg.e4m3, "y_t_scale": gg.f32})


def test_configs_that_cannot_hold_the_blocks_are_refused_and_never_chosen():
    """Only the cooperative sm_90a schedule's epilogue subtile holds 128 rows: pingpong, swap_ab and
    sm_100a are refused naming the fix, and the heuristic never picks them."""
    from gemmgen.tuning.heuristic import choose

    r = _dual()
    with pytest.raises(gg.ConfigError, match=r"schedule pingpong, tile M = 128: gg.quantize_columns's blocks of "
                                                r"128 rows must lie in one epilogue subtile, which has 64 rows"):
        r.source(gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.PINGPONG))
    with pytest.raises(gg.ConfigError, match=r"swap_ab=True: .* blocks of columns of a row"):
        r.source(gg.KernelConfig(tile=(128, 128, 64), swap_ab=True))
    with pytest.raises(gg.ConfigError, match=r"gg.quantize_columns: sm_100a kernels do not write a column-quantized "
                                                r"copy yet \(sm_90a only\); build with --arch sm_90a"):
        r.source(r.default_config(gg.Arch.SM100A))
    for m in (1, 8, 200, 4096):
        choice = choose(r.ir, m, 7168, 4096, arch=gg.Arch.SM90A)
        assert gg.codegen.is_valid(choice.config, r.ir), choice.why
        assert choice.config.schedule is gg.Schedule.COOPERATIVE and not choice.config.swap_ab, choice.why


def test_the_copy_has_no_gradient():
    with pytest.raises(gg.RecipeError, match=r"a copy per block of its columns \(gg.quantize_columns\), which gemmgen "
                                             r"does not differentiate"):
        gg.Recipe("t", _copy_and_scales, aux={"y_t": gg.e4m3, "y_t_scale": gg.f32}).backward()

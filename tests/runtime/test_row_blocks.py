"""D per block of columns of each row (gemmgen/include/gemmgen/row_blocks.hpp): gg.quantize (issue
32 item 6: D quantized to fp8 per block, its block scales an output), gg.rms_norm (item 3: an
RMSNorm per head, its statistic reduced in the epilogue, as QK-norm needs) and gg.exp_minus_max
(item 3: a per-block max for a scaled exp, a softmax's numerator). The references against
torch written out here (and F.rms_norm, and gg.quantize_blockwise), the emulated kernels, mistakes
that must fail the emulation, the scales' layout as a block-scaled GEMM reads it, empty problems,
and misuse refused naming the fix. The compiled kernels' checks (SASS, local memory, oracle) are
with the other compiled kernels' (examples/recipes.py's qk_norm, tests/data/extra_recipes.py's
block_softmax and fc1_fp8block_fprop_train_q, whose D is quantized per block as fp8_quantized's)."""

from __future__ import annotations

import math

import pytest
import torch

import gemmgen as gg
from gemmgen.runtime import kernel as kernel_module
from gemmgen.runtime.problem import TensorArg
from gemmgen.testing.calls import EMULATED_CONFIGS, emulated_shapes
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled, uncompiled_kernel


def _quantized(block: int = 128, d=gg.e4m3, batched: bool = False) -> gg.Recipe:
    def epilogue(acc, bias):
        q, scale = gg.quantize(gg.gelu(acc + bias), block=block)
        return {"d": q, "scale": scale}

    return gg.Recipe(f"quantized_{block}", epilogue, d=d, batched=batched, aux={"scale": gg.f32},
                     operands={"bias": gg.RowVector(gg.bf16)})


def _normed(block: int = 128, weighted: bool = True, batched: bool = False) -> gg.Recipe:
    def epilogue(acc, bias, weight):
        y, rstd = gg.rms_norm(acc + bias, block=block, eps=1e-5, weight=weight if weighted else None)
        return {"d": y, "rstd": rstd}

    return gg.Recipe(f"normed_{block}", epilogue if weighted else (lambda acc, bias: epilogue(acc, bias, None)),
                     batched=batched, aux={"rstd": gg.f32},
                     operands={"bias": gg.RowVector(gg.bf16), **({"weight": gg.RowVector(gg.f32)} if weighted else {})})


def _by_torch(x: torch.Tensor, block: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise quantization written out with torch alone: per row and block of columns, the scale
    is max |x| / qmax (1 for a block of zeros or with a NaN), the values x / scale."""
    n = x.shape[-1]
    scales = []
    values = torch.empty_like(x)
    for j in range(0, n, block):
        part = x[..., j:j + block]
        amax = part.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        values[..., j:j + block] = part / scale
        scales.append(scale)
    return values, torch.cat(scales, dim=-1)


@pytest.mark.parametrize("block, dtype", [(128, gg.e4m3), (32, gg.e5m2), (8, gg.e4m3)])
def test_the_reference_is_blockwise_quantization(block, dtype):
    """Fresh inputs, N not a multiple of the block (a partial last block), a row of zeros and a NaN:
    the reference's D and scales against torch written out, and against gg.quantize_blockwise with
    the scales in the layout a block-scaled GEMM reads, bit for bit."""
    recipe = _quantized(block, dtype, batched=True)
    a, b = torch.randn(2, 9, 40).bfloat16(), torch.randn(2, 40, 3 * block + 5).bfloat16()
    a[1, 4] = 0.0  # a row of zeros: scale 1
    bias = torch.randn(b.shape[-1]).bfloat16()
    bias[block + 1] = math.nan  # a NaN in the second block of every row: scale 1, the block's values as they are
    d, scale = recipe.reference(a, b, bias=bias)
    y = (a.float() @ b.float()) + bias.float()
    x = 0.5 * y * (1.0 + (y * (1.0 / math.sqrt(2.0))).erf())  # gg.gelu, the erf form
    values, scales = _by_torch(x, block, torch.finfo(dtype.torch).max)
    assert scale.shape == (2, 9, 4) and d.dtype == dtype.torch and (scales != 1).any()
    assert torch.equal(scale, scales)
    limit = torch.finfo(dtype.torch).max
    torch.testing.assert_close(d.float(), values.clamp(-limit, limit).to(dtype.torch).float(), rtol=0, atol=0,
                               equal_nan=True)
    assert d.float()[..., block + 1].isnan().all() and (scale[..., 1] == 1).all()
    q, s = gg.quantize_blockwise(x, (1, block), dtype, scale_layout=gg.ColMajor)
    assert torch.equal(s, scale) and torch.equal(q.view(torch.uint8), d.view(torch.uint8))
    assert d.float().nan_to_num(0.0).abs().amax() <= limit


@pytest.mark.parametrize("block", [128, 32])
def test_emulated_kernels_quantize_d(block):
    """Every config that may run the recipe (unswapped: sm_90a's cooperative and ping-pong, sm_100a's
    one SM and pair), on the emulated shapes (odd sizes, K tails, M = 1, batches): D and the scales
    as the reference has them. sm_100a's epilogue tile is the block or the Auto tile's 32 columns
    (no C), whichever is wider, each thread a whole row of it; its bias is read in place."""
    recipe = _quantized(block, batched=True)
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert [(c.arch, c.swap_ab) for c in configs] == [(gg.Arch.SM90A, False)] * 2 + [(gg.Arch.SM100A, False)] * 2
    for config in configs:
        ck = uncompiled(recipe, config)
        src = ck.generated.source
        if config.arch is gg.Arch.SM90A:
            assert f"Sm90RowBlocks<gemmgen::epi::QuantizeBlock<0x43e00000u>, {block}," in src
            auto_n = 64 if config.tile[0] == 64 else 32
            assert f"using EpilogueTile = Shape<_{config.tile[0]}, _{max(block, auto_n)}>;" in src
        else:
            assert f"Sm100RowBlocks<gemmgen::epi::QuantizeBlock<0x43e00000u>, {block}, " \
                "EpilogueDescriptor::DispatchPolicy::FragmentSize, cutlass::float_e4m3_t," in src
            assert f"using EpilogueTile = Shape<_128, _{max(block, 32)}>;" in src
            assert "Sm100RowBroadcastInPlace<cutlass::epilogue::fusion::Sm90RowBroadcast<" in src
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, f"block {block} {config.name}")


@pytest.mark.parametrize("mistake, arch", [(m, a) for a in (gg.Arch.SM90A, gg.Arch.SM100A)
                                            for m in ("block", "fp8 maximum", "scale strides")] +
                         [("element", gg.Arch.SM100A)])
def test_mistakes_fail_the_check(mistake, arch, monkeypatch):
    """A kernel quantizing in other blocks, scaling to another fp8 type's range, the scales'
    strides written as another layout's, or (sm_100a, whose node converts D itself) D converted to
    another fp8 type each fail the emulated call (the unchanged kernel passes)."""
    recipe, shape = _quantized(), (130, 300, 24, 2)
    config = next(c for c in EMULATED_CONFIGS if c.arch is arch)
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    if mistake == "element":  # sm_90a's node gives fp32, which the collective converts to ElementD
        ck = uncompiled(recipe, config, source_replaced("FragmentSize, cutlass::float_e4m3_t,",
                                                        "FragmentSize, cutlass::float_e5m2_t,"))
    elif mistake == "block":
        ck = uncompiled(recipe, config,
                        source_replaced("QuantizeBlock<0x43e00000u>, 128,", "QuantizeBlock<0x43e00000u>, 64,"))
    elif mistake == "fp8 maximum":
        ck = uncompiled(recipe, config, source_replaced("0x43e00000u", "0x47600000u"))  # e5m2's 57344
    else:
        ck = uncompiled(recipe, config)
        real = kernel_module.check_block_factors_output

        def transposed(*args):
            t = real(*args)
            return TensorArg(t.ptr, (t.strides[1], t.strides[0], t.strides[2]))
        monkeypatch.setattr(kernel_module, "check_block_factors_output", transposed)
    with pytest.raises(AssertionError):
        assert_computes(ck, shape, mistake)


def test_the_scales_feed_a_block_scaled_gemm():
    """The scales come in the layout a block-scaled GEMM's scale_a is read in (M contiguous, each
    column of blocks 16 bytes apart): D and its scales are the next layer's A and scale_a as they are."""
    k = uncompiled_kernel(_quantized())
    a, b, bias = torch.randn(37, 64).bfloat16(), torch.randn(256, 64).bfloat16().t(), torch.randn(256).bfloat16()
    prep = k.prepare(a, b, bias=bias)
    d, scale = prep.outputs
    assert scale.shape == (37, 2) and scale.stride() == (1, 40) and d.dtype == torch.float8_e4m3fn
    nxt = gg.Recipe("next", a=gg.e4m3, b=gg.e4m3, block_scale=gg.DEEPSEEK_BLOCK_SCALE)
    w_q, scale_b = gg.quantize_blockwise(torch.randn(128, 256).t(), (128, 128), scale_layout=gg.RowMajor)
    uncompiled_kernel(nxt).prepare(d, w_q, scale_a=scale, scale_b=scale_b)  # taken as it is: no copy, no error
    given = torch.empty(37, 2)
    out = k.prepare(a, b, bias=bias, out=(torch.empty(37, 256, dtype=torch.float8_e4m3fn), given)).outputs
    assert out[1] is given  # a row-major one is written through its own strides
    with pytest.raises(gg.InvalidArgument, match=r"out\[scale\]: expected shape \(37, 2\)"):
        k.prepare(a, b, bias=bias, out=(torch.empty(37, 256, dtype=torch.float8_e4m3fn), torch.empty(37, 3)))
    with pytest.raises(gg.LayoutMismatch, match=r"out\[scale\]: strides \(0, 1\) make elements overlap"):
        k.prepare(a, b, bias=bias, out=(torch.empty(37, 256, dtype=torch.float8_e4m3fn),
                                        torch.empty(2).expand(37, 2)))


def test_empty_problems_behave_like_torch():
    """N = 0 and M = 0 give empty outputs, nothing launched; K = 0 quantizes the epilogue of a zero
    accumulator (each block of gelu(bias) by its own scale)."""
    k = uncompiled_kernel(_quantized())
    prep = k.prepare(torch.randn(5, 8).bfloat16(), torch.randn(0, 8).bfloat16().t(), bias=torch.randn(0).bfloat16())
    assert prep.params is None and prep.outputs[1].shape == (5, 0)
    prep = k.prepare(torch.randn(0, 8).bfloat16(), torch.randn(6, 8).bfloat16().t(), bias=torch.randn(6).bfloat16())
    assert prep.params is None and prep.outputs[1].shape == (0, 1)
    bias = torch.randn(200).bfloat16()
    prep = k.prepare(torch.randn(3, 0).bfloat16(), torch.randn(200, 0).bfloat16().t(), bias=bias)
    y = bias.float().expand(3, 200)
    values, scales = _by_torch(0.5 * y * (1.0 + (y * (1.0 / math.sqrt(2.0))).erf()), 128, 448.0)
    assert torch.equal(prep.outputs[1], scales)
    assert torch.equal(prep.outputs[0].float(), values.to(torch.float8_e4m3fn).float())


def _values_and_scales(y):
    q, scale = gg.quantize(y, block=128)
    return {"d": q, "scale": scale}


@pytest.mark.parametrize("epilogue, kwargs, match", [
    (_values_and_scales, {"d": gg.bf16}, r"gg.quantize stores D in an fp8 type, and D is bf16; declare d=gg.e4m3"),
    (_values_and_scales, {"aux": {"scale": gg.bf16}},
     r"gg.quantize's factors are fp32; declare aux=\{'scale': gg.f32\}"),
    (lambda acc: {"d": gg.quantize(acc)[1], "scale": gg.quantize(acc)[0]}, {},
     r"output 'd': the factors \(gg.quantize's second value\) are an aux output; q, scale = gg.quantize"),
    (lambda acc: {"d": gg.quantize(acc)[0], "scale": gg.amax(acc, dim=1)}, {},
     r"output 'd': return both of gg.quantize's values, the scales too"),
    (lambda acc: {"d": gg.quantize(acc)[0], "scale": gg.quantize(acc)[1]}, {},
     r"output 'scale': D's row blocks come from one gg.quantize call"),
    (lambda acc: {"d": gg.quantize(acc, block=100)[0]}, {}, r"quantize: block=100; expected one of 8, 16, 32, 64, 128"),
    (lambda acc: {"d": acc, "scale": gg.rms_norm(acc, 128)[1]}, {"d": gg.bf16},
     r"output 'scale': gg.rms_norm's factors come with its values as D; y, rstd = gg.rms_norm"),
    (lambda acc: {"d": gg.rms_norm(acc, 128, eps=0.0)[0], "scale": acc}, {"d": gg.bf16, "aux": {"scale": gg.bf16}},
     r"rms_norm: eps=0.0; expected a positive number"),
    (lambda acc: gg.exp(gg.quantize(acc)[0]), {}, r"gives outputs, not values to compute with"),
    (_values_and_scales, {"layout_d": gg.ColMajor},
     r"layout_d: the blocks of gg.quantize, gg.rms_norm and gg.exp_minus_max are columns"),
    (_values_and_scales, {"grouped": True}, r"aux output 'scale': a grouped GEMM writes D only"),
])
def test_misuse_names_the_fix(epilogue, kwargs, match):
    kwargs = {"d": gg.e4m3, "aux": {"scale": gg.f32}} | kwargs
    with pytest.raises(gg.RecipeError, match=match):
        gg.Recipe("t", epilogue, **kwargs)


def test_the_fixes_work():
    """Each fix as its message gives it builds the recipe."""
    gg.Recipe("t", _values_and_scales, d=gg.e4m3, aux={"scale": gg.f32})
    gg.Recipe("t", lambda acc: {**_values_and_scales(acc), "s": gg.sum(acc, dim=1)}, d=gg.e4m3,
              aux={"scale": gg.f32, "s": gg.f32})


def test_configs_that_cannot_hold_the_blocks_are_refused_and_never_chosen():
    from gemmgen.tuning.heuristic import candidate_configs, choose

    r = _quantized()
    with pytest.raises(gg.ConfigError, match=r"swap_ab=True: .* blocks of columns of a row \(gg.quantize, gg.rms_"):
        r.source(gg.KernelConfig(tile=(128, 64, 64), swap_ab=True))
    with pytest.raises(gg.ConfigError, match=r"tile N = 64: gg.quantize's blocks of 128 columns .* multiple of 128"):
        r.source(gg.KernelConfig(tile=(128, 64, 64)))
    with pytest.raises(gg.ConfigError, match=r"tile M = 64 \(1sm\): gg.quantize's blocks are reduced within a "
                                                r"thread's row .* use tile M = 128"):
        r.source(gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.ONE_SM, arch=gg.Arch.SM100A))
    assert "Sm100RowBlocks<" in r.source(r.default_config(gg.Arch.SM100A))
    for m in (1, 8, 4096):
        for arch in (gg.Arch.SM90A, gg.Arch.SM100A):
            choice = choose(r.ir, m, 7168, 4096, arch=arch)
            assert not choice.config.swap_ab and choice.config.tile[1] % 128 == 0, choice.why
            assert gg.codegen.is_valid(choice.config, r.ir) and choice.config.cta_tile[0] in (64, 128), choice.why
    assert any(c.tile[1] % 128 for c in candidate_configs(r.ir, 4096))  # pruned by the constraint, not absent


def test_row_blocks_have_no_gradient():
    for recipe in (_quantized(), _normed()):
        with pytest.raises(gg.RecipeError, match=r"D is computed per block of its rows .* does not differentiate"):
            recipe.backward()


def test_a_binary_without_the_quads_shuffles_is_refused():
    """The quad's shuffles prove the blocks' reduction is in the binary: a record without them (SHFL
    counted 0, all else as fp8_quantized's kernel's when compiled) fails the binary check every source
    goes through."""
    from gemmgen.codegen import render_kernel
    from gemmgen.compile.validate import sass_problem

    r = _quantized()
    gen = render_kernel(r.ir, r.default_config())
    problem = lambda meta: sass_problem(meta, gen.required_sass, gen.arch.value)  # noqa: E731
    assert ("SHFL",) in gen.required_sass
    sass = {"HGMMA": 8, "QGMMA": 0, "SHFL": 10, "SYNCS": 48, "USETMAXREG": 2, "UTMALDG": 2, "UTMASTG": 1}
    assert problem({"sass": sass, "local_bytes": 0}) is None
    assert "has no SHFL instruction" in str(problem({"sass": sass | {"SHFL": 0}, "local_bytes": 0}))


def test_the_op_refuses_gradients():
    """The torch op of a recipe with row blocks (on the CPU: the reference) says there is no gradient
    when one is asked for."""
    a = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    b, bias = torch.randn(128, 64).bfloat16().t(), torch.randn(128).bfloat16()
    d, scale = gg.op(_quantized())(a, b, bias)
    with pytest.raises(gg.InvalidArgument, match=r"D is computed per block of its rows .* does not differentiate"):
        (d.float() * scale.repeat_interleave(128, dim=1)).sum().backward()


@pytest.mark.parametrize("block", [128, 64])
def test_the_rms_norm_reference_is_torchs_per_head(block):
    """Fresh inputs, 3 heads, a head of zeros (rstd = 1 / sqrt(eps)): D and rstd against torch's
    F.rms_norm over each head, times the weight, and 1 / sqrt(mean(x^2) + eps) written out."""
    recipe = _normed(block, batched=True)
    heads = 3
    a, b = torch.randn(2, 7, 40).bfloat16(), torch.randn(2, 40, heads * block).bfloat16()
    b[..., block:2 * block] = 0.0
    bias, weight = torch.randn(heads * block).bfloat16(), torch.randn(heads * block)
    bias[block:2 * block] = 0.0
    d, rstd = recipe.reference(a, b, bias=bias, weight=weight)
    x = (a.float() @ b.float() + bias.float()).unflatten(-1, (heads, block))
    want = torch.nn.functional.rms_norm(x, (block,), eps=1e-5).flatten(-2) * weight
    torch.testing.assert_close(d.float(), want.bfloat16().float(), rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(rstd, 1.0 / (x.square().mean(dim=-1) + 1e-5).sqrt(), rtol=1e-6, atol=0)
    assert rstd.shape == (2, 7, heads) and torch.equal(rstd[..., 1], torch.full((2, 7), 1e-5).rsqrt())


@pytest.mark.parametrize("weighted", [True, False])
def test_emulated_kernels_normalize_each_head(weighted):
    """Each config that may run it, on the emulated shapes (partial last heads among them): D and
    rstd as the reference has them; without a weight the node reads one value, with one two
    (x * weight, and x for the statistic)."""
    recipe = _normed(64, weighted, batched=True)
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert [(c.arch, c.swap_ab) for c in configs] == [(gg.Arch.SM90A, False)] * 2 + [(gg.Arch.SM100A, False)] * 2
    for config in configs:
        ck = uncompiled(recipe, config)
        node = "Sm90RowBlocks" if config.arch is gg.Arch.SM90A else "Sm100RowBlocks"
        assert f"{node}<gemmgen::epi::RmsNormBlock<64, 0x3727c5acu>, 64," in ck.generated.source
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, f"{config.name} weighted={weighted}")


@pytest.mark.parametrize("mistake", ["eps", "block", "no statistic input"])
def test_rms_norm_mistakes_fail_the_check(mistake):
    """Another eps, heads of another width, or the statistic taken of D's value (x * weight) instead
    of x each fail the emulated call (the unchanged kernel passes)."""
    recipe, config, shape = _normed(64), EMULATED_CONFIGS[0], (130, 192, 24, 1)
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    policy = "RmsNormBlock<64, 0x3727c5acu>, 64,"
    change = {"eps": source_replaced("0x3727c5acu", "0x42c80000u"),  # 100.0
              "block": source_replaced(policy, "RmsNormBlock<32, 0x3727c5acu>, 32,"),
              "no statistic input": _one_input}[mistake]
    with pytest.raises(AssertionError):
        assert_computes(uncompiled(recipe, config, change), shape, mistake)


def _one_input(generated):
    """The root's second child (x, whose statistic the heads take) dropped: the statistic of x * weight."""
    import dataclasses
    import re

    source, n = re.subn(r"(Sm90TopologicalVisitor<float, cute::tuple<.*)cute::seq<(\d+), (\d+)>>",
                        r"\1cute::seq<\2>>", generated.source)
    assert n == 1, "the root's edges are not where the mistake expects them"
    return dataclasses.replace(generated, source=source)


def test_a_partial_last_head_is_normalized_over_its_own_columns_and_empty_problems_behave():
    """N = 100 with heads of 64: the second head's 36 columns are normalized over themselves (as
    F.rms_norm of them); M = 0 and N = 0 give empty outputs; K = 0 normalizes the bias alone."""
    recipe = _normed(64, weighted=False)
    k = uncompiled_kernel(recipe)
    a, b, bias = torch.randn(3, 16).bfloat16(), torch.randn(100, 16).bfloat16().t(), torch.randn(100).bfloat16()
    y, rstd = recipe.reference(a, b, bias=bias)
    x = a.float() @ b.float() + bias.float()
    want = torch.cat([torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-5) for h in x.split(64, dim=-1)], -1)
    torch.testing.assert_close(y.float(), want.bfloat16().float(), rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(rstd[:, 1], (x[:, 64:].square().mean(dim=-1) + 1e-5).rsqrt(), rtol=1e-6, atol=0)
    assert k.prepare(a, b, bias=bias).params is not None
    assert_computes(uncompiled(recipe, EMULATED_CONFIGS[0]), (3, 100, 16, 1), "a partial head")
    prep = k.prepare(a, torch.randn(0, 16).bfloat16().t(), bias=torch.randn(0).bfloat16())
    assert prep.params is None and prep.outputs[1].shape == (3, 0)
    bias = torch.randn(128).bfloat16()
    prep = k.prepare(torch.randn(3, 0).bfloat16(), torch.randn(128, 0).bfloat16().t(), bias=bias)
    want = torch.nn.functional.rms_norm(bias.float().unflatten(0, (2, 64)), (64,), eps=1e-5).flatten()
    torch.testing.assert_close(prep.outputs[0].float(), want.expand(3, 128).bfloat16().float())


def test_row_blocks_with_a_reduction_over_m():
    """D quantized per block of a row and each column's sum over M in one kernel: never swapped,
    the sum is the kernel's over its M (row_reduction.hpp), under the row blocks' epilogue tile."""
    recipe = gg.Recipe("t", lambda acc: {**_values_and_scales(acc), "s": gg.sum(acc, dim=0)}, d=gg.e4m3,
                       batched=True, aux={"scale": gg.f32, "s": gg.f32})
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert [(c.arch, c.swap_ab) for c in configs] == [(gg.Arch.SM90A, False)] * 2
    for config in configs:
        ck = uncompiled(recipe, config)
        assert "gemmgen::epi::Sm90RowReduction<" in ck.generated.source
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, config.name)


def _exp_shifted(block: int = 64, scale: float = 0.125, batched: bool = True) -> gg.Recipe:
    def epilogue(acc, bias):
        p, top = gg.exp_minus_max(acc + bias, block=block, scale=scale)
        return {"d": p, "max": top}

    return gg.Recipe(f"exp_{block}", epilogue, d=gg.f32, batched=batched, aux={"max": gg.f32},
                     operands={"bias": gg.RowVector(gg.bf16)})


def test_the_exp_minus_max_reference_is_a_blockwise_softmax_numerator():
    """Fresh inputs, N not a multiple of the block (its partial last block all negative), a NaN: D
    and each block's max against torch written out per block, and the blocks combined (online
    softmax) into torch's softmax over the row."""
    block, scale = 64, 0.125
    recipe = _exp_shifted(block, scale)
    a, b = torch.randn(2, 9, 40).bfloat16(), torch.randn(2, 40, 2 * block + 5).bfloat16()
    bias = torch.randn(b.shape[-1]).bfloat16()
    bias[2 * block:] = -100.0  # the partial last block all negative: its max is not 0
    d, top = recipe.reference(a, b, bias=bias)
    x = a.float() @ b.float() + bias.float()
    assert (top[..., 2] < 0).all()
    for j, start in enumerate(range(0, x.shape[-1], block)):
        part = x[..., start:start + block]
        torch.testing.assert_close(top[..., j], part.amax(dim=-1), rtol=0, atol=0)
        torch.testing.assert_close(d[..., start:start + block], torch.exp(scale * (part - top[..., j:j + 1])),
                                   rtol=1e-6, atol=0)
    assert top.shape == (2, 9, 3) and (d <= 1).all() and (d.amax(dim=-1) == 1).all()
    row_max = top.amax(dim=-1, keepdim=True)
    rescaled = d * torch.exp(scale * (top - row_max)).repeat_interleave(block, dim=-1)[..., :x.shape[-1]]
    torch.testing.assert_close(rescaled / rescaled.sum(dim=-1, keepdim=True), torch.softmax(scale * x, dim=-1),
                               rtol=1e-5, atol=1e-7)
    bias[3] = math.nan  # a NaN in the first block: its max and values NaN, as torch.amax gives
    d, top = recipe.reference(a, b, bias=bias)
    assert top[..., 0].isnan().all() and d[..., :block].isnan().all() and not top[..., 1:].isnan().any()


def test_emulated_kernels_take_exp_minus_max():
    recipe = _exp_shifted(64)
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert [(c.arch, c.swap_ab) for c in configs] == [(gg.Arch.SM90A, False)] * 2 + [(gg.Arch.SM100A, False)] * 2
    for config in configs:
        ck = uncompiled(recipe, config)
        node = "Sm90RowBlocks" if config.arch is gg.Arch.SM90A else "Sm100RowBlocks"
        assert f"{node}<gemmgen::epi::ExpMinusMaxBlock<0x3e000000u>, 64," in ck.generated.source
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, config.name)


@pytest.mark.parametrize("mistake", ["scale", "block", "the quantize policy"])
def test_exp_minus_max_mistakes_fail_the_check(mistake):
    """Another scale, blocks of another width, or another policy's statistic each fail the emulated
    call of a shape the unchanged kernel passes (all-negative rows: a max from 0 would be wrong)."""
    recipe, config, shape = _exp_shifted(64), EMULATED_CONFIGS[0], (130, 192, 24, 2)
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    policy = "ExpMinusMaxBlock<0x3e000000u>, 64,"
    change = {"scale": source_replaced(policy, "ExpMinusMaxBlock<0x3f800000u>, 64,"),
              "block": source_replaced(policy, "ExpMinusMaxBlock<0x3e000000u>, 32,"),
              "the quantize policy": source_replaced(policy, "QuantizeBlock<0x3e000000u>, 64,")}[mistake]
    with pytest.raises(AssertionError):
        assert_computes(uncompiled(recipe, config, change), shape, mistake)


def _as_outputs(values_and_maxima):
    p, top = values_and_maxima
    return {"d": p, "m": top}


def test_exp_minus_max_misuse_names_the_fix():
    with pytest.raises(gg.RecipeError, match=r"exp_minus_max: scale=0.0; expected a positive number"):
        gg.Recipe("t", lambda acc: _as_outputs(gg.exp_minus_max(acc, 64, scale=0.0)), aux={"m": gg.f32})
    with pytest.raises(gg.RecipeError, match=r"gives outputs, not values to compute with: return them, p, m = "
                                             r"gg.exp_minus_max\(x, block=128\)"):
        gg.Recipe("t", lambda acc: gg.exp_minus_max(acc, 64)[0] * 2.0)
    with pytest.raises(gg.RecipeError, match=r"exp_minus_max: block=100; expected one of 8, 16, 32, 64, 128"):
        gg.Recipe("t", lambda acc: _as_outputs(gg.exp_minus_max(acc, 100)), aux={"m": gg.f32})
    ok = gg.Recipe("t", lambda acc: gg.exp_minus_max(acc, 64)[0])  # the maxima are optional
    assert ok.ir.epilogue.row_blocks is not None

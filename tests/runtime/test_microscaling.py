"""Microscaled fp8 (`Recipe(block_scale=gg.MXFP8)`, sm_100a's block-scaled MMA): the DSL's rules,
the blocked order of the scales against two independent spellings of it, `quantize_mx`, the
reference against a dequantized product, the call's checks of the scales, and the configs.

The kernel itself is covered with the sm_100a kernels: its Params and scale tensor maps against
CUTLASS's host code (test_sm100_oracle.py: the compiled one-SM kernel and VALUE_CONFIGS' pairs,
multicast and swapped ones), its reads of A, B and the scales through them (test_sm100_emulation.py),
its SASS (test_sm100.py: UTCCP, the scales' copy into tensor memory).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen import is_valid, violations
from gemmgen.ir import microscaling
from gemmgen.ir.reference import accumulate, group_bounds
from gemmgen.runtime.checks import check_call
from gemmgen.testing.grouped import generator
from gemmgen.tuning.heuristic import choose

SM100 = gg.Arch.SM100A


def _recipe(**kw):
    kw.setdefault("block_scale", gg.MXFP8)
    return gg.Recipe("mx", kw.pop("epilogue", None), a=kw.pop("a", gg.e4m3), b=kw.pop("b", gg.e4m3), **kw)



@pytest.mark.parametrize("kw, match", [
    ({"a": gg.bf16, "b": gg.bf16}, r"block_scale: gemmgen.MXFP8 scales fp8 A and B \(e4m3/e5m2\); declare a=gg.e4m3"),
    ({"block_scale": "mxfp8"}, r"block_scale: expected \(M, N, K\) granularity ints such as \(1, 128, 128\), or "
                               r"gg.MXFP8, got 'mxfp8'"),
    ({"operands": {"scale_a": gg.ColVector(gg.f32)}, "epilogue": lambda acc, scale_a: acc * scale_a},
     r"operand 'scale_a': a block-scaled recipe's call takes scale_a and scale_b"),
])
def test_the_dsl_names_what_microscaling_needs(kw, match):
    with pytest.raises(gg.RecipeError, match=match):
        _recipe(**kw)


def test_the_ir_keys_microscaling_and_a_swap_keeps_it():
    mx, plain = _recipe(), gg.Recipe("mx", a=gg.e4m3, b=gg.e4m3)
    assert mx.ir.key != plain.ir.key
    assert [o.name for o in mx.ir.operands] == ["scale_a", "scale_b"]
    assert {o.dtype for o in mx.ir.operands} == {gg.DType.UE8M0}
    assert mx.ir.transposed().gemm.microscaling is gg.MXFP8  # the swapped kernel's A is B: both scaled along K


def _torch_to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """torch._scaled_mm's documented swizzle of (rows, cols) scales into 128 x 4 blocks, as a
    flat tensor: a second spelling of the order, written from its description, not from gemmgen's."""
    rows, cols = scales.shape
    n_row_blocks, n_col_blocks = -(-rows // 128), -(-cols // 4)
    padded = torch.nn.functional.pad(scales, (0, n_col_blocks * 4 - cols, 0, n_row_blocks * 128 - rows),
                                     value=microscaling.UE8M0_BIAS)
    blocks = padded.view(n_row_blocks, 128, n_col_blocks, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _cutlass_offset(row: int, column: int, row_blocks: int, k_blocks: int, batch: int) -> int:
    """CUTLASS's Sm1xxBlockScaledConfig layout, (((32, 4), row blocks), ((32, 4), K blocks), (1, L)) :
    (((16, 4), K blocks * 512), ((0, 1), 512), (0, row blocks * K blocks * 512)), at value row and
    scale column (a scale column is 32 values of K)."""
    return ((row % 32) * 16 + (row // 32 % 4) * 4 + (row // 128) * k_blocks * 512
            + column % 4 + (column // 4) * 512 + batch * row_blocks * k_blocks * 512)


@pytest.mark.parametrize("rows, k", [(1, 32), (130, 129), (128, 128), (300, 4096), (257, 1000)])
def test_the_blocked_order_is_cutlasss_and_torchs(rows, k):
    """`to_blocked` puts each scale where CUTLASS's layout and torch's swizzle put it; padding is 2^0."""
    gen = generator()
    columns = microscaling.scale_columns(k, gg.MXFP8)
    scales = torch.randint(0, 255, (2, rows, columns), dtype=torch.uint8, generator=gen)
    blocked = microscaling.to_blocked(scales)
    assert blocked.shape[-2:] == microscaling.blocked_shape(rows, k, gg.MXFP8)
    assert torch.equal(blocked[1].flatten(), _torch_to_blocked(scales[1]))
    flat = blocked.flatten()
    row_blocks, k_blocks = blocked.shape[-2] // 128, blocked.shape[-1] // 4
    for _ in range(50):
        b, r, c = (int(torch.randint(0, e, (1,), generator=gen)) for e in (2, rows, columns))
        assert flat[_cutlass_offset(r, c, row_blocks, k_blocks, b)] == scales[b, r, c]
    assert torch.equal(microscaling.from_blocked(blocked, rows, columns), scales)
    padding = torch.ones_like(blocked, dtype=torch.bool)
    padding[..., :rows, :columns] = False
    assert (microscaling.from_blocked(blocked, *blocked.shape[-2:])[padding] == microscaling.UE8M0_BIAS).all()


def test_quantize_mx_follows_the_ocp_floor_rule():
    """Each vector of 32 gets 2^(floor(log2 amax) - 8) for e4m3 (- 15 for e5m2), its values saturate at
    the fp8 maximum, a vector of zeros gets 2^0, and the K tail is a vector of its own."""
    x = torch.zeros(3, 70)
    x[0, :32] = torch.linspace(-3.0, 5.0, 32)  # amax 5: 2^(2 - 8)
    x[1, 32:64] = 1000.0  # 2^(9 - 8): 1000 / 2 = 500 saturates to 448
    x[2, 64:] = 0.25  # the tail of 6: 2^(-2 - 8)
    q, blocked = gg.quantize_mx(x)
    scales = microscaling.from_blocked(blocked, 3, 3).view(torch.uint8).int() - microscaling.UE8M0_BIAS
    assert scales.tolist() == [[-6, 0, 0], [0, 1, 0], [0, 0, -10]]
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert float(q[1, 40].float()) == 448.0
    assert torch.equal(q[0, :32].float(), (x[0, :32] * 64).to(torch.float8_e4m3fn).float())
    _, e5m2 = gg.quantize_mx(x, dtype=gg.e5m2)
    assert int(microscaling.from_blocked(e5m2, 3, 3).view(torch.uint8)[0, 0]) == microscaling.UE8M0_BIAS + 2 - 15
    with pytest.raises(gg.InvalidArgument, match=r"dtype: expected gg.e4m3 or gg.e5m2, got bf16"):
        gg.quantize_mx(x, dtype=gg.bf16)
    with pytest.raises(gg.InvalidArgument, match=r"scales: expected a torch.float8_e8m0fnu \(MXFP8\) or "
                                                 r"torch.float8_e4m3fn \(NVFP4\) tensor"):
        gg.to_blocked_scales(torch.ones(3, 3))


@pytest.mark.parametrize("m, n, k, batch", [(1, 7, 129, ()), (130, 33, 64, ()), (5, 200, 300, (3,))])
def test_the_reference_multiplies_each_value_by_its_power_of_two(m, n, k, batch):
    """acc = (A * 2^scale_a per row and 32 K) @ (B * 2^scale_b per column and 32 K), in fp64 here from
    the logical scales, against the reference reading them in blocked order; non-zero, fresh inputs."""
    gen = generator()
    recipe = _recipe(batched=bool(batch))
    a = torch.randn(*batch, m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(*batch, n, k, generator=gen).to(torch.float8_e4m3fn).mT
    columns = microscaling.scale_columns(k, gg.MXFP8)
    sa = torch.randint(120, 134, (*batch, m, columns), dtype=torch.uint8, generator=gen)
    sb = torch.randint(120, 134, (*batch, n, columns), dtype=torch.uint8, generator=gen)
    e8m0 = gg.DType.UE8M0.torch
    ops = {"scale_a": microscaling.to_blocked(sa.view(e8m0)), "scale_b": microscaling.to_blocked(sb.view(e8m0))}
    got = accumulate(recipe.ir.gemm, a, b, ops)
    wa = (sa.double() - 127).exp2().repeat_interleave(32, dim=-1)[..., :k]
    wb = (sb.double() - 127).exp2().repeat_interleave(32, dim=-1)[..., :k]
    want = (a.double() * wa) @ (b.double() * wb.mT)
    magnitude = (a.double() * wa).abs() @ (b.double() * wb.mT).abs()  # fp32 sums: K roundings of at most this
    assert want.abs().max() > 0
    assert ((got.double() - want).abs() <= k * 2.0**-24 * magnitude).all()
    assert torch.equal(recipe.reference(a, b, **ops), got.to(torch.bfloat16))


def test_quantized_operands_reproduce_the_product():
    """gg.quantize_mx's A and weight, through the reference, give A @ W^T within fp8's error."""
    gen = generator()
    a, w = torch.randn(70, 300, generator=gen), torch.randn(40, 300, generator=gen)
    (aq, sa), (wq, sb) = gg.quantize_mx(a), gg.quantize_mx(w)
    d = _recipe(d=gg.f32).reference(aq, wq.t(), scale_a=sa, scale_b=sb)
    want = a.double() @ w.double().t()
    assert (d.double() - want).norm() / want.norm() < 0.1


def _call(m=70, n=40, k=304, **change):
    gen = generator()
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()
    _, sa = gg.quantize_mx(torch.randn(m, k, generator=gen))
    _, sb = gg.quantize_mx(torch.randn(n, k, generator=gen))
    ops = {"scale_a": sa, "scale_b": sb, **change}
    return check_call(_recipe().ir, a, b, ops, require_cuda=False)


@pytest.mark.parametrize("change, error, match", [
    ({"scale_a": torch.ones(128, 12, dtype=torch.uint8)}, gg.InvalidArgument,
     r"scale_a: expected dtype torch.float8_e8m0fnu, got uint8; if it holds UE8M0 exponents \(2\^\(e - 127\)\), pass "
     r"scale_a.view\(torch.float8_e8m0fnu\)"),
    ({"scale_b": torch.ones(128, 12)}, gg.InvalidArgument,
     r"scale_b: expected dtype torch.float8_e8m0fnu \(the recipe declares ue8m0\), got torch.float32"),
    ({"scale_a": torch.ones(70, 10, dtype=torch.uint8).view(torch.float8_e8m0fnu)}, gg.InvalidArgument,
     r"scale_a: expected shape \(128, 12\) \(torch.float8_e8m0fnu \(round_up\(M, 128\), round_up\(ceil\(K/32\), 4\)\), "
     r"contiguous: one exponent per 32 values of K of each row of A, in the MMA's blocked order "
     r"\(gg.to_blocked_scales, or gg.quantize_mx\)\), got \(70, 10\)"),
    ({"scale_b": torch.ones(12, 128, dtype=torch.uint8).view(torch.float8_e8m0fnu).t()}, gg.LayoutMismatch,
     r"scale_b: the blocked order is a contiguous tensor, got strides \(1, 128\)"),
])
def test_the_call_checks_the_scales(change, error, match):
    with pytest.raises(error, match=match):
        _call(**change)


def test_the_call_accepts_quantize_mx_and_refuses_scales_past_32_bits():
    checked = _call()
    assert checked.operands["scale_a"].ptr and checked.operands["scale_b"].ptr
    rows = 2**29 + 128  # (rows, 4) blocked scales: past 2^31 bytes
    recipe = _recipe()
    a = torch.empty(rows, 128, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(64, 128, dtype=torch.float8_e4m3fn, device="meta").t()
    scales: dict[str, object] = {"scale_a": torch.empty(rows, 4, dtype=torch.float8_e8m0fnu, device="meta"),
                                 "scale_b": torch.empty(128, 4, dtype=torch.float8_e8m0fnu, device="meta")}
    with pytest.raises(gg.InvalidArgument, match=r"scale_a: \d+ scales per batch lie past the 2\^31 - 1 bytes"):
        check_call(recipe.ir, a, b, scales, require_cuda=False)


def test_sm90_refuses_microscaling_with_a_fix_that_works():
    recipe = _recipe()
    problems = violations(recipe.default_config(), recipe.ir)
    assert problems == ["block_scale=gemmgen.MXFP8: the MMA scales microscaled fp8 on sm_100a (B200) only; build it "
                        "with arch=Arch.SM100A, or declare block_scale=gg.DEEPSEEK_BLOCK_SCALE for sm_90a"]
    assert is_valid(recipe.default_config(SM100), recipe.ir)
    fixed = _recipe(block_scale=gg.DEEPSEEK_BLOCK_SCALE)
    assert is_valid(fixed.default_config(), fixed.ir)


@pytest.mark.parametrize("config, match", [
    (gg.KernelConfig(tile=(64, 128, 128), schedule=gg.Schedule.ONE_SM, arch=SM100),
     r"tile M = 64: the block-scaled MMA of gemmgen.MXFP8 computes 128 rows per SM; use tile M = 128"),
    (gg.KernelConfig(tile=(128, 128, 128), schedule=gg.Schedule.TWO_SM, cluster=(2, 1, 1), arch=SM100),
     r"tile M = 128: .* use tile M = 256 with the 2sm schedule"),
    (gg.KernelConfig(tile=(128, 32, 128), schedule=gg.Schedule.ONE_SM, swap_ab=True, arch=SM100),
     r"tile N = 32: CUTLASS's block-scaled main loop takes tile N = 64, 128, 192 or 256"),
    (gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM, arch=SM100),
     r"tile K = 64: a K tile of gemmgen.MXFP8 reads whole blocks of 4 scales \(128 values of K\); use tile K = 128"),
])
def test_sm100_configs_the_block_scaled_mma_cannot_run_are_refused(config, match):
    problems = violations(config, _recipe().ir)
    assert any(re.search(match, p) for p in problems), problems


def test_the_heuristic_picks_block_scaled_tiles_at_every_size():
    recipe = _recipe()
    for m in (1, 8, 64, 300, 1024, 8192):
        for n, k in ((4096, 4096), (1024, 8192), (14336, 4096)):
            config = choose(recipe.ir, m, n, k, arch=SM100).config
            assert is_valid(config, recipe.ir) and config.cta_tile[0] == 128, config.name


def test_the_op_takes_microscaled_operands_and_traces():
    """The op (CPU: the reference) takes the scales as they are, in a non-contiguous view too (it holds
    the same blocked order), traces with fake tensors, and refuses their gradients."""
    gen = generator()
    recipe = _recipe(epilogue=lambda acc, bias: acc + bias, operands={"bias": gg.RowVector(gg.bf16)})
    op = gg.op(recipe)
    (a, scale_a), (w, scale_b) = gg.quantize_mx(torch.randn(9, 96, generator=gen)), \
        gg.quantize_mx(torch.randn(40, 96, generator=gen))
    bias = torch.randn(40, generator=gen).bfloat16()
    want = recipe.reference(a, w.t(), scale_a=scale_a, scale_b=scale_b, bias=bias)
    assert want.float().abs().max() > 0
    torch.testing.assert_close(op(a, w.t(), scale_a.t().contiguous().t(), scale_b, bias), want, rtol=0, atol=0)
    torch.library.opcheck(op.default, (a, w.t(), scale_a, scale_b, bias),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(gg.InvalidArgument, match="scale_a: gemmgen has no gradient for block scales"):
        op(a, w.t(), scale_a.float().requires_grad_(True).to(scale_a.dtype), scale_b, bias).float().sum().backward()


@pytest.mark.parametrize("activation, bias", [("silu", True), (None, False)])
def test_mxfp8_linear_is_the_quantized_layer(activation, bias):
    """MXFP8Linear.from_linear: the weight and each call's input quantized per 32 values of K (the
    OCP floor rule), then x @ W^T + b and the activation: against that math in float64, every
    value times its vector's power of two (on the CPU the op runs the recipe's reference), and
    within fp8's precision of the bf16 layer; from_quantized takes the checkpoint's exponents in
    row order and gives the same layer."""
    gen = generator()
    linear = torch.nn.Linear(272, 300, bias=bias)  # in: a partial last vector of 32; out: past 256 rows
    with torch.no_grad():
        linear.weight.copy_(torch.randn(300, 272, generator=gen) * 0.05)
    layer = gg.nn.MXFP8Linear.from_linear(linear, activation=activation)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (384, 12)
    x = torch.randn(2, 7, 272, generator=gen)
    y = layer(x)
    assert y.shape == (2, 7, 300) and y.dtype == torch.bfloat16

    def dequantized(q, blocked):  # each value times 2^(e - 127) of its row's vector of 32
        e = microscaling.from_blocked(blocked, q.shape[0], 9).view(torch.uint8).double() - 127
        return q.double() * torch.pow(2.0, e).repeat_interleave(32, dim=-1)[:, :272]

    q, s = gg.quantize_mx(x.reshape(14, 272))
    pre = dequantized(q, s) @ dequantized(layer.weight, layer.weight_scale).t()
    if bias:
        assert layer.bias is not None
        pre = pre + layer.bias.double()
    act = {None: lambda v: v, "silu": torch.nn.functional.silu}[activation]
    want = act(pre).reshape(2, 7, 300)
    assert want.abs().max() > 0
    torch.testing.assert_close(y.double(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
    exact = act(linear(x).detach().double())
    assert float((y.double() - exact).norm() / exact.norm()) < 0.08  # e4m3 with power-of-two scales
    rows = microscaling.from_blocked(layer.weight_scale, 300, 9)
    again = gg.nn.MXFP8Linear.from_quantized(layer.weight, rows.view(torch.uint8), layer.bias, activation)
    assert torch.equal(again.weight_scale, layer.weight_scale) and torch.equal(again(x), y)
    fresh = gg.nn.MXFP8Linear(272, 300, bias=bias, activation=activation)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), y)


def test_mxfp8_linear_refuses_what_it_cannot_run_and_launches_on_sm100():
    """Shapes, dtypes and scales are checked when the layer is built; its launches are sm_100a's,
    and on sm_90a the policy names the arch that builds them."""
    with pytest.raises(gg.InvalidArgument, match="in_features 264 is not a multiple of 16"):
        gg.nn.MXFP8Linear(264, 128)
    w = torch.randn(128, 256).to(torch.float8_e4m3fn)
    with pytest.raises(gg.InvalidArgument, match=r"weight_scale: expected a torch.float8_e8m0fnu \(or uint8\) "
                                                 r"tensor of shape \(128, 8\)"):
        gg.nn.MXFP8Linear.from_quantized(w, torch.zeros(128, 2, dtype=torch.uint8))
    with pytest.raises(gg.InvalidArgument, match=r"weight: expected torch\.float8_e4m3fn"):
        gg.nn.MXFP8Linear.from_quantized(w.float(), torch.zeros(128, 8, dtype=torch.uint8))
    with pytest.raises(gg.InvalidArgument, match=r"dtype: expected torch\.bfloat16 or torch\.float16"):
        gg.nn.MXFP8Linear(256, 128, dtype=torch.float32)
    layer = gg.nn.MXFP8Linear(256, 128, activation="gelu")
    with pytest.raises(gg.InvalidArgument, match=r"input: expected a tensor of shape \(\.\.\., 256\)"):
        layer(torch.randn(3, 128))
    recipe, config = layer.launches(8, arch="sm_100a")
    assert config.arch is SM100 and is_valid(config, recipe.ir)
    assert gg.nn.model_launches(torch.nn.Sequential(layer), (8,), arch="sm_100a") == [(recipe, config)]
    with pytest.raises(gg.ConfigError, match=r"block_scale=gemmgen.MXFP8: the MMA scales microscaled fp8 on sm_100a"):
        layer.launches(8, arch="sm_90a")


def test_fuse_quantizes_a_model_to_mxfp8():
    """fuse(model, quantize="mxfp8", unpaired=True): each Linear (an activation's with it) becomes an
    MXFP8Linear; the model stays within fp8's precision of the bf16 one; its launches are sm_100a's."""
    gen = generator()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model = model.bfloat16()
    x = torch.randn(9, 256, generator=gen).bfloat16()
    with torch.no_grad():
        exact = model(x).double()
    fused: Any
    fused, report = gg.nn.fuse(model, quantize="mxfp8", unpaired=True)
    assert [type(m).__name__ for m in fused] == ["MXFP8Linear", "Identity", "MXFP8Linear"]
    assert any("Linear + SiLU -> MXFP8Linear(mxfp8_linear_silu_bias_bf16)" in line for line in report), report
    assert exact.abs().max() > 0 and float((fused(x).double() - exact).norm() / exact.norm()) < 0.1
    launches = gg.nn.model_launches(fused, tokens=(1, 300), arch="sm_100a")
    assert len(launches) == 4 and all(r.gemm.microscaling and c.arch is SM100 for r, c in launches)


@pytest.mark.parametrize("rows, offsets", [(37, (5, 5, 20, 30)), (400, (130, 131, 260, 399, 399)),
                                          (300, (-3, 500, 200)), (1, (1,))])
@pytest.mark.parametrize("fmt", [gg.MXFP8, gg.NVFP4])
def test_the_grouped_blocked_order_gives_each_group_blocks_of_its_own(rows, offsets, fmt):
    """A grouped kernel's scale_a (`to_blocked_scales(..., offsets=)`): (ceil(T/128) + G) blocks of
    rows, group g's from block first // 128 + g on, each group's region the blocked order of its
    own rows' scales (what the setup kernel's pointer and CUTLASS's layout of the group's shape
    read), no two groups' regions overlapping; offsets out of order or range bounded as the
    kernel bounds them."""
    gen = generator()
    offs = torch.tensor(offsets, dtype=torch.int32)
    columns = microscaling.scale_columns(200, fmt)
    scales = torch.randint(1, 120, (rows, columns), dtype=torch.uint8, generator=gen).view(fmt.scale_dtype.torch)
    blocked = gg.to_blocked_scales(scales, offsets=offs)
    assert blocked.shape == ((-(-rows // 128) + len(offsets)) * 128, -(-columns // 4) * 4)
    taken: set[int] = set()
    for g, (start, end) in enumerate(group_bounds(offsets, rows)):
        first = (start // 128 + g) * 128
        count = -(-(end - start) // 128) * 128
        region = blocked[first:first + count]
        assert region.shape[0] == count and not taken & set(range(first, first + count))
        taken |= set(range(first, first + count))
        want = scales[start:end].view(torch.uint8)
        assert torch.equal(microscaling.from_blocked(region, end - start, columns).view(torch.uint8), want)
    back = microscaling.from_grouped_blocked(blocked, offs, rows, columns)  # rows in no group kept too
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))
    q, from_x = gg.quantize_mx(torch.randn(rows, 200, generator=gen), fmt, offsets=offs)
    assert from_x.shape == blocked.shape and q.shape[0] == rows
    with pytest.raises(gg.InvalidArgument, match=r"offsets: expected a grouped GEMM's int32 group ends"):
        gg.to_blocked_scales(scales, offsets=offs.long())


def test_a_grouped_call_checks_the_grouped_blocked_scales():
    """Their dtype, shape (with the function that makes them) and contiguity, before any launch."""
    from gemmgen.runtime.grouped_checks import check_grouped_call
    from gemmgen.testing.grouped import moe_mx_recipe, mx_grouped_inputs

    recipe = moe_mx_recipe(gg.MXFP8)
    a, b, offs, inputs = mx_grouped_inputs(gg.MXFP8, 37, 256, 136, 4, (5, 5, 20, 30))
    ops: dict[str, object] = {**inputs}
    call = check_grouped_call(recipe.ir, a, b, offs, ops, require_cuda=False)
    # bytes per block of 128 rows, and per group (scale_b's: 136 columns of B padded to 256 rows)
    assert call.operands["scale_a"].strides == (128 * 8, 0, 0)  # type: ignore[union-attr]
    assert call.operands["scale_b"].strides == (128 * 8, 0, 256 * 8)  # type: ignore[union-attr]
    with pytest.raises(gg.InvalidArgument, match=r"scale_a: expected shape \(640, 8\) \(torch.float8_e8m0fnu "
                                                 r"\(\(ceil\(rows/128\) \+ groups\) \* 128, .*\("
                                                 r"gg.quantize_mx\(x, fmt, offsets=offsets\)"):
        check_grouped_call(recipe.ir, a, b, offs, {**ops, "scale_a": inputs["scale_a"][:128]}, require_cuda=False)
    with pytest.raises(gg.LayoutMismatch, match=r"scale_b: the blocked order is a contiguous tensor"):
        check_grouped_call(recipe.ir, a, b, offs, {**ops, "scale_b": inputs["scale_b"].mT.contiguous().mT},
                           require_cuda=False)

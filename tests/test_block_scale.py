"""fp8 block scaling (`Recipe(block_scale=...)`): the DSL's rules, the IR's key, the configs, the
reference against a per-K-block sum, `quantize_blockwise`, and the call's checks of the scales.

The kernel itself (CUTLASS's blockwise main loop, compiled with NVRTC) is covered with every
example kernel: its Params against CUTLASS's host code (test_oracle.py), its reads of A, B and the
scales through those Params (test_runtime.py's emulation), its SASS (test_kernels.py), and on a
GPU by tests/test_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import gemmgen as gg
from gemmgen.config import KernelConfig, Schedule, default_config, is_valid, scale_tma, violations
from gemmgen.quantize import random_block_scale
from gemmgen.reference import FP8_MAX, accumulate
from gemmgen.runtime.checks import check_call
from gemmgen.select import choose

DEEPSEEK = gg.DEEPSEEK_BLOCK_SCALE


def _recipe(**kw):
    kw.setdefault("block_scale", DEEPSEEK)
    return gg.Recipe("blocks", kw.pop("epilogue", None), a=gg.e4m3, b=gg.e4m3, **kw)


def _gen() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kw, match", [
    ({"block_scale": (1, 128)}, r"block_scale: expected \(M, N, K\) granularity ints"),
    ({"block_scale": (3, 128, 128)}, r"block_scale: M granularity 3 must be a power of two"),
    ({"block_scale": (1, 256, 128)}, r"block_scale: N granularity 256 must be a power of two from 1 to 128"),
    ({"block_scale": (1, 128, 64)}, r"block_scale: K granularity 64 must be 128"),
    ({"block_scale": DEEPSEEK, "a": gg.bf16, "b": gg.bf16}, r"block_scale: block scaling is for fp8 A and B"),
    ({"block_scale": DEEPSEEK, "grouped": True}, r"block_scale: grouped GEMMs with block scales are not supported"),
    ({"block_scale": DEEPSEEK, "epilogue": lambda acc, scale_a: acc * scale_a,
      "operands": {"scale_a": gg.ColVector(gg.f32)}},
     r"operand 'scale_a': a block-scaled recipe's call takes scale_a and scale_b"),
    ({"block_scale": DEEPSEEK, "epilogue": lambda acc: {"d": acc, "s": gg.sum(acc, dim=0)}, "aux": {"s": gg.f32}},
     r"a reduction over M \(dim=0\) needs a swapped kernel, and block-scaled kernels are built unswapped"),
])
def test_invalid_block_scaled_recipes_are_refused(kw, match):
    kw = {"a": gg.e4m3, "b": gg.e4m3, **kw}
    epilogue = kw.pop("epilogue", None)
    with pytest.raises(gg.RecipeError, match=match):
        gg.Recipe("blocks", epilogue, **kw)


def test_block_scales_are_the_first_operands_and_enter_the_key():
    plain = gg.Recipe("plain", lambda acc, bias: acc + bias, a=gg.e4m3, b=gg.e4m3,
                      operands={"bias": gg.RowVector(gg.bf16)})
    scaled = _recipe(epilogue=lambda acc, bias: acc + bias, operands={"bias": gg.RowVector(gg.bf16)})
    assert [o.name for o in scaled.operands] == ["scale_a", "scale_b", "bias"]
    assert [o.kind for o in scaled.operands[:2]] == [gg.OperandKind.SCALE_A, gg.OperandKind.SCALE_B]
    assert [o.name for o in plain.operands] == ["bias"]
    assert "block_scale" not in str(plain.ir.canonical())  # keys of recipes without block scales stay
    assert scaled.key != plain.key != _recipe(block_scale=(128, 128, 128)).key
    swapped = scaled.ir.transposed()
    assert swapped.gemm.block_scale == (128, 1, 128) and swapped.transposed() == scaled.ir


def test_configs_keep_tile_k_at_the_scales_k_and_stay_unswapped():
    ir = _recipe().ir
    assert is_valid(default_config(ir), ir) and default_config(ir).tile[2] == 128
    assert scale_tma(default_config(ir), ir) == (True, False)  # 128 scales of A per tile: TMA; B's one: cp.async
    problems = violations(KernelConfig(tile=(128, 128, 64)), ir)
    assert any("tile K = 64: must equal the block scales' K granularity 128" in p for p in problems)
    assert any("block-scaled kernels are built unswapped" in p
               for p in violations(KernelConfig(tile=(128, 128, 128), swap_ab=True), ir))
    assert any("tile N = 64: must be a multiple of the block scales' N granularity 128" in p
               for p in violations(KernelConfig(tile=(64, 64, 128), schedule=Schedule.PINGPONG), ir))
    with pytest.raises(gg.ConfigError, match="tile K = 64"):
        ir_recipe = _recipe(config=KernelConfig(tile=(128, 128, 64)))  # noqa: F841
    for m in (1, 7, 64, 65, 1000, 16384):  # the heuristic finds an unswapped config at every M
        for n, k in ((4096, 7168), (576, 7168), (7168, 2048)):
            cfg = choose(ir, m, n, k).config
            assert is_valid(cfg, ir) and not cfg.swap_ab, (m, n, k, cfg)


@pytest.mark.parametrize("m, n, k, batch", [(1, 1, 1, None), (37, 300, 1000, None), (129, 256, 384, 2),
                                            (5, 130, 257, None)])
def test_reference_is_the_per_k_block_sum_of_scaled_products(m, n, k, batch):
    """The recipe's accumulator against the main loop's own order, in float64: each K block's
    product of the fp8 values, times that block's two scales, summed over the K blocks."""
    gen = _gen()
    r = _recipe(batched=batch is not None)
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(*lead, n, k, generator=gen).to(torch.float8_e4m3fn).transpose(-1, -2)
    sa = random_block_scale(gg.OperandKind.SCALE_A, r.gemm, m, n, k, lead)
    sb = random_block_scale(gg.OperandKind.SCALE_B, r.gemm, m, n, k, lead)
    want = torch.zeros(*lead, m, n, dtype=torch.float64)
    for kb in range(-(-k // 128)):
        ks = slice(128 * kb, 128 * (kb + 1))
        part = a[..., ks].double() @ b[..., ks, :].double()
        per_n = sb[..., kb, :].double().repeat_interleave(128, dim=-1)[..., :n]
        want += part * sa[..., :, kb:kb + 1].double() * per_n.unsqueeze(-2)
    assert want.abs().sum() > 0
    got = accumulate(r.gemm, a, b, {"scale_a": sa, "scale_b": sb})
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    d = r.reference(a, b, scale_a=sa, scale_b=sb)
    assert d.dtype == torch.bfloat16 and d.shape == (*lead, m, n)


def test_quantize_blockwise_round_trips_within_fp8_precision():
    gen = _gen()
    x = torch.randn(3, 200, 300, generator=gen) * torch.rand(3, 200, 1, generator=gen) * 100
    x[0, :7] = 0  # all-zero blocks get scale 1
    for block, layout in (((1, 128), gg.ColMajor), ((128, 128), gg.RowMajor), ((32, 64), gg.RowMajor)):
        q, scale = gg.quantize_blockwise(x, block, scale_layout=layout)
        rows, cols = -(-200 // block[0]), -(-300 // block[1])
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.stride() == x.stride()
        assert scale.shape == (3, rows, cols) and scale.dtype == torch.float32
        contiguous = -2 if layout is gg.ColMajor else -1
        assert scale.stride(contiguous) == 1 and scale.stride(-3 - contiguous) % 4 == 0  # 16-byte leading dim
        full = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :200, :300]
        back = q.float() * full
        # e4m3 keeps 3 mantissa bits: half a unit in the last place is 2^-4 of the value; below 2^-6
        # (in units of the scale) values are subnormal, spaced 2^-9 apart
        bound = torch.maximum(x.abs() * 2**-4, full * 2**-10)
        assert ((back - x).abs() <= bound * (1 + 1e-6)).all(), block
        assert (q.float().abs().amax() <= FP8_MAX[gg.e4m3]).item()
        if block[0] <= 7:
            assert (scale[0, 0, 0] == 1.0).item()
    wide = x.transpose(-1, -2)  # q keeps the memory order of a transposed view too (B as W.t())
    q, _ = gg.quantize_blockwise(wide, (128, 128))
    assert q.stride() == wide.stride()
    with pytest.raises(gg.InvalidArgument, match=r"dtype: expected gg\.e4m3 or gg\.e5m2"):
        gg.quantize_blockwise(x, (1, 128), dtype=gg.bf16)
    with pytest.raises(gg.InvalidArgument, match="block: expected"):
        gg.quantize_blockwise(x, (0, 128))


def _call(r, m=64, n=256, k=512, **replace):
    lead = (2,) if r.gemm.batched else ()
    a = torch.randn(*lead, m, k).to(torch.float8_e4m3fn)
    b = torch.randn(*lead, n, k).to(torch.float8_e4m3fn).transpose(-1, -2)
    ops: dict[str, object] = {o.name: random_block_scale(o.kind, r.gemm, m, n, k, lead) for o in r.operands}
    ops.update(replace)
    return check_call(r.ir, a, b, ops, require_cuda=False)


def test_scales_are_checked_before_launch():
    r = _recipe()
    call = _call(r)
    assert call.operands["scale_a"].strides == (1, 64, 0) and call.operands["scale_b"].strides == (1, 4, 0)
    with pytest.raises(gg.InvalidArgument, match=r"scale_a: missing operand; pass scale_a=\.\.\. \(fp32 "
                                                 r"\(ceil\(M/1\), ceil\(K/128\)\), M-major"):
        check_call(r.ir, torch.randn(4, 128).to(torch.float8_e4m3fn),
                   torch.randn(128, 128).to(torch.float8_e4m3fn).t().contiguous().t(), {}, require_cuda=False)
    with pytest.raises(gg.InvalidArgument, match=r"scale_a: expected shape \(64, 4\)"):
        _call(r, scale_a=torch.ones(64, 5))
    with pytest.raises(gg.InvalidArgument, match=r"scale_b: expected dtype torch.float32"):
        _call(r, scale_b=torch.ones(4, 2, dtype=torch.bfloat16))
    with pytest.raises(gg.LayoutMismatch, match=r"scale_a: the kernel reads block scales M-major .* pass "
                                                r"scale_a.t\(\).contiguous\(\).t\(\)"):
        _call(r, scale_a=torch.ones(64, 4))  # row-major: K-major
    with pytest.raises(gg.LayoutMismatch, match=r"scale_b: the kernel reads block scales N-major"):
        _call(r, scale_b=torch.ones(2, 4).t())
    odd = torch.ones(4, 66)[:, :64].t()  # M-major, K blocks 66 apart: not 16 bytes (TMA)
    with pytest.raises(gg.LayoutMismatch, match=r"scale_a: stride 66 between K blocks must be >= 64 and a multiple "
                                                r"of 4 \(the kernel loads these scales with TMA\)"):
        _call(r, scale_a=odd)
    b_odd = torch.ones(4, 3)[:, :2]  # B's scales are read with cp.async: 4-byte steps suffice
    assert _call(r, scale_b=b_odd).operands["scale_b"].strides == (1, 3, 0)
    batched = _recipe(batched=True)
    shared = random_block_scale(gg.OperandKind.SCALE_A, batched.gemm, 64, 256, 512)
    with pytest.raises(gg.LayoutMismatch, match=r"scale_a: batch stride 0 must be a non-zero multiple of 4"):
        _call(batched, scale_a=shared.expand(2, 64, 4))

"""The traced reference (the recipe's own semantics) against independently written torch code."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import gemmgen as gg
from gemmgen.ir import Columns
from gemmgen.ir.reference import reference
from gemmgen.runtime.quantize import random_block_scale
from gemmgen.testing.calls import dense, output_tolerance
from gemmgen.testing.tensors import FP32_UNIT_ROUNDOFF, assert_output_close, assert_outputs_close

# One ulp of the output type: the two sides differ only in fp32 rounding order before the final cast.
TOL = {torch.bfloat16: (2**-7, 2**-7), torch.float16: (2**-10, 2**-10), torch.float32: (1e-5, 1e-5),
       torch.float8_e4m3fn: (2**-3, 2**-9), torch.float8_e5m2: (2**-2, 2**-16)}
SHAPES = [(1, 8, 16), (7, 129, 64), (129, 1000, 65), (256, 24, 4097)]


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; printed on failure
    return torch.Generator().manual_seed(seed)


def _operands_for(recipe, m, n, gen, batch=None, k=None):
    out: dict[str, torch.Tensor | float] = {}
    lead = (batch,) if batch else ()
    for o in recipe.operands:
        dt = o.dtype.torch
        if o.kind.block_scale:
            out[o.name] = random_block_scale(o.kind, recipe.gemm, m, n, k, lead)
        elif o.kind is gg.OperandKind.SCALAR:
            out[o.name] = torch.randn(lead, generator=gen) if o.per_batch else float(torch.randn((), generator=gen))
        elif o.kind is gg.OperandKind.SEED:  # 63 bits
            out[o.name] = int(torch.randint(0, 2**62, (), generator=gen)) * 2 + 1
        elif o.kind is gg.OperandKind.ROW:
            out[o.name] = torch.randn(*lead[:o.per_batch], n, generator=gen).to(dt)
        elif o.kind is gg.OperandKind.COL and not dt.is_floating_point:  # a class index per row (gg.gather)
            out[o.name] = torch.randint(0, n, (*lead[:o.per_batch], m), generator=gen, dtype=dt)
        elif o.kind is gg.OperandKind.COL:
            out[o.name] = torch.randn(*lead[:o.per_batch], m, generator=gen).to(dt)
        else:
            out[o.name] = torch.randn(*lead[:o.per_batch], m, o.columns.extent(n), generator=gen).to(dt)
    return out


def _accumulator(recipe, a, b, ops):
    """A @ B in fp32; with block scales, each 128-wide K block's product times its scales, summed;
    microscaled, each 32-wide K block's product times its powers of two (read through CUTLASS's
    layout formula, not gemmgen's blocked-order code), summed."""
    if recipe.gemm.microscaling is not None:
        return _microscaled_accumulator(a, b, ops)
    if recipe.gemm.block_scale is None:
        return a.float() @ b.float()
    gm, gn, gk = recipe.gemm.block_scale
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    acc = torch.zeros(*a.shape[:-2], m, n, dtype=torch.float64)
    for kb in range(-(-k // gk)):
        part = a[..., kb * gk:(kb + 1) * gk].double() @ b[..., kb * gk:(kb + 1) * gk, :].double()
        rows = ops["scale_a"][..., :, kb].double().repeat_interleave(gm, dim=-1)[..., :m]
        cols = ops["scale_b"][..., kb, :].double().repeat_interleave(gn, dim=-1)[..., :n]
        acc += part * rows.unsqueeze(-1) * cols.unsqueeze(-2)
    return acc.float()


def _microscaled_accumulator(a, b, ops):
    """sum over 32-wide K blocks kb of (A_kb @ B_kb) * 2^(scale_a[m, kb] - 127) * 2^(scale_b[n, kb] - 127),
    each scale at (r % 32) * 16 + (r // 32 % 4) * 4 + (r // 128) * K blocks * 512 + kb % 4 + (kb // 4) * 512
    of its batch's blocked bytes (CUTLASS's Sm1xxBlockScaledConfig)."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]

    def exponents(scales, rows):
        raw = scales.view(torch.uint8).flatten(-2)
        k_blocks = scales.shape[-1] // 4
        r, kb = torch.arange(rows)[:, None], torch.arange(-(-k // 32))[None, :]
        at = (r % 32) * 16 + (r // 32 % 4) * 4 + (r // 128) * k_blocks * 512 + kb % 4 + (kb // 4) * 512
        return (raw[..., at].double() - 127).exp2()  # (..., rows, K blocks)

    sa, sb = exponents(ops["scale_a"], m), exponents(ops["scale_b"], n)
    acc = torch.zeros(*a.shape[:-2], m, n, dtype=torch.float64)
    for kb in range(-(-k // 32)):
        part = a[..., kb * 32:(kb + 1) * 32].double() @ b[..., kb * 32:(kb + 1) * 32, :].double()
        acc += part * sa[..., :, kb].unsqueeze(-1) * sb[..., :, kb].unsqueeze(-2)
    return acc.float()


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 on int64 tensors of 32-bit values, each product taken whole (int64
    wraps; its low 32 bits are the uint32 product's): not gemmgen's split products."""
    x = (x ^ (x >> 16)) * 0x7FEB352D & 0xFFFFFFFF
    x = (x ^ (x >> 15)) * 0x846CA68B & 0xFFFFFFFF
    return x ^ (x >> 16)


def _uniform(seed: int, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """gg.rand's numbers as docs/design/recipes.md defines them: lowbias32 chained over the seed's low and
    high halves, the stream, the batch, the row and the column; the top 24 bits over 2^24."""
    l, m, n = shape if len(shape) == 3 else (1, *shape)  # noqa: E741
    start = _lowbias32(_lowbias32(_lowbias32(torch.tensor(seed & 0xFFFFFFFF)) ^ (seed >> 32)) ^ stream)
    tile = _lowbias32(start ^ torch.arange(l).reshape(-1, 1, 1))
    h = _lowbias32(_lowbias32(tile ^ torch.arange(m).reshape(1, -1, 1)) ^ torch.arange(n).reshape(1, 1, -1))
    u = (h >> 8).double() / 2**24
    return u.reshape(shape).float()


def _rounded_bf16(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x to bf16 toward zero, or one bf16 step away from zero where x's 16 low bits plus
    floor(u * 2^16) carry: the stochastic rounding of docs/design/recipes.md."""
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    toward = ((bits & 0xFFFF0000) - (((bits >> 31) & 1) << 32)).int().view(torch.float32)
    away = torch.nextafter(toward.bfloat16(), torch.where(x < 0, -torch.inf, torch.inf).bfloat16()).float()
    return torch.where((bits & 0xFFFF) + (u * 65536).floor().long() >= 65536, away, toward)


def _independent(name, acc, ops):
    """The same math as examples/recipes.py and tests/data/extra_recipes.py, written with torch directly."""
    f = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}
    if name == "gemm_bf16":
        return (acc.bfloat16(),)
    if name == "bias_gelu":
        return (F.gelu(acc + f["bias"]).bfloat16(),)
    if name == "bias_silu_residual":
        return ((F.silu(acc + f["bias"]) + f["residual"]).bfloat16(),)
    if name in ("linear_combination", "linear_combination_swapped"):
        return (f["alpha"] * acc + f["beta"] * f["c"],)
    if name == "bias_gelu_aux":
        pre = acc + f["bias"]
        d = F.gelu(pre, approximate="tanh")
        return d.bfloat16(), pre.bfloat16(), d.abs().flatten(-2).max(dim=-1).values
    if name == "quick_gelu_scaled":
        x = f["scale"][:, None] * acc + f["bias"]
        return ((x * torch.sigmoid(1.702 * x)).half(),)
    if name == "fp8_block_scaled":
        return (acc.bfloat16(),)
    if name == "mxfp8_linear":
        return ((acc + f["bias"]).bfloat16(),)
    if name == "block_scaled_swapped":
        y = acc + f["bias"]
        return y.bfloat16(), y.sum(dim=-2)
    if name == "scaled_mm_fp8":
        return ((acc * f["scale_a"][:, None] * f["scale_b"] + f["bias"]).bfloat16(),)
    if name == "every_op":
        x = 0.5 * acc + f["c"]
        y = torch.clamp(F.leaky_relu(x, 0.2), -4.0, 4.0)
        z = (y.abs() / (1.0 + torch.exp(-y))).bfloat16().float()
        w = torch.tanh(z) - torch.sigmoid(f["r2"]) * (2.0 - f["bias"])
        return (torch.maximum(torch.minimum(w, f["scale"][:, None]), F.relu(-w) + F.gelu(w, approximate="tanh")),)
    if name == "swapped":  # bias (L, N), alpha (L,): one per batch; r2 (M, N) for every batch
        pre = acc * f["scale"][:, None] * f["alpha"][:, None, None] + f["bias"][:, None, :]
        dropped = _uniform(ops["seed"], 0, acc.shape) < 0.125
        d = torch.where(dropped, 0.0, F.silu(pre) * (8.0 / 7.0)) + f["c"] * f["r2"]
        rounded = _rounded_bf16(pre, _uniform(ops["seed"], 1, acc.shape))
        return d.bfloat16(), rounded.bfloat16(), d.abs().flatten(-2).max(dim=-1).values
    if name == "fp8_quantized":  # per token and 128 columns: max |x| / 448 (1 for zeros), x over it in e4m3
        x = F.gelu(acc + f["bias"])
        blocks = F.pad(x, (0, -x.shape[-1] % 128)).unflatten(-1, (-1, 128))
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, 1.0)
        q = (blocks / scale).flatten(-2)[..., :x.shape[-1]].clamp(-448, 448).to(torch.float8_e4m3fn)
        return q.float(), scale.squeeze(-1)
    if name == "qk_norm":  # an RMSNorm over each head of 128 columns (a partial last one over its own), times w
        heads = acc.split(128, dim=-1)
        y = torch.cat([F.rms_norm(h, (h.shape[-1],), eps=1e-6) for h in heads], dim=-1) * f["weight"]
        return y.bfloat16(), torch.stack([(h.square().mean(dim=-1) + 1e-6).rsqrt() for h in heads], dim=-1)
    if name == "residual_norm_stats":
        h = acc + f["residual"]
        return h.bfloat16(), (h * h).sum(dim=-1), h.abs().amax(dim=-1)
    if name == "block_softmax":  # exp(x / 8 - the max of its block of 128 columns), and the maxima
        x = acc + f["bias"]
        n = x.shape[-1]
        top = F.pad(x, (0, -n % 128), value=-math.inf).unflatten(-1, (-1, 128)).amax(dim=-1)
        return torch.exp(0.125 * (x - top.repeat_interleave(128, dim=-1)[..., :n])).bfloat16(), top
    if name == "row_col_amax":  # max |y| per token (over N) and per channel (over M)
        y = acc + f["bias"]
        return y.bfloat16(), y.abs().amax(dim=-1), y.abs().amax(dim=-2)
    if name == "column_stats":
        y = acc * f["row_scale"][:, None]
        quantized = y.clamp(-448, 448).to(torch.float8_e4m3fn).half()
        return quantized, y.sum(dim=(0, -2)), y.abs().amax(dim=-2), y.abs().flatten(-2).max(dim=-1).values
    if name == "row_extrema":  # bias (L, N); position (M, N) for every batch; target (L, M), some outside N
        y = acc + f["bias"][:, None, :] + f["position"]
        target = f["target"].long()
        inside = (target >= 0) & (target < y.shape[-1])
        logit = y.gather(-1, target.clamp(0, max(y.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1) if y.shape[-1] \
            else torch.zeros(target.shape)
        return (y.bfloat16(), y.amax(dim=-1), y.amin(dim=-1), torch.logsumexp(y, dim=-1), y.amax(dim=(-2, -1)),
                y.amin(dim=(-2, -1)), torch.where(inside, logit, 0.0))
    if name == "stream_k":
        y = F.silu(acc + f["bias"])
        return y.bfloat16(), y.sum(dim=-1)
    if name == "select_ops":
        bias, one = f["bias"], torch.tensor(1.0)
        first = torch.where(acc > bias, torch.erf(acc - bias), torch.sin(acc - bias) * torch.cos(acc))
        second = torch.clamp(acc, min=0.5) * torch.clamp(acc, min=-1.0)  # where(acc <= 0.5, 0.5, acc) ...
        step = torch.where((acc < -1e30) | (acc == 3e38) | (acc != acc), one, torch.tensor(0.0))
        dropped = _uniform(ops["seed"], 0, acc.shape) < 0.125
        rounded = _rounded_bf16(first, _uniform(ops["seed"], 1, acc.shape))
        return torch.where(dropped, 0.0, first + second - step).bfloat16(), rounded.bfloat16()
    if name == "swiglu":  # B's columns interleave gate and up
        return ((F.silu(acc[..., 0::2]) * acc[..., 1::2]).bfloat16(),)
    if name == "pair_ops":
        gate, up = acc[..., 0::2], acc[..., 1::2]
        h = F.gelu(gate) * up * f["scale"][:, None] + f["residual"]
        c, s = f["cos"], f["sin"]
        rot = torch.stack((gate * c - up * s, gate * s + up * c), dim=-1).flatten(-2)
        gate_only = torch.stack((gate, torch.zeros_like(gate)), dim=-1).flatten(-2)
        return (h.bfloat16(), F.silu(gate) * up, rot.bfloat16(), gate_only.bfloat16(), (h * h).sum(dim=-1),
                h.abs().flatten(-2).max(dim=-1).values)
    if name == "weight_grad_accumulate_fp8block_wgrad":  # fp32, added to main_grad
        return (acc + f["main_grad"],)
    if name == "fc1_fp8block_fprop_train":  # and the accumulator saved in bf16
        return F.gelu(acc + f["bias"]).bfloat16(), acc.bfloat16()
    if name == "swiglu_fc1_fp8block_fprop_train":
        return (F.silu(acc[..., 0::2]) * acc[..., 1::2]).bfloat16(), acc.bfloat16()
    if name in ("fc1_fp8block_fprop_train_q", "fc1_fp8block_fprop_bwd_q"):  # D rounded to bf16, then quantized
        # gg.gelu's erf form and its derivative written out: a single-row block of a partial last block
        # quantizes any nonzero to +-448, so a gelu of -10 must be the same 0 (or not) as the recipe's
        cdf = lambda x: 0.5 * (1.0 + (x * (1.0 / math.sqrt(2.0))).erf())  # noqa: E731
        if name.endswith("train_q"):  # per token and 128 columns (D) and per column and 128 tokens (D^T)
            x = acc + f["bias"]
            d, rest = 0.5 * x * (1.0 + (x * (1.0 / math.sqrt(2.0))).erf()), (acc.bfloat16(),)
        else:
            x = f["saved_acc"] + f["bias"]
            d = acc * (cdf(x) + x * (-0.5 * x * x).exp() * (1.0 / math.sqrt(2.0 * math.pi)))
            rest = (d.sum(dim=-2),)
        h = d.bfloat16().float()

        def rows(x):  # per row and block of 128: max |x| / 448 (1 for zeros), x over it in e4m3
            blocks = F.pad(x, (0, -x.shape[-1] % 128)).unflatten(-1, (-1, 128))
            amax = blocks.abs().amax(dim=-1, keepdim=True)
            scale = torch.where(amax > 0, amax / 448.0, 1.0)
            q = (blocks / scale).flatten(-2)[..., :x.shape[-1]].clamp(-448, 448).to(torch.float8_e4m3fn)
            return q.float(), scale.squeeze(-1)

        return (*rows(h), *rows(h.transpose(-1, -2)), *rest)
    if name == "fc1_fp8block_fprop_bwd":
        name = "bias_gelu_bwd"
    if name == "fc1_fp8tensor_fprop_bwd":  # the accumulator times both operands' per-tensor scales first
        acc, name = acc * f["scale_a"] * f["scale_b"], "bias_gelu_bwd"
    if name == "swiglu_fc1_fp8block_fprop_bwd":
        name = "swiglu_bwd"
    if name == "swiglu_bwd":  # torch's silu_backward on the saved gate, times up; silu(gate) for up
        gate, up = f["saved_acc"][..., 0::2], f["saved_acc"][..., 1::2]
        d = torch.stack((torch.ops.aten.silu_backward(acc * up, gate), acc * F.silu(gate)), dim=-1).flatten(-2)
        return (d.bfloat16(),)
    if name == "bias_gelu_bwd":  # torch's own gelu_backward from the saved accumulator, and its column sums
        d_pre = torch.ops.aten.gelu_backward(acc, f["saved_acc"] + f["bias"])
        return d_pre.bfloat16(), d_pre.sum(dim=-2)
    raise KeyError(name)


def _all_recipes(examples, extra):
    return list(dense(examples).values()) + list(extra.values())  # grouped: tests/ir/test_grouped_reference.py


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_matches_independent_torch(examples, extra, shape, gen):
    m, n, k = shape
    for recipe in _all_recipes(examples, extra):
        n = shape[1] + shape[1] % 2 if recipe.ir.epilogue.pairs else shape[1]  # pairs: an even N
        batch = 3 if recipe.gemm.batched else None
        lead = (batch,) if batch else ()
        a = torch.randn(*lead, m, k, generator=gen).to(recipe.gemm.a.torch)
        b = torch.randn(*lead, k, n, generator=gen).to(recipe.gemm.b.torch)  # e4m3 x e5m2 recipes mix them
        ops = _operands_for(recipe, m, n, gen, batch, k)
        got = recipe.reference(a, b, **ops)
        got = got if isinstance(got, tuple) else (got,)
        scale = reference(recipe.ir, a, b, ops, magnitudes=True)
        acc = _accumulator(recipe, a, b, ops)
        want = _independent(recipe.name, acc, ops)
        assert len(got) == len(want) == len(recipe.outputs)
        for o, g, w, mag in zip(recipe.outputs, got, want, scale, strict=True):
            assert g.dtype == o.dtype.torch, (recipe.name, o.name)
            assert g.shape == o.shape((*lead, m, n))
            assert w.abs().max() > 0, "reference must not be all zeros"
            rtol, atol = TOL[g.dtype]
            rtol = max(rtol, output_tolerance(recipe, o))  # a value rounded on its way (a cast): that type's
            if g.dtype == torch.float32 and o.reduce is None and o.columns is Columns.FULL:
                # an fp32 D holds a sum of K terms itself: its error scales with what was summed
                terms = _accumulator(recipe, a.float().abs(), b.float().abs(), ops).float()
                bound = rtol * w.float().abs() + k * FP32_UNIT_ROUNDOFF * terms + atol
                assert ((g.float() - w.float()).abs() <= bound).all(), f"{recipe.name}.{o.name}"
                continue
            assert_output_close(o, g, w, mag, (m, n), rtol, atol, f"{recipe.name}.{o.name} seed={gen.initial_seed()}")


def test_reference_k_zero_is_epilogue_of_zero(examples, gen):
    r = examples["bias_gelu"]
    a, b = torch.empty(5, 0, dtype=torch.bfloat16), torch.empty(0, 9, dtype=torch.bfloat16)
    bias = torch.randn(9, generator=gen).bfloat16()
    torch.testing.assert_close(r.reference(a, b, bias=bias), F.gelu(bias.float()).expand(5, 9).bfloat16())


def test_reference_empty_m(examples):
    r = examples["gemm_bf16"]
    out = r.reference(torch.empty(0, 8, dtype=torch.bfloat16), torch.empty(8, 3, dtype=torch.bfloat16))
    assert out.shape == (0, 3) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_transposed_recipe_is_the_transposed_math(examples, extra, shape, gen):
    """What a swapped kernel computes: the transposed recipe on B^T, A^T (the same operand tensors,
    row and column vectors trading places, matrices transposed) is D^T, for every recipe."""
    m, n, k = shape
    for recipe in _all_recipes(examples, extra):
        if recipe.ir.epilogue.along_rows:  # never swapped: a row's columns are the kernel's (row_violations)
            continue
        batch = 3 if recipe.gemm.batched else None
        lead = (batch,) if batch else ()
        a = torch.randn(*lead, m, k, generator=gen).to(recipe.gemm.a.torch)
        b = torch.randn(*lead, k, n, generator=gen).to(recipe.gemm.b.torch)
        ops = _operands_for(recipe, m, n, gen, batch, k)
        t = recipe.ir.transposed()
        assert t.transposed() == recipe.ir and t.key != recipe.ir.key
        matrices = {o.name for o in recipe.operands  # (microscaled: blocked, each along K of its own rows)
                    if o.kind is gg.OperandKind.MATRIX or (o.kind.block_scale and recipe.gemm.block_scale)}
        t_ops = {name: v.mT if name in matrices else v for name, v in ops.items()}  # a vector per batch stays
        if recipe.gemm.scaled:  # the transposed problem's A is B^T: the scales trade places too
            t_ops["scale_a"], t_ops["scale_b"] = t_ops["scale_b"], t_ops["scale_a"]
        want = recipe.reference(a, b, **ops)
        want = want if isinstance(want, tuple) else (want,)
        scale = reference(recipe.ir, a, b, ops, magnitudes=True)
        got = reference(t, b.mT, a.mT, t_ops)
        for o, g, w, mag in zip(recipe.outputs, got, want, scale, strict=True):
            assert w.float().abs().max() > 0
            rtol, atol = TOL[g.dtype]
            assert_output_close(o, g.mT if o.reduce is None else g, w, mag, (m, n), rtol, atol,
                                f"{recipe.name}.{o.name} seed={gen.initial_seed()}")
            assert t.epilogue.outputs[recipe.outputs.index(o)].dim == (None if o.dim is None else 1 - o.dim)


def test_reductions_per_row_and_column(gen):
    """gg.sum and gg.amax over N (dim=1) and over M (dim=0), per batch: NaN propagates through a
    sum and is skipped by an amax (as CUTLASS's maximum skips it); nothing to reduce gives 0."""
    r = gg.Recipe("r", lambda acc: {"d": acc, "s1": gg.sum(acc, 1), "a1": gg.amax(acc, 1), "a": gg.amax(acc)},
                  aux={"s1": gg.f32, "a1": gg.f32, "a": gg.f32}, batched=True)
    c = gg.Recipe("c", lambda acc: {"d": acc, "s0": gg.sum(acc * acc, 0), "a0": gg.amax(acc, -2)},
                  aux={"s0": gg.f32, "a0": gg.f32}, batched=True)
    a = torch.randn(2, 5, 16, generator=gen).bfloat16()
    b = torch.randn(2, 16, 7, generator=gen).bfloat16()
    acc = a.float() @ b.float()
    d, s1, a1, amax = r.reference(a, b)
    assert s1.shape == a1.shape == (2, 5) and amax.shape == (2,)
    torch.testing.assert_close(d, acc.bfloat16())
    torch.testing.assert_close(s1, acc.sum(-1))
    torch.testing.assert_close(a1, acc.abs().amax(-1))
    _, s0, a0 = c.reference(a, b)
    assert s0.shape == a0.shape == (2, 7)
    torch.testing.assert_close(s0, (acc * acc).sum(-2))
    torch.testing.assert_close(a0, acc.abs().amax(-2))
    a[0, 3, 0] = float("nan")
    _, s1, a1, _ = r.reference(a, b)
    assert s1[0, 3].isnan() and not s1[0, :3].isnan().any() and not a1.isnan().any()
    torch.testing.assert_close(a1[0, 3], torch.tensor(0.0))  # every value of the row is NaN: the identity
    empty = r.reference(torch.empty(2, 5, 16).bfloat16(), torch.empty(2, 16, 0).bfloat16())
    assert [tuple(t.shape) for t in empty] == [(2, 5, 0), (2, 5), (2, 5), (2,)]
    assert not any(t.any() for t in empty[1:])


def test_max_and_min_reductions(gen):
    """gg.reduce_max and gg.reduce_min over N and over M, per batch: signed, NaN skipped (as CUTLASS's
    maximum<float> and minimum<float>, fmaxf and fminf, skip it), -inf and +inf where nothing is
    left (a row of NaNs, an empty dimension)."""
    r = gg.Recipe("r", lambda acc: {"d": acc, "hi": gg.reduce_max(acc, 1), "lo": gg.reduce_min(acc, -1)},
                  aux={"hi": gg.f32, "lo": gg.f32}, batched=True)
    c = gg.Recipe("c", lambda acc: {"d": acc, "hi": gg.reduce_max(acc - 100.0, 0)}, aux={"hi": gg.f32})
    a = torch.randn(2, 5, 16, generator=gen).bfloat16()
    b = torch.randn(2, 16, 7, generator=gen).bfloat16()
    acc = a.float() @ b.float()
    _, hi, lo = r.reference(a, b)
    assert hi.shape == lo.shape == (2, 5) and (hi > lo).all()
    torch.testing.assert_close(hi, acc.amax(-1))
    torch.testing.assert_close(lo, acc.amin(-1))
    _, column = c.reference(a[0], b[0])
    assert (column < 0).all()  # signed: not the largest magnitude (acc is far below 100)
    torch.testing.assert_close(column, (acc[0] - 100.0).amax(-2))
    a[0, 3, 0] = float("nan")
    _, hi, lo = r.reference(a, b)
    assert hi[0, 3] == -torch.inf and lo[0, 3] == torch.inf and not hi.isnan().any()
    torch.testing.assert_close(hi[1], acc[1].amax(-1))
    empty = r.reference(torch.empty(2, 5, 16).bfloat16(), torch.empty(2, 16, 0).bfloat16())
    assert [tuple(t.shape) for t in empty] == [(2, 5, 0), (2, 5), (2, 5)]
    assert (empty[1] == -torch.inf).all() and (empty[2] == torch.inf).all()
    assert gg.ir.Reduction.MAX.identity == -gg.ir.Reduction.MIN.identity == -torch.inf


def test_a_quantized_output_is_held_to_its_dequantized_values():
    """assert_outputs_close: a block of one value within its rounding error of zero quantizes to
    -448 and a tiny scale, or to 0 and scale 1 (an fp8 GEMM's exact cancellation summed in another
    order: CI's failure, GEMMGEN_TEST_SEED 2256538497 before it was one); both are the same value,
    so both pass. A scale a quarter off, or a value one binade off, fails; the magnitudes of an fp8
    output are not saturated at 448."""
    def epilogue(acc):
        q_t, scale_t = gg.quantize_columns(acc)
        return {"d": acc, "y_t": q_t, "y_t_scale": scale_t}

    r = gg.Recipe("q", epilogue, a=gg.e4m3, b=gg.e4m3, layout_b=gg.ColMajor, aux={"y_t": gg.e4m3, "y_t_scale": gg.f32})
    a = torch.tensor([[-1.875, -1.125, -1.125]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[-1.5, 1.875, 0.625], [1.0, 1.0, 1.0]]).to(torch.float8_e4m3fn).mT
    want = reference(r.ir, a, b, {})
    magnitude = reference(r.ir, a, b, {}, magnitudes=True)
    assert want[1][0, 0] == 0 and want[2][0, 0] == 1  # A . B's first column cancels exactly
    assert magnitude[1].dtype == torch.float32 and magnitude[1][0, 0] == 5.625  # |A| . |B|, in no fp8 type
    got = (want[0], torch.tensor([[-448.0], [-448.0]]).to(torch.float8_e4m3fn),
           torch.tensor([[3e-8 / 448], [4.125 / 448]]))
    by = lambda o, w: (TOL[o.dtype.torch][0] if o.dtype.bits > 8 else 2**-3,) * 2  # noqa: E731
    assert_outputs_close(r.outputs, got, want, magnitude, (1, 2), by)
    with pytest.raises(AssertionError, match=r"y_t: dequantized: 1 of 2 values off"):
        assert_outputs_close(r.outputs, (*got[:2], got[2] * torch.tensor([[1.0], [1.25]])), want, magnitude,
                             (1, 2), by)
    with pytest.raises(AssertionError, match=r"y_t: dequantized: 1 of 2 values off"):
        assert_outputs_close(r.outputs, (got[0], torch.tensor([[-448.0], [-224.0]]).to(torch.float8_e4m3fn),
                                         got[2]), want, magnitude, (1, 2), by)


def test_sums_are_held_to_the_bound_of_their_summation():
    """assert_output_close: a sum within (rtol + terms * 2^-24) * sum |terms| passes, one past it
    fails, however small the sum itself is after cancellation; NaN only where the reference has it."""
    r = gg.Recipe("r", lambda acc: {"d": acc, "s": gg.sum(acc, 1)}, aux={"s": gg.f32})
    o = r.outputs[1]
    want, magnitude = torch.tensor([1e-3, 5.0, float("nan")]), torch.tensor([1e4, 5.0, 1.0])
    bound = (1e-5 + 100 * 2.0**-24) * magnitude
    assert_output_close(o, want + 0.9 * bound.nan_to_num(), want, magnitude, (3, 100), 1e-5, 0.0)
    with pytest.raises(AssertionError, match=r"sum 's' of 100 terms: 1 of 3 values off"):
        assert_output_close(o, want + torch.tensor([1.1, 0, 0]) * bound, want, magnitude, (3, 100), 1e-5, 0.0)
    with pytest.raises(AssertionError, match=r"1 of 3 values off"):
        assert_output_close(o, torch.tensor([1e-3, 5.0, 0.0]), want, magnitude, (3, 100), 1e-5, 0.0)


def test_a_max_is_held_to_the_largest_magnitude_of_its_values():
    """assert_output_close: an amax (max, min) picks a value, so it is off by what a value can be:
    rtol of it and of the largest magnitude among the values (a dot product that cancels to 0.5 is
    off relative to |A| . |B|: CI's column_stats, GEMMGEN_TEST_SEED=125); an empty one's
    identity matches exactly."""
    r = gg.Recipe("r", lambda acc: {"d": acc, "m": gg.amax(acc, 0), "lo": gg.reduce_min(acc, 0)},
                  aux={"m": gg.f32, "lo": gg.f32})
    a, b = torch.ones(1, 3), torch.tensor([[256.0, 0.0], [-255.0, 0.0], [-0.5, 0.0]])
    magnitude = reference(r.ir, a.bfloat16(), b.bfloat16(), {}, magnitudes=True)
    assert magnitude[1].tolist() == [511.5, 0.0] == magnitude[2].tolist()
    o, want = r.outputs[1], reference(r.ir, a.bfloat16(), b.bfloat16(), {})[1]
    assert want.tolist() == [0.5, 0.0]
    assert_output_close(o, want + 0.9e-5 * magnitude[1], want, magnitude[1], (1, 2), 1e-5, 0.0)
    with pytest.raises(AssertionError, match=r"'m', a max, min or amax: 1 of 2 values off"):
        assert_output_close(o, want + 1.1e-5 * magnitude[1], want, magnitude[1], (1, 2), 1e-5, 0.0)
    inf = torch.tensor([math.inf])
    assert_output_close(r.outputs[2], inf, inf, torch.zeros(1), (0, 1), 1e-5, 0.0)

"""Grouped kernels on the CPU: the generated code (NVRTC, SASS), the call's checks, the per-group
arrays the setup kernel fills, and the emulation of both launches through their Params."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import InvalidArgument
from gemmgen.ir.reference import group_bounds
from gemmgen.runtime.grouped import SETUP, BufferLayout
from gemmgen.testing.checks import uncompiled
from gemmgen.testing.emulate import emulate_grouped, fill_groups
from gemmgen.testing.grouped import (
    block_grouped_inputs,
    cpu_grouped_kernel,
    emulated_block_moe,
    emulated_moe,
    grouped_inputs,
    moe_recipe,
    params_field,
)
from tests.data.gpu_matrix import (
    BLOCK_GROUPED_CONFIGS,
    GROUPED_CONFIGS,
)
from tests.data.session_kernels import is_compiled_grouped

BLOCK_INDEX = pytest.mark.parametrize("index", range(len(BLOCK_GROUPED_CONFIGS)),
                                      ids=[c.name for c in BLOCK_GROUPED_CONFIGS])


def test_the_example_is_the_recipe_tested_here(examples):
    assert examples["moe_up"].key == moe_recipe().key


def test_grouped_kernel_is_hopper_code(grouped_kernel):
    r = grouped_kernel.report
    assert "KernelPtrArrayTmaWarpSpecializedCooperative" in grouped_kernel.source
    assert r.sass["HGMMA"] > 0 and r.sass["UTMALDG"] > 0 and r.sass["UTMASTG"] > 0 and r.sass["USETMAXREG"] > 0
    assert r.local_bytes == 0 and r.stack_bytes == 0
    assert gg.codegen.sm90.smem_need(grouped_kernel.config, grouped_kernel.recipe) >= r.smem_bytes


def test_call_checks_arguments(grouped_kernel):
    k = cpu_grouped_kernel(grouped_kernel)
    a, b, offsets, bias, weight = grouped_inputs()
    with pytest.raises(InvalidArgument, match="offsets: expected an int32"):
        k.prepare(a, b, offsets.long(), bias=bias, weight=weight)
    with pytest.raises(InvalidArgument, match="b: expected a 3-D"):
        k.prepare(a, b[0], offsets, bias=bias, weight=weight)
    with pytest.raises(InvalidArgument, match=r"bias: expected a \(groups, N\)"):
        k.prepare(a, b, offsets, bias=bias[0], weight=weight)
    with pytest.raises(InvalidArgument, match="weight: expected a 1-D tensor of length 37"):
        k.prepare(a, b, offsets, bias=bias, weight=weight[:-1])
    with pytest.raises(InvalidArgument, match="16 bytes"):
        k.prepare(a, b, offsets, bias=torch.randn(4, 50).bfloat16()[:, :48], weight=weight)
    huge = a[:1].expand(2**31, 64)  # no memory behind it: the check comes first
    with pytest.raises(InvalidArgument, match="rows of a = 2147483648"):
        k.prepare(huge, b, offsets, bias=bias, weight=weight[:1].expand(2**31))


def test_a_refused_layout_is_refused_again_without_rechecking(grouped_kernel):
    """A call signature the checks refused for a layout (here A at an odd address) raises the same
    LayoutMismatch at once the next time, without rechecking: the torch op copies A then."""
    from unittest import mock

    from gemmgen.errors import LayoutMismatch

    k = cpu_grouped_kernel(grouped_kernel)
    a, b, offsets, bias, weight = grouped_inputs()
    odd = torch.empty(37 * 64 + 1).bfloat16()[1:].view(37, 64).copy_(a)
    with pytest.raises(LayoutMismatch) as refused:
        k.prepare(odd, b, offsets, bias=bias, weight=weight)
    with mock.patch("gemmgen.runtime.grouped.check_grouped_call", side_effect=AssertionError("checked again")), \
            pytest.raises(LayoutMismatch) as again:
        k.prepare(odd, b, offsets, bias=bias, weight=weight)
    assert again.value.argument == refused.value.argument == "a" and str(again.value) == str(refused.value)
    assert k.prepare(a, b, offsets, bias=bias, weight=weight).params is not None


def test_prepare_builds_setup_and_params(grouped_kernel):
    k = cpu_grouped_kernel(grouped_kernel)
    a, b, offsets, bias, weight = grouped_inputs()
    p = k.prepare(a, b, offsets, bias=bias, weight=weight)
    assert p.output.shape == (37, 48) and p.grid == (132, 1, 1) and p.setup_grid == (1, 1, 1)
    fields = SETUP.unpack(p.setup)
    # G, rows, N, K, and the columns: 5 pointers (A, B, D, bias, weight), 3 strides (A, B, D)
    assert fields[0] == offsets.data_ptr() and fields[3:8] == (4, 37, 48, 64, 8)
    layout = BufferLayout.of(4, 8, 132, False)
    assert p.buffer.numel() == layout.size
    assert len(p.params) == grouped_kernel.info.params_size


def _filled(setup: bytes, offsets: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """What the setup kernel writes, from the Setup block (emulate.fill_groups, which is grouped.hpp's
    `fill` as test_setup_kernel_arithmetic_on_the_host checks it): each group's shape and columns."""
    return fill_groups(SETUP.unpack(setup), offsets)


def _moe_up(grouped_kernels: dict, config: gg.KernelConfig):
    """moe_up's kernel under `config`: compiled where the session compiles it, else as the runtime
    sees it without NVRTC (`uncompiled`: the same source and fields)."""
    return grouped_kernels.get(config.name) or uncompiled(moe_recipe(), config)


CONFIG = pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=[c.name for c in GROUPED_CONFIGS])


@CONFIG
def test_group_arrays_address_each_groups_rows(grouped_kernels, config):
    """Every per-group pointer and stride the kernel's Params point it at, against torch's own
    addressing of the same elements: group g's first row of A, D and the routing weights, its B
    and its bias row. A swapped kernel (D_g^T = B_g^T A_g^T) reads the caller's B as its A, A as
    its B, the weights as its row vector and the bias as its column vector; its problem is (N, M_g, K)."""
    k = cpu_grouped_kernel(_moe_up(grouped_kernels, config))
    swapped = k.compiled.config.swap_ab
    a, b, offsets, bias, weight = grouped_inputs(rows=61, k=72, n=40, groups=5, offsets=(7, 7, 30, 44, 60))
    a = torch.randn(61, 96).bfloat16()[:, :72]  # padded rows: lda 96
    bias = torch.randn(5, 64).bfloat16()[:, :40]  # padded group rows: 64 elements apart
    p = k.prepare(a, b, offsets, bias=bias, weight=weight)
    shapes, table = _filled(p.setup, offsets.tolist())
    field = params_field(k.compiled, p.params)
    layout = BufferLayout.of(5, 8, 132, False)
    arrays = field("problem.shapes") - layout.shapes + layout.table  # the buffer's column arrays

    def column(name: str, g: int) -> int:
        at = field(name) - arrays
        assert at % (8 * 5) == 0, name
        return table[g][at // (8 * 5)]

    kernel_a, kernel_b, weight_kind, bias_kind = ("b", "a", "row", "col") if swapped else ("a", "b", "col", "row")
    d = p.output
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), 61)):
        assert shapes[g] == ([40, end - start, 72] if swapped else [end - start, 40, 72])
        assert column(f"mainloop.ptr_{kernel_a}", g) == a[start].data_ptr()
        assert column(f"mainloop.ptr_{kernel_b}", g) == b[g].data_ptr()
        assert column("epilogue.ptr_d", g) == d[start].data_ptr()
        assert column(f"epilogue.{bias_kind}.bias.ptr", g) == bias[g].data_ptr()
        assert column(f"epilogue.{weight_kind}.weight.ptr", g) == weight[start].data_ptr()
        # B per group is N x K, K contiguous: ld K
        assert column(f"mainloop.stride_{kernel_a}", g) == 96 and column(f"mainloop.stride_{kernel_b}", g) == 72
        assert column("epilogue.stride_d", g) == d.stride(0)


def test_repeated_calls_follow_every_address(grouped_kernel):
    """The per-signature cache never serves stale addresses: each call's setup block holds that
    call's A, D and vectors, whether the tensors moved or D was freshly allocated."""
    k = cpu_grouped_kernel(grouped_kernel)
    first = grouped_inputs()
    second = tuple(t.clone() for t in first)
    for args in (first, second, first):
        a, b, offsets, bias, weight = args
        for out in (None, torch.empty(37, 48).bfloat16()):
            p = k.prepare(a, b, offsets, bias=bias, weight=weight, out=out)
            _, table = _filled(p.setup, offsets.tolist())
            assert SETUP.unpack(p.setup)[0] == offsets.data_ptr()
            assert table[0][:5] == [a.data_ptr(), b.data_ptr(), p.output.data_ptr(), bias.data_ptr(), weight.data_ptr()]
            assert out is None or p.output is out


@CONFIG
@pytest.mark.parametrize("shape, offsets", [
    ((37, 64, 48, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((37, 64, 48, 4), (40, 3, 50, 60)),  # out of range and decreasing: clamped
    ((300, 72, 136, 3), (1, 129, 300)),  # M = 1, groups over several tiles, K and N tails
])
def test_emulated_groups_compute_the_recipe(grouped_kernels, config, shape, offsets):
    """The whole host path through an emulation of both kernels: the setup block turned into the
    group arrays as the setup kernel would, then per group what the GEMM reads through its Params
    (shape, A, B, the bias and weight pointers, D's address and stride) and the epilogue its source
    declares. Against the reference; rows in no group stay NaN."""
    out, want = emulated_moe(_moe_up(grouped_kernels, config), shape, offsets)
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


def test_empty_and_zero_k(grouped_kernel):
    k = cpu_grouped_kernel(grouped_kernel)
    a, b, offsets, bias, weight = grouped_inputs(rows=0)
    assert k.prepare(a, b, torch.zeros(4, dtype=torch.int32), bias=bias, weight=weight).params is None
    a, b, offsets, bias, weight = grouped_inputs(k=0)
    out = torch.full((37, 48), float("nan")).bfloat16()
    p = k.prepare(a, b, offsets, bias=bias, weight=weight, out=out)
    assert p.params is None
    want = moe_recipe().reference(a, b, offsets, bias=bias, weight=weight)
    torch.testing.assert_close(out[:30].float(), want[:30].float())
    assert out[30:].float().isnan().all()


@BLOCK_INDEX
def test_block_scaled_groups_are_hopper_code(block_kernels, index):
    """CUTLASS's grouped blockwise main loop with K-major scales: QGMMA, TMA for A and B (the scales
    by cp.async), no spills, and gemmgen's shared memory bound. Swapped, the weights' 128 x 128
    blocks are the kernel's A scales and the tokens' the kernel's B scales, one per column."""
    kernel = block_kernels[index]
    src, r = kernel.source, kernel.report
    granularity = "128, 1, 128" if kernel.config.swap_ab else "1, 128, 128"
    assert "MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise<" in src
    assert f"KernelPtrArrayTmaWarpSpecialized{kernel.config.schedule.value.title()}FP8Blockwise" in src
    assert f"Sm90BlockwiseScaleConfig<{granularity}, cute::GMMA::Major::K, cute::GMMA::Major::K>" in src
    assert bool(kernel.cubin) == is_compiled_grouped(kernel.recipe.name, kernel.config)
    if kernel.cubin:  # the session compiles all but tests/data/session_kernels.UNCOMPILED_GROUPED
        assert r.sass["QGMMA"] > 0 and r.sass["HGMMA"] == 0 and r.sass["UTMALDG"] == 2
        assert r.local_bytes == 0 and r.stack_bytes == 0
        need = gg.codegen.sm90.smem_need(kernel.config, kernel.generated.kernel_recipe)
        assert 0 <= need - kernel.info.smem_bytes <= 1024


def test_grouped_blockwise_main_loop_reads_no_scale_layouts():
    """gemmgen passes null for layout_SFA/SFB (param_fields): CUTLASS's grouped blockwise main loop
    lays out each group's scales from its shape. Should a CUTLASS update read them on the device,
    this fails first: they may appear only in its Arguments, Params and their copy."""
    from gemmgen.compile.toolchain import toolchain

    header = next(d / "cutlass/gemm/collective/sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp"
                  for d in map(Path, toolchain().include_dirs) if (d / "cutlass").is_dir())
    uses = [line.strip() for line in header.read_text().splitlines() if "layout_SF" in line]
    assert uses == ["LayoutSFA layout_SFA;", "LayoutSFB layout_SFB;"] * 2 + ["args.layout_SFA,", "args.layout_SFB"]


def test_block_scales_of_groups_are_checked(block_kernel):
    k = cpu_grouped_kernel(block_kernel)
    a, b, offsets, ops, _, _ = block_grouped_inputs()
    p = k.prepare(a, b, offsets, **ops)
    fields = SETUP.unpack(p.setup)
    assert fields[7] == 9  # A, B, their scales, D and weight; the strides of A, B and D
    _, table = _filled(p.setup, offsets.tolist())
    for g, (start, _end) in enumerate(group_bounds(offsets.tolist(), 37)):
        assert table[g][2:4] == [ops["scale_a"][start].data_ptr(), ops["scale_b"][g].data_ptr()]
    with pytest.raises(InvalidArgument, match=r"scale_a: missing operand; pass scale_a=\.\.\. \(fp32 \(rows, "
                                              r"ceil\(K/128\)\), K contiguous"):
        k.prepare(a, b, offsets, scale_b=ops["scale_b"], weight=ops["weight"])
    with pytest.raises(InvalidArgument, match=r"scale_b: expected shape \(4, 3, 2\)"):
        k.prepare(a, b, offsets, **{**ops, "scale_b": ops["scale_b"][:, :, :1]})
    padded = gg.quantize_blockwise(a.float(), (1, 128))[1]  # rows 4 apart (16 bytes): not compact
    with pytest.raises(gg.LayoutMismatch, match=r"scale_a: a grouped kernel reads each group's block scales as a "
                                                r"compact K-major block .* got strides \(4, 1\); pass "
                                                r"scale_a.contiguous\(\)"):
        k.prepare(a, b, offsets, **{**ops, "scale_a": padded})
    with pytest.raises(gg.LayoutMismatch, match=r"scale_b: .* pass scale_b.mT.contiguous\(\).mT"):
        k.prepare(a, b, offsets, **{**ops, "scale_b": ops["scale_b"].contiguous()})
    many = torch.ones(1).expand(2**29, 5)  # no memory behind it: 2^29 rows of 5 scales pass 2^31 - 1
    with pytest.raises(InvalidArgument, match=r"scale_a: 536870912 x 5 scales, and the kernel indexes a group's "
                                              r"block scales in 32 bits"):
        fp8 = torch.zeros(1, dtype=torch.float8_e4m3fn)
        k.prepare(fp8.expand(2**29, 544), fp8.expand(4, 544, 136), offsets, scale_a=many,
                  scale_b=ops["scale_b"][:, :1].expand(4, 5, 2), weight=ops["weight"][:1].expand(2**29))
    odd = torch.empty(2 + 37 * 3)[2:].view(37, 3).copy_(ops["scale_a"])  # 8-byte offset: fine for 4-byte loads
    assert k.prepare(a, b, offsets, **{**ops, "scale_a": odd}).params is not None


def test_block_scaled_groups_empty_and_zero_k(block_kernel):
    """No rows: nothing launched. K = 0 (scales with no K blocks): each covered row is the epilogue
    of a zero accumulator, as torch's matmul over an empty K; rows after the last group untouched."""
    k = cpu_grouped_kernel(block_kernel)
    fp8 = torch.float8_e4m3fn
    b = torch.zeros(2, 16, 128, dtype=fp8).mT
    p = k.prepare(torch.zeros(0, 128, dtype=fp8), b, torch.zeros(2, dtype=torch.int32), torch.ones(0, 1),
                  torch.ones(2, 1, 1), torch.rand(0))
    assert p.params is None and p.output.shape == (0, 16)
    out = torch.full((5, 16), float("nan")).bfloat16()
    p = k.prepare(torch.zeros(5, 0, dtype=fp8), b[:, :0], torch.tensor([2, 4], dtype=torch.int32),
                  torch.ones(5, 0), torch.ones(2, 0, 1), torch.rand(5), out=out)
    assert p.params is None and (out[:4] == 0).all() and out[4:].isnan().all()


@pytest.mark.parametrize("shape, offsets", [
    ((37, 304, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last; K and N tails
    ((37, 304, 136, 4), (40, 3, 50, 60)),  # out of range and decreasing: clamped
    ((300, 528, 264, 3), (1, 129, 300)),  # M = 1, groups over several tiles
])
@BLOCK_INDEX
def test_emulated_block_scaled_groups_compute_the_recipe(block_kernels, index, shape, offsets):
    """Both kernels emulated from the Params (the group arrays as the setup kernel fills them; per
    group A, B and both scales through their pointer arrays, laid out as CUTLASS's main loop lays
    them out from the group's shape), against the reference; rows in no group stay NaN. And the
    result against the unquantized layer: within fp8's precision."""
    rows = shape[0]
    out, want, ops, x, w = emulated_block_moe(block_kernels[index], shape, offsets)
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    for g, (start, end) in enumerate(group_bounds(list(offsets), rows)):
        if start < end:
            exact = (x[start:end].double() @ w[g].double().T) * ops["weight"][start:end, None].double()
            assert (out[start:end].double() - exact).norm() / exact.norm() < 0.06  # e4m3: 3 mantissa bits


def _masked_inputs(groups: int, max_m: int, k: int, n: int, masked: list[int]) -> tuple[torch.Tensor, ...]:
    """moe_up's inputs in the masked layout: (groups, max_m, K) tokens and (groups, max_m) routing
    weights, NaN in every row past its group's count (what the kernel must not read)."""
    a = torch.randn(groups, max_m, k + 8).bfloat16()[..., :k]  # rows 8 apart from K
    b = torch.randn(groups, n, k).bfloat16().transpose(1, 2)
    weight = torch.rand(groups, max_m)
    for g, count in enumerate(masked):
        a[g, max(count, 0):] = float("nan")
        weight[g, max(count, 0):] = float("nan")
    return a, b, torch.tensor(masked, dtype=torch.int32), torch.randn(groups, n).bfloat16(), weight


@CONFIG
@pytest.mark.parametrize("shape, masked", [
    ((5, 19, 72, 40), [3, 0, 19, 40, -2]),  # empty, full, over max_m and negative: clamped
    ((3, 130, 64, 48), [1, 129, 130]),  # M = 1, a group over two tiles, N and K tails
])
def test_emulated_masked_layout_computes_the_recipe(grouped_kernels, config, shape, masked):
    """The masked layout (DeepGEMM's, for CUDA-graph decode): A (groups, max_m, K), masked_m on the
    device. The same kernel, its setup told each group's rows start at g * max_m: both launches
    emulated from the Params (the setup block's masked rows included) against the reference, the rows
    past each count NaN in A and in the routing weights, D pre-filled with NaN, which they keep."""
    kernel = _moe_up(grouped_kernels, config)
    k = cpu_grouped_kernel(kernel)
    enc = k._encode
    groups, max_m, depth, n = shape
    a, b, counts, bias, weight = _masked_inputs(groups, max_m, depth, n, masked)
    out = torch.full((groups, max_m, n), float("nan")).bfloat16()
    p = k.prepare(a, b, counts, bias=bias, weight=weight, out=out)
    assert SETUP.unpack(p.setup)[3:5] == (groups, groups * max_m) and SETUP.unpack(p.setup)[12] == max_m
    emulate_grouped(kernel, p.setup, p.params, enc, [a, b, counts, bias, weight, out, p.buffer])
    want = moe_recipe().reference(a, b, counts, bias=bias, weight=weight).float()
    assert want.shape == (groups, max_m, n) and want.nan_to_num().abs().sum() > 0
    for g, count in enumerate(masked):  # the reference's own rows, against per-group torch
        rows = min(max(count, 0), max_m)
        exact = torch.nn.functional.silu(a[g, :rows].double() @ b[g].double() + bias[g].double()) * \
            weight[g, :rows, None].double()
        torch.testing.assert_close(want[g, :rows].double(), exact, rtol=1.6e-2, atol=1e-2)
        assert want[g, rows:].isnan().all()
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    d = k.prepare(a, b, counts, bias=bias, weight=weight).output
    assert d.shape == (groups, max_m, n) and d.stride() == (max_m * n, n, 1)


def test_masked_layout_calls_are_checked(grouped_kernel):
    k = cpu_grouped_kernel(grouped_kernel)
    a, b, counts, bias, weight = _masked_inputs(4, 6, 64, 48, [1, 2, 3, 4])
    with pytest.raises(InvalidArgument, match=r"masked_m: expected an int32 tensor of 4 entries \(how many of each "
                                              r"group's max_m rows"):
        k.prepare(a, b, counts[:3], bias=bias, weight=weight)
    with pytest.raises(InvalidArgument, match=r"a/b: the masked layout takes a \(groups, max_m, K\) and b \(groups, "
                                              r"K, N\), got a \(4, 6, 64\) and b \(3, 64, 48\)"):
        k.prepare(a, b[:3], counts, bias=bias, weight=weight)
    with pytest.raises(InvalidArgument, match=r"weight: the masked layout takes \(groups, max_m\) = \(4, 6, \.\.\.\)"):
        k.prepare(a, b, counts, bias=bias, weight=weight.flatten())
    with pytest.raises(gg.LayoutMismatch, match=r"a: its groups and max_m rows must be one stride apart"):
        k.prepare(a.transpose(0, 1).contiguous().transpose(0, 1), b, counts, bias=bias, weight=weight)
    with pytest.raises(InvalidArgument, match=r"out: expected shape \(4, 6, 48\)"):
        k.prepare(a, b, counts, bias=bias, weight=weight, out=torch.empty(24, 48).bfloat16())
    out = torch.full((4, 6, 48), float("nan")).bfloat16()  # K = 0: each counted row the epilogue of zero
    p = k.prepare(a[..., :0], b[:, :0], counts, bias=bias, weight=weight.nan_to_num(), out=out)
    assert p.params is None
    for g in range(4):
        assert not out[g, :g + 1].isnan().any() and out[g, g + 1:].isnan().all()


def _scaled_moe() -> gg.Recipe:
    """A grouped recipe with a scalar read from a tensor: one value per group (`gg.Scalar(tensor=True)`)."""
    return gg.Recipe("moe_scaled", lambda acc, s, bias: gg.silu(acc * s + bias), grouped=True,
                     operands={"s": gg.Scalar(tensor=True), "bias": gg.RowVector(gg.bf16)})


@pytest.mark.parametrize("arch", [gg.Arch.SM90A, gg.Arch.SM100A])
def test_a_tensor_scalar_is_read_at_each_group(arch):
    """A grouped kernel's tensor scalar is (groups,): the epilogue reads entry g for group g (its L
    coordinate, CUTLASS's Sm90ScalarBroadcast with a batch stride), or one value for all through a
    stride of 0 (`s.expand(groups)`). Both launches emulated against the reference and per-group
    torch; a wrong shape is refused naming the operand."""
    recipe = _scaled_moe()
    kernel = uncompiled(recipe, recipe.default_config(arch))
    k = cpu_grouped_kernel(kernel, 148 if arch is gg.Arch.SM100A else 132)
    a, b, offsets, bias, _ = grouped_inputs()
    s = torch.tensor([0.5, 4.0, 1.5, 0.25])
    for scale in (s, s[1:2].expand(4)):
        out = torch.full((37, 48), float("nan")).bfloat16()
        p = k.prepare(a, b, offsets, s=scale, bias=bias, out=out)
        emulate_grouped(kernel, p.setup, p.params, k._encode, [a, b, offsets, scale, bias, out, p.buffer])
        want = recipe.reference(a, b, offsets, s=scale, bias=bias).float()
        torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
        for g, (start, end) in enumerate(group_bounds(offsets.tolist(), 37)):
            exact = torch.nn.functional.silu(a[start:end].double() @ b[g].double() * float(scale[g]) + bias[g].double())
            torch.testing.assert_close(want[start:end].double(), exact, rtol=1.6e-2, atol=1e-2)
    with pytest.raises(InvalidArgument, match=r"s: expected an fp32 \(4,\) tensor, one value per group "
                                              r"\(s.expand\(groups\) shares one\), got torch.float32 \(1,\)"):
        k.prepare(a, b, offsets, s=s[:1], bias=bias)

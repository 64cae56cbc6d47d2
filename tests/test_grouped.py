"""Grouped (MoE) GEMMs on the CPU: the recipe's semantics, the generated kernel (NVRTC, SASS), the
Params and tensor maps against CUTLASS's own host code, and the setup kernel's arithmetic run on
the host from the very header the GPU compiles. GPU runs are in test_gpu.py."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import InvalidArgument, RecipeError
from gemmgen.reference import group_bounds
from gemmgen.runtime.grouped import MAX_COLUMNS, SETUP, BufferLayout, GroupedKernel
from gemmgen.select import choose
from gemmgen.testing.emulate import emulate_grouped, fill_groups
from gemmgen.testing.recording import RecordingEncoder

from .data.gpu_matrix import (
    BLOCK_GROUPED_CONFIGS,
    FP8_GROUPED_CONFIGS,
    GROUPED_CONFIGS,
    GROUPED_TUNE_PROBLEM,
    TUNE_CANDIDATES,
    moe_fp8_recipe,
)

MOE = dict(epilogue=lambda acc, bias, weight: gg.silu(acc + bias) * weight,
           operands={"bias": gg.RowVector(gg.bf16), "weight": gg.ColVector(gg.f32)})


def moe_recipe(**kw) -> gg.Recipe:
    """An MoE expert layer: per-expert bias, SiLU, then each token's routing weight."""
    args = {**MOE, **kw}
    return gg.Recipe("moe_up", args.pop("epilogue"), grouped=True, **args)


@pytest.fixture(scope="module")
def grouped_kernels(session_cache):
    """`moe_recipe()` under GROUPED_CONFIGS (the default config is compiled with the examples, of
    which it is moe_up; the pingpong one here, NVRTC, about 30 s; from the bundle on the GPU)."""
    recipe = moe_recipe()
    return [recipe.build(config, cache=session_cache) for config in GROUPED_CONFIGS]


@pytest.fixture(scope="module")
def grouped_kernel(grouped_kernels):
    return grouped_kernels[0]


def test_the_example_is_the_recipe_tested_here(examples):
    assert examples["moe_up"].key == moe_recipe().key


def test_the_gpu_bundle_holds_every_grouped_kernel_the_gpu_checks_launch(examples):
    """The GPU run loads every kernel from the bundle (GEMMGEN_JIT=0: a missing one fails there, after
    the device minutes are spent): each grouped kernel the GPU tests pick by shape is in the matrix."""
    from .data.gpu_matrix import gpu_matrix

    matrix = {(r.key, c) for r, c in gpu_matrix()}
    experts = gg.nn.GroupedLinear(4, 64, 128, activation="silu", device="meta")
    fp8_experts = gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(512, 256) for _ in range(2)],
                                                              activation="silu")
    wanted = [(moe_recipe(), choose(moe_recipe().ir, 37, 48, 64, groups).config) for groups in (1, 4)]
    wanted += [experts.launches(rows) for rows in (12, 300)] + [fp8_experts.launches(rows) for rows in (12, 300)]
    wanted += [(examples["moe_fp8_block"], c) for c in BLOCK_GROUPED_CONFIGS]
    wanted += [(moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS] + [(moe_recipe(), c) for c in GROUPED_CONFIGS]
    wanted += [(moe_recipe(), c) for c in gg.tuning.candidates(moe_recipe().ir, *GROUPED_TUNE_PROBLEM,
                                                               limit=TUNE_CANDIDATES)]
    missing = [(r.name, c.name) for r, c in wanted if (r.key, c) not in matrix]
    assert not missing and {c.swap_ab for _, c in wanted} == {True, False}, missing


def _cpu(kernel, sm_count=132, clusters=0):
    return GroupedKernel(kernel, encoder=RecordingEncoder(), hardware=lambda i: (sm_count, clusters),
                         require_cuda=False)


def _params_field(compiled, params: bytes):
    """A Params field's value by name, as the oracle prints it (sign-extended to 64 bits)."""
    layout = {f.name: (offset, f) for f, offset, _ in compiled.params_layout.fields}

    def field(name: str) -> int:
        offset, f = layout[name]
        return int.from_bytes(params[offset:offset + f.size], "little", signed=f.kind in ("i32", "i64")) \
            & (2**64 - 1)

    return field


def _oracle_values(field, groups: int, sm_count: int, clusters: int) -> dict[str, int]:
    """The Arguments every grouped kernel's oracle takes: the group arrays, the workspace, hardware."""
    return {"groups": groups, "shapes": field("problem.shapes"), "workspace": field("workspace"),
            "a.array": field("mainloop.ptr_a"), "a.strides": field("mainloop.stride_a"),
            "b.array": field("mainloop.ptr_b"), "b.strides": field("mainloop.stride_b"),
            "d.array": field("epilogue.ptr_d"), "d.strides": field("epilogue.stride_d"),
            "hw.device_id": 0, "hw.sm_count": sm_count, "hw.max_active_clusters": clusters}


def _vector_values(compiled, field) -> dict[str, int]:
    """The oracle's vector pointers: each operand's Params field as the kernel binds it (a swapped
    kernel's row vectors are the caller's column vectors)."""
    return {f"operand.{b.name}.ptr": field(f"epilogue.{b.kind}.{b.name}.ptr")
            for b in compiled.generated.epilogue.bindings if b.kind in ("row", "col")}


def _inputs(rows=37, k=64, n=48, groups=4, offsets=(5, 5, 20, 30)):
    a = torch.randn(rows, k).bfloat16()
    b = torch.randn(groups, n, k).bfloat16().transpose(1, 2)  # per group K x N, stored N x K (K-major)
    return a, b, torch.tensor(offsets, dtype=torch.int32), torch.randn(groups, n).bfloat16(), torch.rand(rows)


def _fp8_inputs(rows=37, k=128, n=48, groups=4, offsets=(5, 5, 20, 30)):
    """moe_fp8's: e4m3 tokens and expert weights, each token's scale, each expert's channel scales and bias."""
    a = torch.randn(rows, k).to(torch.float8_e4m3fn)
    b = torch.randn(groups, n, k).to(torch.float8_e4m3fn).transpose(1, 2)
    return (a, b, torch.tensor(offsets, dtype=torch.int32),
            {"scale_a": torch.rand(rows) + 0.5, "scale_b": torch.rand(groups, n) + 0.5,
             "bias": torch.randn(groups, n).bfloat16()})


@pytest.fixture(scope="module")
def fp8_kernels(session_cache):
    """moe_fp8 under FP8_GROUPED_CONFIGS, its default and swapped (NVRTC, about 25 s each; from the
    bundle on the GPU)."""
    return [moe_fp8_recipe().build(config, cache=session_cache) for config in FP8_GROUPED_CONFIGS]


# ---- semantics


@pytest.mark.parametrize("offsets, rows, want", [
    ([5, 5, 20, 30], 37, [(0, 5), (5, 5), (5, 20), (20, 30)]),
    ([10, 4, 12], 37, [(0, 10), (10, 10), (10, 12)]),  # decreasing: an empty group, never an overlap
    ([-3, 50, 60], 37, [(0, 0), (0, 37), (37, 37)]),  # clamped to the rows of A
])
def test_group_bounds(offsets, rows, want):
    assert group_bounds(offsets, rows) == want


def test_reference_is_each_group_through_its_own_b():
    r = moe_recipe()
    a, b, offsets, bias, weight = _inputs()
    d = r.reference(a, b, offsets, bias=bias, weight=weight).float()
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), a.shape[0])):
        acc = a[start:end].double() @ b[g].double()
        want = torch.nn.functional.silu(acc + bias[g].double()) * weight[start:end, None].double()
        assert want.abs().sum() > 0 or start == end
        torch.testing.assert_close(d[start:end].double(), want, rtol=1.6e-2, atol=1e-2)
    assert d[30:].isnan().all()  # after the last group: not written


def test_grouped_recipe_mistakes():
    with pytest.raises(RecipeError, match="layout_a"):
        moe_recipe(layout_a=gg.ColMajor)
    with pytest.raises(RecipeError, match="batched"):
        moe_recipe(batched=True)
    with pytest.raises(RecipeError, match="aux output"):
        gg.Recipe("g", lambda acc: {"d": acc, "pre": acc}, grouped=True, aux={"pre": gg.bf16})
    with pytest.raises(RecipeError, match="at most one"):
        gg.Recipe("g", lambda acc, x, y: acc + x + y, grouped=True,
                  operands={"x": gg.Matrix(gg.bf16), "y": gg.Matrix(gg.bf16)})
    with pytest.raises(gg.ConfigError, match=r"tile M = 64: must be a multiple of the block scales' granularity "
                                            r"128 along the kernel's M \(swapped: the kernel's M is the recipe's N\)"):
        gg.Recipe("g", lambda acc: acc, a=gg.e4m3, b=gg.e4m3, d=gg.bf16, grouped=True,
                  block_scale=gg.DEEPSEEK_BLOCK_SCALE,
                  config=gg.KernelConfig(tile=(64, 32, 128), schedule=gg.Schedule.PINGPONG, swap_ab=True))


# ---- the kernel


def test_grouped_kernel_is_hopper_code(grouped_kernel):
    r = grouped_kernel.report
    assert "KernelPtrArrayTmaWarpSpecializedCooperative" in grouped_kernel.source
    assert r.sass["HGMMA"] > 0 and r.sass["UTMALDG"] > 0 and r.sass["UTMASTG"] > 0 and r.sass["USETMAXREG"] > 0
    assert r.local_bytes == 0 and r.stack_bytes == 0
    assert gg.config.smem_need(grouped_kernel.config, grouped_kernel.recipe.ir) >= r.smem_bytes


def test_call_checks_arguments(grouped_kernel):
    k = _cpu(grouped_kernel)
    a, b, offsets, bias, weight = _inputs()
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

    k = _cpu(grouped_kernel)
    a, b, offsets, bias, weight = _inputs()
    odd = torch.empty(37 * 64 + 1).bfloat16()[1:].view(37, 64).copy_(a)
    with pytest.raises(LayoutMismatch) as refused:
        k.prepare(odd, b, offsets, bias=bias, weight=weight)
    with mock.patch("gemmgen.runtime.grouped.check_grouped_call", side_effect=AssertionError("checked again")), \
            pytest.raises(LayoutMismatch) as again:
        k.prepare(odd, b, offsets, bias=bias, weight=weight)
    assert again.value.argument == refused.value.argument == "a" and str(again.value) == str(refused.value)
    assert k.prepare(a, b, offsets, bias=bias, weight=weight).params is not None


def test_prepare_builds_setup_and_params(grouped_kernel):
    k = _cpu(grouped_kernel)
    a, b, offsets, bias, weight = _inputs()
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


@pytest.mark.parametrize("index", range(len(GROUPED_CONFIGS)), ids=[c.name for c in GROUPED_CONFIGS])
def test_group_arrays_address_each_groups_rows(grouped_kernels, index):
    """Every per-group pointer and stride the kernel's Params point it at, against torch's own
    addressing of the same elements: group g's first row of A, D and the routing weights, its B
    and its bias row. A swapped kernel (D_g^T = B_g^T A_g^T) reads the caller's B as its A, A as
    its B, the weights as its row vector and the bias as its column vector; its problem is (N, M_g, K)."""
    k = _cpu(grouped_kernels[index])
    swapped = k.compiled.config.swap_ab
    a, b, offsets, bias, weight = _inputs(rows=61, k=72, n=40, groups=5, offsets=(7, 7, 30, 44, 60))
    a = torch.randn(61, 96).bfloat16()[:, :72]  # padded rows: lda 96
    bias = torch.randn(5, 64).bfloat16()[:, :40]  # padded group rows: 64 elements apart
    p = k.prepare(a, b, offsets, bias=bias, weight=weight)
    shapes, table = _filled(p.setup, offsets.tolist())
    field = _params_field(k.compiled, p.params)
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
    k = _cpu(grouped_kernel)
    first = _inputs()
    second = tuple(t.clone() for t in first)
    for args in (first, second, first):
        a, b, offsets, bias, weight = args
        for out in (None, torch.empty(37, 48).bfloat16()):
            p = k.prepare(a, b, offsets, bias=bias, weight=weight, out=out)
            _, table = _filled(p.setup, offsets.tolist())
            assert SETUP.unpack(p.setup)[0] == offsets.data_ptr()
            assert table[0][:5] == [a.data_ptr(), b.data_ptr(), p.output.data_ptr(), bias.data_ptr(), weight.data_ptr()]
            assert out is None or p.output is out


@pytest.mark.parametrize("index", range(len(GROUPED_CONFIGS)), ids=[c.name for c in GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [
    ((37, 64, 48, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((37, 64, 48, 4), (40, 3, 50, 60)),  # out of range and decreasing: clamped
    ((300, 72, 136, 3), (1, 129, 300)),  # M = 1, groups over several tiles, K and N tails
])
def test_emulated_groups_compute_the_recipe(grouped_kernels, index, shape, offsets):
    """The whole host path through an emulation of both kernels: the setup block turned into the
    group arrays as the setup kernel would, then per group what the GEMM reads through its Params
    (shape, A, B, the bias and weight pointers, D's address and stride) and the epilogue its source
    declares. Against the reference; rows in no group stay NaN."""
    ck = grouped_kernels[index]
    enc = RecordingEncoder()
    k = GroupedKernel(ck, encoder=enc, hardware=lambda i: (132, 0), require_cuda=False)
    rows, depth, n, groups = shape
    a, b, offs, bias, weight = _inputs(rows, depth, n, groups, offsets)
    a = torch.randn(rows, depth + 8).bfloat16()[:, :depth]  # rows 8 apart from K: A's and B's strides differ
    out = torch.full((rows, n), float("nan")).bfloat16()
    p = k.prepare(a, b, offs, bias=bias, weight=weight, out=out)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(ck, p.setup, p.params, enc, [a, b, offs, bias, weight, out, p.buffer])
    want = moe_recipe().reference(a, b, offs, bias=bias, weight=weight).float()
    assert want.nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.oracle
@pytest.mark.parametrize("index", range(len(FP8_GROUPED_CONFIGS)), ids=[c.name for c in FP8_GROUPED_CONFIGS])
def test_fp8_groups(fp8_kernels, index, tmp_path):
    """fp8 experts: QGMMA through the fp8 mainloop's promotion into fp32; Params against CUTLASS's
    host code; the emulation against the reference (scales per token and per expert channel),
    unswapped and swapped."""
    from gemmgen.testing.oracle import OracleProgram

    fp8_kernel = fp8_kernels[index]
    r = fp8_kernel.report
    assert "MainloopSm90ArrayTmaGmmaWarpSpecializedFP8" in fp8_kernel.source
    assert r.sass["QGMMA"] > 0 and r.sass["HGMMA"] == 0 and r.local_bytes == 0 and r.stack_bytes == 0
    assert 0 <= gg.config.smem_need(fp8_kernel.config, fp8_kernel.generated.kernel_recipe) - \
        fp8_kernel.info.smem_bytes <= 1024
    enc = RecordingEncoder()
    k = GroupedKernel(fp8_kernel, encoder=enc, hardware=lambda i: (132, 0), require_cuda=False)
    a, b, offsets, ops = _fp8_inputs(rows=300, k=144, n=136, groups=3, offsets=(1, 129, 300))
    out = torch.full((300, 136), float("nan")).bfloat16()
    p = k.prepare(a, b, offsets, out=out, **ops)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(fp8_kernel, p.setup, p.params, enc, [a, b, offsets, *ops.values(), out, p.buffer])
    want = moe_fp8_recipe().reference(a, b, offsets, **ops).float()
    assert want.abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2)
    oracle = OracleProgram(fp8_kernel.generated, tmp_path)
    field = _params_field(fp8_kernel, p.params)
    values = {**_oracle_values(field, 3, 132, 0), **_vector_values(fp8_kernel, field)}
    assert set(values) >= {"operand.scale_a.ptr", "operand.scale_b.ptr", "operand.bias.ptr"}
    expected = oracle.run_argv(oracle.grouped_argv(values))
    assert expected.can_implement
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    for f, _, _ in fp8_kernel.params_layout.fields:
        if f.kind != "desc":
            assert field(f.name) == expected.fields[f.name]["bits"], f.name
    assert field("mainloop.mma_promotion_interval") == 4
    assert list(p.grid) == expected.launch["grid"]


def test_empty_and_zero_k(grouped_kernel):
    k = _cpu(grouped_kernel)
    a, b, offsets, bias, weight = _inputs(rows=0)
    assert k.prepare(a, b, torch.zeros(4, dtype=torch.int32), bias=bias, weight=weight).params is None
    a, b, offsets, bias, weight = _inputs(k=0)
    out = torch.full((37, 48), float("nan")).bfloat16()
    p = k.prepare(a, b, offsets, bias=bias, weight=weight, out=out)
    assert p.params is None
    want = moe_recipe().reference(a, b, offsets, bias=bias, weight=weight)
    torch.testing.assert_close(out[:30].float(), want[:30].float())
    assert out[30:].float().isnan().all()


# ---- against CUTLASS's host code


@pytest.fixture(scope="module")
def grouped_oracles(grouped_kernels, tmp_path_factory):
    """CUTLASS's host code for each grouped kernel (nvcc, about 25 s each)."""
    from gemmgen.testing.oracle import OracleProgram

    build = tmp_path_factory.mktemp("grouped-oracle")
    return [OracleProgram(k.generated, build) for k in grouped_kernels]


@pytest.mark.oracle
@pytest.mark.parametrize("index", range(len(GROUPED_CONFIGS)), ids=[c.name for c in GROUPED_CONFIGS])
@pytest.mark.parametrize("sm_count, clusters", [(132, 0), (114, 0), (16, 0), (132, 66), (132, 33)])
def test_arguments_match_cutlass(grouped_kernels, grouped_oracles, index, sm_count, clusters):
    grouped_kernel, oracle = grouped_kernels[index], grouped_oracles[index]
    k = _cpu(grouped_kernel, sm_count, clusters)
    enc = k._encode
    a, b, offsets, bias, weight = _inputs(rows=1000, k=264, n=136, groups=8, offsets=range(100, 900, 100))
    p = k.prepare(a, b, offsets, bias=bias, weight=weight)
    layout = k.compiled.params_layout
    field = _params_field(k.compiled, p.params)
    values = {**_oracle_values(field, 8, sm_count, clusters), **_vector_values(grouped_kernel, field)}
    assert set(values) >= {"operand.bias.ptr", "operand.weight.ptr"}
    expected = oracle.run_argv(oracle.grouped_argv(values))
    assert expected.can_implement
    by_addr = {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    assert {c.addr: c.as_dict() for c in enc.calls} == by_addr
    for f, offset, _ in layout.fields:
        want = expected.fields[f.name]
        if f.kind == "desc":
            ours = enc.of(p.params[offset:offset + 128])
            theirs = expected.encodes[want["desc"] - 1] if want["desc"] else None
            assert (ours.addr if ours else None) == (theirs["addr"] if theirs else None), f.name
        else:
            assert field(f.name) == want["bits"], f.name
    assert list(p.grid) == expected.launch["grid"]
    assert expected.launch["smem"] == grouped_kernel.info.smem_bytes
    # the buffer's workspace (tensor maps per SM) holds what CUTLASS asks for, before the group arrays
    layout = BufferLayout.of(8, 8, sm_count, False)
    assert field("problem.shapes") - field("workspace") == layout.shapes >= expected.workspace_size > 0


@pytest.mark.oracle
def test_setup_kernel_arithmetic_on_the_host(tmp_path):
    """gemmgen/include/gemmgen/grouped.hpp's `fill`, compiled for the host by nvcc, against
    group_bounds and the column formula, for offsets that are sorted, decreasing and out of range,
    unswapped and swapped (the problem (N, M_g, K))."""
    from gemmgen.compile.toolchain import toolchain
    from gemmgen.testing.oracle import nvcc_path

    src = tmp_path / "fill.cu"
    src.write_text(r'''
#include <cstdio>
#include <cstdlib>
#include <cutlass/cutlass.h>
#include <gemmgen/grouped.hpp>
int main(int argc, char** argv) {
  int groups = argc - 3, offsets[64], shapes[3 * 64];
  long long table[3 * 64];
  for (int g = 0; g < groups; ++g) offsets[g] = std::atoi(argv[g + 3]);
  gemmgen::grouped::Setup s{offsets, shapes, table, groups, std::atoi(argv[2]), 48, 64, 3, std::atoi(argv[1]),
                            {1000, 7, 5}, {24, 0, 0}, {0, 1 << 20, 0}};
  for (int g = 0; g < groups; ++g) gemmgen::grouped::fill(s, g);
  for (int g = 0; g < groups; ++g)
    std::printf("%d %d %d %lld %lld %lld\n", shapes[3 * g], shapes[3 * g + 1], shapes[3 * g + 2], table[g],
                table[groups + g], table[2 * groups + g]);
}
''')
    exe = tmp_path / "fill"
    tc = toolchain()
    subprocess.run([str(nvcc_path()), "-std=c++17", "-w", *(f"-I{d}" for d in tc.include_dirs),
                    f"-L{nvcc_path().parent.parent / 'lib'}", "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    for swapped in (0, 1):
        for rows, offsets in ((37, [5, 5, 20, 30]), (37, [10, 4, 12]), (37, [-3, 50, 60]), (1, [1]), (9, [0, 0, 9])):
            out = subprocess.run([str(exe), str(swapped), str(rows), *map(str, offsets)], check=True,
                                 capture_output=True, text=True).stdout.split("\n")
            pad = [0] * (MAX_COLUMNS - 3)  # ...and emulate.fill_groups, which the emulation runs, agrees
            shapes, table = fill_groups((0, 0, 0, len(offsets), rows, 48, 64, 3, swapped, 1000, 7, 5, *pad,
                                         24, 0, 0, *pad, 0, 1 << 20, 0, *pad), offsets)
            for g, (start, end) in enumerate(group_bounds(offsets, rows)):
                shape = [48, end - start, 64] if swapped else [end - start, 48, 64]
                columns = [1000 + 24 * start, 7 + (1 << 20) * g, 5]
                assert list(map(int, out[g].split())) == [*shape, *columns] == [*shapes[g], *table[g]]


# ---- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GROUPED_CONFIGS)), ids=[c.name for c in GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [
    ((37, 64, 48, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((37, 64, 48, 4), (0, 37, 37, 37)),  # all rows in one group
    ((37, 64, 48, 4), (40, 3, 50, 60)),  # out of range and decreasing: clamped
    ((1000, 264, 136, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # tiles per group, K and N tails, M = 1
], ids=["gaps", "one", "bad", "large"])
def test_grouped_on_gpu(grouped_kernels, index, shape, offsets):
    """Against the reference (fp32 on the CPU), output pre-filled with NaN: rows after the last group
    stay NaN; then a CUDA graph of the call replayed after the offsets changed on the GPU."""
    kernel = GroupedKernel(grouped_kernels[index])
    rows, k, n, groups = shape
    a, b, offs, bias, weight = (t.cuda() for t in _inputs(rows, k, n, groups, offsets))
    want = moe_recipe().reference(a, b, offs, bias=bias, weight=weight).float()
    assert want.nan_to_num().abs().sum() > 0
    out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
    kernel(a, b, offs, bias=bias, weight=weight, out=out)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    graph = torch.cuda.CUDAGraph()
    again = torch.full_like(out, float("nan"))
    with torch.cuda.graph(graph):
        kernel(a, b, offs, bias=bias, weight=weight, out=again)
    new = sorted(torch.randint(0, rows + 1, (groups,)).tolist())
    offs.copy_(torch.tensor(new, dtype=torch.int32))  # the replay reads the offsets on the GPU
    graph.replay()
    torch.cuda.synchronize()
    want = moe_recipe().reference(a, b, offs, bias=bias, weight=weight).float()
    covered = new[-1]
    torch.testing.assert_close(again[:covered].float().cpu(), want[:covered], rtol=1.6e-2, atol=1e-2,
                               msg=f"replay with offsets {new}")


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(FP8_GROUPED_CONFIGS)), ids=[c.name for c in FP8_GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [((37, 128, 48, 4), (5, 5, 20, 30)),
                                            ((1000, 272, 136, 8), (90, 90, 333, 334, 600, 700, 999, 1000))])
def test_fp8_groups_on_gpu(fp8_kernels, index, shape, offsets):
    """moe_fp8 against the reference on the GPU, output pre-filled with NaN, unswapped and swapped."""
    rows, k, n, groups = shape
    a, b, offs, ops = _fp8_inputs(rows, k, n, groups, offsets)
    a, b, offs = a.cuda(), b.cuda(), offs.cuda()
    ops = {name: v.cuda() for name, v in ops.items()}
    want = moe_fp8_recipe().reference(a, b, offs, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
    GroupedKernel(fp8_kernels[index])(a, b, offs, out=out, **ops)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.gpu
def test_grouped_op_on_gpu(grouped_kernel):
    """The op on CUDA tensors (the kernel: swapped for 37 rows in 4 groups, the default for 37 in
    one), its gradients (torch._grouped_mm) and torch.compile."""
    op = gg.op(moe_recipe())
    one = [t.cuda() for t in _inputs(groups=1, offsets=(37,))]
    assert not choose(moe_recipe().ir, 37, 48, 64, 1).config.swap_ab
    torch.testing.assert_close(op(*one).double().cpu(), _unfused(*(t.cpu() for t in one)), rtol=1.6e-2, atol=1e-2)
    a, b, offsets, bias, weight = (t.cuda() for t in _inputs(offsets=(5, 5, 20, 37)))
    assert choose(moe_recipe().ir, 37, 48, 64, 4).config.swap_ab
    want = _unfused(a.cpu(), b.cpu(), offsets.cpu(), bias.cpu(), weight.cpu())
    torch.testing.assert_close(op(a, b, offsets, bias, weight).double().cpu(), want, rtol=1.6e-2, atol=1e-2)
    compiled = torch.compile(lambda *x: op(*x), fullgraph=True)
    torch.testing.assert_close(compiled(a, b, offsets, bias, weight).double().cpu(), want, rtol=1.6e-2, atol=1e-2)
    leaves = [t.clone().requires_grad_(True) for t in (a, b, bias, weight)]
    grad = torch.randn(37, 48, device="cuda")
    op(leaves[0], leaves[1], offsets, leaves[2], leaves[3]).float().backward(grad)
    ref = [t.detach().cpu().double().requires_grad_(True) for t in (a, b, bias, weight)]
    _unfused(ref[0], ref[1], offsets.cpu(), ref[2], ref[3]).backward(grad.cpu().double())
    _assert_gradients(leaves, ref)


@pytest.mark.gpu
def test_grouped_autotune_on_gpu(tmp_path, monkeypatch):
    """A grouped autotune on the GPU: the swapped kernel and the default timed at a decode step;
    then the op launches the winner, which computes the layer (output checked against fp64)."""
    from gemmgen import tuning
    from gemmgen.integrations.grouped_ops import grouped_config

    monkeypatch.setattr(tuning, "_TABLES", [])
    recipe = moe_recipe()
    table = gg.autotune(recipe, [GROUPED_TUNE_PROBLEM], limit=TUNE_CANDIDATES, out=tmp_path / "t.json")
    (entry,) = table.entries.values()
    assert len(entry["timings_us"]) == TUNE_CANDIDATES and all(t > 0 for t in entry["timings_us"].values())
    rows, n, k, groups = GROUPED_TUNE_PROBLEM
    assert grouped_config(recipe, rows, n, k, groups, tuning.Device.current()).name == entry["name"]
    a, b, offsets, bias, weight = (t.cuda() for t in _inputs(rows, k, n, groups, (3, 20, 20, 30, 41, 50, 60, 64)))
    want = _unfused(a.cpu(), b.cpu(), offsets.cpu(), bias.cpu(), weight.cpu())
    assert want.abs().sum() > 0
    torch.testing.assert_close(gg.op(recipe)(a, b, offsets, bias, weight).double().cpu(), want, rtol=1.6e-2,
                               atol=1e-2)


# ---- the torch op


def _unfused(a, b, offsets, bias, weight):
    """The MoE layer in plain torch, one group at a time (float64)."""
    out = []
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), a.shape[0])):
        acc = a[start:end].double() @ b[g].double()
        out.append(torch.nn.functional.silu(acc + bias[g].double()) * weight[start:end, None].double())
    return torch.cat(out)


def _assert_gradients(mine: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Each gradient within 1% of the fp64 unfused layer's, relative to its norm: the op recomputes
    the accumulator in bf16 (as the unfused bf16 layer would have saved it) and returns bf16
    gradients for bf16 inputs, so each element carries bf16 rounding (about 0.3% here)."""
    for name, m, r in zip(("a", "b", "bias", "weight"), mine, ref, strict=True):
        assert m.grad is not None and r.grad is not None and r.grad.norm() > 0, name
        error = (m.grad.double().cpu() - r.grad).norm() / r.grad.norm()
        assert error < 1e-2, (name, float(error))


def test_op_cpu_fake_and_opcheck():
    op = gg.op(moe_recipe())
    a, b, offsets, bias, weight = _inputs(offsets=(5, 5, 20, 37))
    d = op(a, b, offsets, bias, weight)
    assert d.shape == (37, 48) and d.dtype == torch.bfloat16
    torch.testing.assert_close(d.double(), _unfused(a, b, offsets, bias, weight), rtol=1.6e-2, atol=1e-2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(t) for t in (a, b, offsets, bias, weight)))
    assert fake.shape == (37, 48) and fake.stride() == (48, 1)
    torch.library.opcheck(op.default, (a, b, offsets, bias, weight))


def test_op_gradients_match_the_unfused_layer():
    op = gg.op(moe_recipe())
    a, b, offsets, bias, weight = _inputs(offsets=(5, 5, 20, 37))
    leaves = [t.clone().requires_grad_(True) for t in (a, b, bias, weight)]
    grad = torch.randn(37, 48)
    op(leaves[0], leaves[1], offsets, leaves[2], leaves[3]).float().backward(grad)
    ref = [t.detach().double().requires_grad_(True) for t in (a, b, bias, weight)]
    _unfused(ref[0], ref[1], offsets, ref[2], ref[3]).backward(grad.double())
    _assert_gradients(leaves, ref)


def test_fp8_op_differentiates_scales_not_inputs():
    """The fp8 op's gradients reach the scales and the bias (the accumulator recomputed from the fp8
    values, exact in bf16), like the unfused layer's in fp64; fp8 A or B raise InvalidArgument."""
    op = gg.op(moe_fp8_recipe())
    a, b, offsets, ops = _fp8_inputs(offsets=(5, 5, 20, 37))
    leaves = {k: v.clone().requires_grad_(True) for k, v in ops.items()}
    grad = torch.randn(37, 48)
    op(a, b, offsets, *leaves.values()).float().backward(grad)
    ref = {k: v.detach().double().requires_grad_(True) for k, v in ops.items()}
    rows = []
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), 37)):
        acc = a[start:end].double() @ b[g].double()
        rows.append(acc * ref["scale_a"][start:end, None] * ref["scale_b"][g] + ref["bias"][g])
    torch.cat(rows).backward(grad.double())
    for k in ops:
        error = (leaves[k].grad.double() - ref[k].grad).norm() / ref[k].grad.norm()
        assert error < 1e-2, (k, float(error))
    with pytest.raises(InvalidArgument, match="no gradient for fp8"):
        op(a.float().requires_grad_(True).to(torch.float8_e4m3fn), b, offsets, *ops.values()).sum().backward()


def test_op_traces_without_graph_breaks():
    op = gg.op(moe_recipe())
    a, b, offsets, bias, weight = _inputs(offsets=(5, 5, 20, 37))

    def layer(a, b, offsets, bias, weight):
        return op(torch.relu(a), b, offsets, bias, weight) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b, offsets, bias, weight), layer(a, b, offsets, bias, weight))


# ---- the module


def _experts_loop(linears, x, offsets, activation):
    """The experts as a model without gemmgen runs them: each expert's nn.Linear (in float64) on its
    own rows, then the activation."""
    act = {None: lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu}[activation]
    out = []
    for e, (start, end) in enumerate(group_bounds(offsets.tolist(), x.shape[0])):
        out.append(act(linears[e].double()(x[start:end].double())))
    return torch.cat(out)


def _absolute(linear: torch.nn.Linear) -> torch.nn.Linear:
    """The Linear with |W| and |b|: applied to |x|, the scale of its output's rounding errors."""
    out = copy.deepcopy(linear)
    with torch.no_grad():
        out.weight.abs_()
        if out.bias is not None:
            out.bias.abs_()
    return out


@pytest.mark.parametrize("activation, bias", [("silu", True), (None, False), ("relu", True)])
def test_grouped_linear_is_the_experts_linears(activation, bias):
    """Forward and gradients (input, weights, biases) of GroupedLinear against the experts'
    nn.Linear layers run one by one in float64, an empty expert and odd sizes included; rows after
    the last expert's end are not part of the output's contract."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    linears = [torch.nn.Linear(24, 40, bias=bias, dtype=torch.bfloat16) for _ in range(4)]
    layer = gg.nn.GroupedLinear.from_linears(linears, activation=activation)
    assert layer.weight.shape == (4, 40, 24) and (layer.bias is not None) == bias
    x = torch.randn(37, 24).bfloat16()
    offsets = torch.tensor([5, 5, 20, 33], dtype=torch.int32)
    xs = x.clone().requires_grad_(True)
    y = layer(xs, offsets)
    assert y.shape == (37, 40) and y.dtype == torch.bfloat16
    ref_linears = [torch.nn.Linear(24, 40, bias=bias, dtype=torch.float64) for _ in range(4)]
    with torch.no_grad():
        for mine, ref in zip(linears, ref_linears, strict=True):
            ref.weight.copy_(mine.weight)
            if bias:
                ref.bias.copy_(mine.bias)
    xr = x.double().requires_grad_(True)
    want = _experts_loop(ref_linears, xr, offsets, activation)
    assert want.abs().max() > 0
    torch.testing.assert_close(y[:33].double(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.detach().abs().max()))
    grad = torch.randn(33, 40)
    if activation == "relu":
        # ReLU's derivative jumps at 0, and the op recomputes the pre-activation from a bf16
        # accumulator (as the unfused bf16 layer would have saved it): where the exact one is
        # within that rounding (2^-9 of |x| |W|^T, doubled) of 0, either side is right. No
        # gradient flows from those elements on either side, so the check stays exact elsewhere.
        magnitude = _experts_loop([_absolute(m) for m in ref_linears], x.double().abs(), offsets, None)
        pre = _experts_loop(ref_linears, x.double(), offsets, None)
        grad[(pre.abs() <= 2.0**-8 * magnitude)] = 0.0
    y[:33].float().backward(grad)
    want.backward(grad.double())

    def grad_of(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None and t.grad is not None
        return t.grad

    got = {"input": grad_of(xs), "weight": grad_of(layer.weight)}
    ref_grads = {"input": grad_of(xr), "weight": torch.stack([grad_of(m.weight) for m in ref_linears])}
    if bias:
        got["bias"] = grad_of(layer.bias)
        ref_grads["bias"] = torch.stack([grad_of(m.bias) for m in ref_linears])
    for name, want_grad in ref_grads.items():
        assert want_grad.norm() > 0, name
        error = (got[name].double() - want_grad).norm() / want_grad.norm()
        assert error < 1e-2, (name, float(error))


def test_grouped_linear_pads_odd_bias_rows_itself(monkeypatch):
    """out_features 12 (24-byte bias rows): the module hands the op 16-byte aligned rows, so the op
    never refuses the layout and copies after the fact; gradients reach the bias, and the input's
    and weight's are computed (torch._grouped_mm wants 16-byte strides: the op pads dD's rows)."""
    from gemmgen.integrations import ops

    def refused(*args, **kw):
        raise AssertionError("the op had to realign an argument")

    monkeypatch.setattr(ops, "_realigned", refused)
    layer = gg.nn.GroupedLinear(2, 16, 12)
    x, offsets = torch.randn(10, 16).bfloat16(), torch.tensor([4, 10], dtype=torch.int32)
    y = layer(x, offsets)
    b = layer.bias
    assert b is not None
    w, bf = layer.weight.detach().float(), b.detach().float()
    want = torch.cat([x[:4].float() @ w[0].T + bf[0], x[4:].float() @ w[1].T + bf[1]])
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
    xs = x.clone().requires_grad_(True)
    layer(xs, offsets).float().sum().backward()
    assert b.grad is not None and xs.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(b.grad.float(), torch.tensor([[4.0] * 12, [6.0] * 12]))
    torch.testing.assert_close(xs.grad.float(), torch.cat([w[0].sum(0).expand(4, 16), w[1].sum(0).expand(6, 16)]),
                               rtol=1.6e-2, atol=1e-2)
    want_w = torch.stack([x[:4].float().sum(0).expand(12, 16), x[4:].float().sum(0).expand(12, 16)])
    torch.testing.assert_close(layer.weight.grad.float(), want_w, rtol=1.6e-2, atol=1e-2)


def test_grouped_linear_mistakes_and_trace():
    """Wrong inputs raise InvalidArgument naming them; the offsets are checked by the op; the layer
    traces without graph breaks; `launches` names the kernel a number of rows uses, whatever their
    split, and model_launches both of the layer's."""
    layer = gg.nn.GroupedLinear(3, 16, 24, activation="silu")
    x, offsets = torch.randn(10, 16).bfloat16(), torch.tensor([3, 3, 10], dtype=torch.int32)
    with pytest.raises(InvalidArgument, match=r"input: expected \(tokens, 16\) rows sorted by expert, got \(10, 8\)"):
        layer(torch.randn(10, 8).bfloat16(), offsets)
    with pytest.raises(InvalidArgument, match=r"input: dtype torch.float32, but this layer computes in torch.bfloat16"):
        layer(x.float(), offsets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x.float(), offsets).dtype == torch.bfloat16
    with pytest.raises(InvalidArgument, match=r"offsets"):
        layer(x, offsets.long())
    with pytest.raises(InvalidArgument, match=r"num_experts: expected a positive int, got 0"):
        gg.nn.GroupedLinear(0, 16, 24)
    with pytest.raises(InvalidArgument, match=r"in_features 12 is not a multiple of 8"):
        gg.nn.GroupedLinear(2, 12, 24)
    with pytest.raises(InvalidArgument, match=r"the experts differ"):
        gg.nn.GroupedLinear.from_linears([torch.nn.Linear(16, 24), torch.nn.Linear(16, 32)])
    with pytest.raises(RecipeError, match=r"activation: expected one of"):
        gg.nn.GroupedLinear(2, 16, 24, activation="tanh")
    explained = torch._dynamo.explain(lambda a, o: layer(a, o).relu())(x, offsets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    recipe, config = layer.launches()
    assert recipe.gemm.grouped and recipe is gg.nn.grouped_linear_recipe("silu", True, torch.bfloat16)
    assert config == recipe.default_config() == layer.launches(3 * 33)[1]
    decode = layer.launches(3 * 32)
    assert decode == (recipe, choose(recipe.ir, 96, 24, 16, 3).config) and decode[1].swap_ab
    assert gg.nn.model_launches(torch.nn.Sequential(layer), tokens=(1,)) == [(recipe, config), decode]
    assert "num_experts=3, in_features=16, out_features=24, bias=True, activation='silu'" in repr(layer)
    again = copy.deepcopy(layer)  # pickles without the recipe's lambda, rebuilt on load
    torch.testing.assert_close(again(x, offsets)[:10], layer(x, offsets)[:10])


@pytest.mark.gpu
def test_grouped_linear_on_gpu():
    """The module on CUDA (the grouped kernel), forward and gradients against the experts' Linears in
    float64, eager and under torch.compile."""
    linears = [torch.nn.Linear(64, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    layer = gg.nn.GroupedLinear.from_linears(linears, activation="silu")
    x = torch.randn(300, 64, device="cuda").bfloat16().requires_grad_(True)
    offsets = torch.tensor([40, 40, 200, 300], dtype=torch.int32, device="cuda")
    want = _experts_loop([m.cpu() for m in linears], x.detach().cpu(), offsets.cpu(), "silu")
    y = layer(x, offsets)
    torch.testing.assert_close(y.double().cpu(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets).double().cpu(), want, rtol=1.6e-2,
                               atol=1.6e-2 * float(want.abs().max()))
    y.float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.bias is not None
    assert layer.bias.grad is not None and x.grad.abs().max() > 0
    x, offsets = x[:12].detach(), torch.tensor([3, 3, 10, 12], dtype=torch.int32, device="cuda")  # decode: swapped
    assert layer.launches(12)[1].swap_ab
    want = _experts_loop([m.cpu() for m in linears], x.cpu(), offsets.cpu(), "silu")
    torch.testing.assert_close(layer(x, offsets).double().cpu(), want, rtol=1.6e-2,
                               atol=1.6e-2 * float(want.abs().max()))


# ---- fp8 block-scaled experts (DeepSeek-V3)


def _block_inputs(rows=37, k=304, n=136, groups=4, offsets=(5, 5, 20, 30), gen=None):
    """moe_fp8_block's: tokens and expert weights quantized as DeepSeek-V3 does (per token and 128 of
    K; per 128 x 128 block), scales K-major and unpadded as grouped kernels read them, and routing
    weights. Also the unquantized tokens and weights (float32)."""
    gen = gen or _gen()
    x = torch.randn(rows, k, generator=gen) * (torch.rand(rows, 1, generator=gen) * 4 + 0.1)
    w = torch.randn(groups, n, k, generator=gen) * (torch.rand(groups, 1, 1, generator=gen) + 0.1)
    a, scale_a = gg.quantize_blockwise(x, (1, 128), compact=True)
    b, scale_b = gg.quantize_blockwise(w.mT, (128, 128), scale_layout=gg.ColMajor, compact=True)
    ops = {"scale_a": scale_a, "scale_b": scale_b, "weight": torch.rand(rows, generator=gen) + 0.5}
    return a, b, torch.tensor(offsets, dtype=torch.int32), ops, x, w


def _gen() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def block_kernels(session_cache, examples):
    """The example moe_fp8_block under BLOCK_GROUPED_CONFIGS: its default (compiled with the
    examples) and the others, swapped among them (NVRTC, about 25 s each; from the bundle on the GPU)."""
    return [examples["moe_fp8_block"].build(config, cache=session_cache) for config in BLOCK_GROUPED_CONFIGS]


@pytest.fixture(scope="module")
def block_kernel(block_kernels):
    return block_kernels[0]


BLOCK_INDEX = pytest.mark.parametrize("index", range(len(BLOCK_GROUPED_CONFIGS)),
                                      ids=[c.name for c in BLOCK_GROUPED_CONFIGS])


def test_block_scaled_reference_is_each_groups_scaled_k_blocks(examples):
    """Group g's rows: the sum over K blocks of (A_g,kb @ B_g,kb) times each row's scale of that K
    block and each 128 x 128 block's scale of B_g, in float64 by explicit loops; the K tail's block
    partial; rows in no group NaN."""
    r = examples["moe_fp8_block"]
    a, b, offsets, ops, _, _ = _block_inputs()
    d = r.reference(a, b, offsets, **ops).double()
    sa, sb = ops["scale_a"].double(), ops["scale_b"].double()
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), 37)):
        want = torch.zeros(end - start, 136, dtype=torch.float64)
        for kb in range(3):  # K = 304: blocks of 128, 128 and 48
            ks = slice(128 * kb, 128 * (kb + 1))
            for nb in range(2):  # N = 136: 128 and 8
                ns = slice(128 * nb, 128 * (nb + 1))
                part = a[start:end, ks].double() @ b[g, ks, ns].double()
                want[:, ns] += part * sa[start:end, kb, None] * sb[g, kb, nb]
        want *= ops["weight"][start:end, None].double()
        assert want.abs().sum() > 0 or start == end
        torch.testing.assert_close(d[start:end], want, rtol=1.6e-2, atol=1e-2)
    assert d[30:].isnan().all()
    with pytest.raises(RecipeError, match=r"block_scale: M granularity 128 in a grouped GEMM"):
        gg.Recipe("g", a=gg.e4m3, b=gg.e4m3, grouped=True, block_scale=(128, 128, 128))


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
    assert r.sass["QGMMA"] > 0 and r.sass["HGMMA"] == 0 and r.sass["UTMALDG"] == 2
    assert r.local_bytes == 0 and r.stack_bytes == 0
    assert 0 <= gg.config.smem_need(kernel.config, kernel.generated.kernel_recipe) - kernel.info.smem_bytes <= 1024


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
    k = _cpu(block_kernel)
    a, b, offsets, ops, _, _ = _block_inputs()
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
    k = _cpu(block_kernel)
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
    block_kernel = block_kernels[index]
    rows, k, n, groups = shape
    a, b, offs, ops, x, w = _block_inputs(rows, k, n, groups, offsets)
    enc = RecordingEncoder()
    kernel = GroupedKernel(block_kernel, encoder=enc, hardware=lambda i: (132, 0), require_cuda=False)
    out = torch.full((rows, n), float("nan")).bfloat16()
    p = kernel.prepare(a, b, offs, **ops, out=out)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(block_kernel, p.setup, p.params, enc, [a, b, offs, *ops.values(), out, p.buffer])
    want = block_kernel.recipe.reference(a, b, offs, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    for g, (start, end) in enumerate(group_bounds(list(offsets), rows)):
        if start < end:
            exact = (x[start:end].double() @ w[g].double().T) * ops["weight"][start:end, None].double()
            assert (out[start:end].double() - exact).norm() / exact.norm() < 0.06  # e4m3: 3 mantissa bits


@pytest.mark.oracle
@BLOCK_INDEX
def test_block_scaled_arguments_match_cutlass(block_kernels, index, tmp_path):
    """Every Params field and tensor map against CUTLASS's host code given the same arrays."""
    from gemmgen.testing.oracle import OracleProgram

    block_kernel = block_kernels[index]
    k = _cpu(block_kernel, 114, 0)
    enc = k._encode
    a, b, offsets, ops, _, _ = _block_inputs(1000, 272, 136, 8, range(100, 900, 100))
    p = k.prepare(a, b, offsets, **ops)
    field = _params_field(block_kernel, p.params)
    oracle = OracleProgram(block_kernel.generated, tmp_path)
    values = {**_oracle_values(field, 8, 114, 0), "sfa.array": field("mainloop.ptr_sfa"), "sfa.layouts": 0,
              "sfb.array": field("mainloop.ptr_sfb"), "sfb.layouts": 0, **_vector_values(block_kernel, field)}
    assert "operand.weight.ptr" in values
    expected = oracle.run_argv(oracle.grouped_argv(values))
    assert expected.can_implement
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    for f, _, _ in block_kernel.params_layout.fields:
        if f.kind != "desc":
            assert field(f.name) == expected.fields[f.name]["bits"], f.name
    assert "mainloop.mma_promotion_interval" not in {f.name for f, _, _ in block_kernel.params_layout.fields}
    assert list(p.grid) == expected.launch["grid"]
    assert expected.launch["smem"] == block_kernel.info.smem_bytes


def test_block_scaled_op_realigns_scales_and_refuses_their_gradients(examples):
    """The op (CPU: the reference) copies scales in any layout into the one the kernel reads, traces
    with fake tensors, and differentiates the routing weights through the dequantized accumulator."""
    r = examples["moe_fp8_block"]
    op = gg.op(r)
    a, b, offsets, ops, _, _ = _block_inputs(offsets=(5, 5, 20, 37))
    want = r.reference(a, b, offsets, **ops)
    other = {**ops, "scale_a": ops["scale_a"].mT.contiguous().mT, "scale_b": ops["scale_b"].contiguous()}
    torch.testing.assert_close(op(a, b, offsets, *other.values()), want)
    # all but test_schema, whose check for mutated inputs cannot compare fp8 tensors on the CPU
    torch.library.opcheck(op.default, (a, b, offsets, *ops.values()),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    weight = ops["weight"].clone().requires_grad_(True)
    grad = torch.randn(37, 136)
    op(a, b, offsets, ops["scale_a"], ops["scale_b"], weight).float().backward(grad)
    acc = r.reference(a, b, offsets, **{**ops, "weight": torch.ones(37)}).double()
    want = (acc * grad.double()).sum(1)  # within 1% in norm, as _assert_gradients: the op recomputes in bf16
    assert weight.grad is not None and (weight.grad.double() - want).norm() / want.norm() < 1e-2
    with pytest.raises(InvalidArgument, match="scale_a: gemmgen has no gradient for block scales"):
        op(a, b, offsets, ops["scale_a"].requires_grad_(True), ops["scale_b"], ops["weight"]).sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(BLOCK_GROUPED_CONFIGS)), ids=[c.name for c in BLOCK_GROUPED_CONFIGS])
@pytest.mark.parametrize("shape, offsets", [
    ((37, 304, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last; K and N tails
    ((1000, 528, 264, 8), (90, 90, 333, 334, 600, 700, 999, 1000)),  # tiles per group, M = 1
], ids=["gaps", "large"])
def test_block_scaled_groups_on_gpu(examples, index, shape, offsets):
    """moe_fp8_block on the GPU against the reference (fp32 on the CPU), output pre-filled with NaN,
    then a CUDA graph of the call replayed after the offsets changed on the GPU."""
    recipe = examples["moe_fp8_block"]
    kernel = recipe.compile(BLOCK_GROUPED_CONFIGS[index])
    rows, k, n, groups = shape
    a, b, offs, ops, _, _ = _block_inputs(rows, k, n, groups, offsets)
    a, b, offs = a.cuda(), b.cuda(), offs.cuda()
    ops = {name: v.cuda() for name, v in ops.items()}
    want = recipe.reference(a, b, offs, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    out = torch.full((rows, n), float("nan"), device="cuda").bfloat16()
    kernel(a, b, offs, **ops, out=out)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    graph = torch.cuda.CUDAGraph()
    again = torch.full_like(out, float("nan"))
    with torch.cuda.graph(graph):
        kernel(a, b, offs, **ops, out=again)
    new = sorted(torch.randint(0, rows + 1, (groups,)).tolist())
    offs.copy_(torch.tensor(new, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = recipe.reference(a, b, offs, **ops).float()
    torch.testing.assert_close(again[:new[-1]].float().cpu(), want[:new[-1]], rtol=1.6e-2, atol=1e-2,
                               msg=f"replay with offsets {new}")


@pytest.mark.parametrize("activation, bias", [("silu", True), (None, False)])
def test_block_scaled_grouped_linear_is_the_quantized_experts(activation, bias):
    """fp8 experts (CPU: the op's reference) against the quantized math in float64 (tokens quantized
    per row and 128 features, each expert's weight per 128 x 128 block), and within fp8's precision
    of the bf16 experts' Linears; from_quantized and pickling give the same layer."""
    gen = _gen()
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    linears = [torch.nn.Linear(272, 136, bias=bias).bfloat16() for _ in range(3)]
    layer = gg.nn.BlockScaledGroupedLinear.from_linears(linears, activation=activation)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (3, 2, 3)
    x = torch.randn(50, 272, generator=gen).bfloat16()
    offsets = torch.tensor([9, 9, 44], dtype=torch.int32)
    y = layer(x, offsets)
    assert y.shape == (50, 136) and y.dtype == torch.bfloat16
    xq, sx = gg.quantize_blockwise(x, (1, 128), compact=True)
    act = {None: lambda t: t, "silu": torch.nn.functional.silu}[activation]
    for e, (start, end) in enumerate(group_bounds(offsets.tolist(), 50)):
        if start == end:
            continue
        xs = xq[start:end].double() * sx[start:end].double().repeat_interleave(128, 1)[:, :272]
        ws = layer.weight[e].double() * layer.weight_scale[e].double().repeat_interleave(128, 0).repeat_interleave(
            128, 1)[:136, :272]
        acc = xs @ ws.T + (layer.bias[e].double() if layer.bias is not None else 0)
        torch.testing.assert_close(y[start:end].double(), act(acc), rtol=1.6e-2, atol=1e-2)
        unquantized = act(linears[e].double()(x[start:end].double()))
        assert (y[start:end].double() - unquantized).norm() / unquantized.norm() < 0.06
    again = gg.nn.BlockScaledGroupedLinear.from_quantized(layer.weight, layer.weight_scale, layer.bias, activation)
    assert torch.equal(again(x, offsets)[:44], y[:44])
    copied = copy.deepcopy(layer)
    assert torch.equal(copied(x, offsets)[:44], y[:44])
    assert gg.nn.model_launches(torch.nn.Sequential(layer), tokens=(1, 64)) == [layer.launches(), layer.launches(8)]
    assert layer.launches()[0].gemm.block_scale == gg.DEEPSEEK_BLOCK_SCALE and layer.launches(8)[1].swap_ab


def test_block_scaled_grouped_linear_mistakes_and_trace():
    layer = gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(256, 128) for _ in range(2)])
    x, offsets = torch.randn(20, 256), torch.tensor([7, 20], dtype=torch.int32)
    explained = torch._dynamo.explain(lambda a, o: layer(a, o).relu())(x, offsets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    with pytest.raises(InvalidArgument, match=r"input: expected \(tokens, 256\) rows sorted by expert"):
        layer(x[None], offsets)
    with pytest.raises(InvalidArgument, match=r"in_features 24 is not a multiple of 16"):
        gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(24, 128)])
    with pytest.raises(InvalidArgument, match=r"out_features 12 is not a multiple of 8"):
        gg.nn.BlockScaledGroupedLinear.from_linears([torch.nn.Linear(256, 12)])
    with pytest.raises(InvalidArgument, match=r"weight_scale: expected an fp32 tensor of shape \(2, 1, 2\)"):
        gg.nn.BlockScaledGroupedLinear.from_quantized(layer.weight, layer.weight_scale[:, :, :1])
    with pytest.raises(InvalidArgument, match=r"weight: expected torch.float8_e4m3fn"):
        gg.nn.BlockScaledGroupedLinear.from_quantized(layer.weight.float(), layer.weight_scale)
    assert "num_experts=2, in_features=256, out_features=128, bias=True" in repr(layer)


@pytest.mark.gpu
def test_block_scaled_grouped_linear_on_gpu():
    """The fp8 experts on CUDA (the kernel) against the same layer on the CPU (the op's reference on
    the same quantized values), eager and replayed in a CUDA graph; and a decode step (swapped)."""
    linears = [torch.nn.Linear(512, 256, dtype=torch.bfloat16) for _ in range(4)]
    cpu = gg.nn.BlockScaledGroupedLinear.from_linears(linears, activation="silu")
    layer = copy.deepcopy(cpu).cuda()
    x = torch.randn(300, 512).bfloat16()
    offsets = torch.tensor([40, 40, 200, 300], dtype=torch.int32)
    want = cpu(x, offsets).float()
    assert want.abs().sum() > 0
    xc, oc = x.cuda(), offsets.cuda()
    torch.testing.assert_close(layer(xc, oc).float().cpu(), want, rtol=1.6e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(xc, oc)
    xc.copy_(torch.randn(300, 512).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float().cpu(), cpu(xc.cpu(), offsets).float(), rtol=1.6e-2, atol=1e-2)
    x, offsets = x[:12], torch.tensor([3, 3, 10, 12], dtype=torch.int32)  # a decode step: the swapped kernel
    assert layer.launches(12)[1].swap_ab
    torch.testing.assert_close(layer(x.cuda(), offsets.cuda()).float().cpu(), cpu(x, offsets).float(), rtol=1.6e-2,
                               atol=1e-2)

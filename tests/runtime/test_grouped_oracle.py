"""Grouped kernels' Params and tensor maps against CUTLASS's own host code (built by nvcc), and the
setup kernel's arithmetic run on the host from the very header the GPU compiles."""

from __future__ import annotations

import subprocess

import pytest
import torch

import gemmgen as gg
from gemmgen.ir.reference import group_bounds
from gemmgen.runtime.grouped import MAX_COLUMNS, BufferLayout, GroupedKernel
from gemmgen.testing.emulate import emulate_grouped, fill_groups
from gemmgen.testing.grouped import (
    block_grouped_inputs,
    cpu_grouped_kernel,
    fp8_grouped_inputs,
    grouped_inputs,
    params_field,
)
from gemmgen.testing.recording import RecordingEncoder
from tests.data.gpu_matrix import (
    BLOCK_GROUPED_CONFIGS,
    CHECKED_GROUPED_CONFIGS,
    FP8_GROUPED_CONFIGS,
    derived_grouped_recipe,
    moe_fp8_recipe,
)
from tests.data.session_kernels import is_compiled_grouped
from tests.runtime.test_k_grouped import SIZES as K_GROUPED_SIZES
from tests.runtime.test_k_grouped import _inputs as k_grouped_inputs
from tests.runtime.test_k_grouped import _per_expert as per_expert_weight_grad
from tests.runtime.test_k_grouped import zero_buffer

BLOCK_INDEX = pytest.mark.parametrize("index", range(len(BLOCK_GROUPED_CONFIGS)),
                                      ids=[c.name for c in BLOCK_GROUPED_CONFIGS])


def _oracle_values(field, groups: int, sm_count: int, clusters: int, pair_d: bool = False) -> dict[str, int]:
    """The Arguments every grouped kernel's oracle takes: the group arrays, the workspace, hardware;
    D's pointer and stride arrays, or (`pair_d`: D of N/2 columns) the PairStore's pointer array
    and row stride."""
    d = {"d.ptr": field("epilogue.pair_store.d.ptr"), "d.s0": field("epilogue.pair_store.d.stride_m"), "d.s1": 1,
         "d.s2": field("epilogue.pair_store.d.stride_l")} if pair_d else \
        {"d.array": field("epilogue.ptr_d"), "d.strides": field("epilogue.stride_d")}
    return {"groups": groups, "shapes": field("problem.shapes"), "workspace": field("workspace"),
            "a.array": field("mainloop.ptr_a"), "a.strides": field("mainloop.stride_a"),
            "b.array": field("mainloop.ptr_b"), "b.strides": field("mainloop.stride_b"), **d,
            "hw.device_id": 0, "hw.sm_count": sm_count, "hw.max_active_clusters": clusters}


def _vector_values(compiled, field) -> dict[str, int]:
    """The oracle's vector pointers: each operand's Params field as the kernel binds it (a swapped
    kernel's row vectors are the caller's column vectors)."""
    return {f"operand.{b.name}.ptr": field(f"epilogue.{b.kind}.{b.name}.ptr")
            for b in compiled.generated.epilogue.bindings if b.kind in ("row", "col")}


#: Fields whose value is a constant of the kernel's types (the layout probe's default, which only a
#: compile knows): a rendered kernel's (`UNCOMPILED_GROUPED`) are not compared.
_CONSTANTS = ("tma_transaction_bytes", "tma_transaction_bytes_mk", "tma_transaction_bytes_nk",
              "mma_promotion_interval", ".null_default")


def _fields_match(kernel, field, expected) -> None:
    """Every field but the tensor maps against CUTLASS's host code's, a rendered kernel's constants
    left out (at least 30 compared)."""
    compiled = bool(kernel.cubin)
    names = [f.name for f, _, _ in kernel.params_layout.fields if f.kind != "desc" and
             (compiled or not (f.name.endswith(_CONSTANTS) or f.name.startswith("hw_info.cluster_shape")))]
    for name in names:
        assert field(name) == expected.fields[name]["bits"], name
    assert len(names) >= 30, len(names)


def _matches_cutlass(ck, field, enc, p, expected) -> None:
    """The oracle's run against a prepared call: it can implement it, and the tensor maps encoded,
    every Params field but the maps, the grid and the shared memory are CUTLASS's."""
    assert expected.can_implement
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    for f, _, _ in ck.params_layout.fields:
        if f.kind != "desc":
            assert field(f.name) == expected.fields[f.name]["bits"], f.name
    assert list(p.grid) == expected.launch["grid"] and expected.launch["smem"] == ck.info.smem_bytes


@pytest.mark.oracle
@pytest.mark.parametrize("index", range(len(FP8_GROUPED_CONFIGS)), ids=[c.name for c in FP8_GROUPED_CONFIGS])
def test_fp8_groups(fp8_kernels, fp8_and_block_oracles, index, tmp_path):
    """fp8 experts: QGMMA through the fp8 mainloop's promotion into fp32 (the compiled kernels);
    Params against CUTLASS's host code; the emulation against the reference (scales per token and
    per expert channel), unswapped and swapped."""
    from gemmgen.testing.oracle import OracleProgram

    fp8_kernel = fp8_kernels[index]
    compiled = is_compiled_grouped(fp8_kernel.recipe.name, fp8_kernel.config)
    assert bool(fp8_kernel.cubin) == compiled
    assert "MainloopSm90ArrayTmaGmmaWarpSpecializedFP8" in fp8_kernel.source
    if compiled:
        r = fp8_kernel.report
        assert r.sass["QGMMA"] > 0 and r.sass["HGMMA"] == 0 and r.local_bytes == 0 and r.stack_bytes == 0
        assert 0 <= gg.codegen.sm90.smem_need(fp8_kernel.config, fp8_kernel.generated.kernel_recipe) - \
            fp8_kernel.info.smem_bytes <= 1024
    enc = RecordingEncoder()
    k = GroupedKernel(fp8_kernel, encoder=enc, hardware=lambda i: (132, 0), require_cuda=False)
    a, b, offsets, ops = fp8_grouped_inputs(rows=300, k=144, n=136, groups=3, offsets=(1, 129, 300))
    out = torch.full((300, 136), float("nan")).bfloat16()
    p = k.prepare(a, b, offsets, out=out, **ops)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(fp8_kernel, p.setup, p.params, enc, [a, b, offsets, *ops.values(), out, p.buffer])
    want = moe_fp8_recipe().reference(a, b, offsets, **ops).float()
    assert want.abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2)
    oracle = OracleProgram(fp8_kernel.generated, tmp_path)
    field = params_field(fp8_kernel, p.params)
    values = {**_oracle_values(field, 3, 132, 0), **_vector_values(fp8_kernel, field)}
    assert set(values) >= {"operand.scale_a.ptr", "operand.scale_b.ptr", "operand.bias.ptr"}
    expected = oracle.run_argv(oracle.grouped_argv(values))
    assert expected.can_implement
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    _fields_match(fp8_kernel, field, expected)
    if compiled:
        assert field("mainloop.mma_promotion_interval") == 4
    assert list(p.grid) == expected.launch["grid"]


@pytest.fixture(scope="module")
def fp8_and_block_oracles(fp8_kernels, block_kernels, tmp_path_factory):
    """CUTLASS's host code for the fp8 and block-scaled grouped kernels, built at once (two
    programs); a test's own OracleProgram of one of them runs these."""
    from gemmgen.testing.oracle import OracleProgram, build_all

    build = tmp_path_factory.mktemp("fp8-grouped-oracle")
    programs = [OracleProgram(k.generated, build) for k in (*fp8_kernels, *block_kernels)]
    build_all(programs, build)
    return programs


@pytest.fixture(scope="module")
def grouped_oracles(grouped_kernels, gated_grouped_kernel, derived_grouped_kernel, k_grouped_kernel,
                    tmp_path_factory):
    """CUTLASS's host code for each of moe_up's kernels (by config name), the gated experts'
    ("gated"), the derived backward kernel's ("derived") and the K-grouped weight gradient's
    ("k_grouped", test_k_grouped), built at once."""
    from gemmgen.testing.oracle import OracleProgram, build_all

    build = tmp_path_factory.mktemp("grouped-oracle")
    kernels = {**grouped_kernels, "gated": gated_grouped_kernel, "derived": derived_grouped_kernel,
               "k_grouped": k_grouped_kernel}
    programs = {name: OracleProgram(k.generated, build) for name, k in kernels.items()}
    build_all(list(programs.values()), build)
    return programs


@pytest.mark.oracle
@pytest.mark.parametrize("config", CHECKED_GROUPED_CONFIGS, ids=[c.name for c in CHECKED_GROUPED_CONFIGS])
@pytest.mark.parametrize("sm_count, clusters", [(132, 0), (114, 0), (16, 0), (132, 66), (132, 33)])
def test_arguments_match_cutlass(grouped_kernels, grouped_oracles, config, sm_count, clusters):
    grouped_kernel, oracle = grouped_kernels[config.name], grouped_oracles[config.name]
    k = cpu_grouped_kernel(grouped_kernel, sm_count, clusters)
    enc = k._encode
    a, b, offsets, bias, weight = grouped_inputs(rows=1000, k=264, n=136, groups=8, offsets=range(100, 900, 100))
    p = k.prepare(a, b, offsets, bias=bias, weight=weight)
    layout = k.compiled.params_layout
    field = params_field(k.compiled, p.params)
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
def test_gated_experts_match_cutlass_and_compute_the_recipe(gated_grouped_kernel, grouped_oracles):
    """Gated experts over column pairs (moe_swiglu): Hopper code with no TMA store (a PairStore
    writes each group's N/2 columns from the registers) and no spills; every Params field against
    CUTLASS's host code given the same arrays (no tensor map of D: its collective's D is void);
    every thread's registers in pairs of adjacent columns under the grouped collective's own
    partition; the compiled kernel's emulation against the reference."""
    from gemmgen.testing.grouped import moe_swiglu_recipe

    ck = gated_grouped_kernel
    r = ck.report
    assert r.sass["HGMMA"] > 0 and r.sass["UTMALDG"] > 0 and r.sass["UTMASTG"] == 0 and r.local_bytes == 0
    assert 0 <= gg.codegen.sm90.smem_need(ck.config, ck.generated.kernel_recipe) - ck.info.smem_bytes <= 1024
    k = cpu_grouped_kernel(ck, 114, 0)
    enc = k._encode
    a, b, offsets, bias, weight = grouped_inputs(rows=1000, k=264, n=136, groups=8, offsets=range(100, 900, 100))
    out = torch.full((1000, 72), float("nan")).bfloat16()[:, :68]  # rows 16-byte aligned
    p = k.prepare(a, b, offsets, bias=bias, weight=weight, out=out)
    field = params_field(ck, p.params)
    values = {**_oracle_values(field, 8, 114, 0, pair_d=True), **_vector_values(ck, field)}
    expected = grouped_oracles["gated"].run_argv(grouped_oracles["gated"].grouped_argv(values))
    assert expected.can_implement
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    assert len(enc.calls) == 2  # A's and B's starting maps: no D
    for f, _, _ in ck.params_layout.fields:
        if f.kind != "desc":
            assert field(f.name) == expected.fields[f.name]["bits"], f.name
    assert list(p.grid) == expected.launch["grid"] and expected.launch["smem"] == ck.info.smem_bytes
    pairs = expected.pairs
    assert pairs is not None and pairs["pairs"] > 0 and pairs["broken"] == 0 and pairs["uncovered"] == 0, pairs
    emulate_grouped(ck, p.setup, p.params, enc, [a, b, offsets, bias, weight, out, p.buffer])
    want = moe_swiglu_recipe().reference(a, b, offsets, bias=bias, weight=weight).float()
    assert want.nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.oracle
def test_a_derived_backward_reading_c_matches_cutlass_and_computes_the_recipe(derived_grouped_kernel,
                                                                              grouped_oracles):
    """GroupedLinear's derived backward kernel (pingpong, 2 x 1 cluster), which reads dL/dD per
    group as C: CUTLASS's pointer-array C, whose per-group pointers and strides the setup kernel
    writes and whose tensor map each SM encodes in the workspace. Hopper code without spills;
    every Params field against CUTLASS's host code given the same arrays, the encodes, grid and
    shared memory; the compiled kernel's emulation against the reference (dL/dacc)."""
    ck = derived_grouped_kernel
    r = ck.report
    assert r.sass["HGMMA"] > 0 and r.sass["UTMALDG"] > 0 and r.sass["UTMASTG"] > 0 and r.local_bytes == 0
    assert ck.generated.epilogue.source is not None
    k = cpu_grouped_kernel(ck, 132, 0)
    enc = k._encode
    rows, depth, n, groups = 1000, 264, 136, 8
    a, b, offsets, bias, _ = grouped_inputs(rows, depth, n, groups, offsets=(100, 100, 333, 334, 600, 700, 999, 999))
    grad_d = torch.randn(rows, n + 8).bfloat16()[:, :n]  # rows padded: C's stride is not D's
    out = torch.full((rows, n), float("nan")).bfloat16()
    p = k.prepare(a, b, offsets, bias=bias, grad_d=grad_d, out=out)
    field = params_field(ck, p.params)
    values = {**_oracle_values(field, groups, 132, 0), **_vector_values(ck, field),
              "c.array": field("epilogue.ptr_c"), "c.strides": field("epilogue.stride_c")}
    expected = grouped_oracles["derived"].run_argv(grouped_oracles["derived"].grouped_argv(values))
    _matches_cutlass(ck, field, enc, p, expected)
    assert field("problem.shapes") - field("workspace") >= expected.workspace_size > 0  # C's maps included
    emulate_grouped(ck, p.setup, p.params, enc, [a, b, offsets, bias, grad_d, out, p.buffer])
    want = derived_grouped_recipe().reference(a, b, offsets, bias=bias, grad_d=grad_d).float()
    assert want.nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.oracle
def test_setup_kernel_arithmetic_on_the_host(tmp_path):
    """gemmgen/include/gemmgen/grouped.hpp's `fill`, compiled for the host by nvcc, against
    group_bounds and the column formula, for offsets that are sorted, decreasing and out of range,
    unswapped and swapped (the problem (N, M_g, K)) and K-grouped (the problem (M, N, K_g), an empty
    group's K = 1 over the zero buffer; over fp8 copies, each group at its aligned column and an
    empty one's scales at the zero buffer) and in the masked layout (group g's rows from g * 7, as
    many as its entry says, clamped to [0, 7]), a column per block of 128 rows among them; and
    `fill_scale_layouts` (sm100's grouped blockwise kernels) for DeepSeek's K-major scales: each
    group's layouts, CUTLASS's of the group's shape, in ScaleLayoutBytes each (its static_assert:
    SCALE_LAYOUT_BYTES, which sizes the arrays)."""
    from gemmgen.compile.toolchain import toolchain
    from gemmgen.testing.oracle import nvcc_path

    src = tmp_path / "fill.cu"
    src.write_text(r'''
#include <cstdio>
#include <cstdlib>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <gemmgen/grouped.hpp>
using Config = cutlass::detail::Sm100BlockwiseScaleConfig<1, 128, 128, cute::UMMA::Major::K, cute::UMMA::Major::K>;
using LayoutSFA = decltype(Config::deduce_layoutSFA());
using LayoutSFB = decltype(Config::deduce_layoutSFB());
int main(int argc, char** argv) {
  int groups = argc - 3, offsets[64], shapes[3 * 64], layouts[2][5 * 64];
  long long table[3 * 64];
  for (int g = 0; g < groups; ++g) offsets[g] = std::atoi(argv[g + 3]);
  int const mode = std::atoi(argv[1]);  // 0: rows, 1: rows swapped, 2: K-grouped, 3: K-grouped fp8 (aligned),
                                       // 4: rows, masked (7 rows per group)
  gemmgen::grouped::Setup s{offsets, shapes, table, groups, std::atoi(argv[2]), 48, 300, 3, mode == 1, 64,
                            mode == 2 || mode == 3, mode == 3 ? 16 : 0, mode == 4 ? 7 : 0, 999, {1000, 7, 5},
                            {24, 0, 0}, {0, 0, 512},
                            {0, 1 << 20, 0}, {layouts[0], layouts[1]}};
  for (int g = 0; g < groups; ++g) gemmgen::grouped::fill_scale_layouts<Config, LayoutSFA, LayoutSFB>(s, g);
  for (int g = 0; g < groups; ++g) {
    std::printf("%d %d %d %lld %lld %lld", shapes[3 * g], shapes[3 * g + 1], shapes[3 * g + 2], table[g],
                table[groups + g], table[2 * groups + g]);
    for (int x = 0; x < 2; ++x)
      for (int i = 0; i < 5; ++i) std::printf(" %d", layouts[x][5 * g + i]);
    std::printf("\n");
  }
}
''')
    exe = tmp_path / "fill"
    tc = toolchain()
    subprocess.run([str(nvcc_path()), "-std=c++17", "-w", *(f"-I{d}" for d in tc.include_dirs),
                    f"-L{nvcc_path().parent.parent / 'lib'}", "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    for mode in (0, 1, 2, 3, 4):
        for rows, offsets in ((37, [5, 5, 20, 30]), (37, [10, 4, 12]), (37, [-3, 50, 60]), (1, [1]), (9, [0, 0, 9]),
                              (300, [130, 260, 300])):
            out = subprocess.run([str(exe), str(mode), str(rows), *map(str, offsets)], check=True,
                                 capture_output=True, text=True).stdout.split("\n")
            pad = [0] * (MAX_COLUMNS - 3)  # ...and emulate.fill_groups, which the emulation runs, agrees
            shapes, table = fill_groups((0, 0, 0, len(offsets), rows, 48, 300, 3, int(mode == 1), 64,
                                         int(mode in (2, 3)), 16 if mode == 3 else 0, 7 if mode == 4 else 0, 999,
                                         1000, 7, 5, *pad, 24, 0, 0, *pad, 0, 0, 512, *pad, 0, 1 << 20, 0, *pad),
                                        offsets)
            bounds = [(7 * g, 7 * g + min(max(n, 0), 7)) for g, n in enumerate(offsets)] if mode == 4 else \
                group_bounds(offsets, rows)
            for g, (start, end) in enumerate(bounds):
                shape = {0: [end - start, 48, 300], 1: [48, end - start, 300], 4: [end - start, 48, 300]}.get(
                    mode, [64, 48, max(end - start, 1)])
                at = 16 * (g + -(-start // 16)) if mode == 3 else start  # fp8 copies: the group's aligned column
                columns = [1000 + 24 * at, 7 + (1 << 20) * g, 5 + 512 * (start // 128)]
                if mode == 2 and start == end:  # an empty group of tokens: K = 1 over zeros, for what moves with them
                    columns = [999, 7 + (1 << 20) * g, 999]
                if mode == 3 and start == end:  # ...over fp8 copies: its own (zero) column, zero scales
                    columns = [1000 + 24 * at, 7 + (1 << 20) * g, 999]
                # K-major (blocks of M or N, blocks of K, L; the M or N blocks' stride, L's): A per row,
                # B per 128 columns, the blocks of K
                blocks_a, blocks_b, kb = shape[0], -(-shape[1] // 128), -(-shape[2] // 128)
                layouts = [blocks_a, kb, 1, kb, kb * blocks_a, blocks_b, kb, 1, kb, kb * blocks_b]
                assert list(map(int, out[g].split())) == [*shape, *columns, *layouts]
                assert [*shape, *columns] == [*shapes[g], *table[g]]


@pytest.mark.oracle
@BLOCK_INDEX
def test_block_scaled_arguments_match_cutlass(block_kernels, fp8_and_block_oracles, index, tmp_path):
    """Every Params field and tensor map against CUTLASS's host code given the same arrays."""
    from gemmgen.testing.oracle import OracleProgram

    block_kernel = block_kernels[index]
    k = cpu_grouped_kernel(block_kernel, 114, 0)
    enc = k._encode
    a, b, offsets, ops, _, _ = block_grouped_inputs(1000, 272, 136, 8, range(100, 900, 100))
    p = k.prepare(a, b, offsets, **ops)
    field = params_field(block_kernel, p.params)
    oracle = OracleProgram(block_kernel.generated, tmp_path)
    values = {**_oracle_values(field, 8, 114, 0), "sfa.array": field("mainloop.ptr_sfa"), "sfa.layouts": 0,
              "sfb.array": field("mainloop.ptr_sfb"), "sfb.layouts": 0, **_vector_values(block_kernel, field)}
    assert "operand.weight.ptr" in values
    expected = oracle.run_argv(oracle.grouped_argv(values))
    assert expected.can_implement
    assert {c.addr: c.as_dict() for c in enc.calls} == \
        {c["addr"]: {key: v for key, v in c.items() if key != "encode"} for c in expected.encodes}
    _fields_match(block_kernel, field, expected)
    assert "mainloop.mma_promotion_interval" not in {f.name for f, _, _ in block_kernel.params_layout.fields}
    assert list(p.grid) == expected.launch["grid"]
    if block_kernel.cubin:  # NVRTC's figure
        assert expected.launch["smem"] == block_kernel.info.smem_bytes


@pytest.mark.oracle
def test_the_k_grouped_weight_gradient_matches_cutlass_and_each_expert(k_grouped_kernel, grouped_oracles):
    """The experts' weight gradient (test_k_grouped): Hopper code without spills (HGMMA, TMA
    loads and stores); every Params field against CUTLASS's host code given the same per-group
    arrays, the tensor maps it encodes, grid and shared memory; the compiled kernel's emulation
    against per-expert fp64 torch."""
    ck = k_grouped_kernel
    r = ck.report
    assert r.sass["HGMMA"] > 0 and r.sass["UTMALDG"] > 0 and r.sass["UTMASTG"] > 0 and r.local_bytes == 0
    assert "cutlass::layout::ColumnMajor *" in ck.source  # A: tokens-major dY, seen M-major
    k = cpu_grouped_kernel(ck, 132, 0)
    enc = k._encode
    dy, x, offsets, main_grad = k_grouped_inputs()
    out = torch.full((len(K_GROUPED_SIZES), 136, 72), float("nan"))
    p = k.prepare(dy.t(), x, offsets, main_grad=main_grad, out=out)
    field = params_field(ck, p.params)
    values = {**_oracle_values(field, len(K_GROUPED_SIZES), 132, 0),
              "c.array": field("epilogue.ptr_c"), "c.strides": field("epilogue.stride_c")}
    oracle = grouped_oracles["k_grouped"]
    expected = oracle.run_argv(oracle.grouped_argv(values))
    _matches_cutlass(ck, field, enc, p, expected)
    zero = zero_buffer(k, p)
    emulate_grouped(ck, p.setup, p.params, enc, [dy, x, offsets, main_grad, out, p.buffer, zero])
    want = per_expert_weight_grad(dy, x, K_GROUPED_SIZES, main_grad)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


"""Grouped (pointer-array) sm_100a kernels on the CPU: the emulation of their per-group data flow
(no NVRTC), their Params and tensor maps against CUTLASS's own sm100 host code (the compiled pair's
kernel, and by value a one-SM kernel, a swapped one and one reading C), and the choice of kernel on
B200. The sm90 grouped kernels: test_grouped_kernel.py and test_grouped_oracle.py."""

from __future__ import annotations

import json

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.runtime.grouped import BufferLayout, GroupedArguments
from gemmgen.runtime.grouped_checks import check_grouped_call
from gemmgen.runtime.problem import TensorArg
from gemmgen.testing.checks import source_replaced, uncompiled
from gemmgen.testing.emulate import emulate_grouped
from gemmgen.testing.grouped import (
    block_grouped_inputs,
    cpu_grouped_kernel,
    emulated_block_moe,
    emulated_moe,
    emulated_mx_moe,
    grouped_inputs,
    moe_mx_recipe,
    moe_recipe,
    mx_grouped_inputs,
    params_field,
)
from gemmgen.testing.oracle import OracleProgram, build_all, field_bits
from gemmgen.testing.recording import RecordingEncoder
from tests.data.sm100 import grouped_value_kernels

SM100 = gg.Arch.SM100A
ONE = gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM, arch=SM100)
PAIR = gg.KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM, arch=SM100)
PAIR_4X1 = gg.KernelConfig(tile=(256, 128, 64), cluster=(4, 1, 1), schedule=gg.Schedule.TWO_SM, arch=SM100)
SWAPPED = gg.KernelConfig(tile=(128, 32, 64), schedule=gg.Schedule.ONE_SM, swap_ab=True, arch=SM100)
CONFIGS = (ONE, PAIR, PAIR_4X1, SWAPPED)
VALUE_KERNELS = grouped_value_kernels()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
@pytest.mark.parametrize("shape, offsets", [
    ((37, 64, 48, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((300, 72, 136, 3), (1, 129, 300)),  # M = 1, groups over several tiles, K and N tails
])
def test_sm100_grouped_kernels_compute_the_recipe(config, shape, offsets):
    """The setup block turned into the group arrays, then per group what the sm100 GEMM reads
    through its Params and the epilogue its source declares, against the reference; rows in no
    group stay NaN."""
    assert gg.codegen.is_valid(config, moe_recipe().ir)
    out, want = emulated_moe(uncompiled(moe_recipe(), config), shape, offsets, sm_count=148)
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


_BLOCK = VALUE_KERNELS["block_scaled"][0]
#: The block-scaled example on one SM, on a pair and swapped (B200's choice for groups of few rows)
BLOCK_SCALED = {"block_scaled": VALUE_KERNELS["block_scaled"],
                "block_scaled_pair": (_BLOCK, gg.KernelConfig(tile=(256, 128, 128), cluster=(2, 1, 1),
                                                              schedule=gg.Schedule.TWO_SM, arch=SM100)),
                "block_scaled_swapped": (_BLOCK, gg.KernelConfig(tile=(128, 32, 128), schedule=gg.Schedule.ONE_SM,
                                                                 swap_ab=True, arch=SM100))}


@pytest.mark.parametrize("name", BLOCK_SCALED)
@pytest.mark.parametrize("shape, offsets", [
    ((37, 304, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group, a K tail
    ((300, 272, 136, 3), (1, 129, 300)),  # M = 1, groups over several tiles
])
def test_sm100_block_scaled_groups_compute_the_recipe(name, shape, offsets):
    """The block-scaled example on one SM, on a pair and swapped: the setup block turned into the group
    arrays and the places of each group's scale layouts (which the setup kernel writes with
    CUTLASS's own function of the group's shape), then per group A, B and both scales as the main
    loop reads them, against the reference; rows in no group stay NaN."""
    ck = uncompiled(*BLOCK_SCALED[name])
    assert "fill_scale_layouts<" in ck.generated.source
    out, want, *_ = emulated_block_moe(ck, shape, offsets, sm_count=148)
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


#: Microscaled experts (moe_up over MXFP8 and NVFP4 tokens and weights) on one SM, on a pair and
#: swapped (128 x 64: the narrowest tile N of the block-scaled main loop, B200's choice for few rows)
MICROSCALED = {f"{fmt.value}_{kind}": (fmt, gg.KernelConfig(tile=(*tile, 128 if fmt is gg.MXFP8 else 256), **kw))
               for fmt in (gg.MXFP8, gg.NVFP4)
               for kind, tile, kw in (("one", (128, 128), {"schedule": gg.Schedule.ONE_SM, "arch": SM100}),
                                      ("pair", (256, 128), {"schedule": gg.Schedule.TWO_SM, "cluster": (2, 1, 1),
                                                            "arch": SM100}),
                                      ("swapped", (128, 64), {"schedule": gg.Schedule.ONE_SM, "swap_ab": True,
                                                              "arch": SM100}))}


@pytest.mark.parametrize("name", MICROSCALED)
@pytest.mark.parametrize("shape, offsets", [
    ((37, 256, 136, 4), (5, 5, 20, 30)),  # an empty group, rows after the last group
    ((400, 512, 64, 5), (130, 131, 260, 399, 399)),  # groups starting inside a block of 128 rows, an empty last
])
def test_sm100_microscaled_groups_compute_the_recipe(name, shape, offsets):
    """Microscaled experts: the setup block turned into the group arrays, each group's scales of its
    tokens at block first // 128 + g of the grouped blocked order, then per group packed or fp8 A
    and B and both scales as the block-scaled main loop reads them, against the reference; rows in
    no group stay NaN."""
    fmt, config = MICROSCALED[name]
    assert gg.codegen.is_valid(config, moe_mx_recipe(fmt).ir)
    ck = uncompiled(moe_mx_recipe(fmt), config)
    assert "fill_scale_layouts<" in ck.generated.source
    out, want = emulated_mx_moe(ck, shape, offsets, sm_count=148)
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


def test_a_wrong_layout_in_an_sm100_grouped_kernel_fails_the_check():
    """The check reads each group's D as the source lays it out: column-major, it fails."""
    ck = uncompiled(moe_recipe(), PAIR, source_replaced("using LayoutD = cutlass::layout::RowMajor *;",
                                                       "using LayoutD = cutlass::layout::ColumnMajor *;"))
    with pytest.raises(AssertionError):
        out, want = emulated_moe(ck, (37, 64, 48, 4), (5, 5, 20, 30), sm_count=148)
        torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


def test_sm100_grouped_kernels_are_cutlass_pointer_array_kernels():
    source = render_kernel(moe_recipe().ir, PAIR).source
    assert "KernelPtrArrayTmaWarpSpecialized2SmSm100" in source
    assert "PtrArrayTmaWarpSpecialized2Sm" in source and "GroupProblemShape" in source
    assert "KernelPtrArrayTmaWarpSpecialized1SmSm100" in render_kernel(moe_recipe().ir, ONE).source


@pytest.mark.parametrize("recipe", [moe_recipe().ir, VALUE_KERNELS["block_scaled"][0].ir], ids=["bf16", "block"])
def test_b200_chooses_a_grouped_kernel_by_rows_per_group(recipe):
    """One SM's 128 x 128 for many rows per group, swapped 128 x 32 for few (tile K 128 bytes: the
    block scales' K for DeepSeek's fp8), and valid autotune candidates."""
    many = gg.tuning.grouped_choice(recipe, 4096, 8, SM100).config
    few = gg.tuning.grouped_choice(recipe, 64, 8, SM100).config
    assert many == gg.config.default_config(recipe, SM100) and not many.swap_ab
    assert few.swap_ab and few.arch is SM100 and few.schedule is gg.Schedule.ONE_SM and few.tile[:2] == (128, 32)
    assert gg.codegen.is_valid(few, recipe) and few.tile[2] == 128 // recipe.gemm.a.nbytes
    candidates = gg.tuning.tuner.candidates(recipe, 4096, 512, 1024, 8, arch=SM100)
    assert len(candidates) >= 3 and all(c.arch is SM100 and gg.codegen.is_valid(c, recipe) for c in candidates)


@pytest.mark.parametrize("fmt", [gg.MXFP8, gg.NVFP4])
def test_b200_chooses_microscaled_experts_the_block_scaled_main_loop_takes(fmt):
    """Few rows per group: swapped 128 x 64 (the block-scaled main loop's narrowest N; 128 x 32 is
    refused); many: gemmgen's default, tile K 128 bytes of A."""
    recipe = moe_mx_recipe(fmt).ir
    few = gg.tuning.grouped_choice(recipe, 64, 8, SM100).config
    many = gg.tuning.grouped_choice(recipe, 4096, 8, SM100).config
    assert few.swap_ab and few.tile == (128, 64, 1024 // recipe.gemm.a.bits) and gg.codegen.is_valid(few, recipe)
    assert not many.swap_ab and gg.codegen.is_valid(many, recipe)
    candidates = gg.tuning.tuner.candidates(recipe, 4096, 512, 1024, 8, arch=SM100)
    assert candidates and all(gg.codegen.is_valid(c, recipe) for c in candidates)


def _maps(encodes) -> set[str]:
    """Distinct encode calls, compared in full: a grouped kernel's maps all start at null, so their
    addresses tell none apart (and gemmgen encodes a fallback map's copy once)."""
    return {json.dumps({k: v for k, v in e.items() if k != "encode"}, sort_keys=True) for e in encodes}


def _oracle_values(field, groups: int, sm_count: int, clusters: int) -> dict[str, int]:
    """The Arguments the oracle takes: the group arrays, the workspace (the buffer's start, where
    gemmgen keeps CUTLASS's workspace), hardware."""
    return {"groups": groups, "shapes": field("problem.shapes"), "workspace": field("epilogue.tensormaps"),
            "a.array": field("mainloop.ptr_a"), "a.strides": field("mainloop.stride_a"),
            "b.array": field("mainloop.ptr_b"), "b.strides": field("mainloop.stride_b"),
            "d.array": field("epilogue.ptr_d"), "d.strides": field("epilogue.stride_d"),
            "hw.device_id": 0, "hw.sm_count": sm_count, "hw.max_active_clusters": clusters}


@pytest.fixture(scope="module")
def grouped_oracles(sm100_kernels, tmp_path_factory):
    """CUTLASS's sm100 host code for the compiled grouped kernels (on a pair: bf16 and NVFP4) and
    VALUE_KERNELS (built at once, or in the background from the session's start:
    tests/data/oracle_sets.py)."""
    build = tmp_path_factory.mktemp("oracle100-grouped")
    programs = {name: OracleProgram(sm100_kernels[name].generated, build) for name in COMPILED}
    programs.update({name: OracleProgram(render_kernel(recipe.ir, config), build)
                     for name, (recipe, config) in VALUE_KERNELS.items()})
    build_all(list(programs.values()), build)
    return programs


def _vectors(generated, field) -> dict[str, int]:
    return {f"operand.{b.name}.ptr": field(f"epilogue.{b.kind}.{b.name}.ptr")
            for b in generated.epilogue.bindings if b.kind in ("row", "col")}


#: The grouped kernels the suite compiles (tests/data/sm100.py), on a pair of SMs: bf16, and NVFP4
#: (the block-scaled pointer-array collective, four maps rewritten per group, each group's scale
#: layouts written by the setup kernel), with their MMA's SASS marker.
COMPILED = {"moe_up": "UTCHMMA.2CTA", "moe_nvfp4": "UTCOMMA.2CTA"}


def _compiled_call(name: str, recipe) -> tuple[tuple, dict]:
    """A call of a compiled grouped kernel: 8 groups over 1000 rows, rows 800-999 in no group."""
    offsets = range(100, 900, 100)
    if recipe.ir.gemm.microscaling is None:
        a, b, offs, bias, weight = grouped_inputs(rows=1000, k=264, n=136, groups=8, offsets=offsets)
        return (a, b, offs), {"bias": bias, "weight": weight}
    a, b, offs, ops = mx_grouped_inputs(recipe.ir.gemm.microscaling, 1000, 512, 136, 8, offsets)
    return (a, b, offs), {**ops, "scale": torch.rand(1000) * 0.01 + 0.01}


@pytest.mark.oracle
@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("sm_count, clusters", [(148, 0), (132, 0), (16, 0), (148, 74), (148, 37)])
def test_the_compiled_pairs_match_cutlass(sm100_kernels, sm100_examples, grouped_oracles, name, sm_count, clusters):
    """The compiled 2-SM grouped kernels: tcgen05 for the pair, TMA, tensor memory, no spills and no
    cluster launch control (the group scheduler is persistent); every Params field, encode call,
    the grid, shared memory and the workspace against CUTLASS's host code given the same arrays;
    its emulation against the reference."""
    ck = sm100_kernels[name]
    r = ck.report
    assert r.sass[COMPILED[name]] > 0 and r.sass["UTMALDG"] > 0 and r.sass["LDTM"] > 0 and r.sass["UTMASTG"] > 0
    assert r.sass["UGETNEXTWORKID"] == 0 and r.local_bytes == 0 and r.stack_bytes == 0
    recipe = sm100_examples[name]
    k = cpu_grouped_kernel(ck, sm_count, clusters)
    enc = k._encode
    (a, b, offsets), ops = _compiled_call(name, recipe)
    out = torch.full((1000, 136), float("nan")).bfloat16()  # rows 800-999 are in no group: left as they are
    p = k.prepare(a, b, offsets, **ops, out=out)
    field = params_field(ck, p.params)
    values = {**_oracle_values(field, 8, sm_count, clusters), **_vectors(ck.generated, field)}
    if recipe.ir.gemm.scaled:
        values.update({f"sf{x}.{part}": field(f"mainloop.{kind}_sf{x}") for x in "ab"
                       for part, kind in (("array", "ptr"), ("layouts", "layout"))})
    assert set(values) >= {"operand.bias.ptr", "operand.weight.ptr"}
    oracle = grouped_oracles[name]
    expected = oracle.run_argv(oracle.grouped_argv(values))
    assert expected.can_implement
    assert _maps(c.as_dict() for c in enc.calls) == _maps(expected.encodes)
    for f, offset, _ in ck.params_layout.fields:
        if f.kind == "desc":
            ours = enc.of(p.params[offset:offset + 128])
            theirs = expected.encodes[expected.fields[f.name]["desc"] - 1]
            assert ours is not None and ours.as_dict() == {key: v for key, v in theirs.items() if key != "encode"}
        else:
            assert field(f.name) == expected.fields[f.name]["bits"], f.name
    assert list(p.grid) == expected.launch["grid"] and expected.launch["smem"] == ck.info.smem_bytes
    assert field("problem.shapes") - field("epilogue.tensormaps") >= expected.workspace_size > 0
    emulate_grouped(ck, p.setup, p.params, enc, [a, b, offsets, *ops.values(), out, p.buffer])
    want = recipe.reference(a, b, offsets, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.oracle
@pytest.mark.parametrize("name", VALUE_KERNELS)
def test_grouped_geometries_without_a_compiled_kernel_match_cutlass(grouped_oracles, name):
    """Every field gemmgen writes, every encode call and the grid, by name, against CUTLASS's host
    code for kernels not compiled here."""
    oracle = grouped_oracles[name]
    recipe, config = VALUE_KERNELS[name]
    kernel_ir = oracle.kernel.kernel_recipe
    args = GroupedArguments(kernel_ir, config)
    rows, depth, n, groups = 1000, 264, 136, 8
    offsets = (100, 100, 333, 334, 600, 700, 999, 999)
    block_scaled = recipe.ir.gemm.scaled
    ops: dict[str, object]
    fmt = recipe.ir.gemm.microscaling
    if fmt is not None:
        a, b, offs, scales = mx_grouped_inputs(fmt, rows, 512, n, groups, offsets)
        ops = {k: v for k, v in scales.items() if k in {o.name for o in recipe.ir.operands}}
    elif block_scaled:
        a, b, offs, scales, _, _ = block_grouped_inputs(rows, 272, n, groups, offsets)
        ops = dict(scales)
    else:
        a, b, offs, bias, _ = grouped_inputs(rows, depth, n, groups, offsets)
        ops = {"bias": bias}
        if name == "reads_c":
            ops["grad_d"] = torch.randn(rows, n + 8).bfloat16()[:, :n]  # rows padded: C's stride is not D's
        else:
            ops["weight"] = torch.rand(rows)
    call = check_grouped_call(recipe.ir, a, b, offs, ops, require_cuda=False)
    d_columns = recipe.ir.outputs[0].columns.extent(n)  # N/2 over column pairs: a PairStore's
    d = torch.empty(rows, d_columns).bfloat16()
    columns = args.columns(call, TensorArg(d.data_ptr(), (d_columns, 1, 0)))
    has_c = args.source is not None
    for sm_count, clusters in ((148, 0), (132, 66)):
        layout = BufferLayout.of(groups, len(columns), sm_count, has_c, SM100, scale_layouts=block_scaled,
                                 mainloop_map_count=args.mainloop_map_count)
        buffer = 1 << 40
        enc = RecordingEncoder()
        v = args.values(call, columns, buffer, layout, sm_count, clusters, 0, enc, d_columns)
        d_store = args.d_store  # the PairStore's pointer array and row stride, or the collective's D arrays
        d_values = {"d.ptr": v[f"{d_store}.ptr"], "d.s0": v[f"{d_store}.stride_m"], "d.s1": 1,
                    "d.s2": v[f"{d_store}.stride_l"]} if d_store else \
            {"d.array": v["epilogue.ptr_d"], "d.strides": v["epilogue.stride_d"]}
        values = {"groups": groups, "shapes": v["problem.shapes"], "workspace": buffer,
                  "a.array": v["mainloop.ptr_a"], "a.strides": v["mainloop.stride_a"],
                  "b.array": v["mainloop.ptr_b"], "b.strides": v["mainloop.stride_b"], **d_values,
                  "hw.device_id": 0, "hw.sm_count": sm_count, "hw.max_active_clusters": clusters,
                  **{f"operand.{b.name}.ptr": v[f"epilogue.{b.kind}.{b.name}.ptr"]
                     for b in oracle.kernel.epilogue.bindings if b.kind in ("row", "col")}}
        if has_c:
            values.update({"c.array": v["epilogue.ptr_c"], "c.strides": v["epilogue.stride_c"]})
        if block_scaled:  # each group's scale layouts: in the buffer, after the arrays the setup fills
            at_a, at_b = (int(v[f"mainloop.layout_sf{x}"]) - buffer for x in "ab")
            assert layout.table < at_a < at_b < layout.size, (at_a, at_b)
            values.update({f"sf{x}.{part}": v[f"mainloop.{field}_sf{x}"] for x in "ab"
                           for part, field in (("array", "ptr"), ("layouts", "layout"))})
        expected = oracle.run_argv(oracle.grouped_argv(values))
        assert expected.can_implement
        assert _maps(c.as_dict() for c in enc.calls) == _maps(expected.encodes)
        # A, B, D (and C; and a microscaled kernel's scales): the fallback maps are copies
        assert len(enc.calls) == 2 + int(not d_store) + int(has_c) + 2 * int(fmt is not None)
        compared = 0
        for f in oracle.kernel.fields:
            if f.kind == "desc":  # each in full: every map starts at null, so the addresses tell none apart
                ours = enc.of(v[f.name])  # type: ignore[arg-type]
                theirs = expected.encodes[expected.fields[f.name]["desc"] - 1]
                assert ours is not None and ours.as_dict() == {key: val for key, val in theirs.items()
                                                               if key != "encode"}, f.name
            elif f.name in v:
                assert field_bits(f.kind, v[f.name]) == expected.fields[f.name]["bits"], f.name
            else:  # only constants keep the probe's default: a field the builder forgot fails here
                assert f.name.endswith(".null_default") or f.name.startswith("hw_info.cluster_shape"), f.name
                continue
            compared += 1
        assert compared >= 50, compared
        assert (layout.shapes >= expected.workspace_size > 0) and layout.mainloop_maps > 0
        assert list(args.scheduler(sm_count, clusters).grid) == expected.launch["grid"]
        if recipe.ir.epilogue.pairs:  # pairs.hpp's premise under the pointer-array collective's partition
            pairs = expected.pairs
            assert pairs is not None and pairs["pairs"] > 0 and pairs["broken"] == 0 and not pairs["uncovered"], pairs

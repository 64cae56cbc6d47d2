"""gemmgen's direct epilogue (EpilogueCollective.DIRECT, gemmgen/include/gemmgen/direct_epilogue.hpp):
its generated functor run on the host against the reference, every kernel's data flow emulated
through the Params the runtime builds, its refusals, and (NVRTC) one kernel's SASS."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.compile.toolchain import gemmgen_include_dir, toolchain
from gemmgen.testing.calls import args_with_nonzero_reference, emulated_shapes
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled

DIRECT = gg.EpilogueCollective.DIRECT
#: The examples whose epilogues the direct epilogue computes (the rest are refused by name below).
DIRECT_EXAMPLES = ("gemm_bf16", "bias_gelu", "bias_silu_residual", "linear_combination", "bias_gelu_aux",
                   "quick_gelu_scaled", "scaled_mm_fp8", "fp8_block_scaled")


def _mix(acc, alpha, s, bias, scale, c, shared):
    x = alpha * acc + bias * scale
    y = gg.leaky_relu(x, 0.1) + gg.where(x > 0.0, c, 2.0) * s
    z = gg.cast(y, gg.bf16) - shared
    return {"d": gg.tanh(z) + 1.0, "pre": x, "peak": gg.amax(y), "low": gg.reduce_min(z, over_batch=True)}


#: Every leaf and view the functor has: scalars by value and per batch, row and column vectors (one
#: per batch), matrices per batch and shared, an aux output, a cast, a slope, a constant branch, and
#: reductions over M and N per batch and over every batch.
MIX = gg.Recipe("direct_mix", _mix, a=gg.bf16, b=gg.bf16, d=gg.bf16, batched=True,
                operands={"alpha": gg.Scalar(), "s": gg.Scalar(per_batch=True),
                          "bias": gg.RowVector(gg.bf16, per_batch=True), "scale": gg.ColVector(gg.f32),
                          "c": gg.Matrix(gg.f16), "shared": gg.Matrix(gg.bf16, per_batch=False)},
                aux={"pre": gg.f32, "peak": gg.f32, "low": gg.f32})


def direct(recipe: gg.Recipe, **changes) -> gg.KernelConfig:
    return dataclasses.replace(recipe.default_config(), epilogue=DIRECT, **changes)


@pytest.mark.parametrize("swap", [False, True], ids=["d_row_major", "swapped"])
def test_every_view_computes_the_recipe_through_the_runtimes_params(swap):
    """The emulation of MIX's kernel (the runtime's Params, the functor's statements parsed from the
    source) at odd sizes, K tails, M = 1 and batches, outputs NaN-filled; swapped, D is column-major
    in the kernel's terms and every matrix view takes its other stride."""
    ck = uncompiled(MIX, direct(MIX, swap_ab=swap))
    assert "gemmgen::direct::Sm90Direct<DirectFunctor, ElementD>" in ck.generated.source
    for shape in emulated_shapes(MIX):
        assert_computes(ck, shape, f"direct_mix swap={swap}")


@pytest.mark.parametrize("name", DIRECT_EXAMPLES)
def test_the_examples_compute_their_recipes(name, examples):
    ck = uncompiled(examples[name], direct(examples[name]))
    for shape in emulated_shapes(examples[name]):
        assert_computes(ck, shape, name)


@pytest.mark.parametrize("old,new", [
    ("args.in_bias.load(n, l)", "args.in_bias.load(m, l)"),  # a row vector read along M
    ("gemmgen::direct::Matrix<cutlass::half_t, false> in_c", "gemmgen::direct::Matrix<cutlass::half_t, true> in_c"),
    ("args.out_pre.store(m, n, l, add7)", "args.out_pre.store(m, n, l, mul6)"),  # the aux output's value
    ("partials.out_peak = args.out_peak.reduce(partials.out_peak, add15)",  # a reduction's value
     "partials.out_peak = args.out_peak.reduce(partials.out_peak, add7)"),
    ("cutlass::minimum<float>, cutlass::minimum<float>, gemmgen::epi::AtomicMinimum<float>",  # min as max
     "cutlass::maximum<float>, cutlass::maximum<float>, cutlass::atomic_maximum<float>"),
])
def test_the_emulation_fails_on_a_wrong_functor(old, new):
    ck = uncompiled(MIX, direct(MIX), mutate=source_replaced(old, new))
    with pytest.raises(AssertionError):
        for shape in emulated_shapes(MIX):
            assert_computes(ck, shape, "mutated")


def test_the_runtime_fills_each_views_fields():
    """The Params fields by name: the visitors' names for scalars and vectors (one argument builder
    writes both), `epilogue.matrix.<name>` for each M x N tensor, no tensor map in the epilogue."""
    names = [f.name for f in render_kernel(MIX.ir, direct(MIX)).fields if f.name.startswith("epilogue.")]
    assert names == [
        "epilogue.scalar.alpha.value", "epilogue.scalar.alpha.ptr", "epilogue.scalar.alpha.batch_stride",
        "epilogue.scalar.s.value", "epilogue.scalar.s.ptr", "epilogue.scalar.s.batch_stride",
        "epilogue.row.bias.ptr", "epilogue.row.bias.batch_stride", "epilogue.col.scale.ptr",
        "epilogue.col.scale.batch_stride", *(f"epilogue.matrix.{x}.{f}" for x in ("c", "shared", "d", "pre")
                                             for f in ("ptr", "stride", "batch_stride")),
        *(f"epilogue.amax.{x}.{f}" for x in ("peak", "low") for f in ("ptr", "identity", "batch_stride"))]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the generated functor on the host")
def test_the_generated_functor_computes_the_recipe_on_the_host(tmp_path):
    """The functor's C++, as the kernel compiles it, built with g++ against CUTLASS's own numeric
    types and run over every element of a batched problem (accumulators from torch), against the
    recipe's reference: its statements, conversions, views and strides as C++ means them, not as
    the emulation reads them. It fails when a view indexes the wrong mode, and when a reduction's
    store replaces the value instead of combining with it (made to, once each)."""
    generated = render_kernel(MIX.ir, direct(MIX))
    src = generated.source
    functor = src[src.index("// direct_mix's epilogue"):src.index("// Epilogue collective")]
    batches, m, n, k = 2, 9, 12, 16
    a, b, ops, want = args_with_nonzero_reference(MIX, m, n, k, (batches,))
    acc = torch.matmul(a.float(), b.float())
    inputs = {"acc": acc, **{name: v for name, v in ops.items() if isinstance(v, torch.Tensor)}}
    arrays = []
    ctypes = {torch.float32: "float", torch.bfloat16: "cutlass::bfloat16_t", torch.float16: "cutlass::half_t"}
    for name, t in inputs.items():  # each input's bits, as the element type the functor reads it as
        width = 8 * t.element_size()
        bits = t.contiguous().flatten().view(torch.int32 if width == 32 else torch.int16).tolist()
        arrays.append(f"static uint{width}_t {name}_bits[] = {{{', '.join(str(x % 2 ** width) for x in bits)}}};\n"
                      f"static {ctypes[t.dtype]}* {name} = reinterpret_cast<{ctypes[t.dtype]}*>({name}_bits);\n")
    program = f"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cutlass/numeric_types.h>
inline float __uint_as_float(uint32_t b) {{ float f; std::memcpy(&f, &b, 4); return f; }}
inline uint32_t __float_as_uint(float f) {{ uint32_t b; std::memcpy(&b, &f, 4); return b; }}
#include <gemmgen/epilogue.hpp>
#include <gemmgen/direct.hpp>
{''.join(arrays)}
static cutlass::bfloat16_t d_out[{batches * m * n}];
static float pre_out[{batches * m * n}];
static float peak_out[{batches}];  // per batch, from the runtime's identity fill: 0
static float low_out[1] = {{INFINITY}};  // over every batch
{functor}
int main() {{
  DirectFunctor::Arguments args;
  args.in_alpha.value = {float(ops["alpha"])}f;
  args.in_s.ptr = s; args.in_s.batch_stride = 1;
  args.in_bias.ptr = bias; args.in_bias.batch_stride = {n};
  args.in_scale.ptr = scale;
  args.in_c = {{c, {n}, {m * n}}};
  args.in_shared = {{shared, {n}, 0}};
  args.out_d = {{d_out, {n}, {m * n}}};
  args.out_pre = {{pre_out, {n}, {m * n}}};
  args.out_peak = {{peak_out, 0.0f, 1}};
  args.out_low = {{low_out, INFINITY, 0}};
  DirectFunctor const functor{{}};
  for (int l = 0; l < {batches}; ++l) {{
    DirectFunctor::Partials partials = functor.start(args);
    for (int m = 0; m < {m}; ++m)
      for (int n = 0; n < {n}; ++n)
        functor(args, partials, acc[(l * {m} + m) * {n} + n], m, n, l);
    functor.finish(args, partials, l);
    functor.finish(args, functor.start(args), l);  // a thread whose elements are all past M or N
  }}
  for (int i = 0; i < {batches * m * n}; ++i) std::printf("%a %a\\n", float(d_out[i]), pre_out[i]);
  std::printf("%a %a %a\\n", peak_out[0], peak_out[1], low_out[0]);
}}
"""
    (tmp_path / "direct.cpp").write_text(program)
    include = [f"-I{d}" for d in (gemmgen_include_dir(), *toolchain().include_dirs)]
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", *include, "-o", str(tmp_path / "direct"),
                    str(tmp_path / "direct.cpp")], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "direct")], check=True, capture_output=True, text=True).stdout.split()
    values = torch.tensor([float.fromhex(v) for v in out])
    got = values[:-3].view(batches, m, n, 2)
    d, pre, peak, low = want  # the recipe's reference on the same inputs
    assert torch.equal(got[..., 1], pre.float()), "the aux output (fp32) is the reference's, bit for bit"
    torch.testing.assert_close(got[..., 0].bfloat16(), d, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(values[-3:-1], peak.float(), rtol=1e-6, atol=0)  # max |y| per batch
    torch.testing.assert_close(values[-1], low.float(), rtol=1e-6, atol=0)  # min over every batch


def test_what_it_cannot_compute_is_refused_by_name(examples):
    """Sums and per-row or per-column reductions, blocks, pairs, grouped GEMMs, sm_100a, stream-K and
    the one tile shape whose kernels spilled: a ConfigError before anything is compiled, naming what
    and the fix."""
    with pytest.raises(gg.ConfigError, match=r"does not compute output 'sum_sq': a reduction \(sum\); "
                                             r"use EpilogueCollective.TMA"):
        render_kernel(examples["residual_norm_stats"].ir, direct(examples["residual_norm_stats"]))
    with pytest.raises(gg.ConfigError, match=r"output 'amax_cols': a reduction per column \(amax\)"):
        render_kernel(examples["row_col_amax"].ir, direct(examples["row_col_amax"]))
    with pytest.raises(gg.ConfigError, match=r"output 'd': per block of its columns \(gemmgen.quantize\)"):
        render_kernel(examples["fp8_quantized"].ir, direct(examples["fp8_quantized"]))
    with pytest.raises(gg.ConfigError, match=r"gemmgen.pairs \(column pairs\)"):
        render_kernel(examples["swiglu"].ir, direct(examples["swiglu"]))
    with pytest.raises(gg.ConfigError, match="a grouped GEMM"):
        render_kernel(examples["moe_up"].ir, direct(examples["moe_up"]))
    with pytest.raises(gg.ConfigError, match="built for sm_90a only"):
        render_kernel(examples["bias_gelu"].ir, dataclasses.replace(
            examples["bias_gelu"].default_config(gg.Arch.SM100A), epilogue=DIRECT))
    with pytest.raises(gg.ConfigError, match="persistent tile scheduler only"):
        render_kernel(examples["bias_gelu"].ir, direct(examples["bias_gelu"],
                                                      tile_scheduler=gg.TileScheduler.STREAM_K))
    pingpong = dict(tile=(128, 128, 64), cluster=(1, 1, 1), schedule=gg.Schedule.PINGPONG)  # spills swapped (measured)
    with pytest.raises(gg.ConfigError, match=r"a pingpong 128x128 tile storing D column-major \(swap_ab\) with 2 "
                                             r"M x N tensors spills registers; use EpilogueCollective.TMA"):
        render_kernel(examples["bias_gelu_aux"].ir, direct(examples["bias_gelu_aux"], swap_ab=True, **pingpong))
    render_kernel(examples["bias_gelu"].ir, direct(examples["bias_gelu"], swap_ab=True, **pingpong))  # D alone: kept
    with pytest.raises(gg.ConfigError, match=r"epilogue: expected gemmgen.EpilogueCollective.TMA or .DIRECT"):
        gg.KernelConfig(epilogue="direct")  # type: ignore[arg-type]


def test_the_config_names_it_and_keeps_every_other_key():
    """`_direct` in the name and a trailing canonical field; a TMA config's canonical form (so
    every cached and bundled kernel's key) is what it was."""
    cfg = gg.KernelConfig(epilogue=DIRECT)
    assert cfg.name.endswith("_direct") and cfg.canonical()[-1] == "direct"
    assert gg.KernelConfig.from_canonical(cfg.canonical()) == cfg
    assert gg.KernelConfig().canonical() == [[128, 128, 64], [1, 1, 1], "cooperative", None, "persistent"]


def _views(acc, bias, residual):
    pre = acc + bias
    d = gg.silu(pre) + residual
    return {"d": d, "pre": pre, "amax_d": gg.amax(d)}


#: One kernel with a view of each kind a compile can get wrong: a vector and a matrix read, an aux
#: output written, a reduction over M and N (shuffles and an atomic).
VIEWS = gg.Recipe("direct_views", _views, a=gg.bf16, b=gg.bf16, d=gg.bf16,
                  operands={"bias": gg.RowVector(gg.bf16), "residual": gg.Matrix(gg.bf16)},
                  aux={"pre": gg.bf16, "amax_d": gg.f32})


@pytest.mark.nvrtc
def test_a_direct_kernel_compiles_with_wgmma_tma_loads_and_no_local_memory(session_cache):
    """VIEWS built by NVRTC: its SASS has HGMMA, TMA loads, STG and no TMA store, the reduction's
    shuffles and atomic (REDG), 0 local and stack; the layout probe found every Params field."""
    from gemmgen.compile.build import build_kernel

    k = build_kernel(VIEWS.ir, direct(VIEWS), session_cache)
    report = k.report
    assert report.epilogue == "direct" and report.local_bytes == 0 and report.stack_bytes == 0
    assert report.sass is not None, "cuobjdump read the binary"
    assert report.sass["HGMMA"] > 0 and report.sass["UTMALDG"] > 0 and report.sass["STG"] > 0
    assert report.sass["UTMASTG"] == 0 and report.sass["SHFL"] > 0 and report.sass["REDG"] > 0
    assert {f.name for f, _, _ in k.params_layout.fields} == {f.name for f in k.generated.fields}

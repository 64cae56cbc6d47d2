"""The call path up to the driver, on the CPU: argument checks, outputs, empty problems, Params.

`Kernel.prepare(..., require_cuda=False)` runs everything a launch does except the driver calls:
tensor maps go through a recording stand-in and the hardware facts are given.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

import gemmgen as gg
from gemmgen.errors import LayoutMismatch
from gemmgen.integrations.ops import call_realigning
from gemmgen.ir import Output
from gemmgen.ir.reference import reference
from gemmgen.runtime.kernel import Kernel
from gemmgen.runtime.quantize import random_block_scale
from gemmgen.testing.calls import (
    EMULATED,
    TOLERANCE,
    args_with_nonzero_reference,
    by_dtype,
    cpu_kernel,
    dense,
    fresh_args,
    given_outputs,
    unwritten,
)
from gemmgen.testing.recording import RecordingEncoder, launch_violations
from gemmgen.testing.tensors import assert_outputs_close

pytestmark = pytest.mark.nvrtc  # needs the compiled kernels (Params layout)

def _prep(kernel, a, b, **kw):
    enc = kw.pop("encoder", None)
    if enc is not None:
        kernel = cpu_kernel(kernel.compiled, enc)
    return kernel.prepare(a, b, **kw)


def _ab(m, n, k, dtype=torch.bfloat16, layout_a="row", layout_b="col", batch=None):
    lead = (batch,) if batch else ()
    def make(rows, cols, row_major):
        t = torch.randn(*lead, rows, cols) if row_major else torch.randn(*lead, cols, rows).transpose(-1, -2)
        return t.to(dtype)

    a, b = make(m, k, layout_a == "row"), make(k, n, layout_b == "row")
    return a, b


@pytest.fixture(scope="module")
def kernels(recipe_kernels):
    return {name: cpu_kernel(k) for name, k in dense(recipe_kernels).items()}


def test_prepare_builds_params_and_outputs(kernels):
    k = kernels["bias_gelu"]
    a, b = _ab(300, 264, 136)
    enc = RecordingEncoder()
    prep = _prep(k, a, b, bias=torch.randn(264).bfloat16(), encoder=enc)
    (d,) = prep.outputs
    assert d.shape == (300, 264) and d.dtype == torch.bfloat16
    assert len(prep.params) == k.compiled.info.params_size
    assert prep.grid[0] * prep.grid[1] * prep.grid[2] > 0
    addrs = {c.addr for c in enc.calls}
    assert addrs == {a.data_ptr(), b.data_ptr(), d.data_ptr()}
    a_call = next(c for c in enc.calls if c.addr == a.data_ptr())
    assert a_call.dims == (136, 300, 1) and a_call.strides == (136 * 2, 0)


def test_layouts_and_batch_map_to_cutlass_strides(kernels):
    k = kernels["every_op"]  # A column-major, B row-major, batched, e4m3 D
    a, b = _ab(72, 40, 24, layout_a="col", layout_b="row", batch=3)
    ops = dict(c=torch.randn(3, 72, 40).bfloat16(), r2=torch.randn(3, 72, 40).half(), bias=torch.randn(40),
               scale=torch.randn(72).bfloat16())
    enc = RecordingEncoder()
    prep = _prep(k, a, b, encoder=enc, **ops)
    assert prep.outputs[0].shape == (3, 72, 40) and prep.outputs[0].dtype == torch.float8_e4m3fn
    a_call = next(c for c in enc.calls if c.addr == a.data_ptr())
    assert a_call.dims == (72, 24, 3)  # M contiguous
    assert a_call.strides == (a.stride(2) * 2, a.stride(0) * 2)
    b_call = next(c for c in enc.calls if c.addr == b.data_ptr())
    assert b_call.dims == (40, 24, 3)  # N contiguous


def test_aux_outputs_returned_and_given(kernels):
    """M x N aux outputs and an amax; the amax, given or allocated, is zeroed before the launch
    (the kernel max-reduces into it), and a wrong one is refused by name."""
    k = kernels["bias_gelu_aux"]
    a, b = _ab(64, 32, 16, layout_a="col")
    bias = torch.randn(32).bfloat16()
    fresh = _prep(k, a, b, bias=bias).outputs
    assert [tuple(t.shape) for t in fresh] == [(64, 32), (64, 32), ()] and fresh[2].item() == 0.0
    d, pre = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 32, dtype=torch.bfloat16)
    amax = torch.tensor(float("nan"))
    prep = _prep(k, a, b, bias=bias, out=(d, pre, amax))
    assert prep.outputs[0] is d and prep.outputs[1] is pre and prep.outputs[2] is amax and amax.item() == 0.0
    for bad, match in ((torch.zeros(1), r"out\[amax_d\]: expected shape \(\) \(the reduction.s values per batch\), "
                                        r"got \(1,\)"),
                       (torch.zeros((), dtype=torch.bfloat16), r"out\[amax_d\]: expected dtype torch\.float32"),
                       (None, None)):
        if bad is None:
            assert _prep(k, a, b, bias=bias, out=(d, pre, None)).outputs[2].item() == 0.0
            continue
        with pytest.raises(gg.InvalidArgument, match=match):
            _prep(k, a, b, bias=bias, out=(d, pre, bad))


def test_empty_m_or_n_returns_empty_outputs(kernels):
    k = kernels["bias_gelu"]
    for m, n in ((0, 16), (16, 0)):
        a, b = _ab(m, n, 32)
        prep = _prep(k, a, b, bias=torch.randn(n).bfloat16())
        assert prep.params is None and prep.outputs[0].shape == (m, n)


def test_k_zero_is_the_epilogue_of_zero(kernels, examples):
    k = kernels["bias_gelu"]
    a, b = torch.empty(5, 0, dtype=torch.bfloat16), torch.empty(0, 16, dtype=torch.bfloat16)
    bias = torch.randn(16).bfloat16()
    prep = _prep(k, a, b, bias=bias)
    assert prep.params is None
    torch.testing.assert_close(prep.outputs[0], examples["bias_gelu"].reference(a, b, bias=bias))


def _bad_cases():
    bf = torch.bfloat16
    a, b = _ab(64, 64, 64)
    bias = torch.randn(64).to(bf)
    mis = torch.randn(64 * 64 + 1).to(bf)[1:].view(64, 64)  # data pointer off by 2 bytes
    return [
        ("dtype", dict(a=a.half(), b=b, bias=bias),
         r"a: expected dtype torch.bfloat16 \(the recipe declares bf16\), got torch.float16.*a\.to\(torch.bfloat16\)"),
        ("not a tensor", dict(a=[1, 2], b=b, bias=bias), r"a: expected a torch.Tensor, got list"),
        ("rank", dict(a=a[None], b=b, bias=bias), r"a: expected a 2-D"),
        ("K mismatch", dict(a=a[:, :32], b=b, bias=bias), r"b: expected 32 rows \(K of a"),
        ("layout", dict(a=a.t().contiguous().t(), b=b, bias=bias), r"a: expected a row-major tensor.*contiguous"),
        ("misaligned pointer", dict(a=mis, b=b, bias=bias), r"a: data pointer .* not 16-byte aligned.*clone"),
        ("misaligned ld", dict(a=torch.randn(64, 70).to(bf)[:, :64], b=b, bias=bias),
         r"a: row stride 70 must be a multiple of 8 elements .* its rows are 140 bytes apart"),
        ("row vector length", dict(a=a, b=b, bias=torch.randn(63).to(bf)),
         r"bias: expected a 1-D tensor of length 64 = N"),
        ("row vector dtype", dict(a=a, b=b, bias=torch.randn(64)), r"bias: expected dtype torch.bfloat16"),
        ("vector stride", dict(a=a, b=b, bias=torch.randn(128).to(bf)[::2]), r"bias: expected a contiguous vector"),
        ("scalar as tensor", dict(a=a, b=b, bias=bias, extra=1.0), r"extra: not an operand of this recipe"),
        ("missing", dict(a=a, b=b), r"bias: missing operand; pass bias=\.\.\. \(a length-N bf16 vector\)"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise_before_launch(kernels, case):
    _, kw, match = case
    kw = dict(kw)
    with pytest.raises(gg.InvalidArgument, match=match):
        _prep(kernels["bias_gelu"], kw.pop("a"), kw.pop("b"), **kw)


_FIXED_BY_A_COPY = {"layout": "a", "misaligned pointer": "a", "misaligned ld": "a", "vector stride": "bias"}


@pytest.mark.parametrize("case", [c for c in _bad_cases() if set(c[1]) == {"a", "b", "bias"}], ids=lambda c: c[0])
def test_torch_ops_copy_what_only_the_layout_refuses(kernels, case):
    """Kernels raise LayoutMismatch, naming the argument, exactly where a copy would do (again at
    once for the same call signature, without rechecking); the torch op's path (call_realigning)
    then copies that tensor into a TMA-readable layout and the call goes through on the same
    values. Any other mistake still raises, unchanged."""
    name, kw, match = case
    kernel = kernels["bias_gelu"]
    a, b, bias = kw["a"], kw["b"], kw["bias"]
    seen = []

    def call(a, b, *args):
        seen.append((a, b, *args))
        return kernel.prepare(a, b, *args)

    if name in _FIXED_BY_A_COPY:
        with pytest.raises(LayoutMismatch, match=match) as refused:
            kernel.prepare(a, b, bias)
        assert refused.value.argument == _FIXED_BY_A_COPY[name]
        with mock.patch("gemmgen.runtime.kernel.check_call", side_effect=AssertionError("checked again")), \
                pytest.raises(LayoutMismatch, match=match) as again:  # the same signature: the same verdict, kept
            kernel.prepare(a, b, bias)
        assert again.value.argument == refused.value.argument and again.value is not refused.value
        prep = call_realigning(kernel.recipe, call, a, b, (bias,))
        assert prep.outputs[0].shape == (64, 64) and len(seen) == 2
        for given, used in zip((a, b, bias), seen[-1], strict=True):
            assert torch.equal(given, used)
        assert seen[-1][0 if _FIXED_BY_A_COPY[name] == "a" else 2] is not (a if _FIXED_BY_A_COPY[name] == "a" else bias)
    else:
        with pytest.raises(gg.InvalidArgument, match=match) as not_layout:
            call_realigning(kernel.recipe, call, a, b, (bias,))
        assert not isinstance(not_layout.value, LayoutMismatch) and len(seen) == 1


def test_scalar_operand_must_be_a_number(kernels):
    a, b = _ab(16, 16, 16, dtype=torch.float16, layout_a="col", layout_b="row")
    c = torch.randn(16, 16).half()
    with pytest.raises(gg.InvalidArgument, match=r"alpha: expected a Python number"):
        _prep(kernels["linear_combination"], a, b, alpha=torch.tensor(1.0), beta=1.0, c=c)
    with pytest.raises(gg.InvalidArgument, match=r"c: expected shape \(16, 16\)"):
        _prep(kernels["linear_combination"], a, b, alpha=1.0, beta=1.0, c=c[:8])


def test_out_checks(kernels):
    k = kernels["bias_gelu"]
    a, b = _ab(64, 64, 64)
    bias = torch.randn(64).bfloat16()
    with pytest.raises(gg.InvalidArgument, match=r"out: expected shape \(64, 64\), got \(64, 32\)"):
        _prep(k, a, b, bias=bias, out=torch.empty(64, 32, dtype=torch.bfloat16))
    with pytest.raises(gg.InvalidArgument,
                       match=r"out: expected dtype torch.bfloat16 \(the recipe declares bf16\), got torch.float32"):
        _prep(k, a, b, bias=bias, out=torch.empty(64, 64))
    with pytest.raises(gg.InvalidArgument, match=r"out: shares memory with input a; "):
        _prep(k, a, b, bias=bias, out=a)
    with pytest.raises(gg.InvalidArgument, match=r"out: expected a tensor for D or a tuple of 1"):
        _prep(k, a, b, bias=bias, out=(a, b))


def test_outputs_may_not_share_memory(recipe_kernels):
    """D and an aux output given in the same memory would have the kernel's stores race (one output
    silently holding the other's values): refused. Disjoint parts of one buffer are fine."""
    ck = recipe_kernels["bias_gelu_aux"]
    a, b, ops = fresh_args(ck.recipe, 16, 16, 16, ())
    dt = [o.dtype.torch for o in ck.recipe.outputs]
    assert dt[0] == dt[1]
    buf = torch.empty(32, 16, dtype=dt[0])
    amax = torch.zeros(())
    for outs in ((buf[:16], buf[:16], amax), (buf[:16], buf[8:24], amax)):
        with pytest.raises(gg.InvalidArgument, match=r"out\[pre_act\]: shares memory with out; give each output"):
            cpu_kernel(ck).prepare(a, b, **ops, out=outs)
    with pytest.raises(gg.InvalidArgument, match=r"out\[amax_d\]: shares memory with out"):
        cpu_kernel(ck).prepare(a, b, **ops, out=(buf[:16], buf[16:], buf[0, :2].view(torch.float32)[0]))
    assert cpu_kernel(ck).prepare(a, b, **ops, out=(buf[:16], buf[16:], amax)).params is not None


def test_batched_checks(kernels):
    k = kernels["every_op"]
    a, b = _ab(16, 16, 16, layout_a="col", layout_b="row", batch=3)
    ops = dict(c=torch.randn(3, 16, 16).bfloat16(), r2=torch.randn(3, 16, 16).half(), bias=torch.randn(16),
               scale=torch.randn(16).bfloat16())
    with pytest.raises(gg.InvalidArgument, match=r"b: batch size 2 does not match a's 3"):
        _prep(k, a, b[:2], **ops)
    with pytest.raises(gg.InvalidArgument, match=r"a: batch stride 0 must be a non-zero multiple"):
        _prep(k, a[:1].expand(3, -1, -1), b, **ops)


def test_cuda_is_required_for_a_real_call(recipe_kernels):
    a, b = _ab(16, 16, 16)
    with pytest.raises(gg.InvalidArgument, match=r"a: expected a CUDA tensor, got one on cpu; move it with a.cuda\(\)"):
        Kernel(recipe_kernels["bias_gelu"])(a, b, bias=torch.randn(16).bfloat16())


def test_a_gpu_gemmgen_builds_for_no_arch_is_refused(monkeypatch):
    from gemmgen.runtime import driver

    monkeypatch.setattr(driver, "device_facts", lambda i: (108, (8, 0)))
    with pytest.raises(gg.InvalidArgument, match=r"device cuda:0 has compute capability 8.0; gemmgen builds kernels "
                       r"for sm_90a \(H100/H200, compute capability 9.0\); sm_100a \(B200/GB200"):
        driver.device_arch(0)
    monkeypatch.setattr(driver, "device_facts", lambda i: (148, (10, 0)))
    assert driver.device_arch(0) == (gg.Arch.SM100A, 148)


def test_repeated_calls_reuse_the_plan_but_not_stale_outputs(recipe_kernels):
    enc = RecordingEncoder()
    k = cpu_kernel(recipe_kernels["bias_gelu"], enc)
    a, b = _ab(256, 512, 128)
    bias = torch.randn(512).bfloat16()
    first = k.prepare(a, b, bias=bias)
    n_calls = len(enc.calls)
    again = k.prepare(a, b, bias=bias, out=first.outputs[0])
    assert len(enc.calls) == n_calls  # inputs and the same output: nothing re-encoded
    assert again.params == first.params
    other = torch.empty(256, 512, dtype=torch.bfloat16)
    third = k.prepare(a, b, bias=bias, out=other)
    assert len(enc.calls) == n_calls + 1 and enc.calls[-1].addr == other.data_ptr()
    assert third.params != first.params
    b2 = b.clone()
    k.prepare(a, b2, bias=bias)  # a new B: a new plan
    assert any(c.addr == b2.data_ptr() for c in enc.calls)


def test_outputs_moving_between_addresses_get_their_own_maps(recipe_kernels):
    """The last Params block is reused only while the outputs stay where they were: alternating
    outputs (and fresh ones) each get Params equal to a fresh kernel's for the same tensors."""
    ck = recipe_kernels["bias_gelu"]
    enc = RecordingEncoder()
    k = cpu_kernel(ck, enc)
    a, b = _ab(72, 40, 24)
    bias = torch.randn(40).bfloat16()
    first, second = torch.empty(72, 40, dtype=torch.bfloat16), torch.empty(72, 40, dtype=torch.bfloat16)
    for out in (first, second, first, None, second, None, first):
        got = k.prepare(a, b, bias, out=out)
        fresh_enc = RecordingEncoder()
        want = cpu_kernel(ck, fresh_enc).prepare(a, b, bias, out=got.outputs[0])
        assert _decoded(ck, got.params, enc) == _decoded(ck, want.params, fresh_enc)


def test_operands_by_position_or_by_name(recipe_kernels):
    """Operands positionally in declaration order (as the op passes them) build the same launch as
    by name; a mix, or a wrong count, is refused before anything is built."""
    ck = recipe_kernels["bias_silu_residual"]
    names = [o.name for o in ck.recipe.operands]
    a, b, ops = fresh_args(ck.recipe, 40, 24, 72, ())
    enc_named, enc_pos = RecordingEncoder(), RecordingEncoder()
    named = cpu_kernel(ck, enc_named).prepare(a, b, out=torch.empty(40, 24, dtype=torch.bfloat16), **ops)
    pos = cpu_kernel(ck, enc_pos).prepare(a, b, *(ops[n] for n in names), out=named.outputs[0])
    assert _decoded(ck, pos.params, enc_pos) == _decoded(ck, named.params, enc_named)
    k = cpu_kernel(ck)
    with pytest.raises(gg.InvalidArgument, match=r"operands: pass all 2 of \['bias', 'residual'\] positionally"):
        k.prepare(a, b, ops[names[0]])
    with pytest.raises(gg.InvalidArgument, match=r"got 1 positional and \['residual'\] by name"):
        k.prepare(a, b, ops[names[0]], **{names[1]: ops[names[1]]})


def test_odd_n_output_rows_are_padded_for_tma(kernels):
    a, b = _ab(16, 7, 32)
    d = _prep(kernels["bias_gelu"], a, b, bias=torch.randn(7).bfloat16()).outputs[0]
    assert d.shape == (16, 7) and d.stride() == (8, 1)


def _has_libcuda() -> bool:
    import ctypes.util

    return ctypes.util.find_library("cuda") is not None


@pytest.mark.skipif(_has_libcuda(), reason="a CUDA driver is present: the GPU tests cover the real calls")
def test_driver_calls_are_well_typed_up_to_the_driver():
    """Without a driver the bindings fail at dlopen, after checking the launch's arguments' types (the
    encode fails at once: it looks the driver's function up first). tests/runtime/test_stub_driver.py
    follows every call into a stand-in driver."""
    from cuda.bindings import driver as cu

    from gemmgen.runtime import driver
    from gemmgen.runtime.tma import EncodeArgs

    with pytest.raises(RuntimeError, match="libcuda"):
        driver.encode_tensor_map(EncodeArgs(1, 3, 0x10000, (64, 64, 1), (128, 0), (64, 64, 1), (1, 1, 1), 0, 3, 2, 0))
    cfg = driver.launch_config((2, 66, 1), 384, (2, 1, 1), 1000, 0)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.blockDimX, cfg.sharedMemBytes, cfg.numAttrs) == (2, 66, 384, 1000, 1)
    assert cfg.attrs[0].value.clusterDim.x == 2
    assert driver.launch_config((2, 66, 1), 384, (2, 1, 1), 1000, 0) is cfg  # built once per launch shape
    assert driver.launch_config((2, 66, 1), 384, (2, 1, 1), 1000, 7) is not cfg
    occ = driver.occupancy_config(384, (2, 1, 1), 1000)  # one cluster's grid, as CUTLASS queries it
    assert (occ.gridDimX, occ.gridDimY, occ.gridDimZ, occ.sharedMemBytes) == (2, 1, 1, 1000)
    assert occ.attrs[0].value.clusterDim.x == 2
    fn = driver.LoadedFunction(None, cu.CUfunction(), 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        driver.launch(fn, b"\0" * 64, (1, 1, 1), 384, (1, 1, 1), 0, 0)


def test_recording_encoder_applies_the_drivers_tensor_map_rules():
    """The CPU stand-in refuses what cuTensorMapEncodeTiled documents as invalid, one rule at a time
    (the oracle tests show it accepts every map CUTLASS's own host code encodes)."""
    from gemmgen.runtime.tma import EncodeArgs
    from gemmgen.testing.recording import TensorMapRejected, encode_violations

    good = EncodeArgs(9, 3, 0x10000, (24, 7, 2), (64, 448), (64, 128, 1), (1, 1, 1), 0, 3, 2, 0)
    assert encode_violations(good) == []
    bad: dict[str, Any] = {"addr": 0x10008, "dims": (24, 0, 2), "strides": (2, 448), "box": (64, 512, 1),
                           "elem_strides": (1, 9, 1)}
    for name, value in bad.items():
        assert len(encode_violations(good._replace(**{name: value}))) == 1, name
    assert encode_violations(good._replace(box=(4, 128, 1))) == ["box inner dimension 8 bytes is not a multiple of 16"]
    assert "swizzle" in encode_violations(good._replace(box=(128, 128, 1)))[0]
    with pytest.raises(TensorMapRejected, match="global strides"):
        RecordingEncoder()(good._replace(strides=(2, 448)))
    assert RecordingEncoder(strict=False)(good._replace(strides=(2, 448)))
    assert launch_violations((2, 66, 1), 384, (2, 1, 1), 200_000) == []
    for bad_launch in (((3, 66, 1), 384, (2, 1, 1), 0), ((2, 70000, 1), 384, (2, 1, 1), 0),
                       ((4, 4, 1), 384, (4, 4, 1), 0), ((2, 66, 1), 2048, (2, 1, 1), 0),
                       ((2, 66, 1), 384, (2, 1, 1), 240_000)):
        assert len(launch_violations(*bad_launch)) == 1, bad_launch


@pytest.mark.parametrize("outputs", ["given", "fresh"])
@pytest.mark.parametrize("shape", EMULATED, ids=lambda s: "x".join(map(str, s)))
def test_params_address_the_recipes_math(recipe_kernels, shape, outputs):
    """Every kernel family, swapped ones included: reading the operands through the tensor maps and
    pointers in the Params gemmgen builds, and writing the outputs through theirs, computes the
    recipe's reference on the caller's tensors (NaN-prefilled outputs, padded leading dimensions),
    whether the caller gives the outputs or gemmgen allocates them. Every tensor map must also pass
    cuTensorMapEncodeTiled's documented checks (the strict RecordingEncoder). Every example and
    coverage recipe: in its probed Params layout where the session compiles it (`recipe_kernels`)."""
    from gemmgen.testing.emulate import emulate

    m, _, k, batch = shape
    for name, compiled_kernel in dense(recipe_kernels).items():
        recipe = compiled_kernel.recipe
        n = shape[1] + shape[1] % 2 if recipe.epilogue.pairs else shape[1]  # column pairs: whole pairs
        lead = (batch,) if recipe.gemm.batched else ()
        a, b, ops, want = args_with_nonzero_reference(recipe, m, n, k, lead)
        enc = RecordingEncoder()
        kernel = cpu_kernel(compiled_kernel, enc)
        if outputs == "given":
            outs = given_outputs(recipe, m, n, lead)
            prep = kernel.prepare(a, b, out=outs if len(outs) > 1 else outs[0], **ops)
        else:
            prep = kernel.prepare(a, b, **ops)
            outs = unwritten(recipe, prep.outputs)
        tensors = [a, b, *outs, *(v for v in ops.values() if isinstance(v, torch.Tensor))]
        if prep.workspace is not None:
            tensors.append(prep.workspace)
        assert (prep.workspace is not None) == any(o.dim is not None and o.blocks is None for o in recipe.outputs)
        assert launch_violations(prep.grid, kernel._block, compiled_kernel.config.cluster, kernel._smem) == []
        emulate(compiled_kernel, prep.params, enc, tensors)
        scale = reference(recipe, a, b, ops, magnitudes=True)
        for got in outs:
            assert not got.isnan().any(), f"{name} {shape}: output elements the kernel would not write"
        assert_outputs_close(recipe.outputs, outs, want, scale, (m, n), by_dtype, f"{name} {shape}")


def test_new_addresses_of_a_known_layout_redo_only_the_address_work(recipe_kernels):
    """New tensors shaped like earlier ones: the Params equal a fresh kernel's for the same tensors,
    only the input tensor maps are encoded again, and the address checks still run."""
    for name in ("bias_gelu", "swapped"):
        ck = recipe_kernels[name]
        enc = RecordingEncoder()
        k = cpu_kernel(ck, enc)
        g = ck.recipe.gemm
        lead = (2,) if g.batched else ()

        outs = given_outputs(ck.recipe, 40, 24, lead, fill=None)
        out = outs if len(outs) > 1 else outs[0]
        a, b, ops = fresh_args(ck.recipe, 40, 24, 72, lead, scalar=0.5)
        k.prepare(a, b, out=out, **ops)
        a2, b2, ops2 = fresh_args(ck.recipe, 40, 24, 72, lead, scalar=0.5)
        before = len(enc.calls)
        again = k.prepare(a2, b2, out=out, **ops2)
        n_inputs = 2 + sum(o.kind is gg.OperandKind.MATRIX and bool(o.per_batch) for o in ck.recipe.operands)  # TMA
        assert len(enc.calls) - before == n_inputs, name  # output maps are shared by the layout
        fresh_enc = RecordingEncoder()
        fresh = cpu_kernel(ck, fresh_enc).prepare(a2, b2, out=out, **ops2)
        assert again.grid == fresh.grid
        assert _decoded(ck, again.params, enc) == _decoded(ck, fresh.params, fresh_enc), name
        storage = torch.empty(a2.untyped_storage().nbytes() // a2.element_size() + 8, dtype=a2.dtype)
        bad = storage.as_strided(a2.shape, a2.stride(), storage_offset=1)  # a2's layout, 2 bytes off
        with pytest.raises(gg.InvalidArgument, match=r"a: data pointer .* not 16-byte aligned"):
            k.prepare(bad, b2, out=out, **ops2)


def test_d_may_be_written_over_its_own_c(recipe_kernels):
    """beta = 1 in place: D given as the very tensor read as C (same address, strides and type) is
    accepted, the Params point D's map at C's memory, and the emulated kernel computes the recipe
    there; any other overlap with C (a view at another offset, C of another type) is refused.
    (The `swapped` kernel: batched, swapped, C bf16 like D; and an aux load beside it.)"""
    from gemmgen.testing.emulate import emulate

    ck = recipe_kernels["swapped"]
    recipe = ck.recipe
    assert recipe.epilogue.source == "c"
    enc = RecordingEncoder()
    k = cpu_kernel(ck, enc)
    a, b, ops, want = args_with_nonzero_reference(recipe, 40, 24, 72, (2,))
    c = ops["c"]
    outs = given_outputs(recipe, 40, 24, (2,))
    prep = k.prepare(a, b, out=(c, *outs[1:]), **ops)
    tensors = [a, b, c, *outs[1:], *(v for v in ops.values() if isinstance(v, torch.Tensor) and v is not c)]
    emulate(ck, prep.params, enc, tensors + ([prep.workspace] if prep.workspace is not None else []))
    scale = reference(recipe, a, b, {**ops, "c": want[0]}, magnitudes=True)  # magnitudes: any bf16 matrix will do
    assert_outputs_close(recipe.outputs, (c, *outs[1:]), want, scale, (40, 24), by_dtype, "in place")
    storage = torch.empty(c.numel() + 64, dtype=c.dtype)
    shifted = storage[8:8 + c.numel()].view(c.shape)  # 16 bytes further: still aligned, not C itself
    shifted_c = storage[:c.numel()].view(c.shape)
    with pytest.raises(gg.InvalidArgument, match=r"out: shares memory with input c; gemmgen writes in place only D"):
        k.prepare(a, b, out=(shifted, *outs[1:]), **{**ops, "c": shifted_c})
    r2 = c[0].view(torch.float16)  # a (shared) aux load over C's memory: D over C would also be written over it
    with pytest.raises(gg.InvalidArgument, match=r"out: shares memory with input r2"):
        k.prepare(a, b, out=(c, *outs[1:]), **{**ops, "r2": r2})
    combination = recipe_kernels["linear_combination"]  # C f16, D f32: the same element strides, other bytes
    a, b, ops = fresh_args(combination.recipe, 40, 24, 72, (), scalar=0.5)
    storage = torch.zeros(40 * 24 * 2, dtype=torch.float16)
    over = storage.view(torch.float32)[:40 * 24].view(40, 24)  # f32 D at C's address, C's element strides
    with pytest.raises(gg.InvalidArgument, match=r"out: shares memory with input c"):
        cpu_kernel(combination).prepare(a, b, out=over, **{**ops, "c": storage[:40 * 24].view(40, 24)})


def _decoded(ck, params, enc):
    """Params as {field: value}; tensor maps as the arguments they were encoded from."""
    from gemmgen.codegen.fields import KIND_SIZE

    out = {}
    for f, offset, _ in ck.params_layout.fields:
        raw = params[offset:offset + KIND_SIZE[f.kind]]
        out[f.name] = enc.of(raw) if f.kind == "desc" else raw
    return out


def test_swapped_kernel_empty_dimensions_behave_like_torch(recipe_kernels):
    ck = recipe_kernels["swapped"]
    k = cpu_kernel(ck)
    for m, n, kk in ((0, 24, 16), (8, 0, 16), (8, 24, 0)):
        a, b, ops = fresh_args(ck.recipe, m, n, kk, (2,))
        prep = k.prepare(a, b, **ops)
        assert prep.params is None and [o.shape for o in prep.outputs] == [(2, m, n)] * 2 + [(2,)]
        if kk:
            assert prep.outputs[2].tolist() == [0.0, 0.0]  # the amax of nothing is the identity
        if kk == 0:
            for got, want in zip(prep.outputs, reference(ck.recipe, a, b, ops), strict=True):
                torch.testing.assert_close(got, want)



def test_vector_reductions_outputs_and_workspace(recipe_kernels):
    """Per-row and per-column reductions: fp32 vectors per batch, written whole by the kernel (NaN
    given outputs are not zeroed), partials and tile counters in a workspace zeroed per launch and
    sized as CUTLASS sizes it, whose pointers are patched per call; wrong outputs refused by name."""
    from gemmgen.runtime.arguments import ArgumentBuilder

    for name, m, n, lead in (("residual_norm_stats", 200, 72, ()), ("column_stats", 72, 200, (3,))):
        ck = recipe_kernels[name]
        k = cpu_kernel(ck)
        a, b, ops = fresh_args(ck.recipe, m, n, 40, lead)
        prep = k.prepare(a, b, **ops)
        want = [o.shape((*lead, m, n)) for o in ck.recipe.outputs]
        assert [tuple(t.shape) for t in prep.outputs] == want and all(t.is_contiguous() for t in prep.outputs)
        builder = ArgumentBuilder(ck.generated.kernel_recipe, ck.config)
        workspace = builder.workspace(k._plans[next(reversed(k._plans))].problem)
        size, slots = workspace.size, workspace.pointers
        assert workspace.zeroed == ((0, size),)
        assert prep.workspace is not None and prep.workspace.numel() == size > 0 and not prep.workspace.any()
        at = {f.name: offset for f, offset, _ in ck.params_layout.fields}
        for call in (prep, k.prepare(a, b, **ops)):  # each call its own workspace, its pointers patched in
            for field, offset in slots:
                assert int.from_bytes(call.params[at[field]:at[field] + 8], "little") == \
                    call.workspace.data_ptr() + offset, field
        given = given_outputs(ck.recipe, m, n, lead)
        prep = k.prepare(a, b, out=given, **ops)
        assert all(t.isnan().all() for o, t in zip(ck.recipe.outputs, given, strict=True) if o.dim is not None)
        vector = next(i for i, o in enumerate(ck.recipe.outputs) if o.dim is not None)
        label = ck.recipe.outputs[vector].name
        good = given[vector]
        for bad, match in ((torch.zeros(*good.shape[:-1], good.shape[-1] + 1), r"expected shape"),
                           (torch.zeros(good.shape, dtype=torch.bfloat16), r"expected dtype torch\.float32"),
                           (torch.zeros(*good.shape, 2)[..., 0], r"expected a contiguous tensor")):
            outs = list(given)
            outs[vector] = bad
            with pytest.raises(gg.InvalidArgument, match=rf"out\[{label}\]: {match}"):
                k.prepare(a, b, out=tuple(outs), **ops)


def test_stream_k_workspace_and_grid(recipe_kernels):
    """A stream-K kernel launches one full wave whatever the problem; when the scheduler splits
    tiles, its partial sums and tile barriers follow the row sum's workspace, the barriers (and
    the row sum's counters) zeroed per launch, the partials not (the first peer of a tile stores
    them); Params point at this call's workspace."""
    from gemmgen.runtime.arguments import ArgumentBuilder
    from gemmgen.runtime.scheduler import decompose

    ck = recipe_kernels["stream_k"]
    k = cpu_kernel(ck)
    builder = ArgumentBuilder(ck.generated.kernel_recipe, ck.config)
    at = {f.name: offset for f, offset, _ in ck.params_layout.fields}
    for (m, n, kk), kind in (((256, 256, 8192), "split-K"), ((129, 1000, 4097), "stream-K"),
                             ((1000, 2048, 128), "data-parallel")):
        assert decompose(m, n, -(-kk // 64), 2, ck.config.tile, ck.config.cluster, 132).kind == kind
        a, b, ops = fresh_args(ck.recipe, m, n, kk, (2,))
        prep = k.prepare(a, b, **ops)
        assert prep.grid[0] * prep.grid[1] * prep.grid[2] == 132, kind  # not truncated to the tiles
        ws = builder.workspace(k._plans[next(reversed(k._plans))].problem)
        rows = ws.zeroed[0][1]  # the row sum's partials and counters, zeroed whole
        assert dict(ws.pointers)["scheduler.reduction_workspace"] == rows > 0  # the scheduler's part follows
        if kind == "data-parallel":
            assert ws.size == rows and ws.zeroed == ((0, rows),)
        else:  # the barriers after the partial sums
            ((_, rows_end), (start, end)) = ws.zeroed
            assert rows_end == rows < start < end == ws.size
        assert prep.workspace.numel() == ws.size and all(not prep.workspace[s:e].any() for s, e in ws.zeroed)
        pointer = int.from_bytes(prep.params[at["scheduler.reduction_workspace"]:][:8], "little")
        assert pointer == prep.workspace.data_ptr() + rows



def test_a_nondeterministic_reduction_is_a_launch_argument_torch_determinism_refuses(compiled, extra, session_cache):
    """`deterministic=False`: the same binary, CUTLASS's Nondeterministic mode in the Params (the only
    byte that changes); under torch.use_deterministic_algorithms(True) the call raises before any
    launch (or warns, with warn_only=True), as torch's own nondeterministic ops do."""
    from dataclasses import replace

    from gemmgen.codegen.fields import KIND_SIZE
    from gemmgen.compile import build_kernel

    ck = compiled["row_extrema"]  # the suite's compiled stream-K kernel
    nondeterministic = build_kernel(extra["row_extrema"].ir, replace(ck.config, deterministic=False), session_cache)
    assert nondeterministic.cache_key == ck.cache_key
    fields = {f.name: (offset, offset + KIND_SIZE[f.kind]) for f, offset, _ in ck.params_layout.fields}
    a, b, ops = fresh_args(ck.recipe, 256, 256, 8192, (2,))  # split-K: every tile's partials reduced
    k, nk = cpu_kernel(ck), cpu_kernel(nondeterministic)
    mine = k.prepare(a, b, **ops)
    theirs = nk.prepare(a, b, out=tuple(mine.outputs), **ops)  # the same outputs: their maps and pointers
    differ = {name for name, (start, end) in fields.items() if mine.params[start:end] != theirs.params[start:end]}
    at = fields["scheduler.reduction_mode"][0]
    assert (mine.params[at], theirs.params[at]) == (0, 1)
    workspace = {name for name, (start, end) in fields.items()  # this call's workspace pointers
                 if 0 <= int.from_bytes(theirs.params[start:end], "little") - theirs.workspace.data_ptr()
                 < theirs.workspace.numel()}
    assert differ - workspace == {"scheduler.reduction_mode"}, differ
    deterministic_mode = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert k.prepare(a, b, **ops).params[at] == 0  # a deterministic kernel runs as before
        with pytest.raises(gg.NotDeterministic, match=r"_nondet.*deterministic=True \(the default\)"):
            nk.prepare(a, b, **ops)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=r"in no fixed order"):
            assert nk.prepare(a, b, **ops).params[at] == 1
    finally:
        torch.use_deterministic_algorithms(deterministic_mode[0], warn_only=deterministic_mode[1])

def test_vector_reductions_of_empty_problems_behave_like_torch(recipe_kernels):
    """Nothing to reduce gives the identity, 0 (torch's sum; its amax refuses, the fp8 recipes'
    convention is 0); K = 0 reduces the epilogue of a zero accumulator."""
    for name, lead in (("residual_norm_stats", ()), ("column_stats", (2,))):
        ck = recipe_kernels[name]
        k = cpu_kernel(ck)
        for m, n, kk in ((0, 24, 16), (8, 0, 16), (8, 24, 0)):
            a, b, ops = fresh_args(ck.recipe, m, n, kk, lead)
            prep = k.prepare(a, b, **ops)
            assert prep.params is None and prep.workspace is None
            assert [tuple(t.shape) for t in prep.outputs] == [o.shape((*lead, m, n)) for o in ck.recipe.outputs]
            for o, got, want in zip(ck.recipe.outputs, prep.outputs, reference(ck.recipe, a, b, ops), strict=True):
                torch.testing.assert_close(got, want, msg=f"{name} {(m, n, kk)} {o.name}")
                if kk and o.reduce is not None:
                    assert not got.any()


def _torch_layout(rng, rows, cols, dtype, layout, lead):
    """A (lead,) rows x cols tensor as torch programs hold them, in `layout`'s majorness: contiguous,
    or a view with a padded leading dimension, an odd storage offset, a padded or broadcast
    (stride 0) batch, drawn at random."""
    inner, outer = (cols, rows) if layout is gg.RowMajor else (rows, cols)
    ld = inner + rng.choice((0, 0, 1, 3, 8))
    offset = rng.choice((0, 0, 1, 8))
    batch = rng.choice((outer * ld, outer * ld + 3, 0)) if lead else 0
    base = torch.randn(offset + ((lead[0] - 1) * batch if lead else 0) + (outer - 1) * ld + inner).to(dtype)
    strides = (ld, 1) if layout is gg.RowMajor else (1, ld)
    return base.as_strided((*lead, rows, cols), ((batch,) if lead else ()) + strides, offset)


def _block_scale_layout(rng, kind, gemm, m, n, k, lead):
    """A block scale as `_torch_layout` draws tensors, in the layout the kernel reads (M/N-major) or,
    one time in three, the other (which the op realigns)."""
    gm, gn, gk = gemm.block_scale
    rows, cols = (-(-m // gm), -(-k // gk)) if kind is gg.OperandKind.SCALE_A else (-(-k // gk), -(-n // gn))
    read = gg.ColMajor if kind is gg.OperandKind.SCALE_A else gg.RowMajor
    layout = rng.choice((read, read, read.transposed))
    return _torch_layout(rng, rows, cols, torch.float32, layout, lead)


class _Seen:
    """A kernel's prepare that keeps the arguments of its last call (the realigned copies)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.args: tuple = ()

    def __call__(self, *args):
        self.args = args
        return self.kernel.prepare(*args)


def test_op_path_on_torch_tensors_of_random_shapes_and_layouts(recipe_kernels):
    """What a torch program passes: tensors of random small and odd M, N, K and batch, contiguous or
    strided views (`_torch_layout`), strided vectors too, realigned as the op does. Every tensor
    map and launch must pass the driver's rules, and the emulated kernel must compute the reference.
    A new seed each run, printed on failure; GEMMGEN_TEST_SEED replays it, tensors and layouts."""
    import os

    seed = int(os.environ.get("GEMMGEN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        _random_shapes_and_layouts(recipe_kernels, seed)


def _random_shapes_and_layouts(recipe_kernels, seed: int) -> None:
    import random

    from gemmgen.testing.emulate import emulate

    rng = random.Random(seed)
    extents = (1, 2, 3, 7, 8, 9, 15, 16, 17, 64, 65, 127, 128, 129, 200)
    for name, ck in dense(recipe_kernels).items():
        recipe, g = ck.recipe, ck.recipe.gemm
        for _ in range(6):
            m, n, k = (rng.choice(extents) for _ in range(3))
            n += n % 2 if recipe.epilogue.pairs else 0  # column pairs: whole pairs
            lead = (rng.choice((1, 2, 3)),) if g.batched else ()
            where = f"{name} M={m} N={n} K={k} lead={lead} (GEMMGEN_TEST_SEED={seed})"
            a = _torch_layout(rng, m, k, g.a.torch, g.layout_a, lead)
            b = _torch_layout(rng, k, n, g.b.torch, g.layout_b, lead)
            step = rng.choice((1, 2))
            ops = {o.name: _block_scale_layout(rng, o.kind, g, m, n, k, lead) if o.kind.block_scale else
                   (torch.randn(lead) if o.per_batch else float(torch.randn(()))) if o.kind is gg.OperandKind.SCALAR
                   else rng.randrange(2**63) if o.kind is gg.OperandKind.SEED
                   else _torch_layout(rng, m, o.columns.extent(n), o.dtype.torch, gg.RowMajor, lead[:o.per_batch])
                   if o.kind is gg.OperandKind.MATRIX else
                   torch.randn(*lead[:o.per_batch], step * (n if o.kind is gg.OperandKind.ROW else m))
                   .to(o.dtype.torch)[..., ::step]
                   for o in recipe.operands}
            enc = RecordingEncoder()
            seen = _Seen(cpu_kernel(ck, enc))
            try:
                prep = call_realigning(recipe, seen, a, b, tuple(ops.values()))
            except AssertionError as refused:  # the driver's rules (TensorMapRejected)
                raise AssertionError(f"{where}: {refused}") from refused
            outs = unwritten(recipe, prep.outputs)
            assert launch_violations(prep.grid, seen.kernel._block, ck.config.cluster, seen.kernel._smem) == [], where
            workspace = [prep.workspace] if prep.workspace is not None else []
            emulate(ck, prep.params, enc, [t for t in seen.args if isinstance(t, torch.Tensor)] + [*outs, *workspace])
            want = reference(recipe, a, b, ops)
            scale = reference(recipe, a, b, ops, magnitudes=True)
            for got in outs:
                assert not got.isnan().any(), where
            assert_outputs_close(recipe.outputs, outs, want, scale, (m, n), _relative_to_largest, where)


def _relative_to_largest(o: Output, want: torch.Tensor) -> tuple[float, float]:
    """Its dtype's tolerance, absolute too relative to the largest reference value; a reduction's
    only relative to its terms (`assert_output_close`)."""
    tol = TOLERANCE[o.dtype.torch]
    return tol, 0.0 if o.reduce else tol * max(1.0, float(want.float().abs().max()))


class _FakeDriver:
    """The driver calls of `driver._load_function`, recorded (with the thread's capture mode)."""

    def __init__(self, occupancy_ok=True):
        from cuda.bindings import driver as cu

        self.CUresult, self.CUstreamCaptureMode, self.CUfunction_attribute = \
            cu.CUresult, cu.CUstreamCaptureMode, cu.CUfunction_attribute
        self.mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
        self.calls, self.occupancy_ok = [], occupancy_ok

    def _ok(self, name, *result):
        self.calls.append((name, self.mode))
        return (self.CUresult.CUDA_SUCCESS, *result)

    def cuThreadExchangeStreamCaptureMode(self, mode):
        previous, self.mode = self.mode, mode
        return self.CUresult.CUDA_SUCCESS, previous

    def cuModuleLoadData(self, cubin):
        return self._ok("load", "module")

    def cuModuleGetFunction(self, module, name):
        return self._ok("function", "function")

    def cuFuncSetAttribute(self, function, attr, value):
        return self._ok("smem")[0]

    def cuOccupancyMaxActiveClusters(self, function, config):
        self.config = config
        if not self.occupancy_ok:
            return self.CUresult.CUDA_ERROR_INVALID_CLUSTER_SIZE, 0
        return self._ok("occupancy", 66)


def test_loading_a_kernel_is_allowed_inside_graph_capture():
    """A kernel's first call may come inside CUDA graph capture: the module load and attribute calls
    run in relaxed capture mode, and the thread's mode is restored after. The occupancy query sees
    one cluster's grid; if it fails, the grid is sized from the SM count (0 clusters), with a warning."""
    from gemmgen.runtime import driver

    cu = _FakeDriver()
    fn = driver._load_function(cu, "entry", b"cubin", 384, (2, 1, 1), 200_000)
    relaxed = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    assert [c for c, _ in cu.calls] == ["load", "function", "smem", "occupancy"]
    assert all(mode == relaxed for _, mode in cu.calls)
    assert cu.mode == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    assert fn.max_active_clusters == 66
    assert (cu.config.gridDimX, cu.config.gridDimY, cu.config.sharedMemBytes) == (2, 1, 200_000)
    failing = _FakeDriver(occupancy_ok=False)
    with pytest.warns(UserWarning, match="cuOccupancyMaxActiveClusters.*CUDA_ERROR_INVALID_CLUSTER_SIZE"):
        assert driver._load_function(failing, "entry", b"cubin", 384, (2, 1, 1), 0).max_active_clusters == 0
    assert failing.mode == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL


def test_call_launches_with_the_tensors_device_current(recipe_kernels, monkeypatch):
    """A call whose tensors live on another GPU than the current one (a process driving several
    GPUs, e.g. layers spread over devices) launches with their device made current for the launch,
    on that device's current stream; otherwise nothing is switched. (Driver and device stubbed: CPU
    tensors stand for device -1.)"""
    import contextlib

    from gemmgen.runtime import driver

    made_current, launches = [], []

    @contextlib.contextmanager
    def device(index):
        made_current.append(index)
        yield
        made_current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(driver, "load", lambda entry, cubin, index, *rest: f"function on {index}")
    monkeypatch.setattr(driver, "current_stream", lambda index: f"stream of {index}")
    monkeypatch.setattr(driver, "launch", lambda fn, params, grid, block, cluster, smem, stream:
                        launches.append((fn, stream, list(made_current))))
    ck = recipe_kernels["bias_gelu"]
    kernel = cpu_kernel(ck)
    a, b, ops = fresh_args(ck.recipe, 40, 24, 72, ())
    monkeypatch.setattr(driver, "current_device", lambda: -1)
    kernel(a, b, **ops)
    assert launches[-1] == ("function on -1", "stream of -1", [])
    monkeypatch.setattr(driver, "current_device", lambda: 0)
    kernel(a, b, **ops)
    assert launches[-1] == ("function on -1", "stream of -1", [-1])



def _meta_args(recipe, m, n, k, lead):
    """A, B and the operands of a call as meta tensors (shapes and strides without memory)."""
    def meta(rows, cols, dtype, layout, batch=lead):
        t = torch.empty(*batch, *((rows, cols) if layout is gg.RowMajor else (cols, rows)), dtype=dtype,
                        device="meta")
        return t if layout is gg.RowMajor else t.transpose(-1, -2)

    g = recipe.gemm
    def vector(o):  # a scalar or vector; one per batch (`Operand.per_batch`) padded to 16 bytes per batch
        if o.kind is gg.OperandKind.SCALAR and not o.per_batch:
            return 1.0
        if o.kind is gg.OperandKind.SEED:
            return 7
        length = {gg.OperandKind.SCALAR: 1, gg.OperandKind.ROW: n, gg.OperandKind.COL: m}[o.kind]
        shape = (*lead, -(-length // 8) * 8) if o.per_batch else (length,)
        t = torch.empty(shape, dtype=o.dtype.torch, device="meta")[..., :length]
        return t.squeeze(-1) if o.kind is gg.OperandKind.SCALAR else t

    ops = {o.name: random_block_scale(o.kind, g, m, n, k, lead).to("meta") if o.kind.block_scale else
           meta(m, n, o.dtype.torch, gg.RowMajor, lead if o.per_batch else ()) if o.kind is gg.OperandKind.MATRIX
           else vector(o)
           for o in recipe.operands}
    return meta(m, k, g.a.torch, g.layout_a), meta(k, n, g.b.torch, g.layout_b), ops


def test_problems_past_the_kernels_32_bit_tile_arithmetic_are_refused(recipe_kernels):
    """CUTLASS counts rows, columns, K and output tiles in 32-bit ints; past that its scheduler values
    wrap around (tests/runtime/test_oracle.py shows where), so such calls raise before any launch, naming
    the dimension in the caller's terms (a swapped kernel's M is the caller's N)."""
    for name in ("bias_gelu", "swapped"):
        ck = recipe_kernels[name]
        lead = (1,) if ck.recipe.gemm.batched else ()
        for dim, shape in (("M", (2**31 - 1, 16, 16)), ("N", (16, 2**31 - 8, 16)), ("K", (16, 16, 2**31 - 8))):
            a, b, ops = _meta_args(ck.recipe, *shape, lead)
            with pytest.raises(gg.InvalidArgument, match=rf"^{dim} = \d+: too large .* split the problem along {dim}"):
                cpu_kernel(ck).prepare(a, b, **ops)
        a, b, ops = _meta_args(ck.recipe, 2**31 - 1024, 16, 16, lead)
        assert cpu_kernel(ck).prepare(a, b, **ops).params is not None  # in range: accepted
    batched = recipe_kernels["swapped"]
    assert batched.recipe.gemm.batched
    a, b, ops = _meta_args(batched.recipe, 8, 8, 8, (2**31,))  # 2^31 batches: at least that many tiles
    with pytest.raises(gg.InvalidArgument, match=r"output tiles, more than .* split the batch"):
        cpu_kernel(batched).prepare(a, b, **ops)


def test_runtime_scalars_are_rounded_to_fp32_as_the_reference_rounds_them(recipe_kernels):
    """A Python number for a runtime scalar reaches the kernel as the fp32 the reference computes
    with: rounded, and +-inf past fp32's range (it used to raise a bare OverflowError)."""
    import struct

    ck = recipe_kernels["linear_combination"]
    kernel = cpu_kernel(ck)
    offset = next(off for f, off, _ in ck.params_layout.fields if f.name == "epilogue.scalar.alpha.value")
    for value in (0.1, 1e39, -(2.0**200), 1e-50, 3.4028235e38):
        a, b, ops = fresh_args(ck.recipe, 16, 16, 16, (), scalar=1.0)
        prep = kernel.prepare(a, b, **{**ops, "alpha": value})
        packed = struct.unpack_from("<f", prep.params, offset)[0]
        assert packed == torch.tensor(value, dtype=torch.float32).item(), value


def test_odd_arguments_raise_invalid_argument(recipe_kernels):
    """What is not a dense tensor or a Python number fails the checks with InvalidArgument naming the
    argument, wherever it is passed (sparse tensors used to escape as torch's RuntimeError from
    data_ptr; a non-tensor inside an `out` tuple as TypeError). An int past a double's range is a
    scalar like any other: +-inf in fp32."""
    ck = recipe_kernels["bias_gelu_aux"]
    kernel = cpu_kernel(ck)
    a, b, ops = fresh_args(ck.recipe, 16, 16, 16, ())
    sparse = torch.randn(16, 16).bfloat16().to_sparse()
    for where, call in (("a", lambda: kernel.prepare(sparse, b, **ops)),
                        ("bias", lambda: kernel.prepare(a, b, bias=sparse[0])),
                        ("out", lambda: kernel.prepare(a, b, **ops, out=sparse)),
                        ("out", lambda: kernel.prepare(a, b, **ops, out=(sparse, None, None))),
                        ("out", lambda: kernel.prepare(a, b, **ops, out=("d", None, None))),
                        (r"out\[amax_d\]", lambda: kernel.prepare(a, b, **ops, out=(None, None, "amax")))):
        with pytest.raises(gg.InvalidArgument, match=rf"^{where}: expected a (dense|torch\.Tensor)"):
            call()
    combo = recipe_kernels["linear_combination"]
    a, b, ops = fresh_args(combo.recipe, 16, 16, 16, (), scalar=1.0)
    assert cpu_kernel(combo).prepare(a, b, **{**ops, "alpha": 10**400}).params is not None


def test_bounded_caches_survive_a_concurrent_change():
    """Threads may share a kernel's caches: a change by another thread between finding the oldest
    entry and dropping it skips that eviction instead of raising."""
    from gemmgen.runtime.base import put_bounded

    class Racing(dict):
        def __iter__(self):
            it = super().__iter__()
            self[f"other thread {len(self)}"] = 0  # lands between iter() and next()
            return it

    cache = Racing((i, i) for i in range(4))
    put_bounded(cache, "mine", 1, limit=4)
    assert cache["mine"] == 1
    plain = {i: i for i in range(4)}
    put_bounded(plain, "mine", 1, limit=4)
    assert list(plain) == [1, 2, 3, "mine"]

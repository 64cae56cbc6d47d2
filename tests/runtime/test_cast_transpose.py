"""The cast-transpose kernel (gemmgen/include/gemmgen/cast_transpose.hpp): its generated source built
for the host with g++ and run thread by thread, step by step, on CPU tensors through the very
Params bytes a GPU launch passes (`runtime.cast_transpose.pack_params`), bit for bit against a
quantizer this file writes from the recipe's definition; its NVRTC binaries for both arches; its
cache entry's check; the launcher's refusals."""

from __future__ import annotations

import ctypes
import functools
import math
import shutil
import subprocess
import threading
import warnings

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen.quantize import AmaxSpec, CastTransposeSpec, render_cast_transpose
from gemmgen.compile.toolchain import gemmgen_include_dir, toolchain
from gemmgen.config import Arch
from gemmgen.errors import ConfigError, InvalidArgument
from gemmgen.runtime.cast_transpose import CastTranspose, CastTransposed, TensorAmax, allocate, grid, pack_params

SPECS = [CastTransposeSpec(), CastTransposeSpec(gg.f16, gg.e5m2), CastTransposeSpec(power_of_two=True)]
TENSOR_SPECS = [CastTransposeSpec(per_tensor=True), CastTransposeSpec(gg.bf16, gg.e5m2, per_tensor=True),
                CastTransposeSpec(gg.f16, gg.e5m2, per_tensor=True)]
AMAX_SPECS = [AmaxSpec(), AmaxSpec(gg.f16)]
SHAPES = [(1, 8), (1, 128), (3, 136), (129, 264), (128, 128), (300, 16), (257, 392)]


def _by_definition(x: torch.Tensor, target: gg.DType, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R x C) per 1 x 128 block of each row, from the definition: a block's scale is its largest
    magnitude (NaN if it holds one) over the fp8 type's largest value, 1 where that max is not
    above 0; with `power_of_two` the least power of two not below it (1 for an infinite one, as
    torch.frexp's exponent of infinity is 0); each value over its scale, saturated, in fp8."""
    qmax = {gg.e4m3: 448.0, gg.e5m2: 57344.0}[target]
    rows, columns = x.shape
    q = torch.empty(rows, columns, dtype=target.torch)
    scales = torch.empty(rows, -(-columns // 128))
    for b, start in enumerate(range(0, columns, 128)):
        block = x[:, start:start + 128].float()
        for r in range(rows):
            amax = float(block[r].abs().max())  # NaN where the block holds one
            scale = amax / qmax if amax > 0 else 1.0
            scale = float(torch.tensor(scale, dtype=torch.float32))  # the kernel divides in fp32
            if power_of_two:
                scale = 1.0 if math.isinf(scale) else 2.0 ** math.ceil(math.log2(scale))
            scales[r, b] = scale
            q[r, start:start + 128] = (block[r] / torch.tensor(scale, dtype=torch.float32)).clamp(-qmax, qmax) \
                .to(target.torch)
    return q, scales


def _four(out: CastTransposed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert out.q is not None and out.scale is not None and out.q_t is not None and out.scale_t is not None
    return out.q, out.scale, out.q_t, out.scale_t


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per value, the same fp8 bits, or both NaN (x86's inf / inf is the NaN with the sign bit set,
    a GPU's without it: either sign is the one NaN the formats have)."""
    return (got.view(torch.uint8) == want.view(torch.uint8)) | (got.float().isnan() & want.float().isnan())


def _drawn(rows: int, columns: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal values spread over many binades, with a block of zeros, a NaN, an infinity, -0,
    subnormals and the type's largest values where the shape has room."""
    x = torch.randn(rows, columns, generator=gen) * torch.exp2(torch.randint(-20, 12, (rows, 1), generator=gen))
    x = x.to(dtype)
    tiny, big = torch.finfo(dtype).smallest_normal / 4, torch.finfo(dtype).max
    for r, c, v in ((0, 0, -0.0), (0, columns - 1, tiny), (rows // 2, columns // 2, big), (rows - 1, 0, -big)):
        x[r, c] = v
    if rows > 2 and columns > 8:
        x[1, :8] = 0.0
        x[2, 3] = float("nan")
        x[rows - 1, columns - 1] = float("inf")
    return x


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """Each spec's generated source built for the host as a shared library: spec -> its entry."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the kernel's source for the host")
    root = tmp_path_factory.mktemp("cast_transpose")
    include = [f"-I{d}" for d in (gemmgen_include_dir(), *toolchain().include_dirs)]
    entries = {}
    specs: list[CastTransposeSpec | AmaxSpec] = [*SPECS, *TENSOR_SPECS, *AMAX_SPECS]
    builds = []
    for i, spec in enumerate(specs):  # g++ processes side by side: a few seconds each
        kernel = render_cast_transpose(spec)
        source, lib = root / f"k{i}.cpp", root / f"k{i}.so"
        source.write_text(kernel.source)
        builds.append((spec, kernel.entry, lib, subprocess.Popen(
            ["g++", "-std=c++17", "-O2", "-w", "-shared", "-fPIC", *include, "-o", str(lib), str(source)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    for spec, entry, lib, build in builds:
        log, _ = build.communicate()
        assert build.returncode == 0, log.decode()
        fn = getattr(ctypes.CDLL(str(lib)), entry)
        fn.argtypes, fn.restype = [ctypes.c_char_p], None
        entries[spec] = fn
    return entries


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_kernel_on_the_host_is_the_quantizer_by_definition(host_kernels, spec):
    """Both copies and both scale tensors, bit for bit, over odd shapes (1 row; partial tiles of
    rows and of columns) and special values, into outputs pre-filled with NaN; the scales in either
    layout. Made to fail once each: the transposed copy's column read as its row (the copies
    differ), the scale's block index as the tile's row (a wrong scale)."""
    gen = torch.Generator().manual_seed(hash(spec.name) % 2**31)
    for rows, columns in SHAPES:
        x = _drawn(rows, columns, spec.source.torch, gen)
        for layouts in ((gg.RowMajor, gg.RowMajor), (gg.ColMajor, gg.ColMajor)):
            out = allocate(x, spec, scale_layout=layouts[0], scale_t_layout=layouts[1])
            q, scale, q_t, scale_t = _four(out)
            for t in (q, q_t):
                t.view(torch.uint8).fill_(0x7F)  # NaN in both fp8 types
            for t in (scale, scale_t):
                t.fill_(float("nan"))
            host_kernels[spec](pack_params(x, out))
            where = f"{spec.name} {rows}x{columns} scales {layouts[0].value}"
            for got_q, got_scale, t in ((q, scale, x), (q_t, scale_t, x.t())):
                want_q, want_scale = _by_definition(t, spec.target, spec.power_of_two)
                assert torch.equal(got_scale, want_scale), where
                differ = int((~_same_bits(got_q, want_q)).sum())
                assert differ == 0, f"{where}: {differ} values differ"


def test_the_host_build_skips_a_copy_whose_pointer_is_null(host_kernels):
    """rows=False or columns=False: the other copy alone, the same bits."""
    spec = SPECS[0]
    x = _drawn(130, 136, torch.bfloat16, torch.Generator().manual_seed(3))
    full = allocate(x, spec)
    host_kernels[spec](pack_params(x, full))
    for rows, columns in ((True, False), (False, True)):
        out = allocate(x, spec, rows=rows, columns=columns)
        assert (out.q is None) is not rows and (out.q_t is None) is not columns
        host_kernels[spec](pack_params(x, out))
        got, want = (out.q, full.q) if rows else (out.q_t, full.q_t)
        assert got is not None and want is not None and _same_bits(got, want).all()


def test_the_cpu_path_is_the_kernels_bits(host_kernels):
    """CastTranspose on a CPU tensor (the torch quantizer) gives what the kernel's host build gives."""
    spec = SPECS[2]
    x = _drawn(129, 264, torch.bfloat16, torch.Generator().manual_seed(4))
    kernel_out = allocate(x, spec)
    host_kernels[spec](pack_params(x, kernel_out))
    got, want = _four(CastTranspose(spec)(x)), _four(kernel_out)
    assert _same_bits(got[0], want[0]).all() and _same_bits(got[2], want[2]).all()
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])


def test_outputs_are_laid_out_for_the_gemms_and_the_grid_covers_x():
    """16-byte rows for both copies (TMA), the scales' contiguous extent a multiple of 4, one CTA
    per 128 x 128 tile; the Params bytes are 6 pointers and 9 int64 in the header's order."""
    x = torch.zeros(300, 136, dtype=torch.bfloat16)
    out = allocate(x, SPECS[0], scale_layout=gg.ColMajor)
    q, scale, q_t, scale_t = _four(out)
    assert q.shape == (300, 136) and q.stride() == (144, 1)
    assert q_t.shape == (136, 300) and q_t.stride() == (304, 1)
    assert scale.shape == (300, 2) and scale.stride() == (1, 300)
    assert scale_t.shape == (136, 3) and scale_t.stride() == (4, 1)
    assert grid(x) == (2, 3, 1)
    params = pack_params(x, out)
    assert len(params) == 15 * 8
    assert params[6 * 8:8 * 8] == (300).to_bytes(8, "little") + (136).to_bytes(8, "little")


def test_bad_inputs_are_refused_by_name():
    """A wrong dtype, a column count TMA cannot read, a strided view, a spec the kernel has no form
    for: each a gemmgen error naming the argument and the fix."""
    ct = CastTranspose(SPECS[0])
    with pytest.raises(InvalidArgument, match=r"x: expected torch.bfloat16 .* x.to\(torch.bfloat16\)"):
        ct(torch.zeros(4, 8))
    with pytest.raises(InvalidArgument, match=r"x: expected its columns a multiple of 8 .* pad them to 16"):
        ct(torch.zeros(4, 12, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match=r"pass x.contiguous\(\)"):
        ct(torch.zeros(16, 4, dtype=torch.bfloat16).t())
    with pytest.raises(InvalidArgument, match=r"2-D"):
        ct(torch.zeros(2, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match=r"source: expected gg.bf16 or gg.f16"):
        CastTransposeSpec(gg.f32)
    with pytest.raises(ConfigError, match=r"target: expected gg.e4m3 or gg.e5m2"):
        CastTransposeSpec(target=gg.bf16)


@pytest.mark.nvrtc
@pytest.mark.parametrize("spec", [CastTransposeSpec(), CastTransposeSpec(per_tensor=True), AmaxSpec()],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("arch", [Arch.SM90A, Arch.SM100A], ids=lambda a: a.value)
def test_the_kernel_compiles_with_its_markers_and_no_local_memory(arch, spec, tmp_path):
    """NVRTC builds each arch's binary through the cache in seconds; the binary check passes
    (16-byte loads, and stores and fp8 conversions or the atomic max, the barriers, 0 local and
    stack bytes), and a record without the 16-byte loads, or with spills, fails it."""
    import dataclasses

    from gemmgen.compile import KernelCache
    from gemmgen.compile.quantize import build_quantize_kernel, quantize_kernel_problem

    kernel = render_cast_transpose(dataclasses.replace(spec, arch=arch))
    cache = KernelCache(tmp_path)
    built = build_quantize_kernel(kernel, cache)
    assert built.origin == "compiled" and built.meta["local_bytes"] == 0 and built.meta["stack_bytes"] == 0
    assert built.meta["compile_seconds"] < 20 and built.meta["registers"] <= 64
    again = build_quantize_kernel(kernel, cache)
    assert again.origin == "cache" and again.cubin == built.cubin
    files = {"kernel.cubin": built.cubin, "kernel.cu": kernel.source.encode()}
    assert quantize_kernel_problem(files, built.meta, kernel) is None
    no_loads = {**built.meta, "sass": {**built.meta["sass"], "LDG.E.128": 0}}
    assert "no LDG.E.128 instruction" in str(quantize_kernel_problem(files, no_loads, kernel))
    assert "local memory" in str(quantize_kernel_problem(files, {**built.meta, "local_bytes": 64}, kernel))


@pytest.mark.parametrize("precision", [gg.training.Float8Blockwise(), gg.training.Float8Tensorwise(),
                                       gg.training.Float8Blockwise(power_of_two_scales=True)], ids=repr)
def test_each_copy_is_the_operand_its_gemm_reads(host_kernels, precision):
    """`Precision.operands` through the kernels' host builds, for each pair a layer asks for (X:
    fprop A and wgrad B; dY: dgrad A and wgrad A): each Operand holds the values `operand` gives
    (bits and scales) in the memory order its GEMM reads (the same contiguous dimension, 16-byte
    strides for TMA), so no realigning copy is made. Made to fail once: Float8Blockwise's
    transposed copy's scales made in the layout the GEMM reads (B's are made transposed, then
    viewed back)."""
    from unittest import mock

    from gemmgen.nn.low_precision import linear_gemms
    from gemmgen.training import Gemm, tensorwise
    from gemmgen.training import precision as blockwise

    gemms = linear_gemms(precision, None, False, torch.bfloat16)
    recipes = {Gemm.FPROP: gemms.fprop.recipe, Gemm.DGRAD: gemms.dgrad.recipe, Gemm.WGRAD: gemms.wgrad.recipe}
    on_host = _host_cast_transpose(host_kernels, [])

    def read_order(t: torch.Tensor) -> int:  # the contiguous dimension
        return 1 if t.stride(1) == 1 else 0

    t = _drawn(130, 256, torch.bfloat16, torch.Generator().manual_seed(5))
    t[2, 3] = 1.0  # no NaN: per tensor, one would make every value NaN
    for rows, columns in (((Gemm.FPROP, "a"), (Gemm.WGRAD, "b")), ((Gemm.DGRAD, "a"), (Gemm.WGRAD, "a"))):
        want = (precision.operand(t, *rows, recipes[rows[0]]), precision.operand(t.t(), *columns, recipes[columns[0]]))
        with mock.patch.object(blockwise, "cast_transposable", lambda t: True), \
                mock.patch.object(blockwise, "cast_transpose", on_host), \
                mock.patch.object(tensorwise, "cast_transposable", lambda t: True), \
                mock.patch.object(tensorwise, "cast_transpose", on_host), \
                mock.patch.object(tensorwise, "tensor_amax", lambda t: _host_amax(host_kernels, t)):
            got = precision.operands(t, (*rows, recipes[rows[0]]), (*columns, recipes[columns[0]]))
        for g, w in zip(got, want, strict=True):
            assert _same_bits(g.data, w.data).all() and torch.equal(g.scale, w.scale)
            assert g.data.stride(1 - read_order(g.data)) % 16 == 0 and read_order(g.data) == read_order(w.data)
            if g.scale.dim() == 2:
                assert g.scale.stride(1 - read_order(g.scale)) % 4 == 0 and read_order(g.scale) == read_order(w.scale)


def _fresh_kernels(monkeypatch, tmp_path):
    """`cast_transpose`'s kernels built through an empty cache, its per-process state forgotten."""
    from gemmgen.compile import KernelCache
    from gemmgen.runtime import cast_transpose as module

    cache = KernelCache(tmp_path / "cache")
    monkeypatch.setattr(module, "_kernel", functools.cache(
        lambda spec: (TensorAmax if isinstance(spec, AmaxSpec) else CastTranspose)(spec, cache)))
    monkeypatch.setattr(module, "_PENDING", set())
    monkeypatch.setattr(module, "_MISSING", set())
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", "")
    return module


def test_a_kernel_gemmgen_jit_0_cannot_load_leaves_the_copies_to_torch(monkeypatch, tmp_path):
    """GEMMGEN_JIT=0 and the kernel in no bundle or cache: `cast_transpose` says so once (how to ship
    it) and returns None, and Float8Blockwise.operands quantizes with torch: the same operands."""
    module = _fresh_kernels(monkeypatch, tmp_path)
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    x = torch.randn(64, 128).bfloat16()
    with pytest.warns(gg.GemmgenWarning, match=r"cast_transpose_bf16_e4m3 kernel .* GEMMGEN_JIT=0 forbids"):
        assert module.cast_transpose(x, gg.e4m3) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert module.cast_transpose(x, gg.e4m3) is None


@pytest.mark.nvrtc
def test_under_gemmgen_jit_async_the_kernel_compiles_in_the_background(monkeypatch, tmp_path):
    """GEMMGEN_JIT=async: the first call finds no kernel and returns None at once (torch quantizes
    meanwhile) while a thread compiles it; once it is built, calls use it."""
    module = _fresh_kernels(monkeypatch, tmp_path)
    monkeypatch.setenv("GEMMGEN_JIT", "async")
    x = torch.randn(64, 128).bfloat16()
    assert module.cast_transpose(x, gg.e4m3) is None
    (thread,) = [t for t in threading.enumerate() if t.name == "gemmgen-cast_transpose_bf16_e4m3"]
    thread.join(timeout=120)
    out = module.cast_transpose(x, gg.e4m3)
    assert out is not None and module._kernel(CastTransposeSpec())._compiled.origin == "compiled"


@pytest.mark.nvrtc
def test_a_bundle_ships_the_kernel(monkeypatch, tmp_path):
    """`write_bundle(..., quantize_kernels=...)` ships a built kernel; a process with
    GEMMGEN_JIT=0, an empty cache and the bundle on GEMMGEN_BUNDLE_PATH loads it from there, the
    same cubin, and a damaged copy is not served (refused and reported, then KernelNotAvailable)."""
    from gemmgen.aot import write_bundle
    from gemmgen.compile import KernelCache
    from gemmgen.compile.quantize import build_quantize_kernel
    from gemmgen.errors import KernelNotAvailable

    kernel = render_cast_transpose(CastTransposeSpec())
    cache = KernelCache(tmp_path / "cache")
    built = build_quantize_kernel(kernel, cache)
    bundle = write_bundle([], tmp_path / "bundle", cache, quantize_kernels=[built])
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(bundle))
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    loaded = build_quantize_kernel(kernel, KernelCache(tmp_path / "empty"))
    assert loaded.origin == "bundle" and loaded.cubin == built.cubin
    (cubin,) = bundle.rglob("kernel.cubin")
    cubin.write_bytes(cubin.read_bytes()[:-64])  # truncated
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(bundle) + "/")  # a new setting: the bundle read again
    with pytest.warns(gg.GemmgenWarning, match="does not match its recorded digest"), \
            pytest.raises(KernelNotAvailable, match="GEMMGEN_JIT=0 forbids compiling it"):
        build_quantize_kernel(kernel, KernelCache(tmp_path / "empty"))


def _host_amax(host_kernels, x: torch.Tensor) -> torch.Tensor:
    amax = torch.zeros(1)
    host_kernels[AmaxSpec(gg.bf16 if x.dtype == torch.bfloat16 else gg.f16)](pack_params(x, amax=amax))
    return amax


@pytest.mark.parametrize("spec", TENSOR_SPECS, ids=lambda s: s.name)
def test_the_per_tensor_kernels_on_the_host_are_current_scaling_by_definition(host_kernels, spec):
    """The amax kernel's max |x| is torch's (NaN where X holds one, -0 and subnormals counted, over
    several CTAs' atomics); the per-tensor cast over it writes both copies as x / (amax / fp8 max),
    saturated (scale 1 for a zero amax), and the scale once, bit for bit, for odd shapes. Made to
    fail once each: the amax's sign bit kept (a negative value's bits win), the transposed copy's
    scale left unset in shared memory."""
    qmax = {gg.e4m3: 448.0, gg.e5m2: 57344.0}[spec.target]
    gen = torch.Generator().manual_seed(11)
    for rows, columns in [*SHAPES, (64, 8)]:
        x = _drawn(rows, columns, spec.source.torch, gen)
        if (rows, columns) == (64, 8):
            x.zero_()
        elif rows > 2 and columns > 8:
            x[2, 3] = 1.0  # not NaN: the scale's own path; a NaN-holding X below
        amax = _host_amax(host_kernels, x)
        want_amax = x.float().abs().amax().reshape(1)
        assert torch.equal(amax, want_amax), (spec.name, rows, columns)
        out = allocate(x, spec)
        q, scale, q_t, scale_t = _four(out)
        scale.fill_(float("nan"))
        host_kernels[spec](pack_params(x, out, amax))
        want_scale = torch.tensor([float(amax) / qmax if float(amax) > 0 else 1.0], dtype=torch.float32)
        assert scale is scale_t and torch.equal(scale, want_scale), (spec.name, rows, columns)
        for got, t in ((q, x), (q_t, x.t())):
            want = (t.float() / want_scale).clamp(-qmax, qmax).to(spec.target.torch)
            assert _same_bits(got, want).all(), (spec.name, rows, columns)
    x = _drawn(130, 136, spec.source.torch, gen)
    assert _host_amax(host_kernels, x).isnan().all()  # _drawn puts a NaN at (2, 3)


def _host_cast_transpose(host_kernels, launched: list):
    """`runtime.cast_transpose.cast_transpose` as the kernels' host builds run it (CPU tensors)."""
    def call(x, target, power_of_two=False, rows=True, columns=True, scale_layout=gg.RowMajor,
             scale_t_layout=gg.RowMajor, amax=None):
        source = gg.bf16 if x.dtype == torch.bfloat16 else gg.f16
        spec = CastTransposeSpec(source, target, power_of_two, per_tensor=amax is not None)
        out = allocate(x, spec, rows, columns, scale_layout, scale_t_layout)
        host_kernels[spec](pack_params(x, out, None if amax is None else amax.reshape(1).contiguous()))
        launched.append((spec.name, tuple(x.shape)))
        return out
    return call


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("precision", ["Float8Blockwise", "Float8Tensorwise"])
def test_a_float8_step_through_the_kernels_is_the_torch_quantizers_step(host_kernels, precision, activation):
    """A FusedMLP's step whose X and dY copies (and a gated MLP's h and dL/dacc1) come from the
    kernels' host builds, as the GPU path launches them (`Precision.operands`: both copies from one
    pass, the scales written in the layouts the GEMMs read), equals the step whose torch ops
    quantize: output and every gradient, bit for bit. Float8Blockwise: the cast-transpose kernel;
    current scaling: the amax kernel and the per-tensor cast, which also quantizes a GELU MLP's h
    and dL/dacc1 over their epilogues' amax. Made to fail once each: the rows copy's scales handed
    over with the transposed copy's values (Float8Blockwise), the transposed copy handed to wgrad
    as the rows copy (Float8Tensorwise)."""
    from unittest import mock

    from gemmgen.training import precision as blockwise
    from gemmgen.training import tensorwise

    launched: list = []
    torch.manual_seed(0)
    gated = activation == "swiglu"
    mlp = gg.nn.FusedMLP(128, 256, 144, activation, bias=not gated, precision=getattr(gg.training, precision)())
    x, g = torch.randn(130, 128).bfloat16(), torch.randn(130, 144).bfloat16()

    def step():
        mlp.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = mlp(xg)
        y.backward(g)
        return [y, xg.grad, *(p.grad for p in mlp.parameters())]

    want = step()
    on_host = _host_cast_transpose(host_kernels, launched)
    with mock.patch.object(blockwise, "cast_transposable", lambda t: t.dim() == 2), \
            mock.patch.object(blockwise, "cast_transpose", on_host), \
            mock.patch.object(tensorwise, "cast_transposable", lambda t: t.dim() == 2), \
            mock.patch.object(tensorwise, "cast_transpose", on_host), \
            mock.patch.object(tensorwise, "tensor_amax", lambda t: _host_amax(host_kernels, t)):
        got = step()
    # X, h, dY, dL/dacc1; a GELU MLP's Float8Blockwise kernels write h and dL/dacc1 quantized themselves
    shapes = [(130, 128), (130, 256), (130, 144), (130, 512 if gated else 256)]
    if precision == "Float8Blockwise":
        assert launched == [("cast_transpose_bf16_e4m3", s) for s in (shapes if gated else shapes[::2])]
    else:
        assert launched == [(f"cast_transpose_tensor_bf16_{t}", s) for t, s in zip(("e4m3", "e4m3", "e5m2", "e5m2"),
                                                                                       shapes, strict=True)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_models_quantize_kernels_are_listed_by_its_precisions():
    """`gemmgen.nn.model_quantize_specs`: each low-precision layer's kernels once, by its precision
    (Float8Blockwise: its cast-transpose; current scaling: the amax and both per-tensor casts;
    delayed scaling and bf16: none), in f16 for a layer computing in f16, for the arch asked."""
    blockwise, current = gg.training.Float8Blockwise(), gg.training.Float8Tensorwise()
    model = torch.nn.Sequential(gg.nn.FusedMLP(128, 256, 128, "gelu", precision=blockwise),
                                gg.nn.FusedLinear(128, 128, precision=blockwise),
                                gg.nn.FusedLinear(128, 128, precision=current).half(),
                                gg.nn.FusedLinear(128, 128, precision=gg.training.Float8Tensorwise(scaling="delayed")),
                                gg.nn.FusedLinear(128, 128))
    assert gg.nn.model_quantize_specs(model, arch="sm_100a") == [
        CastTransposeSpec(gg.bf16, gg.e4m3, arch=Arch.SM100A), AmaxSpec(gg.f16, Arch.SM100A),
        CastTransposeSpec(gg.f16, gg.e4m3, arch=Arch.SM100A, per_tensor=True),
        CastTransposeSpec(gg.f16, gg.e5m2, arch=Arch.SM100A, per_tensor=True)]
    pow2 = gg.nn.FusedLinear(128, 128, precision=gg.training.Float8Blockwise(power_of_two_scales=True))
    assert gg.nn.model_quantize_specs(pow2) == [CastTransposeSpec(power_of_two=True)]
    with pytest.raises(InvalidArgument, match=r"model: expected a torch\.nn\.Module"):
        gg.nn.model_quantize_specs("model")  # type: ignore[arg-type]


@pytest.mark.nvrtc
def test_build_bundle_ships_a_models_quantize_kernels_and_warmup_loads_them(monkeypatch, tmp_path):
    """`build_bundle(..., quantize=model_quantize_specs(model))` ships the kernels for each arch;
    under GEMMGEN_JIT=0 `warmup(..., quantize=)` loads them from it, and without it names what is
    missing (KernelNotAvailable) instead of compiling."""
    from gemmgen.compile import KernelCache
    from gemmgen.errors import KernelNotAvailable

    model = gg.nn.FusedLinear(128, 128, precision=gg.training.Float8Blockwise())
    specs = gg.nn.model_quantize_specs(model)
    out = tmp_path / "bundle"
    gg.build_bundle([], out, cache=KernelCache(tmp_path / "cache"), quiet=True, arches=("sm_90a", "sm_100a"),
                    quantize=specs)
    manifest = (out / "manifest.json").read_text()
    assert manifest.count('"kind": "quantize"') == 2 and '"arches": [\n  "sm_100a",\n  "sm_90a"\n ]' in manifest
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", "")
    with pytest.raises(KernelNotAvailable, match="cast_transpose_bf16_e4m3 kernel for sm_90a is in no bundle"):
        gg.warmup([], quiet=True, arch="sm_90a", cache=KernelCache(tmp_path / "empty"), quantize=specs)
    monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(out))
    gg.warmup([], quiet=True, arch="sm_90a", cache=KernelCache(tmp_path / "empty"), quantize=specs)

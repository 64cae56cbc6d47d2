"""Real launches on an sm_90 GPU (marker `gpu`; skipped with a reason elsewhere).

For every example recipe under both schedules and as a swapped kernel (D^T = B^T A^T): an exact
tier (small integers, so fp32 accumulation is exact), a random tier (fresh inputs, tolerance by
output dtype), odd sizes with K tails, a batch, padded leading dimensions, NaN-prefilled outputs,
run-to-run bitwise determinism, CUDA-graph capture and replay, and launches on the caller's stream;
the fp8 example also against torch._scaled_mm.
Modules: the fused MLP forward and backward, torch.compile (inductor: inference, a training step,
CUDA graph trees), manual graph capture, autocast training, the op's layout copies, the direct
path, autotune, and calls from a thread without a current context.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import gemmgen as gg
from gemmgen.testing.calls import TOLERANCE
from tests.data.gpu_matrix import ROOT, gpu_matrix, load_recipes
from tests.gpu.common import as_tuple, check_kernels, compare, inputs, nan_outputs

pytestmark = pytest.mark.gpu

SHAPES = [(128, 256, 64), (1, 8, 16), (7, 129, 1000), (129, 1000, 4097), (1000, 7, 129)]


@pytest.fixture(scope="session")
def kernels():
    """The example recipes under both schedules (the FusedLinear recipes are tested through modules)."""
    return [(recipe, config, recipe.compile(config)) for recipe, config in gpu_matrix()
            if not recipe.name.startswith("linear_") and not recipe.ir.gemm.grouped]  # grouped: test_grouped_gpu.py


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "random"])
def test_matches_reference(kernels, gen, shape, exact):
    m, n, k = shape
    check_kernels(kernels, gen, m, n, k, exact)


def test_padded_leading_dims_and_batch(kernels, gen):
    check_kernels(kernels, gen, 200, 136, 72, exact=False, pad_bytes=48, prefilled=False)


@pytest.mark.parametrize("shape", [(33, 1, 40), (1, 1, 16)], ids=lambda s: "x".join(map(str, s)))
def test_one_output_column_in_fresh_outputs(kernels, gen, shape):
    """N = 1: the outputs gemmgen allocates have rows padded to 16 bytes, or TMA cannot store them."""
    m, n, k = shape
    for recipe, _config, kernel in kernels:
        for _ in range(20):  # a 1 x 1 GELU of a value below about -5.9 is exactly 0: draw again
            a, b, ops = inputs(recipe, m, n, k, gen, exact=False)
            if all(w.abs().max() > 0 for w in as_tuple(recipe.reference(a, b, **ops))):
                break
        got = as_tuple(kernel(a, b, **ops))
        torch.cuda.synchronize()
        compare(recipe, got, a, b, ops, exact=False)


def test_bitwise_deterministic_and_graph_replay(kernels, gen):
    for recipe, _config, kernel in kernels:
        a, b, ops = inputs(recipe, 300, 264, 520, gen, exact=False)
        first = [t.clone() for t in as_tuple(kernel(a, b, **ops))]
        second = as_tuple(kernel(a, b, **ops))
        for x, y in zip(first, second, strict=True):
            assert torch.equal(x, y), f"{recipe.name}: two runs differ"
        outs = nan_outputs(recipe, 300, 264)
        out_arg = outs if len(outs) > 1 else outs[0]
        kernel(a, b, out=out_arg, **ops)  # warm the host path outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernel(a, b, out=out_arg, **ops)
        for t in outs:
            t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(first, outs, strict=True):
            assert torch.equal(x, y), f"{recipe.name}: graph replay differs from eager"


def test_first_call_inside_graph_capture(kernels, gen):
    """A kernel's very first call (module not loaded yet, no host plan) inside CUDA graph capture:
    loading runs in relaxed capture mode, and the replay computes what an eager call does."""
    from gemmgen.runtime import driver

    recipe, config, warm = kernels[0]
    a, b, ops = inputs(recipe, 200, 136, 72, gen, exact=False)
    want = [t.clone() for t in as_tuple(warm(a, b, **ops))]
    for key in [k for k in driver._LOADED if k[0] == warm.compiled.entry]:
        del driver._LOADED[key]  # the module handle leaks: a test-only way to make the next load a first one
    cold = recipe.compile(config)
    outs = nan_outputs(recipe, 200, 136)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cold(a, b, out=outs if len(outs) > 1 else outs[0], **ops)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(want, outs, strict=True):
        assert torch.equal(x, y), f"{recipe.name}: replay of a graph captured on a first call differs"


def test_launches_on_the_current_stream(kernels, gen):
    """Work queued on the caller's (side) stream before a call is seen by the kernel: A is written
    there after a long sleep, so a launch on any other stream would read the NaNs it held before.
    Operands go positionally here, as the op passes them."""
    side = torch.cuda.Stream()
    for recipe, _config, kernel in kernels:
        a, b, ops = inputs(recipe, 130, 72, 200, gen, exact=True)
        late = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).fill_(math.nan)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            late.copy_(a)
            got = as_tuple(kernel(late, b, *ops.values()))
        torch.cuda.synchronize()
        compare(recipe, got, a, b, ops, exact=True)


def test_calls_from_a_thread_without_a_context(kernels, gen):
    """A worker thread that has made no CUDA call has no current context; a kernel loaded on the
    main thread and called on the worker with the main thread's tensors binds the device's
    primary context itself (its maps and launch would fail with CUDA_ERROR_INVALID_CONTEXT
    otherwise)."""
    from concurrent.futures import ThreadPoolExecutor

    from cuda.bindings import driver as cu

    def on_worker(kernel, a, b, ops, outs):
        err, ctx = cu.cuCtxGetCurrent()
        assert err == cu.CUresult.CUDA_SUCCESS and int(ctx) == 0, "the worker thread began with a context"
        got = as_tuple(kernel(a, b, out=outs if len(outs) > 1 else outs[0], **ops))
        torch.cuda.synchronize()
        return got

    for recipe, _config, kernel in kernels:
        a, b, ops = inputs(recipe, 130, 72, 200, gen, exact=True)
        kernel(a, b, **ops)  # loaded, and planned for these arguments, on the main thread
        outs = nan_outputs(recipe, 130, 72)
        with ThreadPoolExecutor(1) as pool:  # a new thread per kernel
            got = pool.submit(on_worker, kernel, a, b, ops, outs).result()
        compare(recipe, got, a, b, ops, exact=True)


@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (16, 4096, 4096), (256, 1024, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_matches_torch_scaled_mm(kernels, gen, shape):
    """The fp8 example against cuBLASLt's fp8 GEMM through torch._scaled_mm with the same rowwise
    scales: an implementation gemmgen shares nothing with (same inputs, bf16 outputs; sizes that
    cuBLASLt's fp8 GEMM takes, multiples of 16)."""
    m, n, k = shape
    fp8 = [(config, kernel) for recipe, config, kernel in kernels if recipe.name == "scaled_mm_fp8"]
    assert fp8, "the fp8 example is missing from the GPU matrix"
    a = torch.randn(m, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn).t()
    scale_a = torch.rand(m, device="cuda", generator=gen) + 0.5
    scale_b = torch.rand(n, device="cuda", generator=gen) + 0.5
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    try:
        theirs = torch._scaled_mm(a, b, scale_a[:, None], scale_b[None, :], bias=bias, out_dtype=torch.bfloat16)
    except RuntimeError:  # torch builds that take rowwise scales only without a bias
        theirs = (torch._scaled_mm(a, b, scale_a[:, None], scale_b[None, :], out_dtype=torch.float32)
                  + bias.float()).bfloat16()
    assert theirs.float().abs().max() > 0
    for config, kernel in fp8:
        ours = kernel(a, b, scale_a, scale_b, bias)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1.6e-2,
                                   atol=1.6e-2 * float(theirs.float().abs().max()),
                                   msg=lambda s: f"scaled_mm_fp8 {config.name}: {s}")  # noqa: B023


def test_fp8_outputs_saturate(kernels, gen):
    """fp8 D saturates at e4m3's largest finite value (448), as PTX cvt.rn.satfinite does; the amax
    is of the fp32 values before that rounding."""
    recipe, _config, kernel = next(x for x in kernels if x[0].name == "fp8_out_e4m3")
    a = torch.randn(300, 256, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(200, 256, device="cuda", generator=gen).to(torch.float8_e4m3fn).t()
    d, amax = kernel(a, b, scale=40.0)  # |acc| of a few tens: many values past 448
    want_d, want_amax = recipe.reference(a, b, scale=40.0)
    assert float(want_amax) > 448 and (want_d.float().abs() == 448).any()
    got = d.float().cpu()
    assert not got.isnan().any() and got.abs().max() == 448
    torch.testing.assert_close(got, want_d.float(), rtol=2**-3, atol=2**-9)
    torch.testing.assert_close(amax.cpu(), want_amax, rtol=1e-5, atol=0)


def test_stream_k_decompositions(kernels, gen):
    """The stream-K kernel under the decompositions its scheduler picks on this GPU (data-parallel,
    split-K, stream-K) against the reference, outputs pre-filled with NaN, and run again bitwise
    equal (split tiles' partial sums are reduced in a fixed order)."""
    from gemmgen.runtime.scheduler import decompose

    recipe, config, kernel = next(x for x in kernels if x[0].name == "stream_k")
    sm_count, clusters = kernel._hardware(torch.cuda.current_device())
    kinds = []
    for m, n, k in ((1000, 2048, 128), (256, 256, 8192), (129, 1000, 4097), (7, 129, 1000), (200, 100, 40000)):
        kinds.append(decompose(m, n, -(-k // config.tile[2]), 3, config.tile, config.cluster, sm_count,
                               clusters).kind)
        a, b, ops = inputs(recipe, m, n, k, gen, exact=False)
        first = as_tuple(kernel(a, b, out=nan_outputs(recipe, m, n), **ops))
        again = as_tuple(kernel(a, b, **ops))
        torch.cuda.synchronize()
        compare(recipe, first, a, b, ops, exact=False)
        assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True)), (m, n, k, kinds[-1])
    assert {"data-parallel", "split-K", "stream-K"} <= set(kinds), kinds


def test_stream_k_split_counts(kernels, gen):
    """The same binary launched with split counts (KernelConfig.splits: CUTLASS's split-K with
    that many parts per tile, fewer where K has fewer tiles) against the reference, outputs
    pre-filled with NaN, and bitwise equal from run to run."""
    from dataclasses import replace

    recipe, config, _ = next(x for x in kernels if x[0].name == "stream_k")
    for splits in (2, 5, 64):
        kernel = recipe.compile(replace(config, splits=splits))  # from the bundle: the heuristic kernel's binary
        for m, n, k in ((7, 129, 1000), (256, 256, 8192), (300, 1000, 64)):
            a, b, ops = inputs(recipe, m, n, k, gen, exact=False)
            first = as_tuple(kernel(a, b, out=nan_outputs(recipe, m, n), **ops))
            again = as_tuple(kernel(a, b, **ops))
            torch.cuda.synchronize()
            compare(recipe, first, a, b, ops, exact=False)
            assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True)), (m, n, k, splits)


def test_stream_k_nondeterministic_reduction(kernels, gen):
    """`deterministic=False` (the same binary, CUTLASS's Nondeterministic reduction: split tiles' CTAs
    add their partial sums atomically, in the order they finish) under the heuristic's stream-K and
    split-K decompositions and a split count, against the reference, outputs pre-filled with NaN;
    refused under torch.use_deterministic_algorithms(True)."""
    from dataclasses import replace

    recipe, config, _ = next(x for x in kernels if x[0].name == "stream_k")
    for splits in (1, 5):
        kernel = recipe.compile(replace(config, splits=splits, deterministic=False))
        for m, n, k in ((256, 256, 8192), (129, 1000, 4097), (200, 100, 40000)):
            a, b, ops = inputs(recipe, m, n, k, gen, exact=False)
            got = as_tuple(kernel(a, b, out=nan_outputs(recipe, m, n), **ops))
            torch.cuda.synchronize()
            compare(recipe, got, a, b, ops, exact=False)
        mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            with pytest.raises(gg.NotDeterministic):
                kernel(a, b, **ops)
        finally:
            torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


def test_k_zero_and_empty(kernels):
    for recipe, _config, kernel in kernels:
        g = recipe.ir.gemm
        lead = (3,) if g.batched else ()
        a = torch.empty(*lead, 5, 0, dtype=g.a.torch, device="cuda")
        b = torch.empty(*lead, 0, 8, dtype=g.b.torch, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        _, _, ops = inputs(recipe, 5, 8, 0, gen, exact=True)
        got = as_tuple(kernel(a, b, **ops))
        want = as_tuple(recipe.reference(a, b, **ops))
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x.cpu(), y)


def test_fused_mlp_forward_backward_compile_and_graph(gen):
    import copy

    from torch import nn

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = nn.Sequential(nn.Linear(512, 1024, dtype=torch.bfloat16, device="cuda"), nn.SiLU(),
                        nn.Linear(1024, 264, dtype=torch.bfloat16, device="cuda"), nn.GELU(approximate="tanh"))
    fused, report = gg.nn.fuse(copy.deepcopy(ref))
    assert len(report) == 2
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    with torch.no_grad():  # a decode-sized batch: the runtime picks swapped kernels
        torch.testing.assert_close(fused(x[:8]).float(), ref(x[:8]).float(), rtol=3e-2, atol=3e-2)
    y_ref, y = ref(x), fused(x)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    g = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen)
    for a, b in zip(torch.autograd.grad(y, [x, *fused.parameters()], g),
                    torch.autograd.grad(y_ref, [x, *ref.parameters()], g), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * float(b.abs().max()))
    with torch.no_grad():
        eager = fused(x)
        compiled = torch.compile(fused, fullgraph=True)
        torch.testing.assert_close(compiled(x), eager)
        static_x = x.detach().clone()
        fused(static_x)  # warm the host path outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = fused(static_x)
        static_x.copy_(x.detach() * 0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, fused(static_x))


def test_compiled_training_step(gen):
    """torch.compile (inductor) of the fused MLP's forward and backward (the MLP test's shapes, so
    the same kernels): outputs and gradients match the unfused model's."""
    import copy

    from torch import nn

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = nn.Sequential(nn.Linear(512, 1024, dtype=torch.bfloat16, device="cuda"), nn.SiLU(),
                        nn.Linear(1024, 264, dtype=torch.bfloat16, device="cuda"), nn.GELU(approximate="tanh"))
    fused, _ = gg.nn.fuse(copy.deepcopy(ref))
    compiled = torch.compile(fused, fullgraph=True)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    y_ref, y = ref(x), compiled(x)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    g = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen)
    for a, b in zip(torch.autograd.grad(y, [x, *fused.parameters()], g),
                    torch.autograd.grad(y_ref, [x, *ref.parameters()], g), strict=True):
        assert b.abs().max() > 0
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * float(b.abs().max()))


def test_compiled_with_cuda_graph_trees(gen):
    """torch.compile(mode="reduce-overhead") of the fused MLP (the MLP test's shapes, so the same
    kernels): inductor records the gemmgen ops into its CUDA graphs without a skip (a skip raises
    here, and an output of a replay is overwritten by the next one), and the replays match the
    unfused model on fresh inputs."""
    import copy

    import torch._inductor.config as inductor_config
    from torch import nn

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = nn.Sequential(nn.Linear(512, 1024, dtype=torch.bfloat16, device="cuda"), nn.SiLU(),
                        nn.Linear(1024, 264, dtype=torch.bfloat16, device="cuda"), nn.GELU(approximate="tanh"))
    fused, _ = gg.nn.fuse(copy.deepcopy(ref))
    compiled = torch.compile(fused, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad(), inductor_config.patch({"triton.cudagraph_or_error": True}):
        for _ in range(4):  # warm-up, recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
            got = compiled(x).clone()
            want = ref(x)
            assert want.abs().max() > 0
            torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
        stale = compiled(x)  # lives in the graph's memory: the next replay overwrites it, and torch says so
        torch.compiler.cudagraph_mark_step_begin()
        compiled(x)
        with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
            stale.sum()


def test_autocast_training_with_fp32_master_weights(gen):
    """fuse(compute_dtype=bf16) of an fp32 MLP under autocast (the shapes of the MLP test above, so
    the same kernels): outputs and fp32 gradients match the unfused model under the same autocast."""
    import copy

    from torch import nn

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = nn.Sequential(nn.Linear(512, 1024, device="cuda"), nn.SiLU(), nn.Linear(1024, 264, device="cuda"),
                        nn.GELU(approximate="tanh"))
    fused, report = gg.nn.fuse(copy.deepcopy(ref), compute_dtype=torch.bfloat16)
    assert len(report) == 2 and all("cast per call" in line for line in report)
    x = torch.randn(300, 512, device="cuda", generator=gen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref, y = ref(x), fused(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    g = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen)
    for a, b in zip(torch.autograd.grad(y, list(fused.parameters()), g),
                    torch.autograd.grad(y_ref, list(ref.parameters()), g), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * float(b.abs().max()))


def test_the_op_copies_tensors_only_their_layout_keeps_from_tma(gen):
    """An unpadded odd-width residual, A sliced at an odd offset and a column-major B where the
    recipe declares it row-major (what torch.compile or a user may hand over): the op copies them
    into a TMA-readable layout and matches the reference."""
    from gemmgen.aot import load_recipes
    from gemmgen.integrations.ops import op
    from tests.data.gpu_matrix import LAYOUT_PROBLEM, ROOT

    recipe = load_recipes(ROOT / "examples" / "recipes.py")["bias_silu_residual"]
    m, n, k = LAYOUT_PROBLEM
    a = torch.randn(m * k + 1, device="cuda", generator=gen).bfloat16()[1:].view(m, k)
    b = torch.randn(n, k, device="cuda", generator=gen).bfloat16().t()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    got = op(recipe)(a, b, bias, residual)
    want = recipe.reference(a, b, bias=bias, residual=residual)
    assert want.abs().max() > 0
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_quantized_d_is_the_next_block_scaled_gemms_input(gen):
    """fp8_quantized's D and scales, as the kernel writes them (fresh, in the layout it picks), are
    fp8_block_scaled's A and scale_a: the chain against the same two recipes' references on the
    CPU (the scales within fp32 rounding of the reference's, each e4m3 value within one unit of its
    last place, the second GEMM within bf16's tolerance); and each scale is its block's max |D| x
    scale over 448, to fp32 rounding, on the GPU's own values."""
    examples = load_recipes(ROOT / "examples" / "recipes.py")
    fp8_block_scaled, fp8_quantized = examples["fp8_block_scaled"], examples["fp8_quantized"]
    a = torch.randn(300, 512, device="cuda", generator=gen).bfloat16()
    b = torch.randn(1024, 512, device="cuda", generator=gen).bfloat16().t()
    bias = torch.randn(1024, device="cuda", generator=gen).bfloat16()
    d, scale = fp8_quantized.compile()(a, b, bias=bias)
    assert scale.stride() == (1, 300) and d.dtype == torch.float8_e4m3fn and not scale.isnan().any()
    want_d, want_scale = fp8_quantized.reference(a, b, bias=bias)
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(d.cpu().float(), want_d.float(), rtol=2**-3, atol=0)
    dequantized = (d.float() * scale.repeat_interleave(128, dim=1)).unflatten(1, (8, 128))
    torch.testing.assert_close(dequantized.abs().amax(dim=-1) / 448, scale, rtol=2**-3, atol=0)
    w_q, scale_b = gg.quantize_blockwise(torch.randn(768, 1024, device="cuda", generator=gen).t(), (128, 128),
                                         scale_layout=gg.RowMajor)
    out = fp8_block_scaled.compile()(d, w_q, scale_a=scale, scale_b=scale_b)
    want = fp8_block_scaled.reference(d.cpu(), w_q.cpu(), scale_a=scale.cpu(), scale_b=scale_b.cpu())
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))


def test_qk_norm_normalizes_each_head(gen):
    """qk_norm against torch's F.rms_norm per head of the same accumulator, and its rstd."""
    qk_norm = load_recipes(ROOT / "examples" / "recipes.py")["qk_norm"]
    a = torch.randn(77, 256, device="cuda", generator=gen).bfloat16()
    b = torch.randn(1024, 256, device="cuda", generator=gen).bfloat16().t()
    weight = torch.randn(1024, device="cuda", generator=gen).bfloat16()
    y, rstd = qk_norm.compile()(a, b, weight=weight)
    heads = (a.float() @ b.float()).unflatten(1, (8, 128))
    want = torch.nn.functional.rms_norm(heads, (128,), eps=1e-6).flatten(1) * weight.float()
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(rstd, (heads.square().mean(dim=-1) + 1e-6).rsqrt(), rtol=1e-4, atol=0)


def test_row_col_amax_reduces_over_m_and_n_in_one_kernel(gen):
    """row_col_amax (a reduction over N and one over M, gemmgen's row_reduction.hpp, in one kernel)
    against torch on the same fp32 accumulator: odd M, N past a tile, a K tail; under its default
    (unswapped: the reduction over M is the kernel's) and its decode kernel (swapped: over N is)."""
    from gemmgen.tuning import choose
    from tests.data.gpu_matrix import DECODE_PROBLEM

    recipe = load_recipes(ROOT / "examples" / "recipes.py")["row_col_amax"]
    decode = choose(recipe.ir, *DECODE_PROBLEM).config
    assert decode.swap_ab and not recipe.default_config().swap_ab
    for m, config in ((77, recipe.default_config()), (5, decode)):
        a = torch.randn(m, 200, device="cuda", generator=gen).bfloat16()
        b = torch.randn(1000, 200, device="cuda", generator=gen).bfloat16().t()
        bias = torch.randn(1000, device="cuda", generator=gen).bfloat16()
        d, rows, cols = recipe.compile(config)(a, b, bias=bias)
        y = a.float() @ b.float() + bias.float()
        torch.testing.assert_close(d.float(), y, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(rows, y.abs().amax(dim=1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cols, y.abs().amax(dim=0), rtol=1e-4, atol=1e-4)


def test_exp_minus_max_is_a_softmax_numerator_per_block(gen):
    """block_softmax (gg.exp_minus_max over blocks of 128 columns, scale 1/8) against torch on the
    same fp32 accumulator: each block's max, its values, and the blocks combined into torch's
    softmax over the row; odd M, a partial last block, a K tail."""
    recipe = load_recipes(ROOT / "tests" / "data" / "extra_recipes.py")["block_softmax"]
    a = torch.randn(77, 200, device="cuda", generator=gen).bfloat16()
    b = torch.randn(1000, 200, device="cuda", generator=gen).bfloat16().t()
    bias = torch.randn(1000, device="cuda", generator=gen).bfloat16()
    p, top = recipe.compile()(a, b, bias=bias)
    x = a.float() @ b.float() + bias.float()
    want_top = torch.nn.functional.pad(x, (0, 24), value=-math.inf).unflatten(-1, (8, 128)).amax(dim=-1)
    torch.testing.assert_close(top, want_top, rtol=1e-4, atol=1e-4)
    spread = torch.exp(0.125 * (x - want_top.repeat_interleave(128, dim=-1)[:, :1000]))
    torch.testing.assert_close(p.float(), spread, rtol=1.6e-2, atol=1e-3)
    weights = torch.exp(0.125 * (top - top.amax(dim=-1, keepdim=True)))  # each block's against the row's max
    rescaled = p.float() * weights.repeat_interleave(128, dim=-1)[:, :1000]
    torch.testing.assert_close(rescaled / rescaled.sum(dim=-1, keepdim=True), torch.softmax(0.125 * x, dim=-1),
                               rtol=2e-2, atol=1e-4)


def test_block_scaled_linear_eager_and_graph(gen):
    """BlockScaledLinear (e4m3 weight in 128 x 128 blocks, input quantized per call) on the GPU
    against the same layer on the CPU, where the op evaluates the recipe's reference on the same
    quantized input: eager at a decode step and at 300 tokens, then replayed in a CUDA graph with
    new input values."""
    import copy

    from tests.data.gpu_matrix import BLOCK_LINEAR_PROBLEMS

    linear = torch.nn.Linear(512, 384, device="cuda")
    layer = gg.nn.BlockScaledLinear.from_linear(linear, activation="silu")
    on_cpu = copy.deepcopy(layer).cpu()

    def check(got, x):
        want = on_cpu(x.cpu()).float()
        assert want.abs().max() > 0
        torch.testing.assert_close(got.cpu().float(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))

    for tokens, _, _ in BLOCK_LINEAR_PROBLEMS:
        x = torch.randn(tokens, 512, device="cuda", generator=gen)
        check(layer(x), x)
    static = torch.randn(300, 512, device="cuda", generator=gen)
    layer(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    static.copy_(torch.randn(300, 512, device="cuda", generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    check(out, static)


def test_direct_call_matches_the_op(gen):
    """FusedLinear's eager fast path (kernel called directly) gives the op's result, bit for bit."""
    layer = gg.nn.FusedLinear(256, 264, activation="silu", device="cuda")
    x = torch.randn(77, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        direct = layer._op(x, layer.weight.t(), layer.bias)
        through_op = layer._op.overload(x, layer.weight.t(), layer.bias)
    assert torch.equal(direct, through_op)


def test_autotune_times_candidates_and_the_runtime_uses_the_winner(tmp_path, monkeypatch):
    from gemmgen import tuning
    from gemmgen.aot import load_recipes
    from gemmgen.integrations.ops import caller
    from gemmgen.runtime.examples import example_call
    from tests.data.gpu_matrix import ROOT, TUNE_CANDIDATES, TUNE_PROBLEM

    monkeypatch.setattr("gemmgen.tuning.table._TABLES", [])
    recipe = load_recipes(ROOT / "examples" / "recipes.py")["bias_gelu"]
    table = gg.autotune(recipe, [TUNE_PROBLEM], limit=TUNE_CANDIDATES, out=tmp_path / "t.json")
    (entry,) = table.entries.values()
    timed = tuning.candidates(recipe.ir, *TUNE_PROBLEM, limit=TUNE_CANDIDATES, declared=recipe.config)
    assert recipe.config in timed  # the recipe's own config competes
    assert len(entry["timings_us"]) == len(timed) and all(t > 0 for t in entry["timings_us"].values())
    m, n, k = TUNE_PROBLEM
    device = tuning.Device.current()
    assert tuning.config_for(recipe, m, n, k, 1, device=device).name == entry["name"]
    (a, b), ops = example_call(recipe.ir, m, n, k)
    with torch.no_grad():
        got = caller(recipe)(a, b, *ops.values())
    compare(recipe, as_tuple(got), a, b, ops, exact=False)


def test_invalid_input_on_gpu_raises(kernels):
    recipe, _config, kernel = kernels[0]
    a = torch.empty(64, 64, dtype=recipe.ir.gemm.a.torch, device="cuda")
    with pytest.raises(gg.InvalidArgument):
        kernel(a, a.cpu())

"""Cases that run gemmgen's driver layer against the stub libcuda (gemmgen/testing/stub_driver.py).

Run by tests/runtime/test_stub_driver.py in a child process, since a process keeps the driver it loads:

    python tests/runtime/stub_driver_cases.py STUB_LIB CACHE_DIR RESULTS_JSON

Each case reports "ok" or its traceback in RESULTS_JSON. Nothing here needs a GPU: CPU tensors stand
for a GPU's (`stand_in_device`), and every call from gemmgen to the driver goes through the real
cuda.bindings or ctypes into the stub.
"""

from __future__ import annotations

import json
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
STREAM = 0x5E0  # the raw stream handle launches must carry
BLOCK, CLUSTER, SMEM = 384, (2, 1, 1), 200_000


def _on_a_new_thread(fn, *args):
    """fn(*args) on a thread that has made no driver call (so has no current context); its result
    or exception."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def _kernels(cache_dir: str) -> dict:
    """Every kernel the session compiles (tests/data/session_kernels.COMPILED; the sm_100a ones as
    "NAME@sm_100a"), loaded from the session's cache."""
    from gemmgen.aot import load_recipes
    from gemmgen.compile import build_kernel
    from gemmgen.compile.cache import KernelCache
    from gemmgen.config import Arch
    from tests.data.session_kernels import COMPILED
    from tests.data.sm100 import SM100_KERNELS

    cache = KernelCache(cache_dir)
    out = {}
    for path in (ROOT / "examples" / "recipes.py", ROOT / "tests" / "data" / "extra_recipes.py"):
        for r in load_recipes(path).values():
            if r.name in COMPILED:
                out[r.name] = build_kernel(r.ir, r.default_config(), cache)
            if path.parent.name == "examples" and r.name in SM100_KERNELS:
                config = SM100_KERNELS[r.name] or r.default_config(Arch.SM100A)
                out[f"{r.name}@sm_100a"] = build_kernel(r.ir, config, cache)
    return out


def _dense(kernels: dict, arch: str = "sm_90a") -> dict:
    return {name: ck for name, ck in kernels.items() if not ck.recipe.gemm.grouped and ck.config.arch.value == arch}


def case_tensor_maps_reach_the_driver_as_encoded(stub, kernels):
    """Each map a call needs, encoded through the driver path, arrives in C with exactly gemmgen's
    arguments, in a map the driver accepts (64-byte aligned). cuda.bindings' own wrapper would not:
    its CUtensorMap objects are only 16-byte aligned, which is why gemmgen calls the driver itself."""
    from cuda.bindings import driver as cu

    from gemmgen.errors import GemmgenError
    from gemmgen.runtime import driver
    from gemmgen.testing.calls import cpu_kernel, fresh_args
    from gemmgen.testing.recording import RecordingEncoder

    driver.bind_context(0)
    for name, ck in _dense(kernels).items():
        enc = RecordingEncoder()
        lead = (2,) if ck.recipe.gemm.batched else ()
        a, b, ops = fresh_args(ck.recipe, 40, 24, 72, lead)
        cpu_kernel(ck, enc).prepare(a, b, **ops)
        assert enc.calls, name
        for args in enc.calls:
            before = stub.encodes
            got = stub.of(driver.encode_tensor_map(args))
            assert stub.encodes == before + 1
            assert got == args, f"{name}: sent {args}, the driver received {got}"
    args = enc.calls[0]
    err, _ = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType(args.dtype), args.rank, args.addr, [cu.cuuint64_t(x) for x in args.dims],
        [cu.cuuint64_t(x) for x in args.strides], [cu.cuuint32_t(x) for x in args.box],
        [cu.cuuint32_t(x) for x in args.elem_strides], cu.CUtensorMapInterleave(args.interleave),
        cu.CUtensorMapSwizzle(args.swizzle), cu.CUtensorMapL2promotion(args.l2), cu.CUtensorMapFloatOOBfill(args.oob))
    misaligned = {cu.CUtensorMap().getPtr() % 64 for _ in range(64)} != {0}
    assert err == (cu.CUresult.CUDA_ERROR_INVALID_VALUE if misaligned else cu.CUresult.CUDA_SUCCESS)
    try:  # the stub holds gemmgen to the driver's rule: no encode on a thread without a context
        _on_a_new_thread(driver.encode_tensor_map, args)
    except GemmgenError as e:
        assert "CUDA_ERROR_INVALID_CONTEXT" in str(e), str(e)
    else:
        raise AssertionError("an encode on a thread without a context raised nothing")


def case_driver_errors_name_the_call(stub, kernels):
    """A failing driver call raises GemmgenError naming the call, the error and the driver's message."""
    from gemmgen.errors import GemmgenError
    from gemmgen.runtime import driver
    from gemmgen.runtime.tma import EncodeArgs

    args = EncodeArgs(1, 3, 0x10000, (64, 64, 1), (128, 0), (64, 64, 1), (1, 1, 1), 0, 3, 2, 0)
    stub.fail_next(1)  # CUDA_ERROR_INVALID_VALUE
    try:
        driver.encode_tensor_map(args)
    except GemmgenError as e:
        assert "cuTensorMapEncodeTiled(EncodeArgs(dtype=1" in str(e) and "CUDA_ERROR_INVALID_VALUE (invalid argument)" \
            in str(e), str(e)
    else:
        raise AssertionError("a failing encode raised nothing")
    assert stub.of(driver.encode_tensor_map(args)) == args  # the failure was one call's


def case_loading_a_kernel(stub, kernels):
    """driver.load: the cubin image and its entry reach the driver, the function's shared memory
    limit is raised to the kernel's, all in relaxed capture mode (restored after), and the
    occupancy query sees one cluster's launch config; a wrong entry or image raises GemmgenError,
    and a failing occupancy query falls back to 0 clusters with a warning."""
    import warnings

    from cuda.bindings import driver as cu

    from gemmgen.errors import GemmgenError
    from gemmgen.runtime import driver

    ck = kernels["bias_gelu"]
    driver.bind_context(0)
    fn = driver._load_function(cu, ck.entry, ck.cubin, BLOCK, CLUSTER, SMEM)
    assert stub.entry == ck.entry and stub.smem_attribute == SMEM
    assert stub.capture_mode_at_load == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    assert stub.capture_mode == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    q = stub.last_occupancy_query
    assert (q.grid, q.block, q.cluster, q.smem, q.num_attrs) == (CLUSTER, (BLOCK, 1, 1), CLUSTER, SMEM, 1), q
    assert fn.max_active_clusters == 66
    for entry, image, error in ((ck.entry + "_missing", ck.cubin, "CUDA_ERROR_NOT_FOUND"),
                                (ck.entry, b"not a cubin", "CUDA_ERROR_INVALID_IMAGE")):
        try:
            driver._load_function(cu, entry, image, BLOCK, CLUSTER, SMEM)
        except GemmgenError as e:
            assert error in str(e), str(e)
        else:
            raise AssertionError(f"loading {entry!r} from {image[:8]!r} raised nothing")
        assert stub.capture_mode == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    stub.answer_occupancy(-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert driver._load_function(cu, ck.entry, ck.cubin, BLOCK, CLUSTER, SMEM).max_active_clusters == 0
    stub.answer_occupancy(66)
    assert any("CUDA_ERROR_INVALID_CLUSTER_SIZE" in str(w.message) for w in caught), [str(w.message) for w in caught]

    def load_on_device_1():
        driver.load(ck.entry, ck.cubin, 1, SMEM, BLOCK, CLUSTER)
        return stub.current_device()

    retains = stub.primary_retains  # driver.load binds device 1's primary context on a thread with none
    assert _on_a_new_thread(load_on_device_1) == 1 and stub.primary_retains == retains + 1


def case_calls_launch_the_recipes_math(stub, kernels):
    """Kernel.__call__ through the driver for every test kernel family (swapped ones included), with
    given and fresh outputs: the Params block cuLaunchKernelEx receives, read through the maps and
    pointers in it (the CPU emulation), computes the recipe's reference on the caller's tensors;
    the kernel's cubin declares one parameter, of the Params block's size (the stub copies what
    the cubin declares, as the driver does); the launch has the kernel's block, cluster and shared
    memory on the current stream, within the driver's limits, and every map in it passes
    cuTensorMapEncodeTiled's documented rules."""
    _launch_and_emulate(stub, _dense(kernels))


def case_sm100_calls_on_a_b200_launch_the_recipes_math(stub, kernels):
    """The same for the sm_100a kernels on a stand-in compute capability 10.0 device with 148 SMs:
    the 2-SM kernels' clusters, the cluster-launch-control grid, the Params the oracle checks,
    emulated; an sm_90a kernel on that device is refused, naming both arches."""
    from gemmgen.runtime.kernel import Kernel
    from gemmgen.testing.calls import fresh_args
    from gemmgen.testing.stub_driver import stand_in_device

    stand_in_device(STREAM, 148, (10, 0))
    try:
        sm100 = _dense(kernels, "sm_100a")
        assert {ck.config.schedule.value for ck in sm100.values()} == {"1sm", "2sm"}
        _launch_and_emulate(stub, sm100)
        ck = kernels["bias_gelu"]
        a, b, ops = fresh_args(ck.recipe, 40, 24, 72, ())
        _refused_on_a_b200(lambda: Kernel(ck, require_cuda=False)(a, b, **ops), "an sm_90a kernel")
    finally:
        stand_in_device(STREAM)


def _refused_on_a_b200(call, what: str) -> None:
    """`call`, an sm_90a kernel's, raises on the stand-in 10.0 device naming both arches."""
    from gemmgen.errors import InvalidArgument

    try:
        call()
    except InvalidArgument as e:
        assert "is built for sm_90a (H100/H200); device cuda:-1 is sm_100a (B200/GB200)" in str(e), str(e)
    else:
        raise AssertionError(f"{what} launched on a 10.0 device")


def _launch_and_emulate(stub, kernels: dict) -> None:
    from gemmgen.ir.reference import reference
    from gemmgen.runtime.kernel import Kernel
    from gemmgen.testing.calls import args_with_nonzero_reference, by_dtype, emulated_shapes, given_outputs, unwritten
    from gemmgen.testing.emulate import emulate
    from gemmgen.testing.recording import encode_violations, launch_violations
    from gemmgen.testing.stub_driver import GLOBAL_BASE
    from gemmgen.testing.tensors import assert_outputs_close

    for name, ck in kernels.items():
        kernel = Kernel(ck, require_cuda=False)  # the real driver path: encode, load and launch reach the stub
        prepared = _keeping_prepared(kernel)
        recipe = ck.recipe
        for m, n, k, batch in emulated_shapes(recipe):
            lead = (batch,) if recipe.gemm.batched else ()
            for given in (True, False):
                where = f"{name} M={m} N={n} K={k} lead={lead} given={given}"
                a, b, ops, want = args_with_nonzero_reference(recipe, m, n, k, lead)
                launches = stub.launches
                if given:
                    outs = given_outputs(recipe, m, n, lead)
                    kernel(a, b, out=outs if len(outs) > 1 else outs[0], **ops)
                else:
                    got = kernel(a, b, **ops)
                    outs = unwritten(recipe, got if isinstance(got, tuple) else (got,))
                assert stub.launches == launches + 1, where
                launch = stub.last_launch
                # the kernel's one parameter, its size as the cubin declares it (what the driver
                # copies from kernelParams[0]), is gemmgen's Params block
                assert (launch.param_count, len(launch.params)) == (1, ck.info.params_size), where
                assert (launch.block, launch.cluster, launch.smem, launch.stream, launch.num_attrs) == \
                    ((ck.info.max_threads, 1, 1), ck.config.cluster, ck.info.smem_bytes, STREAM, 1), (where, launch)
                assert launch_violations(launch.grid, launch.block[0], launch.cluster, launch.smem) == [], where
                for field, offset, _ in ck.params_layout.fields:
                    if field.kind == "desc":
                        args = stub.of(launch.params[offset:offset + 128])
                        assert args is None or encode_violations(args) == [], (where, field.name, args)
                    if field.name == "epilogue.tma_d" and ck.generated.epilogue.d_sink:  # the module's sink,
                        sink = stub.of(launch.params[offset:offset + 128])  # where cuModuleGetGlobal has it
                        assert sink is not None and sink.addr >= GLOBAL_BASE and sink.dims == (1, 1, 1), where
                _, launched, _ = prepared[-1]  # (outputs, (params, grid, workspace), device)
                workspace = launched[2]
                tensors = [a, b, *outs, *(v for v in ops.values() if isinstance(v, torch.Tensor))]
                emulate(ck, launch.params, stub, tensors + ([workspace] if workspace is not None else []))
                scale = reference(recipe, a, b, ops, magnitudes=True)
                for out in outs:
                    assert not out.isnan().any(), f"{where}: output elements the kernel would not write"
                assert_outputs_close(recipe.outputs, outs, want, scale, (m, n), by_dtype, where)


def _keeping_prepared(kernel):
    """The kernel's prepared calls, kept: the workspace a launch pointed into outlives the call."""
    prepared = []
    prepare = kernel._prepare

    def keeping(*args):
        prepared.append(prepare(*args))
        return prepared[-1]

    kernel._prepare = keeping
    return prepared


def case_a_thread_without_a_context(stub, kernels):
    """A kernel's first call on a thread that has no current context (a worker thread whose tensors
    come from torch's caching allocator, with no CUDA runtime call made on it) binds the primary
    context of the tensors' device before its first driver call, once per thread, in relaxed
    capture mode (restored after: a first call may come during a graph capture); a thread whose
    context is current keeps it. Without the binding, the encode and the launch would fail with
    CUDA_ERROR_INVALID_CONTEXT, as they do against the real driver (triton-lang/triton#3729)."""
    from cuda.bindings import driver as cu

    from gemmgen.runtime import driver
    from gemmgen.runtime.kernel import Kernel
    from gemmgen.testing.calls import fresh_args

    ck = kernels["bias_gelu"]
    kernel = Kernel(ck, require_cuda=False)
    a, b, ops = fresh_args(ck.recipe, 40, 24, 72, ())
    kernel(a, b, **ops)  # loaded, and its plan for these arguments cached, on this thread

    def call(*args):
        before = (stub.launches, stub.primary_retains)
        kernel(*args, **ops)
        kernel(*args, **ops)
        assert stub.capture_mode == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
        return (stub.launches - before[0], stub.primary_retains - before[1], stub.last_launch.device,
                driver.THREAD.has_context)

    assert _on_a_new_thread(call, a, b) == (2, 1, 0, True)  # a cached plan: the launch is the first driver call
    assert stub.capture_mode_at_retain == cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    a2, b2, _ = fresh_args(ck.recipe, 56, 24, 72, ())
    assert _on_a_new_thread(call, a2, b2) == (2, 1, 0, True)  # a new plan: encodes come first

    def call_in_own_context():
        _, dev = cu.cuDeviceGet(0)
        _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        assert cu.cuCtxSetCurrent(ctx) == (cu.CUresult.CUDA_SUCCESS,)
        return call(a, b)

    assert _on_a_new_thread(call_in_own_context) == (2, 0, 0, True)


def case_threads_sharing_a_kernel(stub, kernels):
    """One kernel called by four threads at once (a server's workers sharing a model), thread
    switches forced every microsecond: the threads share each shape's B and operands (the weights)
    and draw their own A twice per shape (a plan rebound from whichever thread's plan of that
    layout came last), calling with a given, a fresh, then a given output (cached plans). The
    Params of each thread's own launch compute that thread's reference: the kernel's shared caches
    (plans, layouts, output maps, the last block built) never hand one thread's arguments to
    another."""
    import gemmgen as gg
    from gemmgen.ir.reference import reference
    from gemmgen.runtime.kernel import Kernel
    from gemmgen.testing.calls import EMULATED, TOLERANCE, args_with_nonzero_reference, padded
    from gemmgen.testing.emulate import emulate

    ck = kernels["bias_gelu"]
    recipe, g = ck.recipe, ck.recipe.gemm
    kernel = Kernel(ck, require_cuda=False)
    lead_of = {shape: (shape[3],) if g.batched else () for shape in EMULATED}
    weights = {shape: args_with_nonzero_reference(recipe, *shape[:3], lead_of[shape])[1:3] for shape in EMULATED}

    def own_inputs(shape):
        b, ops = weights[shape]
        for _ in range(20):  # a 1 x 1 GELU can be exactly 0: draw again
            a = padded(shape[0], shape[2], g.a.torch, g.layout_a is gg.RowMajor, lead_of[shape])
            want = reference(recipe, a, b, ops)
            if all(w.float().abs().sum() > 0 for w in want):
                return a, b, ops, want
        raise AssertionError(f"20 draws at {shape} gave a zero reference")

    def worker(index):
        checked = 0
        for shape in EMULATED * 2:
            a, b, ops, want = own_inputs(shape)
            for given in (True, False, True):
                where = f"thread {index} shape {shape} given={given}"
                if given:
                    out = padded(shape[0], shape[1], recipe.outputs[0].dtype.torch, True, lead_of[shape],
                                  fill=float("nan"))
                    kernel(a, b, out=out, **ops)
                else:
                    out = kernel(a, b, **ops).fill_(float("nan"))
                launch = stub.last_launch
                assert (launch.param_count, len(launch.params)) == (1, ck.info.params_size), where
                emulate(ck, launch.params, stub, [a, b, out, *(v for v in ops.values() if isinstance(v, torch.Tensor))])
                tol = TOLERANCE[out.dtype]
                torch.testing.assert_close(out.float(), want[0].float(), rtol=tol, atol=tol, msg=where)
                checked += 1
        return checked

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(4) as pool:
            counts = list(pool.map(worker, range(4)))
    finally:
        sys.setswitchinterval(switch)
    assert counts == [len(EMULATED) * 2 * 3] * 4, counts


def case_a_grouped_call_launches_setup_then_gemm(stub, kernels):
    """A grouped kernel's call, through the real driver path: two launches on the stream, the setup
    kernel (looked up in the same module) and then the GEMM with its Params; every tensor map it
    encodes is one the driver accepts."""
    from gemmgen.runtime.grouped import GroupedKernel
    from gemmgen.testing.grouped import grouped_inputs
    from gemmgen.testing.recording import encode_violations, launch_violations

    ck = kernels["moe_up"]
    kernel = GroupedKernel(ck, require_cuda=False)
    a, b, offsets, bias, weight = grouped_inputs()
    prepared = kernel.prepare(a, b, offsets, bias=bias, weight=weight)
    before = stub.launches
    kernel(a, b, offsets, bias=bias, weight=weight)
    assert stub.launches == before + 2
    launch = stub.last_launch
    assert stub.entry == f"{ck.entry}_groups"  # the last function looked up: the setup kernel, after the GEMM
    assert (launch.param_count, len(launch.params)) == (1, ck.info.params_size)
    assert (launch.block, launch.cluster, launch.smem, launch.stream) == \
        ((ck.info.max_threads, 1, 1), ck.config.cluster, ck.info.smem_bytes, STREAM)
    assert launch.grid == prepared.grid and launch_violations(launch.grid, 384, launch.cluster, launch.smem) == []
    for field, offset, _ in ck.params_layout.fields:
        if field.kind == "desc":
            args = stub.of(launch.params[offset:offset + 128])
            assert args is not None and encode_violations(args) == [], (field.name, args)


def case_an_sm100_grouped_call_on_a_b200_launches_the_recipes_math(stub, kernels):
    """The grouped sm_100a kernel (a pair of SMs in a 2 x 1 cluster) on a stand-in compute
    capability 10.0 device with 148 SMs, through the real driver path: the setup kernel, then the
    GEMM with its cluster, shared memory and the group scheduler's persistent grid; every map it
    encodes is one the driver accepts; the Params block the GEMM receives and the setup block,
    emulated, compute the recipe's reference. The sm_90a grouped kernel is refused on that device."""
    from gemmgen.runtime import scheduler
    from gemmgen.runtime.grouped import GroupedKernel
    from gemmgen.testing.emulate import emulate_grouped
    from gemmgen.testing.grouped import grouped_inputs, moe_recipe
    from gemmgen.testing.recording import encode_violations, launch_violations
    from gemmgen.testing.stub_driver import stand_in_device

    stand_in_device(STREAM, 148, (10, 0))
    try:
        ck = kernels["moe_up@sm_100a"]
        kernel = GroupedKernel(ck, require_cuda=False)
        prepared = _keeping_prepared(kernel)  # the call's buffer: the emulation reads it after the call
        a, b, offsets, bias, weight = grouped_inputs(rows=300, k=72, n=136, groups=3, offsets=(1, 129, 300))
        out = torch.full((300, 136), float("nan")).bfloat16()
        before = stub.launches
        kernel(a, b, offsets, bias=bias, weight=weight, out=out)
        assert stub.launches == before + 2
        launch = stub.last_launch
        buffer, setup, _, params, grid = prepared[-1][1]
        assert (launch.param_count, launch.params) == (1, params) and len(params) == ck.info.params_size
        assert (launch.block, launch.cluster, launch.smem, launch.stream) == \
            ((ck.info.max_threads, 1, 1), (2, 1, 1), ck.info.smem_bytes, STREAM)
        sm_count, clusters = kernel._hardware(-1)  # the stand-in's SMs; its occupancy's clusters
        want = scheduler.group_plan(ck.config.cta_tile, (2, 1, 1), sm_count, clusters, occupancy=False).grid
        assert sm_count == 148 and launch.grid == grid == want and want[0] % 2 == 0, (launch.grid, want)
        assert launch_violations(launch.grid, launch.block[0], launch.cluster, launch.smem) == []
        for field, offset, _ in ck.params_layout.fields:
            if field.kind == "desc":
                args = stub.of(launch.params[offset:offset + 128])
                assert args is not None and encode_violations(args) == [], (field.name, args)
        emulate_grouped(ck, setup, launch.params, stub, [a, b, offsets, bias, weight, out, buffer])
        want = moe_recipe().reference(a, b, offsets, bias=bias, weight=weight).float()
        torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
        _refused_on_a_b200(lambda: GroupedKernel(kernels["moe_up"], require_cuda=False)(a, b, offsets, bias=bias,
                                                                                      weight=weight),
                           "an sm_90a grouped kernel")
    finally:
        stand_in_device(STREAM)


def case_nvtx_ranges_name_each_launch(stub, kernels):
    """GEMMGEN_NVTX (runtime.nvtx): off by default, no range; on, each launch (a grouped call's two)
    inside one range named `gemmgen <recipe> <config> <M>x<N>x<K>[x<L>]`, the config as the kernel's
    symbol spells it; `enable(False)` stops it."""
    import os

    from gemmgen.runtime import nvtx
    from gemmgen.runtime.grouped import GroupedKernel
    from gemmgen.runtime.kernel import Kernel
    from gemmgen.testing.calls import args_with_nonzero_reference
    from gemmgen.testing.grouped import grouped_inputs

    ranges: list = []
    torch.cuda.nvtx.range_push = lambda name: ranges.append([name, stub.launches])
    torch.cuda.nvtx.range_pop = lambda: ranges[-1].append(stub.launches)
    ck = kernels["bias_gelu"]
    kernel = Kernel(ck, require_cuda=False)
    a, b, ops, _ = args_with_nonzero_reference(ck.recipe, 100, 72, 64, ())
    nvtx.enabled = None  # as a process starts
    assert "GEMMGEN_NVTX" not in os.environ
    kernel(a, b, **ops)
    assert ranges == [] and nvtx.enabled is False  # read once, at the first launch
    nvtx.enable()
    kernel(a, b, **ops)
    config = ck.config.binary().name
    assert ranges[-1][0] == f"gemmgen bias_gelu {config} 100x72x64" and f"_{config}_" in ck.entry, (ranges, ck.entry)
    assert ranges[-1][2] == ranges[-1][1] + 1  # the launch inside the range
    g = kernels["moe_up"]
    x, w, offsets, gb, weight = grouped_inputs()
    GroupedKernel(g, require_cuda=False)(x, w, offsets, bias=gb, weight=weight)
    assert ranges[-1][0] == f"gemmgen moe_up {g.config.binary().name} {x.shape[0]}x{w.shape[-1]}x{x.shape[1]}x" \
        f"{w.shape[0]}" and ranges[-1][2] == ranges[-1][1] + 2, ranges[-1]
    nvtx.enable(False)
    kernel(a, b, **ops)
    assert len(ranges) == 2


def case_the_launch_log_records_each_launch(stub, kernels):
    """GEMMGEN_LAUNCH_LOG (runtime.nvtx, what `gemmgen profile` pairs with ncu's rows): read at the
    first launch; then each launch appends its symbol, config, problem and process, ranges off."""
    import json
    import os
    import tempfile

    from gemmgen.config import KernelConfig
    from gemmgen.runtime import nvtx
    from gemmgen.runtime.grouped import GroupedKernel
    from gemmgen.runtime.kernel import Kernel
    from gemmgen.testing.calls import args_with_nonzero_reference
    from gemmgen.testing.grouped import grouped_inputs

    torch.cuda.nvtx.range_push = lambda name: (_ for _ in ()).throw(AssertionError("a range, with GEMMGEN_NVTX unset"))
    ck, g = kernels["bias_gelu"], kernels["moe_up"]
    a, b, ops, _ = args_with_nonzero_reference(ck.recipe, 100, 72, 64, ())
    x, w, offsets, gb, weight = grouped_inputs()
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "launches.jsonl")
        os.environ["GEMMGEN_LAUNCH_LOG"] = log
        try:
            nvtx.enabled = None  # as a process starts
            kernel = Kernel(ck, require_cuda=False)
            kernel(a, b, **ops)
            GroupedKernel(g, require_cuda=False)(x, w, offsets, bias=gb, weight=weight)
            kernel(a, b, **ops)
        finally:
            del os.environ["GEMMGEN_LAUNCH_LOG"]
            nvtx.enabled = None
        records = nvtx.read_log(log)
    assert [r.symbol for r in records] == [ck.entry, g.entry, ck.entry], records
    dense, grouped = records[0], records[1]
    assert dense.problem == (100, 72, 64) and not dense.grouped and dense.pid == os.getpid()
    assert KernelConfig.from_canonical(json.loads(dense.canonical)) == ck.config and dense.config in ck.entry
    assert (dense.a_bits, dense.d_bits, dense.arch) == (16, 16, "sm_90a")
    assert grouped.problem == (x.shape[0], w.shape[-1], x.shape[1], w.shape[0]) and grouped.grouped


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}


def main(stub_lib: str, cache_dir: str, results: str) -> None:
    sys.path.insert(0, str(ROOT))
    from gemmgen.testing.stub_driver import StubDriver, stand_in_device

    stub = StubDriver(Path(stub_lib))  # before cuda.bindings binds a driver
    stand_in_device(STREAM)
    kernels = _kernels(cache_dir)
    report = {}
    for name, case in CASES.items():
        try:
            case(stub, kernels)
            report[name] = "ok"
        except BaseException:
            report[name] = traceback.format_exc()
    Path(results).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Per-call host cost of the ways to call a gemmgen kernel from PyTorch.

    python scripts/op_overhead.py

On the CPU (no GPU): the CUDA path's host work on CPU tensors, through the real dispatcher and op
registration (`gemmgen.integrations.ops.define`), with the driver's calls going through
cuda.bindings and ctypes into the stub libcuda (gemmgen/testing/stub_driver.py; needs a C
compiler), which does no work of its own (on a GPU machine, the real driver's calls are left out
here instead). A probe op whose CPU kernel is the CUDA kernel's body
(`call_realigning` of `launcher_for(recipe)(...)`: kernel lookup, checks, Params, launch) is timed
against a raw `cuLaunchKernelEx` of prepared arguments and against its steps called directly. The driver's own
work per launch is the same with or without gemmgen, so "over raw" is the overhead the issue's
bar is about, on this CPU. Without a C compiler the driver calls are left out (`--no-stub`
forces that).

On a GPU: a raw cuLaunchKernelEx of prepared arguments, then Kernel.__call__, the eager path
modules use (OpCaller: kernel called directly) and the op, each as host microseconds per call over
a loop of 2000 launches of a 64x64x64 problem; the overheads are over the raw launch.

Both then time the grouped example (moe_up, 8 groups) the same way: its two raw launches (the
setup kernel, then the GEMM) against GroupedKernel.__call__ and the grouped op.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast
from unittest import mock

import torch

import gemmgen as gg
from gemmgen.aot import load_recipes
from gemmgen.integrations import ops
from gemmgen.runtime.kernel import Kernel
from gemmgen.testing.recording import RecordingEncoder
from gemmgen.testing.timing import median_us

ROOT = Path(__file__).resolve().parent.parent
STREAM = 0x5E0


def _us(fn) -> float:
    return median_us(fn, reps=5000)


def _stub_driver():
    """Load the stub libcuda (and stand CPU tensors in for a GPU's); None where a real driver is
    present (the GPU section measures against it), without a C compiler, or with --no-stub."""
    from gemmgen.testing.stub_driver import StubDriver, build, stand_in_device

    if torch.cuda.is_available() or "--no-stub" in sys.argv or not (shutil.which("cc") or shutil.which("gcc")):
        return None
    with tempfile.TemporaryDirectory(prefix="gemmgen-stub-") as folder:
        stub = StubDriver(build(Path(folder)))  # stays loaded once its file is gone
    stand_in_device(STREAM)
    return stub


def cpu_overheads() -> None:
    recipe = load_recipes(ROOT / "examples" / "recipes.py")["bias_gelu"]
    stub = _stub_driver()
    if stub is not None:
        kernel = Kernel(recipe.build(), require_cuda=False)  # the real driver path, into the stub
    else:
        kernel = Kernel(recipe.build(), encoder=RecordingEncoder(strict=False), hardware=lambda i: (132, 0),
                        require_cuda=False)
    a = torch.randn(64, 64).bfloat16()
    b, bias = torch.randn(64, 64).bfloat16().t(), torch.randn(64).bfloat16()
    with mock.patch.object(type(recipe), "compile", lambda self, config=None, **kw: kernel):
        ops.kernel_for(recipe, a, b)  # the runtime's kernel cache now serves this kernel for the bucket

    def prepare(a: torch.Tensor, b: torch.Tensor, *args: object) -> torch.Tensor:
        return cast(Kernel, ops.kernel_for(recipe, a, b)).prepare(a, b, *args).outputs[0]

    call = ops.launcher_for(recipe) if stub is not None else prepare  # the op's: kernel lookup, then the call

    def body(a: torch.Tensor, b: torch.Tensor, *args: object) -> torch.Tensor:
        """The op's CUDA kernel: `call_realigning` of `launcher_for(recipe)(a, b, *args)`."""
        return ops.call_realigning(recipe.ir, call, a, b, args)

    t0 = time.perf_counter()
    probe = ops.define("overhead_probe(Tensor a, Tensor b, Tensor bias) -> Tensor", {"CPU": body},
                       lambda a, b, bias: a.new_empty(a.shape[0], b.shape[1]), lambda ctx, g: (None, None, None),
                       None).default
    first_us = (time.perf_counter() - t0) * 1e6
    further = gg.Recipe("overhead_probe_next", lambda acc, bias: acc * bias, operands={"bias": gg.RowVector(gg.bf16)})
    t0 = time.perf_counter()
    ops.op(further)
    next_us = (time.perf_counter() - t0) * 1e6
    body(a, b, bias)
    allowed = (a, b, bias)
    rows = {}
    if stub is not None:
        from gemmgen.runtime import driver

        out = kernel(a, b, bias)
        prep = kernel.prepare(a, b, bias, out=out)
        assert prep.params is not None, "a non-empty problem has arguments to launch"
        params = prep.params
        fn, info = kernel._function(-1), kernel.compiled.info
        rows["raw cuLaunchKernelEx (prepared arguments)"] = _us(lambda: driver.launch(
            fn, params, prep.grid, info.max_threads, kernel.compiled.config.cluster, info.smem_bytes, STREAM))
        rows["Kernel.__call__, out given"] = _us(lambda: kernel(a, b, bias, out=out))
        rows["Kernel.__call__, D allocated"] = _us(lambda: kernel(a, b, bias))
    rows.update({
        "Kernel.prepare (checks hit, D allocated)": _us(lambda: kernel.prepare(a, b, bias)),
        "  of which torch.empty_strided of D": _us(
            lambda: torch.empty_strided((64, 64), (64, 1), dtype=torch.bfloat16)),
        "kernel_for (config and kernel lookup)": _us(lambda: ops.kernel_for(recipe, a, b)),
        "direct_call_allowed (the module's check)": _us(lambda: ops.direct_call_allowed(allowed, "cpu")),
        "module eager path (check, then the body)": _us(
            lambda: ops.direct_call_allowed(allowed, "cpu") and body(a, b, bias)),
        "op body called directly": _us(lambda: body(a, b, bias)),
        "op through the dispatcher": _us(lambda: probe(a, b, bias)),
    })
    with torch.no_grad():
        rows["op through the dispatcher, no_grad"] = _us(lambda: probe(a, b, bias))
    with torch.inference_mode():
        rows["op through the dispatcher, inference_mode"] = _us(lambda: probe(a, b, bias))
    where = "driver calls into the stub libcuda" if stub is not None else "driver calls left out"
    print(f"# CPU, torch {torch.__version__}, {recipe.name} ({kernel.compiled.config.name}) 64x64x64, "
          f"median of 7x5000 calls; {where}")
    print(f"{'registering the first op of the process':45s} {first_us:6.0f} us")
    print(f"{'registering a further op (once per recipe)':45s} {next_us:6.0f} us")
    raw = rows.get("raw cuLaunchKernelEx (prepared arguments)")
    launching = ("Kernel.__call__", "module eager path", "op ")  # the rows that include the launch
    for name, us in rows.items():
        over = f"   over raw: {us - raw:5.1f} us" if raw is not None and name.startswith(launching) else ""
        print(f"{name:45s} {us:6.1f} us{over}")
    dispatcher = rows["op through the dispatcher"] - rows["op body called directly"]
    print(f"{'dispatcher (op minus its body)':45s} {dispatcher:6.1f} us")
    if stub is not None:
        grouped_cpu_overheads()


def _grouped_inputs(device: str) -> tuple:
    """moe_up's arguments for 8 groups of 8 rows, 64 x 64 (a, b, offsets, bias, weight)."""
    a = torch.randn(64, 64, device=device).bfloat16()
    b = torch.randn(8, 64, 64, device=device).bfloat16().transpose(1, 2)
    offsets = torch.arange(1, 9, dtype=torch.int32, device=device) * 8
    return a, b, offsets, torch.randn(8, 64, device=device).bfloat16(), torch.rand(64, device=device)


def _grouped_launches(kernel, args: tuple, stream: int):
    """Both launches of a grouped call with prepared arguments: what a raw caller would issue."""
    from gemmgen.runtime import driver
    from gemmgen.runtime.grouped import SETUP_BLOCK

    prep = kernel.prepare(*args)
    gemm, setup = kernel._functions(prep.device_index)
    info, cluster = kernel.compiled.info, kernel.compiled.config.cluster

    def raw() -> None:
        driver.launch_function(setup, prep.setup, prep.setup_grid, SETUP_BLOCK, 0, stream)
        driver.launch(gemm, prep.params, prep.grid, info.max_threads, cluster, info.smem_bytes, stream)

    return raw, prep


def grouped_cpu_overheads() -> None:
    """The grouped example (moe_up) the same way: its two raw launches, GroupedKernel.__call__, and
    a probe op whose CPU kernel is the grouped op's CUDA body (`call_realigning` of its kernel
    lookup and call)."""
    from gemmgen.integrations.grouped import GroupedOp
    from gemmgen.runtime.grouped import GroupedKernel
    from gemmgen.tuning import config_for

    recipe = load_recipes(ROOT / "examples" / "recipes.py")["moe_up"]
    args = _grouped_inputs("cpu")
    kernel = GroupedKernel(recipe.build(config_for(recipe, 64, 64, 64, 8)), require_cuda=False)  # the op's: swapped
    kernel_key = GroupedOp(recipe).key
    kernels = {kernel_key(args[0], args[1]): kernel}
    raw, prep = _grouped_launches(kernel, args, STREAM)
    out = prep.output

    def launch(a: torch.Tensor, b: torch.Tensor, *rest: Any) -> torch.Tensor:  # grouped_backends' `launch`
        return kernels[kernel_key(a, b)](a, b, *rest)

    def body(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
        return ops.call_realigning(recipe.ir, launch, a, b, rest)

    probe = ops.define("grouped_overhead_probe(Tensor a, Tensor b, Tensor offsets, Tensor bias, Tensor weight) "
                       "-> Tensor", {"CPU": body}, lambda a, b, *rest: a.new_empty(a.shape[0], b.shape[-1]),
                       lambda ctx, g: (None,) * 5, None).default
    rows = {"raw setup + GEMM launches (prepared arguments)": _us(raw),
            "GroupedKernel.__call__, out given": _us(lambda: kernel(*args, out=out)),
            "GroupedKernel.__call__, D allocated": _us(lambda: kernel(*args)),
            "kernel_key (the op's kernel lookup)": _us(lambda: kernel_key(args[0], args[1])),
            "grouped op body called directly": _us(lambda: body(*args)),
            "grouped op through the dispatcher": _us(lambda: probe(*args))}
    base = rows["raw setup + GEMM launches (prepared arguments)"]
    print(f"# {recipe.name} ({kernel.compiled.config.name}, 8 groups of 8 rows, 64 x 64): two launches per call")
    for name, us in rows.items():
        over = f"   over raw: {us - base:5.1f} us" if name.startswith(("Grouped", "grouped")) else ""
        print(f"{name:45s} {us:6.1f} us{over}")


def main() -> None:
    cpu_overheads()
    if torch.cuda.is_available():
        gpu_overheads()


def _host_us(fn, calls: int = 2000, rounds: int = 7) -> float:
    """Host microseconds per call; the GPU drains between rounds so the launch queue never fills."""
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_overheads() -> None:
    from gemmgen.integrations.ops import caller, kernel_for
    from gemmgen.nn import linear_recipe
    from gemmgen.runtime import driver
    from gemmgen.tuning import config_for

    recipe = linear_recipe("silu", True, torch.bfloat16)
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16).t()
    bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    call, k = caller(recipe), cast(Kernel, kernel_for(recipe, a, w))
    out = k(a, w, bias=bias)
    prep = k.prepare(a, w, bias=bias, out=out)
    fn = k._function(prep.device_index)
    stream = driver.current_stream(prep.device_index)
    info, cluster = k.compiled.info, k.compiled.config.cluster
    params = prep.params
    assert params is not None, "a non-empty problem has arguments to launch"

    def raw() -> None:
        driver.launch(fn, params, prep.grid, info.max_threads, cluster, info.smem_bytes, stream)

    timings = {"raw cuLaunchKernelEx (prepared arguments)": _host_us(raw)}
    with torch.no_grad():
        timings.update({
            "Kernel.__call__ (checks, arguments, output)": _host_us(lambda: k(a, w, bias)),
            "module eager path (OpCaller, direct)": _host_us(lambda: call(a, w, bias)),
            "torch.ops.gemmgen op, no_grad": _host_us(lambda: call.overload(a, w, bias)),
        })
    timings["torch.ops.gemmgen op, grad mode on"] = _host_us(lambda: call.overload(a, w, bias))
    base = timings["raw cuLaunchKernelEx (prepared arguments)"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, host us per call, median of 7x2000 calls")
    for name, us in timings.items():
        print(f"{name:45s} {us:6.1f} us   over raw: {us - base:5.1f} us")
    _stream_k_workspace_cost()
    grouped = load_recipes(ROOT / "examples" / "recipes.py")["moe_up"]
    op, args = ops.op(grouped).default, _grouped_inputs("cuda")
    op(*args)  # loads the op's kernel (from the bundle on the GPU machine)
    kernel = grouped.compile(config_for(grouped, 64, 64, 64, 8))  # the op's: swapped, 8 rows per group
    raw, _ = _grouped_launches(kernel, args, driver.current_stream(args[0].device.index or 0))
    rows = {"raw setup + GEMM launches (prepared arguments)": _host_us(raw)}
    with torch.no_grad():
        rows["GroupedKernel.__call__"] = _host_us(lambda: kernel(*args))
        rows["torch.ops.gemmgen grouped op, no_grad"] = _host_us(lambda: op(*args))
    base = rows["raw setup + GEMM launches (prepared arguments)"]
    print(f"# {grouped.name} ({kernel.compiled.config.name}), 8 groups of 8 rows, 64 x 64: two launches per call")
    for name, us in rows.items():
        print(f"{name:45s} {us:6.1f} us   over raw: {us - base:5.1f} us")


def _stream_k_workspace_cost() -> None:
    """A decode step's stream-K kernel against the same tile under the persistent scheduler: the
    difference is the per-call workspace (allocated, its barriers zeroed on the stream). No raw
    launch here: a stream-K launch on a workspace whose barriers are not zeroed would wait forever."""
    from dataclasses import replace

    from gemmgen.tuning.heuristic import choose
    from tests.data.gpu_matrix import DECODE_PROBLEM

    recipe = load_recipes(ROOT / "examples" / "recipes.py")["bias_gelu"]
    m, n, k = DECODE_PROBLEM
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    stream_k = choose(recipe.ir, m, n, k).config
    rows = {}
    for config in (stream_k, replace(stream_k, tile_scheduler=gg.TileScheduler.PERSISTENT)):
        kernel = recipe.compile(config)
        out = kernel(a, w, bias=bias)
        rows[f"Kernel.__call__, {config.name}"] = _host_us(lambda kernel=kernel, out=out: kernel(a, w, bias, out=out))
    print(f"# {recipe.name} at {m} x {n} x {k}: the stream-K kernel's workspace per call")
    for name, us in rows.items():
        print(f"{name:60s} {us:6.1f} us")


if __name__ == "__main__":
    main()

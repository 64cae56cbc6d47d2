"""GEMMGEN_JIT=async: a call whose kernel no store holds starts at once, runs the recipe unfused
while a background worker compiles the kernel, and launches the kernel once it is ready; it waits
instead under deterministic mode (and CUDA-graph capture), saying why."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gemmgen as gg
from gemmgen import env
from gemmgen.compile.background import BackgroundBuilds
from gemmgen.compile.cache import KernelCache
from gemmgen.errors import GemmgenWarning
from gemmgen.integrations import ops
from gemmgen.integrations.pending import PendingKernel
from gemmgen.testing.calls import fresh_args
from tests.compile.slow_compiler import slow_compile

SLOW = 6.0  # seconds the stand-in compiler takes: far more than an unfused call


def test_the_jit_setting_reads_its_three_modes_and_refuses_others(monkeypatch):
    for value, mode in (("1", env.JitMode.WAIT), ("yes", env.JitMode.WAIT), ("0", env.JitMode.OFF),
                        ("off", env.JitMode.OFF), ("async", env.JitMode.ASYNC), (" ASYNC ", env.JitMode.ASYNC)):
        monkeypatch.setenv("GEMMGEN_JIT", value)
        assert env.jit_mode() is mode and env.jit_enabled() is (mode is not env.JitMode.OFF)
    monkeypatch.setenv("GEMMGEN_JIT", "asnyc")
    with pytest.raises(gg.InvalidArgument, match=r"GEMMGEN_JIT='asnyc': expected 1 .*, 0 .* or async"):
        env.jit_mode()


class _Fused:
    """Stands for the compiled kernel on the CPU: records that it ran, and runs the reference."""

    def __init__(self, recipe: gg.Recipe, compiled) -> None:
        self.recipe, self.compiled, self.calls = recipe, compiled, 0

    def __call__(self, a, b, *args, out=None):
        self.calls += 1
        return ops.run_unfused(ops.kind_of(self.recipe), a, b, args)


@pytest.fixture
def background(monkeypatch, tmp_path, compiled, session_cache):
    """GEMMGEN_JIT=async with an empty cache, a stand-in compiler of SLOW seconds in a spawned
    worker, and kernels that load from that cache (a hit, no NVRTC) into `_Fused` stand-ins."""
    store = KernelCache(tmp_path / "cache")
    builds = BackgroundBuilds(worker=slow_compile, jobs=1)
    monkeypatch.setenv("GEMMGEN_JIT", "async")
    monkeypatch.setenv("SLOW_COMPILER_SECONDS", str(SLOW))
    monkeypatch.setenv("SLOW_COMPILER_SOURCE", str(session_cache.root))
    monkeypatch.setattr(ops, "BACKGROUND", builds)
    monkeypatch.setattr(importlib.import_module("gemmgen.aot.warmup"), "BACKGROUND", builds)
    monkeypatch.setattr(ops, "default_cache", lambda: store)
    loaded: list[_Fused] = []

    def compile_from_cache(self, config=None, *, cache=None):
        from gemmgen.compile import build_kernel

        monkeypatch.setenv("GEMMGEN_JIT", "0")  # a hit: compiling here would be the bug
        try:
            fused = _Fused(self, build_kernel(self.ir, config, store))
        finally:
            monkeypatch.setenv("GEMMGEN_JIT", "async")
        loaded.append(fused)
        return fused

    monkeypatch.setattr(gg.Recipe, "compile", compile_from_cache)
    ops._LAUNCHERS.clear()
    yield builds, loaded
    builds.shutdown()
    ops._LAUNCHERS.clear()


def _call(recipe: gg.Recipe, seed: int):
    torch.manual_seed(seed)
    a, b, operands = fresh_args(recipe.ir, 70, 48, 96, ())
    args = tuple(operands[n] for n in ops.kind_of(recipe).names)
    return a, b, args


def _reference(recipe: gg.Recipe, a, b, args):
    return recipe.reference(a, b, **dict(zip(ops.kind_of(recipe).names, args, strict=True)))


@pytest.mark.nvrtc  # the kernel the stand-in compiler stores is the session's
def test_a_first_call_runs_unfused_at_once_and_later_calls_launch_the_kernel(background, examples):
    """The example bias_gelu (whose kernel the session compiled) on a cold cache: the first call
    returns before the compile could have ended, with the recipe's reference; once the worker
    stored the kernel, the next call launches it, loaded from the cache; the report says how long
    the recipe ran unfused and how many calls did."""
    builds, loaded = background
    recipe = examples["bias_gelu"]
    launcher = ops.launcher_for(recipe)
    a, b, args = _call(recipe, 0)
    start = time.monotonic()
    got = launcher(a, b, *args)
    first = time.monotonic() - start
    assert first < SLOW / 2, f"the first call took {first:.1f} s: it waited for the compile"
    torch.testing.assert_close(got, _reference(recipe, a, b, args), rtol=0, atol=0)
    pending = launcher.kernel_for(a, b)
    assert isinstance(pending, PendingKernel) and pending.build.state == "compiling" and not loaded
    for seed in range(1, 3):  # more steps, still unfused
        a, b, args = _call(recipe, seed)
        launcher(a, b, *args)
    deadline = time.monotonic() + 120
    while not pending.build.ready():
        assert time.monotonic() < deadline, f"the background build did not end: {pending.build}"
        time.sleep(0.2)
    a, b, args = _call(recipe, 9)
    got = launcher(a, b, *args)
    assert len(loaded) == 1 and loaded[0].calls == 1, "the call after the build did not launch the kernel"
    torch.testing.assert_close(got, _reference(recipe, a, b, args), rtol=0, atol=0)
    launcher(a, b, *args)
    assert loaded[0].calls == 2 and len(loaded) == 1  # loaded once
    build, = builds.builds()
    assert build.unfused_calls == 3 and build.state == "ready"
    assert SLOW <= build.unfused_seconds < 120
    row = next(line for line in gg.unfused_report().splitlines() if line.startswith("bias_gelu"))
    assert row.split()[2:] == ["ready", f"{build.unfused_seconds:.1f}", "3"], row


@pytest.mark.nvrtc
def test_deterministic_mode_waits_for_the_compile_and_says_why(background, examples):
    builds, loaded = background
    recipe = examples["bias_gelu"]
    a, b, args = _call(recipe, 0)
    torch.use_deterministic_algorithms(True)
    try:
        start = time.monotonic()
        with pytest.warns(GemmgenWarning, match="waiting for bias_gelu's kernel .* deterministic mode"):
            ops.launcher_for(recipe)(a, b, *args)
        assert time.monotonic() - start >= SLOW * 0.9
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(loaded) == 1 and loaded[0].calls == 1
    assert builds.builds()[0].unfused_calls == 0


def test_a_models_first_training_step_starts_without_waiting_for_a_compile(tmp_path):
    """gemmgen.testing.first_step's model (a FusedMLP and a FusedLinear) fused and warmed up on a
    cold cache under GEMMGEN_JIT=async, in a child process that calls the ops as a GPU process does
    (tests/compile/async_step_child.py: the compiler takes SLOW seconds a kernel): warm-up and the
    first step end long before any compile could; the steps before the builds end run unfused,
    the bits of the CPU path; every kernel `model_launches` lists for the step was requested once,
    by warm-up; the step after the builds launches each kernel, and nothing runs unfused again."""
    from gemmgen.testing.first_step import fused_model, training_step

    result = tmp_path / "result.json"
    env = {**os.environ, "GEMMGEN_JIT": "async", "SLOW_COMPILER_SECONDS": str(SLOW)}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("async_step_child.py")),
                           str(tmp_path / "cache"), str(result)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"the child failed:\n{done.stdout}\n{done.stderr}"
    got = json.loads(result.read_text())
    waited = got["load_seconds"] + got["first_step_seconds"]
    assert waited < SLOW / 2, f"load, warm-up and the first step took {waited:.1f} s: something waited for a compile"
    launches = got["launches"]
    assert len(launches) == 3 and sorted(name for name, _, _ in got["requested"]) == launches, got["requested"]
    assert all(state == "compiling" and calls > 0 for _, state, calls in got["requested"]), got["requested"]
    assert got["after"] == [[name, "ready", calls] for name, _, calls in got["requested"]], \
        "a call ran unfused after its kernel was ready"
    assert got["stand_in_calls"] == {"linear_gelu_bias_bf16_train": 1, "linear_gelu_bias_bf16_bwd": 1,
                                     "linear_none_bias_bf16": 2}, "the step after the builds did not launch each kernel"
    assert all(" ready " in line for line in got["report"].splitlines()[2:]) and len(got["report"].splitlines()) == 5
    model = fused_model()
    for seed, step in enumerate(got["steps"]):
        assert step == training_step(model, seed), f"step {seed} differs from the unfused CPU path's"

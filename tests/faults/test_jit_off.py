"""GEMMGEN_JIT=0 holds on every path that could compile at run time: a lazy first call, warm-up at
model load (of recipes, of pairs, of a model's launch list), autotune. Each reports every missing
kernel with the command that builds it, and compiles nothing. The explicit ahead-of-time builds
(`gemmgen build`, `gemmgen.build_bundle`) compile regardless: building is what they are for."""

from __future__ import annotations

import json

import pytest

import gemmgen as gg
from gemmgen.compile import KernelCache, bundles

pytestmark = pytest.mark.faults


@pytest.fixture
def jit_off(monkeypatch, tmp_path):
    """GEMMGEN_JIT=0, no bundles, an empty cache, and an NVRTC that fails the test if reached."""
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)
    bundles._FROM_ENV.clear()

    def no_compile(kernel):
        raise AssertionError(f"compiled {kernel.entry} under GEMMGEN_JIT=0")

    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", no_compile)
    return KernelCache(tmp_path / "empty")


def _missing_all(excinfo, recipes) -> None:
    message = str(excinfo.value)
    assert f"{len(recipes)} kernels are in no bundle" in message and "GEMMGEN_JIT=0 forbids compiling them" in message
    for r in recipes:
        assert f"recipe {r.name!r} with config {r.default_config().name}" in message
    assert "gemmgen build RECIPES.py --out DIR" in message and "GEMMGEN_BUNDLE_PATH=DIR" in message


def test_warmup_compiles_nothing_and_names_every_missing_kernel(jit_off, examples):
    recipes = [examples[n] for n in ("gemm_bf16", "bias_gelu", "moe_up")]
    with pytest.raises(gg.KernelNotAvailable) as e:
        gg.warmup(recipes, cache=jit_off, quiet=True)
    _missing_all(e, recipes)


def test_warmup_with_shapes_and_of_pairs_compile_nothing(jit_off, examples):
    r = examples["bias_gelu"]
    with pytest.raises(gg.KernelNotAvailable, match="the kernel for recipe 'bias_gelu'"):
        gg.warmup([r], shapes={"bias_gelu": [[8, 4096, 4096]]}, cache=jit_off, quiet=True)
    with pytest.raises(gg.KernelNotAvailable, match="the kernel for recipe 'bias_gelu'"):
        gg.warmup([(r, r.default_config())], cache=jit_off, quiet=True)


def test_a_models_launch_list_warms_up_under_the_same_rule(jit_off):
    model = gg.nn.FusedLinear(64, 128, activation="gelu")
    launches = gg.nn.model_launches(model, (1, 4096))
    with pytest.raises(gg.KernelNotAvailable, match=r"(kernels are|the kernel for recipe) .*in no bundle"):
        gg.warmup(launches, cache=jit_off, quiet=True)


def test_warmup_under_jit_off_loads_what_the_cache_holds(session_cache, compiled, examples, monkeypatch):
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", lambda k: pytest.fail("compiled"))
    kernels = gg.warmup([examples["gemm_bf16"]], cache=session_cache, quiet=True)
    assert [k.origin for k in kernels] == ["cache"]


def test_autotune_compiles_no_candidate(jit_off, examples, monkeypatch):
    from gemmgen import tuning

    monkeypatch.setattr("gemmgen.compile.parallel.default_cache", lambda: jit_off)
    monkeypatch.setattr("gemmgen.compile.build.default_cache", lambda: jit_off)
    with pytest.raises(gg.KernelNotAvailable, match="kernels are in no bundle"):
        gg.autotune(examples["gemm_bf16"], [(512, 4096, 4096)], timer=lambda *a: 1.0,
                    device=tuning.Device("NVIDIA H200", "13.0"), sm_count=132, register=False)


def test_a_lazy_first_call_compiles_nothing(jit_off, examples):
    from gemmgen.testing.calls import cpu_kernel

    r = examples["gemm_bf16"]
    with pytest.raises(gg.KernelNotAvailable, match="the kernel for recipe 'gemm_bf16'"):
        cpu_kernel(r.build(cache=jit_off))


def test_build_bundle_and_gemmgen_build_compile_under_jit_off(session_cache, compiled, examples, tmp_path,
                                                             monkeypatch, capsys):
    """The build step is where kernels are meant to be compiled: NVRTC (stood in for by the
    session's artifacts) runs for a cold cache even with GEMMGEN_JIT=0 set."""
    from gemmgen.cli import main

    monkeypatch.setenv("GEMMGEN_JIT", "0")
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)
    bundles._FROM_ENV.clear()
    ran: list[str] = []

    def stand_in(kernel):
        ran.append(kernel.entry)
        return session_cache.get(compiled["gemm_bf16"].cache_key)

    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", stand_in)
    r = examples["gemm_bf16"]
    kernels = gg.build_bundle([r], tmp_path / "b1", cache=KernelCache(tmp_path / "c1"), jobs=1, quiet=True)
    assert [k.origin for k in kernels] == ["compiled"] and len(ran) == 1
    from tests.data import EXAMPLES

    assert main(["build", str(EXAMPLES), "--recipe", "gemm_bf16", "--cache-dir", str(tmp_path / "c2"), "-j", "1",
                 "--out", str(tmp_path / "b2")]) == 0
    assert len(ran) == 2 and json.loads((tmp_path / "b2" / "manifest.json").read_text())["kernels"]
    capsys.readouterr()

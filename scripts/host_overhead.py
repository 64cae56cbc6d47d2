"""Host cost of one call of a cached kernel, on the CPU: argument checks, output handling, Params
building and tensor-map encoding through the recording stand-in (the driver's encode is not timed).
Four cases: every tensor as in the last call; the same inputs with D allocated; tensors at new
addresses but shaped like an earlier call's (new activations); and tensors never seen. Then the
grouped example (moe_up, 8 groups): every tensor as in the last call, D allocated, and cold.

    python scripts/host_overhead.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from gemmgen.aot import load_recipes
from gemmgen.runtime.grouped import GroupedKernel
from gemmgen.runtime.kernel import Kernel
from gemmgen.testing.recording import RecordingEncoder
from gemmgen.testing.timing import median_us

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    recipe = load_recipes(ROOT / "examples" / "recipes.py")["bias_gelu"]
    enc = RecordingEncoder(strict=False)
    kernel = Kernel(recipe.build(), encoder=enc, hardware=lambda i: (132, 0), require_cuda=False)
    m, n, k = 4096, 4096, 4096
    a = torch.empty(m, k, dtype=torch.bfloat16)
    b = torch.empty(n, k, dtype=torch.bfloat16).t()
    bias = torch.empty(n, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)

    def call(**kw):
        enc.calls.clear()
        return kernel.prepare(a, b, bias=bias, **kw)

    def new_addresses(**kw):
        kernel._plans.clear()  # as if every tensor were new, but shaped like the last call's
        return call(**kw)

    def cold(**kw):
        kernel._plans.clear()  # every call checks and builds from scratch
        kernel._layouts.clear()
        return call(**kw)

    print(f"# {recipe.name} ({kernel.compiled.config.name}), torch {torch.__version__}, CPU, median of 7x2000")
    print(f"same tensors, out= given:       {median_us(lambda: call(out=out)):.1f} us per call")
    print(f"same inputs, D allocated:       {median_us(call):.1f} us per call")
    print(f"  of which torch.empty of D:    {median_us(lambda: torch.empty(m, n, dtype=torch.bfloat16)):.1f} us "
          "(CPU allocator; CUDA's caching allocator is far cheaper)")
    print(f"new addresses, known layout:    {median_us(lambda: new_addresses(out=out), reps=300):.1f} us per call")
    print(f"no reuse (cold host path):      {median_us(lambda: cold(out=out), reps=300):.1f} us per call")
    grouped()


def grouped() -> None:
    recipe = load_recipes(ROOT / "examples" / "recipes.py")["moe_up"]
    kernel = GroupedKernel(recipe.build(), encoder=RecordingEncoder(strict=False), hardware=lambda i: (132, 0),
                           require_cuda=False)
    rows, n, k, groups = 4096, 2048, 4096, 8
    a = torch.empty(rows, k, dtype=torch.bfloat16)
    b = torch.empty(groups, n, k, dtype=torch.bfloat16).transpose(1, 2)
    offsets = torch.arange(1, groups + 1, dtype=torch.int32) * (rows // groups)
    bias, weight = torch.empty(groups, n, dtype=torch.bfloat16), torch.empty(rows)
    out = torch.empty(rows, n, dtype=torch.bfloat16)

    def call(**kw):
        return kernel.prepare(a, b, offsets, bias=bias, weight=weight, **kw)

    def cold(**kw):
        kernel._plans.clear()
        return call(**kw)

    print(f"# {recipe.name} ({kernel.compiled.config.name}, {groups} groups): setup block and Params per call")
    print(f"same tensors, out= given:       {median_us(lambda: call(out=out)):.1f} us per call")
    print(f"same inputs, D allocated:       {median_us(call):.1f} us per call")
    print(f"no reuse (cold host path):      {median_us(lambda: cold(out=out), reps=300):.1f} us per call")


if __name__ == "__main__":
    main()

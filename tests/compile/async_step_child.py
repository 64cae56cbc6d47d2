"""A model's first training steps under GEMMGEN_JIT=async on a cold cache, run by
tests/compile/test_async_jit.py in a child process (a process defines each op once, and this one
defines them as a GPU process does):

    python tests/compile/async_step_child.py CACHE_DIR RESULT_FILE

What stands in for what a CPU machine lacks, and nothing else:
- the ops' CPU kernels are their CUDA kernels (`ops.define` given the CUDA function for both), so a
  call on CPU tensors goes the GPU's way: the launch policy, the launcher, the pending kernel;
- the background compiler sleeps SLOW_COMPILER_SECONDS and stores nothing (`sleeping_compile`),
  and `Recipe.compile`, which would load the built kernel from the cache, returns a `Stand-in` that
  counts its calls and runs the recipe unfused (the kernels' bits are not what this checks).

It fuses gemmgen.testing.first_step's model, warms it up as a training script would
(`model_launches`, `gemmgen.warmup`), and runs three training steps: the first two at once, the
third once every build is ready. It writes what the parent asserts: timings, the builds, each
step's loss and gradients.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(cache_dir: str, result: str) -> None:
    sys.path.insert(0, str(ROOT))
    import importlib

    import gemmgen as gg
    from gemmgen.compile.background import BackgroundBuilds
    from gemmgen.compile.cache import KernelCache
    from gemmgen.integrations import ops
    from gemmgen.testing.first_step import TOKENS, fused_model, training_step
    from tests.compile.slow_compiler import sleeping_compile

    real_define = ops.define
    ops.define = lambda schema, backends, *rest: real_define(schema, {**backends, "CPU": backends["CUDA"]}, *rest)
    builds = BackgroundBuilds(worker=sleeping_compile, jobs=3)
    ops.BACKGROUND = builds
    importlib.import_module("gemmgen.aot.warmup").BACKGROUND = builds  # type: ignore[attr-defined]
    store = KernelCache(cache_dir)
    ops.default_cache = lambda: store  # type: ignore[assignment]
    stand_ins: dict[str, int] = {}

    class StandIn:
        def __init__(self, recipe: gg.Recipe) -> None:
            self.recipe = recipe
            stand_ins[recipe.name] = 0

        def __call__(self, a, b, *args, out=None, **operands):
            stand_ins[self.recipe.name] += 1
            kind = ops.kind_of(self.recipe)
            args = (*args, *(operands[n] for n in kind.names[len(args):] if n in operands))
            return ops.run_unfused(kind, a, b, args)

    def load(self, config=None, *, cache=None):
        assert self.name not in stand_ins, f"{self.name}'s kernel loaded twice"
        return StandIn(self)

    gg.Recipe.compile = load  # type: ignore[method-assign]

    start = time.monotonic()
    fused = fused_model()
    launches = gg.nn.model_launches(fused, (), training_tokens=(TOKENS,))
    gg.warmup(launches, cache=store, quiet=True)
    loaded = time.monotonic()
    first = training_step(fused, 0)
    first_done = time.monotonic()
    second = training_step(fused, 1)
    requested = [(b.name, b.state, b.unfused_calls) for b in builds.builds()]
    for build in builds.builds():
        build.wait()
    third = training_step(fused, 2)
    Path(result).write_text(json.dumps({
        "load_seconds": loaded - start, "first_step_seconds": first_done - loaded,
        "launches": sorted(r.name for r, _ in launches), "requested": requested,
        "after": [(b.name, b.state, b.unfused_calls) for b in builds.builds()], "stand_in_calls": stand_ins,
        "report": gg.unfused_report(), "steps": [first, second, third]}))
    builds.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])

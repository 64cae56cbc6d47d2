"""Time from model load to the first training step on a cold cache, under GEMMGEN_JIT=1 (warm-up
compiles every kernel the step launches, then the step runs) and GEMMGEN_JIT=async (warm-up returns
at once, the step runs its recipes unfused while background workers compile); the model is
gemmgen.testing.first_step's (a FusedMLP and a FusedLinear, 3 kernels for a training step).

    python scripts/first_step.py --jit async
    python scripts/first_step.py --jit 1

Both compile with gemmgen's default number of workers (as many as the cores and the memory allow).

On a machine without a GPU the step runs the recipes' reference in torch whatever the mode: what
the figures show there is how long warm-up keeps a step waiting, with NVRTC's real compiles.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", choices=("1", "async"), required=True)
    args = parser.parse_args()
    os.environ["GEMMGEN_JIT"] = args.jit
    cache_dir = tempfile.mkdtemp(prefix="gemmgen-first-step-")  # cold
    os.environ["GEMMGEN_CACHE_DIR"] = cache_dir

    import torch

    import gemmgen as gg
    from gemmgen.compile.background import BACKGROUND
    from gemmgen.testing.first_step import TOKENS, fused_model, training_step

    start = time.monotonic()
    model = fused_model()
    fused = time.monotonic()
    launches = gg.nn.model_launches(model, (), training_tokens=(TOKENS,))
    gg.warmup(launches, quiet=True)
    warmed = time.monotonic()
    training_step(model, 0)
    stepped = time.monotonic()
    builds = BACKGROUND.builds()
    for build in builds:
        build.wait()
    ready = time.monotonic()
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {now:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, GEMMGEN_JIT={args.jit}, {len(launches)} kernels, cache {cache_dir} (cold)")
    print("| load and fuse | warm-up | first step | load to first step done | every kernel built |")
    print("|---|---|---|---|---|")
    built = f"{ready - start:.1f} s" if builds else f"{warmed - start:.1f} s (in warm-up)"
    print(f"| {fused - start:.2f} s | {warmed - fused:.2f} s | {stepped - warmed:.2f} s | {stepped - start:.2f} s | "
          f"{built} |")
    BACKGROUND.shutdown()


if __name__ == "__main__":
    main()

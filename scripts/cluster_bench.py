"""What the cluster paths cost on this machine (CPU only; docs/design/measurements.md has the figures).

    python scripts/cluster_bench.py [--cache DIR] [--ranks 1 2 4] [--kernels 8]

1. A remote hit (a redis-server of its own on loopback) against a local disk hit, per kernel: the
   example recipes' default kernels, taken from a cache that holds them (`--cache`, default
   GEMMGEN_TEST_CACHE_DIR or the user's cache; `gemmgen build examples/recipes.py` fills it).
   Each read is validated as a load is (digests, metadata, ELF); the remote hit also stores the
   kernel in an empty local cache, as a real hit does.
2. Distributed warm-up of N kernels over 1, 2 and 4 gloo ranks (processes here, each with an empty
   cache folder): the compile count per rank and the time of the gather and exchange phases. The
   NVRTC step is a copy of the cached artifact (a compile is CPU-bound, 25-50 s, and this machine
   has 2 cores: a speed-up measured here would say nothing about a cluster).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemmgen import env  # noqa: E402
from gemmgen.aot import load_recipes  # noqa: E402
from gemmgen.codegen import render_kernel  # noqa: E402
from gemmgen.compile import KernelCache  # noqa: E402
from gemmgen.compile.build import cache_key, kernel_check  # noqa: E402
from gemmgen.compile.remote import RemoteTier, backend_for  # noqa: E402
from gemmgen.testing.servers import redis_server  # noqa: E402

EXAMPLES = ROOT / "examples" / "recipes.py"

RANK = textwrap.dedent("""
    import datetime, json, sys, time
    sys.path.insert(0, {root!r})
    rank, world, names = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    store, caches = sys.argv[4], sys.argv[5]
    import torch.distributed as dist
    import gemmgen
    import gemmgen.compile.build as build
    from gemmgen.aot import load_recipes
    from gemmgen.aot.distributed import process_group, share_kernels
    from gemmgen.compile.cache import KernelCache
    source = KernelCache({source!r})
    build.compile_artifact = lambda kernel: source.get(build.cache_key(kernel))  # stands in for NVRTC
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    recipes = load_recipes({examples!r})
    pairs = [(recipes[n].ir, recipes[n].default_config()) for n in names]
    start = time.perf_counter()
    report = share_kernels(pairs, process_group(), KernelCache(caches + "/" + str(rank)), jobs=1, quiet=True)
    total = time.perf_counter() - start
    print(json.dumps({{"compiled": len(report.compiled_here), "received": len(report.received),
                      "seconds": report.seconds, "total": total}}))
""")


def remote_vs_disk(source: KernelCache, repeats: int) -> None:
    recipes = load_recipes(EXAMPLES)
    kernels = [render_kernel(r.ir, r.default_config()) for r in recipes.values()]
    keyed = [(k, cache_key(k)) for k in kernels]
    found = [(k, key, art) for k, key in keyed if (art := source.get(key)) is not None]
    if not found:
        sys.exit(f"no example kernel is in {source.root}: run `gemmgen build examples/recipes.py` first")
    size = statistics.median(len(a.files["kernel.cubin"]) + len(a.files["kernel.cu"]) for _, _, a in found)
    print(f"{len(found)} kernels from {source.root} (median {size / 1e6:.2f} MB of cubin and source)")
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as server:
        tier = RemoteTier(backend_for(server.url, timeout=5.0), source.arch.value)
        for _, key, art in found:
            tier.store(key, art)
        disk, fetch, fetch_store = [], [], []
        for i in range(repeats):
            for k, key, _ in found:
                check = kernel_check(k)
                t = time.perf_counter()
                assert KernelCache(source.root, source.arch).get(key, check) is not None
                disk.append(time.perf_counter() - t)
                t = time.perf_counter()
                art = tier.fetch(key, check)
                fetch.append(time.perf_counter() - t)
                assert art is not None
                local = KernelCache(Path(tmp) / f"local{i}", source.arch)
                t = time.perf_counter()
                assert tier.fetch(key, check) is not None
                local.get_or_build(key, functools.partial(lambda a: a, art), check=check)
                fetch_store.append(time.perf_counter() - t)
    ms = {name: statistics.median(v) * 1e3 for name, v in
          (("disk hit", disk), ("remote hit", fetch), ("remote hit + local store", fetch_store))}
    for name, value in ms.items():
        print(f"  {name:26s} {value:7.2f} ms per kernel (median of {len(disk)})")
    print(f"  remote hit / disk hit: {ms['remote hit'] / ms['disk hit']:.1f}x; a compile is 25-50 s")


def warmup_over_ranks(source: KernelCache, ranks: list[int], count: int) -> None:
    names = [n for n, r in load_recipes(EXAMPLES).items()
             if source.get(cache_key(render_kernel(r.ir, r.default_config()))) is not None][:count]
    print(f"distributed warm-up of {len(names)} kernels, empty caches, NVRTC replaced by a cache copy:")
    for world in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            script = RANK.format(root=str(ROOT), source=str(source.root), examples=str(EXAMPLES))
            child_env = {k: v for k, v in os.environ.items() if k != "GEMMGEN_REMOTE_CACHE"}
            procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), json.dumps(names),
                                       f"{tmp}/store", f"{tmp}/caches"], stdout=subprocess.PIPE, text=True,
                                      env=child_env) for r in range(world)]
            out = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        counts = [o["compiled"] for o in out]
        prepare = max(o["seconds"]["prepare"] for o in out)
        gather = max(o["seconds"]["gather"] for o in out)
        exchange = max(o["seconds"]["exchange"] for o in out)
        print(f"  {world} rank(s): compiled per rank {counts} (total {sum(counts)}), received per rank "
              f"{[o['received'] for o in out]}; prepare {prepare:.2f} s, gather {gather:.2f} s, "
              f"exchange {exchange:.2f} s (slowest rank), whole share {max(o['total'] for o in out):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=os.environ.get("GEMMGEN_TEST_CACHE_DIR") or str(env.cache_dir()))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kernels", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    source = KernelCache(args.cache)
    remote_vs_disk(source, args.repeats)
    warmup_over_ranks(source, args.ranks, args.kernels)


if __name__ == "__main__":
    main()

"""Warm-up across processes sharing one cold cache: each kernel compiled once, crashes tolerated.

The ranks compile through gemmgen's real path (render, key, lock, publish) with the NVRTC step
replaced by a slow copy of the session's real artifact, so the test costs seconds, not minutes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.data import EXAMPLES, ROOT

pytestmark = pytest.mark.nvrtc

RANK = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    import gemmgen.compile.build as build
    from gemmgen.compile.cache import KernelCache
    from gemmgen.aot import load_recipes

    session = KernelCache({session!r})

    def slow_copy(kernel):  # stands in for NVRTC: the real artifact, after a delay
        key = build.cache_key(kernel)
        with open({log!r}, "a") as f:
            f.write(f"start {{os.getpid()}} {{key}}\\n")
        time.sleep({delay})
        art = session.get(key)
        with open({log!r}, "a") as f:
            f.write(f"done {{os.getpid()}} {{key}}\\n")
        return art

    build.compile_artifact = slow_copy
    import gemmgen
    recipes = [r for r in load_recipes({examples!r}).values() if r.name in ("gemm_bf16", "bias_gelu", "qk_norm")]
    kernels = gemmgen.warmup(recipes, jobs=1, cache=KernelCache({root_dir!r}))
    print("OK", [k.origin for k in kernels])
""")


def _rank(tmp_path, session_cache, delay):
    script = RANK.format(root=str(ROOT), session=str(session_cache.root), log=str(tmp_path / "log"), delay=delay,
                         examples=str(EXAMPLES), root_dir=str(tmp_path / "shared"))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _log(tmp_path):
    lines = (tmp_path / "log").read_text().split("\n") if (tmp_path / "log").exists() else []
    return [line.split() for line in lines if line]


def test_four_ranks_compile_each_kernel_once_and_survive_a_kill(compiled, session_cache, tmp_path):
    ranks = [_rank(tmp_path, session_cache, delay=3.0) for _ in range(4)]
    deadline = time.time() + 60
    while not any(e[0] == "start" for e in _log(tmp_path)) and time.time() < deadline:
        time.sleep(0.05)
    first = next(e for e in _log(tmp_path) if e[0] == "start")
    victim = next(p for p in ranks if p.pid == int(first[1]))
    os.kill(victim.pid, signal.SIGKILL)  # killed while holding a compile lock
    survivors = [p for p in ranks if p is not victim]
    for p in survivors:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.startswith("OK"), out
    victim.wait()
    done = [e[2] for e in _log(tmp_path) if e[0] == "done"]
    assert sorted(done) == sorted(set(done)) and len(done) == 3, _log(tmp_path)  # each key completed once
    assert first[2] in done  # the killed rank's kernel was taken over
    starts = [e for e in _log(tmp_path) if e[0] == "start"]
    assert len(starts) == 4  # three kernels, one restarted after the kill

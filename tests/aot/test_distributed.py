"""Warm-up across torch.distributed ranks: gloo ranks (processes on this machine, a FileStore
rendezvous) warm up 8 kernels, each rank with a cache folder of its own: 4 ranks where the plan's
split is what a test checks, 2 where it checks a fault or a tier (each rank costs a core-second or
three of imports, on CI's two cores).

The ranks run gemmgen's real path (render, key, gather, plan, the worker's lock and publish, the
broadcasts, validation on receipt); only the NVRTC step is replaced by a copy of the session's
real artifact after a delay, logged, so a test costs seconds and counts every compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gemmgen.aot.distributed import RankState, make_plan
from gemmgen.compile.build import kernel_check
from gemmgen.compile.cache import KernelCache
from gemmgen.compile.remote import RemoteTier, backend_for
from gemmgen.testing.servers import redis_server, why_no_redis
from tests.data import EXAMPLES, ROOT

pytestmark = pytest.mark.distributed
NAMES = ["gemm_bf16", "bias_gelu", "scaled_mm_fp8", "moe_swiglu", "qk_norm", "row_col_amax", "moe_up",
         "moe_fp8_block"]  # kernels the session compiles (tests/data/session_kernels.COMPILED)
WORLD = 4  # ranks of the tests of the plan's split; FAULTS: of the others
FAULTS = 2
STATED_TIMEOUT = 60  # GEMMGEN_WARMUP_TIMEOUT the ranks run under: no wait may last longer

RANK = textwrap.dedent("""
    import datetime, json, os, sys, time
    sys.path.insert(0, {root!r})
    rank, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    import torch.distributed as dist
    import gemmgen
    import gemmgen.compile.build as build
    from gemmgen.compile.cache import KernelCache
    from gemmgen.aot import load_recipes

    session = KernelCache({session!r})

    def stand_in(kernel):  # for NVRTC: the session's real artifact, after a delay
        key = build.cache_key(kernel)
        with open(cfg["log"], "a") as f:
            f.write(f"{{rank}} {{key}}\\n")
        if cfg.get("die") == rank:
            os._exit(17)
        if cfg.get("fail") == kernel.recipe.name:
            raise gemmgen.CompileError("stand-in: NVRTC rejected " + kernel.recipe.name)
        time.sleep(cfg["delay"])
        return session.get(key)

    build.compile_artifact = stand_in
    dist.init_process_group("gloo", init_method="file://" + cfg["store"], rank=rank, world_size=cfg["world"],
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    recipes = load_recipes({examples!r})
    items = [recipes[n] for n in cfg["names"]]
    items[0] = (items[0], items[0].default_config())  # a (recipe, config) pair, as gemmgen.nn.model_launches lists
    group = None
    if cfg.get("group"):  # a group passed explicitly ("nccl": one that reports another backend)
        group = dist.new_group(backend="gloo")
        if cfg["group"] == "nccl":
            real = dist.get_backend
            dist.get_backend = lambda g=None: "nccl" if g is group else real(g)
    code = 0
    try:
        kernels = gemmgen.warmup(items, jobs=1, cache=KernelCache(cfg["caches"][rank]), quiet=rank != 0, group=group)
        print(json.dumps({{"ok": [[k.cache_key, k.origin] for k in kernels]}}))
    except gemmgen.GemmgenError as e:
        print(json.dumps({{"error": type(e).__name__ + ": " + str(e)}}))
        code = 3
    # as a training script ends: without it, gloo's threads can still be running at interpreter exit,
    # and their destructors abort the process ("terminate called without an active exception")
    dist.destroy_process_group()
    sys.exit(code)
""")


def _run(tmp_path: Path, session_cache: KernelCache, *, world: int = WORLD, caches: list[Path] | None = None,
         delay: float = 0.5, env: dict[str, str] | None = None,
         **cfg: object) -> tuple[list[dict], list[list[str]], float]:
    """Start `world` ranks, wait for all; (each rank's result, the compile log, seconds)."""
    caches = caches or [tmp_path / f"cache{r}" for r in range(world)]
    config = {"log": str(tmp_path / "log"), "store": str(tmp_path / "store"), "world": world, "delay": delay,
              "timeout": STATED_TIMEOUT, "names": NAMES, "caches": [str(c) for c in caches], **cfg}
    script = RANK.format(root=str(ROOT), session=str(session_cache.root), examples=str(EXAMPLES))
    child_env = {k: v for k, v in os.environ.items() if k != "GEMMGEN_REMOTE_CACHE"}
    child_env.update({"GEMMGEN_WARMUP_TIMEOUT": str(STATED_TIMEOUT), **(env or {})})
    start = time.monotonic()
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(r), json.dumps(config)], stdout=subprocess.PIPE,
                              stderr=open(tmp_path / f"rank{r}.err", "w"), text=True, env=child_env)
             for r in range(world)]
    results = []
    for r, p in enumerate(ranks):
        out, _ = p.communicate(timeout=STATED_TIMEOUT + 60)
        lines = out.strip().splitlines()
        results.append({"rc": p.returncode, **(json.loads(lines[-1]) if lines else {}),
                        "stderr": (tmp_path / f"rank{r}.err").read_text()})
    log = (tmp_path / "log").read_text().split("\n") if (tmp_path / "log").exists() else []
    return results, [line.split() for line in log if line], time.monotonic() - start


def _all_cached(caches: list[Path], compiled: dict) -> None:
    for folder in caches:
        cache = KernelCache(folder)
        for name in NAMES:
            k = compiled[name]
            assert cache.get(k.cache_key, kernel_check(k.generated)) is not None, (folder, name)


def test_four_ranks_compile_each_of_eight_kernels_once_in_total(compiled, session_cache, tmp_path):
    results, log, _ = _run(tmp_path, session_cache)
    assert all(r["rc"] == 0 for r in results), results
    keys = [key for _, key in log]
    assert sorted(keys) == sorted({compiled[n].cache_key for n in NAMES})  # each of the 8 once, in all
    per_rank = {rank: sum(1 for r, _ in log if r == rank) for rank in map(str, range(WORLD))}
    assert all(n >= 1 for n in per_rank.values()), per_rank  # split across every rank
    for rank, r in enumerate(results):
        origins = dict(r["ok"])
        assert set(origins) == {compiled[n].cache_key for n in NAMES}
        mine = {key for who, key in log if who == str(rank)}
        assert {k for k, o in origins.items() if o == "compiled"} == mine
        assert {k for k, o in origins.items() if o == "peer"} == set(origins) - mine
    _all_cached([tmp_path / f"cache{r}" for r in range(WORLD)], compiled)
    assert "distributed warm-up over 4 ranks: 8 kernel(s)" in results[0]["stderr"]


def test_a_rank_with_a_warm_cache_serves_the_others_and_nothing_compiles(compiled, session_cache, tmp_path):
    warm = KernelCache(tmp_path / "cache1")
    for name in NAMES:
        warm.put(compiled[name].cache_key, session_cache.get(compiled[name].cache_key))
    results, log, _ = _run(tmp_path, session_cache, world=FAULTS)
    assert all(r["rc"] == 0 for r in results), results
    assert log == []
    assert {o for _, o in results[1]["ok"]} == {"cache"}
    assert all({o for _, o in r["ok"]} == {"peer"} for i, r in enumerate(results) if i != 1)
    _all_cached([tmp_path / f"cache{r}" for r in range(FAULTS)], compiled)


def test_ranks_sharing_a_cache_folder_end_with_every_kernel_each_compiled_once(compiled, session_cache, tmp_path):
    caches = [tmp_path / "node0", tmp_path / "node0", tmp_path / "node1", tmp_path / "node1"]
    results, log, _ = _run(tmp_path, session_cache, caches=caches)
    assert all(r["rc"] == 0 for r in results), results
    assert len(log) == len(NAMES)
    _all_cached([tmp_path / "node0", tmp_path / "node1"], compiled)


def test_an_explicit_gloo_group_is_used_and_another_backend_is_refused_before_any_collective(compiled,
                                                                                            session_cache, tmp_path):
    results, log, _ = _run(tmp_path, session_cache, world=FAULTS, group="gloo")
    assert all(r["rc"] == 0 for r in results), results
    assert len(log) == len(NAMES)
    _all_cached([tmp_path / f"cache{r}" for r in range(FAULTS)], compiled)
    (tmp_path / "again").mkdir()
    results, log, _ = _run(tmp_path / "again", session_cache, world=FAULTS, group="nccl")
    assert log == [] and all(r["rc"] == 3 for r in results), results
    assert all(r["error"].startswith("InvalidArgument: group: expected a gloo group, got a nccl one") for r in results)


def test_a_rank_killed_during_the_warm_up_makes_the_others_fail_fast(compiled, session_cache, tmp_path):
    results, _, seconds = _run(tmp_path, session_cache, world=3, die=1, delay=2.0)
    assert results[1]["rc"] == 17
    for i in (0, 2):  # the ranks before and after it
        assert results[i]["rc"] == 3, results[i]
        assert results[i]["error"].startswith("GemmgenError: distributed warm-up:"), results[i]
        assert "a rank died or stopped taking part" in results[i]["error"]
    assert seconds < STATED_TIMEOUT


def test_a_failed_compile_makes_every_rank_raise_the_same_error_naming_the_kernel(compiled, session_cache, tmp_path):
    results, _, _ = _run(tmp_path, session_cache, world=FAULTS, fail="bias_gelu")
    errors = {r["error"] for r in results}
    assert all(r["rc"] == 3 for r in results) and len(errors) == 1, results
    error, = errors
    assert "1 kernel(s) failed to compile: bias_gelu (" in error and "NVRTC rejected bias_gelu" in error
    for r in range(FAULTS):  # everything else was still exchanged and stored
        cache = KernelCache(tmp_path / f"cache{r}")
        assert sum(cache.get(compiled[n].cache_key) is not None for n in NAMES) == len(NAMES) - 1


def test_jit_off_exchanges_what_a_rank_holds_and_compiles_nothing(compiled, session_cache, tmp_path):
    warm = KernelCache(tmp_path / "cache1")
    for name in NAMES[:-1]:
        warm.put(compiled[name].cache_key, session_cache.get(compiled[name].cache_key))
    results, log, _ = _run(tmp_path, session_cache, world=FAULTS, env={"GEMMGEN_JIT": "0"})
    assert log == []
    errors = {str(r.get("error")) for r in results}
    assert all(r["rc"] == 3 for r in results) and len(errors) == 1, results
    assert f"KernelNotAvailable: distributed warm-up: no rank holds {NAMES[-1]} (" in errors.pop()
    for r in range(FAULTS):
        cache = KernelCache(tmp_path / f"cache{r}")
        assert sum(cache.get(compiled[n].cache_key) is not None for n in NAMES) == len(NAMES) - 1


def test_a_warm_remote_tier_serves_every_rank_and_nothing_compiles_or_moves(compiled, session_cache, tmp_path):
    if why := why_no_redis():
        pytest.skip(why)
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as server:
        tier = RemoteTier(backend_for(server.url, timeout=5.0), "sm_90a")
        for name in NAMES:
            tier.store(compiled[name].cache_key, session_cache.get(compiled[name].cache_key))
        results, log, _ = _run(tmp_path, session_cache, world=FAULTS, env={"GEMMGEN_REMOTE_CACHE": server.url})
    assert all(r["rc"] == 0 for r in results), results
    assert log == [] and all({o for _, o in r["ok"]} == {"remote"} for r in results)
    _all_cached([tmp_path / f"cache{r}" for r in range(FAULTS)], compiled)


def test_a_cold_remote_tier_is_filled_by_the_ranks_that_compile(compiled, session_cache, tmp_path):
    if why := why_no_redis():
        pytest.skip(why)
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as server:
        results, log, _ = _run(tmp_path, session_cache, world=FAULTS, env={"GEMMGEN_REMOTE_CACHE": server.url})
        assert all(r["rc"] == 0 for r in results), results
        assert len(log) == len(NAMES)
        tier = RemoteTier(backend_for(server.url, timeout=5.0), "sm_90a")
        for name in NAMES:
            k = compiled[name]
            assert tier.fetch(k.cache_key, kernel_check(k.generated)) is not None, name


# ---- no processes: bad arguments, a damaged transfer, the plan


def test_a_group_without_torch_distributed_initialised_is_named_before_anything_compiles(examples, monkeypatch):
    import torch.distributed as dist

    import gemmgen as gg

    assert not dist.is_initialized()
    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", lambda k: pytest.fail("compiled"))
    with pytest.raises(gg.InvalidArgument, match=r"distributed=True: .*init_process_group"):
        gg.warmup([examples["gemm_bf16"]], distributed=True, quiet=True)
    with pytest.raises(gg.InvalidArgument, match=r"group: torch.distributed is not initialised"):
        gg.warmup([examples["gemm_bf16"]], group=object(), quiet=True)


def test_a_transfer_that_fails_validation_is_reported_and_not_used(compiled, session_cache, tmp_path):
    import gemmgen as gg
    from gemmgen.aot.distributed import Transfer, _receive
    from gemmgen.compile.blob import pack

    k = compiled["gemm_bf16"]
    art = session_cache.get(k.cache_key)
    damaged = type(art)({**art.files, "kernel.cubin": art.files["kernel.cubin"][:4096]}, art.meta)
    t = Transfer(k.cache_key, "gemm_bf16 (cfg)", 1, True, (0,), (0,))
    local = KernelCache(tmp_path / "local")
    with pytest.warns(gg.GemmgenWarning, match=r"gemm_bf16 \(cfg\) from rank 1: .*not used"):
        _receive(t, pack(k.cache_key, damaged), k.generated, local, writer=True)
    assert local.get(k.cache_key) is None


# ---- the plan alone (pure; no processes)


def _state(rank: int, have: set[str] = frozenset(), host: str = "h", cache: str = "c", jit: bool = True,  # type: ignore[assignment]
           kernels: dict | None = None) -> RankState:
    kernels = kernels or {"a": ("A", 40.0), "b": ("B", 30.0), "c": ("C", 20.0), "d": ("D", 20.0), "e": ("E", 10.0)}
    return RankState(rank, host, f"{cache}{rank}" if cache == "c" else cache, kernels, frozenset(have), jit)


def test_the_plan_balances_compile_time_and_prefers_a_holder():
    plan = make_plan([_state(0), _state(1), _state(2, have={"c"})])
    by_key = {t.key: t for t in plan}
    assert by_key["c"].source == 2 and not by_key["c"].compile and by_key["c"].receivers == (0, 1)
    load = {r: sum(cost for k, (_, cost) in _state(0).kernels.items() if by_key[k].compile and by_key[k].source == r)
            for r in range(3)}
    assert load == {0: 40.0, 1: 30.0, 2: 30.0}  # costliest first, each to the least loaded rank
    assert make_plan([_state(2, have={"c"}), _state(0), _state(1)]) == plan  # gather order does not matter


def test_the_plan_writes_each_cache_folder_once_and_skips_ranks_that_may_not_compile():
    states = [_state(0, host="n0", cache="shared"), _state(1, host="n0", cache="shared", jit=False),
              _state(2, host="n1", cache="shared", jit=False)]
    plan = make_plan(states)
    assert {t.source for t in plan} == {0}  # only rank 0 may compile
    # one writer per (host, folder), none where the source's folder is: rank 1 reads what rank 0 stored
    assert all(t.receivers == (1, 2) and t.writers == (2,) for t in plan)
    nobody = make_plan([_state(0, jit=False), _state(1, jit=False)])
    assert all(t.source is None for t in nobody)

"""The remote cache tier against real backends: a redis-server of the test's own on a loopback
port, and fsspec over a local folder. The same contract for both: a valid hit is served and
stored locally without compiling; a miss compiles and stores; a corrupt value is refused,
recompiled and replaced; a backend that is down, slow or full degrades to a local compile with
one warning. The session's real artifacts stand in for NVRTC (nothing compiles here)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.compile import blob, remote
from gemmgen.compile.build import build_kernel, kernel_check
from gemmgen.compile.cache import Artifact, KernelCache
from gemmgen.compile.parallel import build_many
from gemmgen.testing.servers import redis_server, why_no_redis

pytestmark = pytest.mark.remote_cache
NAME = "gemm_bf16"


@pytest.fixture
def kernel(compiled, examples, session_cache):
    """(recipe, generated kernel, the session's artifact, its cache key)."""
    r = examples[NAME]
    key = compiled[NAME].cache_key
    art = session_cache.get(key)
    assert art is not None
    return r, render_kernel(r.ir, r.default_config()), art, key


@pytest.fixture(params=["redis", "fsspec"])
def backend_url(request, tmp_path):
    """A fresh, empty remote tier: yields (URL, the redis server or None)."""
    if request.param == "redis":
        if why := why_no_redis():
            pytest.skip(why)
        (tmp_path / "redis").mkdir()
        with redis_server(tmp_path / "redis") as server:
            yield server.url, server
    else:
        yield f"file://{tmp_path / 'remote'}", None


@pytest.fixture
def redis_folder(tmp_path):
    """A folder for a redis-server of the test's own (skips, saying why, where none can start)."""
    if why := why_no_redis():
        pytest.skip(why)
    (tmp_path / "redis").mkdir()
    return tmp_path / "redis"


@pytest.fixture
def compiles(monkeypatch, kernel):
    """Stands in for NVRTC with the session's artifact; counts the calls."""
    calls = []

    def stand_in(k):
        calls.append(k.entry)
        return kernel[2]

    monkeypatch.setattr("gemmgen.compile.build.compile_artifact", stand_in)
    return calls


def _tier(url: str) -> remote.RemoteTier:
    return remote.RemoteTier(remote.backend_for(url, timeout=5.0), "sm_90a")


def test_a_blob_round_trips_and_refuses_what_is_not_its_entry(kernel):
    _, _, art, key = kernel
    data = blob.pack(key, art)
    back, problem = blob.unpack(data, key)
    assert problem is None and back == art
    flipped = bytearray(data)
    flipped[-100] ^= 1
    for value, wanted, problem in [(data, "f" * 64, "records key"), (data[:-10], key, "truncated"),
                                   (data + b"x", key, "truncated or padded"), (bytes(flipped), key, "digest"),
                                   (b"hello", key, "not a gemmgen artifact"), ("text", key, "not bytes")]:
        art_back, why = blob.unpack(value, wanted)  # type: ignore[arg-type]
        assert art_back is None and problem in str(why), (problem, why)


def test_a_fresh_local_cache_with_a_warm_tier_compiles_nothing(kernel, backend_url, tmp_path, monkeypatch,
                                                              compiles):
    r, gen, art, key = kernel
    url, _ = backend_url
    _tier(url).store(key, art)
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", url)
    local = KernelCache(tmp_path / "local")
    built = build_kernel(r.ir, r.default_config(), local)
    assert compiles == [] and built.origin == "remote" and built.cubin == art.files["kernel.cubin"]
    assert KernelCache(tmp_path / "local").get(key, kernel_check(gen)) == art  # stored locally, on disk
    again = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
    assert again.origin == "cache"


def test_a_miss_compiles_once_and_stores_the_kernel_in_the_tier(kernel, backend_url, tmp_path, monkeypatch,
                                                               compiles):
    r, gen, art, key = kernel
    url, _ = backend_url
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", url)
    built = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "a"))
    assert built.origin == "compiled" and len(compiles) == 1
    assert _tier(url).fetch(key, kernel_check(gen)) == art
    other_machine = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "b"))
    assert other_machine.origin == "remote" and len(compiles) == 1


def test_a_corrupt_value_is_refused_recompiled_and_replaced(kernel, backend_url, tmp_path, monkeypatch, compiles):
    r, gen, art, key = kernel
    url, _ = backend_url
    tier = _tier(url)
    damaged = Artifact({**art.files, "kernel.cubin": art.files["kernel.cubin"][:4096]}, art.meta)  # digests match
    tier.backend.put(tier.name(key), blob.pack(key, damaged))
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", url)
    with pytest.warns(gg.GemmgenWarning, match=r"remote cache .* value gemmgen/sm_90a/.*not served"):
        built = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
    assert built.origin == "compiled" and len(compiles) == 1
    assert tier.fetch(key, kernel_check(gen)) == art  # replaced by the good one


def test_a_server_killed_mid_run_degrades_to_a_local_compile_with_one_warning(kernel, tmp_path, monkeypatch, compiles,
                                                                             redis_folder):
    r, _, art, key = kernel
    with redis_server(redis_folder) as server:
        monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", server.url)
        monkeypatch.setenv("GEMMGEN_REMOTE_CACHE_TIMEOUT", "2")
        _tier(server.url).store(key, art)
        assert build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "a")).origin == "remote"
        server.kill()
        start = time.monotonic()
        with pytest.warns(gg.GemmgenWarning, match=r"remote cache redis://.* failed reading .*compiling locally") as w:
            first = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "b"))
            second = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "c"))  # the tier is off now
        assert first.origin == second.origin == "compiled" and len(compiles) == 2
        assert len([x for x in w if "remote cache" in str(x.message)]) == 1
        assert time.monotonic() - start < 10


def test_a_server_that_never_answers_times_out_within_the_stated_time(kernel, tmp_path, monkeypatch, compiles):
    """A listener that accepts and says nothing: GEMMGEN_REMOTE_CACHE_TIMEOUT bounds the wait."""
    if why := why_no_redis():
        pytest.skip(why)
    r, _, _, _ = kernel
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.warns(gg.GemmgenWarning, match="Timeout"):
        built = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
    assert built.origin == "compiled" and time.monotonic() - start < 3
    silent.close()


def test_a_full_server_fails_the_store_not_the_call(kernel, tmp_path, monkeypatch, compiles, redis_folder):
    r, gen, art, key = kernel
    with redis_server(redis_folder, maxmemory="1mb") as server:
        monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", server.url)
        with pytest.warns(gg.GemmgenWarning, match=r"failed storing .*OutOfMemory.*local cache only"):
            built = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
        assert built.origin == "compiled" and len(compiles) == 1
        assert server.client().get(_tier(server.url).name(key)) is None
        assert KernelCache(tmp_path / "local").get(key, kernel_check(gen)) == art


def test_the_ttl_is_set_on_every_stored_kernel(kernel, tmp_path, monkeypatch, compiles, redis_folder):
    r, _, _, key = kernel
    with redis_server(redis_folder) as server:
        monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", server.url)
        monkeypatch.setenv("GEMMGEN_REMOTE_CACHE_TTL", "120")
        build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
        assert 100 <= server.client().ttl(_tier(server.url).name(key)) <= 120


def test_jit_off_serves_remote_hits_and_compiles_nothing(kernel, backend_url, tmp_path, monkeypatch, compiles):
    r, _, art, key = kernel
    url, _ = backend_url
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", url)
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    with pytest.raises(gg.KernelNotAvailable, match="GEMMGEN_JIT=0"):
        build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "a"))
    with pytest.raises(gg.KernelNotAvailable):
        build_many([(r.ir, r.default_config())], KernelCache(tmp_path / "a"), jobs=1, quiet=True)
    _tier(url).store(key, art)
    assert build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "b")).origin == "remote"
    built, = build_many([(r.ir, r.default_config())], KernelCache(tmp_path / "c"), jobs=1, quiet=True)
    assert built.origin == "remote" and compiles == []


def test_a_warm_up_fetches_through_its_workers_path(kernel, backend_url, tmp_path, monkeypatch, compiles):
    r, _, art, key = kernel
    url, _ = backend_url
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", url)
    _tier(url).store(key, art)
    built, = gg.warmup([r], jobs=1, cache=KernelCache(tmp_path / "local"), quiet=True)
    assert built.origin == "remote" and compiles == []


@pytest.mark.parametrize(("name", "value", "match"), [
    ("GEMMGEN_REMOTE_CACHE", "localhost:6379", "expected a URL"),
    ("GEMMGEN_REMOTE_CACHE", "nosuchscheme://x/y", "GEMMGEN_REMOTE_CACHE"),
    ("GEMMGEN_REMOTE_CACHE_TTL", "soon", "positive number of seconds"),
    ("GEMMGEN_REMOTE_CACHE_TIMEOUT", "0", "positive number of seconds"),
])
def test_a_bad_setting_is_named_before_anything_compiles(kernel, tmp_path, monkeypatch, compiles, name, value, match):
    r, _, _, _ = kernel
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv(name, value)
    with pytest.raises(gg.InvalidArgument, match=match):
        build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
    assert compiles == []


def test_a_worker_returns_its_warnings_for_the_parent_to_show(kernel, tmp_path, monkeypatch, compiles):
    """A worker process's warnings would go to its own stderr, once per worker: they come back."""
    from gemmgen.compile.parallel import _worker

    _, gen, _, key = kernel
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    how, unstored, notes = _worker(gen, key, str(tmp_path / "local"))
    assert how == "compiled" and unstored is None and len(compiles) == 1
    assert len(notes) == 1 and "failed reading" in notes[0] and "compiling locally" in notes[0]


def test_autotune_tables_are_shared_through_the_tier(backend_url, monkeypatch):
    from gemmgen.tuning import table as tables

    url, _ = backend_url
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", url)
    monkeypatch.setattr("gemmgen.tuning.table._TABLES", [])
    monkeypatch.setattr("gemmgen.tuning.table._ENV_LOADED", False)
    config = gg.KernelConfig()
    table = tables.TuningTable()
    table.put("dev|drv|ver|recipe|1,2,3,1", config, {config.name: 12.5})
    assert tables.TuningTable.load_or_new("remote:h200").entries == {}
    table.save("remote:h200")
    assert tables.TuningTable.load_or_new("remote:h200").entries == table.entries
    assert tables.TuningTable.load("remote:h200").entries == table.entries
    with pytest.raises(gg.GemmgenError, match=r"remote:nosuch: not in the remote cache .*gemmgen tune --out"):
        gg.add_tuning("remote:nosuch")
    monkeypatch.setenv("GEMMGEN_TUNING_PATH", "remote:h200:remote:nosuch")
    with pytest.warns(gg.GemmgenWarning, match="GEMMGEN_TUNING_PATH: tuning table remote:nosuch"):
        loaded = tables._tables()
    assert [t.entries for t in loaded] == [table.entries]
    monkeypatch.delenv("GEMMGEN_REMOTE_CACHE")
    with pytest.raises(gg.InvalidArgument, match="needs GEMMGEN_REMOTE_CACHE"):
        tables.TuningTable.load("remote:h200")
    with pytest.raises(gg.InvalidArgument, match="plain NAME"):
        tables.TuningTable.load("remote:a/b")


def test_an_fsspec_tier_that_cannot_be_used_degrades_the_same_way(kernel, tmp_path, monkeypatch, compiles):
    r, _, _, _ = kernel
    (tmp_path / "file").write_text("a file where the tier's folder should be")
    monkeypatch.setenv("GEMMGEN_REMOTE_CACHE", f"file://{tmp_path / 'file'}")
    with pytest.warns(gg.GemmgenWarning, match=r"remote cache file://.* failed reading .*compiling locally") as w:
        built = build_kernel(r.ir, r.default_config(), KernelCache(tmp_path / "local"))
    assert built.origin == "compiled" and len(compiles) == 1
    assert len([x for x in w if "remote cache" in str(x.message)]) == 1  # the store was not tried: the tier is off

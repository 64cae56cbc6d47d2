"""Autotune bookkeeping on the CPU: candidates, the winner, the JSON table, where it is found.

The timings themselves need a GPU (tests/gpu/test_gpu.py runs a real autotune); here a timer with
made-up numbers stands in for CUDA events, so what is checked is everything around them."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

import gemmgen as gg
from gemmgen import tuning
from gemmgen.runtime.examples import example_call
from gemmgen.tuning.heuristic import choose, split_variants

H200 = tuning.Device("NVIDIA H200", "13.0")


@pytest.fixture(autouse=True)
def isolated_tables(monkeypatch):
    monkeypatch.setattr("gemmgen.tuning.table._TABLES", [])
    monkeypatch.setattr("gemmgen.tuning.table._ENV_LOADED", True)
    monkeypatch.setattr("gemmgen.tuning.table._FROM_BUNDLES", set())
    monkeypatch.setattr("gemmgen.compile.bundles._ADDED", [])
    monkeypatch.setattr("gemmgen.tuning.tuner.build_many", lambda pairs, **kw: [])  # nothing to compile here


def _recipe():
    return gg.Recipe("tune_bias_relu", lambda acc, bias: gg.relu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})


def _random_timer(seen):
    def timer(recipe, config, problem):
        seen.append((config, problem))
        return random.uniform(10.0, 100.0)
    return timer


def test_autotune_times_a_bounded_candidate_set_and_keeps_the_fastest(tmp_path):
    recipe, seen = _recipe(), list[tuple]()
    out = tmp_path / "tuning.json"
    table = gg.autotune(recipe, [(300, 4096, 4096), (500, 4096, 4096), (8192, 4096, 4096)], limit=3,
                        timer=_random_timer(seen), device=H200, out=out)
    assert len(table.entries) == 2  # M 300 and 500 share the 512 bucket
    assert all(gg.codegen.is_valid(c, recipe.ir) for c, _ in seen)
    for m in (500, 8192):  # three binaries each (and at M 500 split counts of its stream-K ones)
        timed = [c for c, p in seen if p[0] == m]
        assert len({c.binary() for c in timed}) == 3 and len(timed) == len(set(timed))
        assert timed[3:] == split_variants(timed[:3], m, 4096, 4096)
    for key, entry in table.entries.items():
        gpu, driver, version, recipe_key, shape = key.split("|")
        assert (gpu, driver, version, recipe_key) == (H200.name, H200.driver, gg.__version__, recipe.ir.key)
        assert shape in ("512x4096x4096x1", "8192x4096x4096x1")
        assert entry["name"] == min(entry["timings_us"], key=entry["timings_us"].get)
        assert len(entry["timings_us"]) == len([c for c, p in seen if p[0] == (500 if shape[0] == "5" else 8192)])
    assert json.loads(out.read_text())["entries"] == table.entries
    assert not list(tmp_path.glob(".tuning-*"))  # written through a temporary file and renamed


def _moe(**kw):
    return gg.Recipe("tune_moe", lambda acc, bias, weight: gg.silu(acc + bias) * weight, grouped=True,
                     operands={"bias": gg.RowVector(gg.bf16), "weight": gg.ColVector(gg.f32)}, **kw)


def test_grouped_autotune_keys_results_by_rows_per_group_and_the_op_launches_them():
    """A grouped recipe's shapes are (rows, N, K, groups), kept by the rows per group on average,
    as the op chooses: the heuristic's pick is timed against its pick on the other side of the swap
    threshold, and a winner is used on its device, for its bucket, before the recipe's own config."""

    from gemmgen.tuning.heuristic import grouped_choice

    recipe, seen = _moe(), list[tuple]()

    def last_is_fastest(recipe, config, problem):  # never the heuristic's pick (timed first)
        seen.append((config, problem))
        return 100.0 - len(seen)

    # 8 and 13 rows per expert share the bucket of 16; 512 rows per expert are another bucket
    problems = [(64, 4096, 2048, 8), (100, 4096, 2048, 8), (4096, 4096, 2048, 8)]
    table = gg.autotune(recipe, problems, limit=3, timer=last_is_fastest, device=H200)
    assert sorted(key.split("|")[4] for key in table.entries) == ["16x4096x2048x8", "512x4096x2048x8"]
    assert len(seen) == 6 and all(gg.codegen.is_valid(c, recipe.ir) for c, _ in seen)
    for rows in (64, 4096):
        timed = [c for c, p in seen if tuning.grouped_bucket(*p) == tuning.grouped_bucket(rows, 4096, 2048, 8)]
        heuristic = grouped_choice(recipe.ir, rows, 8).config
        assert timed[0] == heuristic and timed[1].swap_ab != heuristic.swap_ab and len(set(timed)) == 3
    h100 = tuning.Device("NVIDIA H100", "13.0")
    own = gg.KernelConfig(tile=(128, 128, 64), cluster=(2, 1, 1))
    for rows in (64, 100, 4096):
        winner = table.get(tuning.entry_key(H200, recipe.ir.key, tuning.grouped_bucket(rows, 4096, 2048, 8)))
        heuristic = grouped_choice(recipe.ir, rows, 8).config
        assert winner is not None and winner != heuristic
        assert tuning.config_for(recipe, rows, 4096, 2048, 8, device=H200) == winner
        assert tuning.config_for(recipe, rows, 4096, 2048, 8, device=h100) == heuristic
        assert tuning.config_for(recipe, rows, 4096, 1024, 8, device=H200) == heuristic  # no result for this K
        assert tuning.config_for(recipe, rows, 4096, 2048, 8) == heuristic  # no device: the heuristic
        assert tuning.config_for(_moe(config=own), rows, 4096, 2048, 8, device=H200) == winner
        assert tuning.config_for(_moe(config=own), rows, 4096, 2048, 8, device=h100) == own


def test_the_tune_command_takes_a_grouped_recipes_shapes(tmp_path, monkeypatch):
    """`gemmgen tune` with [rows, N, K, groups] for a grouped recipe (a timer favouring the
    unswapped kernel stands in for the GPU): one entry, by rows per expert, the unswapped winner."""
    from gemmgen import cli
    from tests.data import EXAMPLES

    real = cli.autotune

    def on_a_stand_in_gpu(recipe, shapes, **kw):
        return real(recipe, shapes, timer=lambda r, c, p: 1.0 + c.swap_ab, device=H200, **kw)

    monkeypatch.setattr(cli, "autotune", on_a_stand_in_gpu)
    (tmp_path / "shapes.json").write_text(json.dumps({"moe_up": [[64, 14336, 4096, 8]]}))
    out = tmp_path / "t.json"
    assert cli.main(["tune", str(EXAMPLES), "--shapes", str(tmp_path / "shapes.json"), "--out", str(out),
                     "--recipe", "moe_up", "--candidates", "2"]) == 0
    ((key, entry),) = tuning.TuningTable.load(out).entries.items()
    assert key.endswith("|16x14336x4096x8") and len(entry["timings_us"]) == 2 and "swapab" not in entry["name"]


def test_example_calls_are_what_each_kernel_accepts(examples, extra):
    """The arguments autotune times each candidate with (dense, batched, grouped, fp8, block-scaled)
    pass the kernel's own checks and give a finite, non-zero reference: a timer on the GPU never
    meets a refusal after the candidates are compiled."""
    from gemmgen.runtime.checks import check_call
    from gemmgen.runtime.grouped_checks import check_grouped_call

    kinds = set()
    for recipe in [*examples.values(), *extra.values()]:
        g = recipe.ir.gemm
        args, ops = example_call(recipe.ir, 37, 48, 256, 3, device="cpu")
        if g.grouped:
            a, b, offsets = args
            assert offsets.tolist() == [12, 24, 37] and b.shape == (3, 256, 48)
            check_grouped_call(recipe.ir, a, b, offsets, ops, require_cuda=False)
        else:
            check_call(recipe.ir, args[0], args[1], ops, require_cuda=False)
            assert args[0].shape == ((3,) if g.batched else ()) + (37, 256)
        out = recipe.reference(*args, **ops)
        d = (out if isinstance(out, torch.Tensor) else out[0]).float()
        assert d.isfinite().all() and d.abs().sum() > 0, recipe.name
        kinds.add("grouped" if g.grouped else "batched" if g.batched else "dense")
        kinds.add("block-scaled" if g.block_scale else "fp8" if g.a.bits == 8 else "16-bit")
    assert kinds == {"grouped", "batched", "dense", "block-scaled", "fp8", "16-bit"}


def test_model_launches_on_a_device_list_what_its_tuning_results_make_the_runtime_launch():
    """What to warm up at model load where autotune results are registered: with the device, a
    dense layer's tuned winner replaces the heuristic's pick for its bucket, and a grouped layer
    adds every winner for its sizes (its rows per expert are the routing's); without it, the
    heuristic's picks as before. Otherwise the first call in serving would compile a kernel."""
    from gemmgen.tuning.heuristic import grouped_candidates

    dense = gg.nn.FusedLinear(256, 512, activation="silu", device="meta")
    experts = gg.nn.GroupedLinear(8, 256, 512, activation="silu", device="meta")
    model = torch.nn.ModuleDict({"mlp": dense, "experts": experts})
    heuristic = gg.nn.model_launches(model, (300,))
    dense_tuned = tuning.candidates(dense.recipe.ir, 300, 512, 256)[-1]
    experts_tuned = grouped_candidates(experts.recipe.ir, 4096, 8)[-1]
    table = tuning.TuningTable()
    table.put(tuning.entry_key(H200, dense.recipe.ir.key, tuning.bucket(300, 512, 256)), dense_tuned, {})
    table.put(tuning.entry_key(H200, experts.recipe.ir.key, tuning.grouped_bucket(4096, 512, 256, 8)),
              experts_tuned, {})
    other = tuning.entry_key(H200, experts.recipe.ir.key, tuning.grouped_bucket(4096, 512, 128, 8))  # another K
    table.put(other, gg.KernelConfig(tile=(128, 16, 64), swap_ab=True), {})
    gg.add_tuning(table)
    assert (dense.recipe, dense_tuned) not in heuristic and (experts.recipe, experts_tuned) not in heuristic
    assert gg.nn.model_launches(model, (300,)) == heuristic
    got = gg.nn.model_launches(model, (300,), device=H200)
    assert got == [(dense.recipe, dense_tuned), *heuristic[1:], (experts.recipe, experts_tuned)]
    assert dense.launches(300, device=H200) == (dense.recipe, dense_tuned)
    assert gg.nn.model_launches(model, (300,), device=tuning.Device("NVIDIA H100", "13.0")) == heuristic
    cuda: Any = "cuda"  # not a tuning.Device
    for call in (lambda: gg.nn.model_launches(model, (300,), device=cuda), lambda: experts.launches(64, cuda)):
        with pytest.raises(gg.InvalidArgument, match=r"device: expected a gemmgen.tuning.Device .*got 'cuda'"):
            call()


def test_the_runtime_prefers_the_tuned_config_on_the_device_it_was_measured_on():
    recipe = _recipe()
    heuristic = choose(recipe.ir, 300, 4096, 4096).config
    slow_for_all_but = tuning.candidates(recipe.ir, 300, 4096, 4096)[-1]
    assert slow_for_all_but != heuristic

    def timer(recipe, config, problem):
        return 1.0 if config == slow_for_all_but else 50.0

    before = tuning.generation()
    gg.autotune(recipe, [(300, 4096, 4096)], timer=timer, device=H200)
    assert tuning.generation() > before  # memoised choices (ops.kernel_for) are keyed by it
    assert tuning.config_for(recipe, 400, 4096, 4096, 1, device=H200) == slow_for_all_but
    assert tuning.config_for(recipe, 400, 4096, 4096, 1, device=tuning.Device("NVIDIA H100", "13.0")) == heuristic
    assert tuning.config_for(recipe, 4000, 4096, 4096, 1, device=H200) == choose(recipe.ir, 4000, 4096, 4096).config


def test_autotune_times_split_counts_of_its_stream_k_candidates_at_no_compile(tmp_path):
    """Where the tiles leave SMs idle (a decode step), each stream-K candidate is also timed with
    split counts (the same binary: warm-up builds no more kernels); a split count that wins is
    kept through the JSON file and launched by the runtime. A large problem times no split count."""
    from gemmgen.tuning.heuristic import SPLITS_TIMED

    recipe, seen, warmed = _recipe(), list[tuple](), []

    def split_wins(recipe, config, problem):
        seen.append((config, problem))
        return 1.0 if config.splits == 4 else 10.0

    def build_many(pairs, **kw):
        warmed.extend(pairs)
        return []

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("gemmgen.tuning.tuner.build_many", build_many)
        gg.autotune(recipe, [(16, 4096, 4096), (4096, 4096, 4096)], limit=4, timer=split_wins, device=H200,
                    out=tmp_path / "t.json")
    decode = [c for c, p in seen if p[0] == 16]
    splits = [c for c in decode if c.splits > 1]
    stream_k = [c for c in decode[:4] if c.tile_scheduler is gg.TileScheduler.STREAM_K]
    assert stream_k and {c.binary() for c in splits} == set(stream_k)
    assert {c.splits for c in splits} == set(SPLITS_TIMED)
    assert {c.binary() for _, c in warmed} == set(decode[:4]) | {c for c, p in seen if p[0] == 4096}
    assert not [c for c, p in seen if p[0] == 4096 and c.splits > 1]
    tuning.add_tuning(tmp_path / "t.json")  # the file, as a bundle or GEMMGEN_TUNING_PATH gives it
    winner = tuning.config_for(recipe, 16, 4096, 4096, 1, device=H200)
    assert winner.splits == 4 and winner.binary() in stream_k


def test_autotune_rejects_bad_shapes_and_limits_before_timing_anything():
    seen: list[tuple] = []
    for shapes, limit, what in (([(128, 128)], 4, "shape"), ([(128, 0, 64)], 4, "shape"), ([(8, 8, 8)], 0, "limit")):
        with pytest.raises(gg.GemmgenError, match=f"autotune: {what}"):
            gg.autotune(_recipe(), shapes, limit=limit, timer=_random_timer(seen), device=H200)
    assert seen == []


def test_tuning_files_round_trip_and_bad_ones_name_the_file(tmp_path):
    table = tuning.TuningTable()
    key = tuning.entry_key(H200, "k" * 64, (512, 128, 256, 1))
    table.put(key, gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.PINGPONG), {"a": 1.0})
    table.save(tmp_path / "t.json")
    assert tuning.TuningTable.load(tmp_path / "t.json").get(key) == table.get(key)
    assert table.configs("k" * 64) == [table.get(key)] and table.configs("j" * 64) == []
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(gg.GemmgenError, match=r"bad\.json.*re-run `gemmgen tune`"):
        tuning.TuningTable.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"format": 0, "entries": {}}))
    with pytest.raises(gg.GemmgenError, match=r"old\.json: expected"):
        tuning.TuningTable.load(tmp_path / "old.json")
    (tmp_path / "cfg.json").write_text(json.dumps({"format": 1, "entries": {key: {"config": ["x"]}}}))
    with pytest.raises(gg.GemmgenError, match="not a kernel config"):
        tuning.TuningTable.load(tmp_path / "cfg.json")


@pytest.mark.parametrize("how", ["add_bundle", "GEMMGEN_BUNDLE_PATH"])
def test_a_bundle_ships_its_tuning_results(tmp_path, monkeypatch, how):
    """A bundle's tuning.json is registered with it: by gemmgen.add_bundle, or when the tables are
    first consulted for a bundle GEMMGEN_BUNDLE_PATH names."""
    recipe = _recipe()
    table = tuning.TuningTable()
    config = gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.PINGPONG)
    table.put(tuning.entry_key(H200, recipe.ir.key, tuning.bucket(100, 4096, 4096)), config, {config.name: 3.0})
    table.save(tmp_path / "tuning.json")
    (tmp_path / "manifest.json").write_text(json.dumps({"arch": "sm_90a", "kernels": []}))
    assert tuning.config_for(recipe, 100, 4096, 4096, 1, device=H200) != config
    before = tuning.generation()
    if how == "add_bundle":
        gg.add_bundle(tmp_path)
        assert tuning.generation() > before  # registered at once: memoised choices see it
    else:
        monkeypatch.setenv("GEMMGEN_BUNDLE_PATH", str(tmp_path))
    assert tuning.config_for(recipe, 100, 4096, 4096, 1, device=H200) == config


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no GPU")
def test_autotune_without_a_gpu_says_what_to_do_instead():
    with pytest.raises(gg.GemmgenError, match=r"autotune needs a CUDA GPU.*gemmgen explain"):
        gg.autotune(_recipe(), [(128, 128, 128)])


def test_device_ms_times_graph_replays_per_call(monkeypatch):
    """What device_ms orchestrates, with a stand-in CUDA graph and events on a virtual clock (the
    real ones need a GPU; tests/gpu/test_gpu.py's autotune and scripts/gpu_bench.py use them): each call runs
    once eagerly and once under capture, then only replays are timed, per call."""
    clock, log = [0.0], []

    class Graph:
        def replay(self):
            log.append("replay")
            clock[0] += 3 * 2.5  # three calls of 2.5 ms each

    class Capture:
        def __init__(self, graph):
            pass

        def __enter__(self):
            log.append("capture")

        def __exit__(self, *exc):
            log.append("captured")

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    calls = [lambda i=i: log.append(f"call{i}") for i in range(3)]
    assert tuning.device_ms(calls, reps=5) == 2.5
    assert log == ["call0", "call1", "call2", "sync", "capture", "call0", "call1", "call2", "captured",
                   *["replay"] * 6]


def test_autotune_refuses_a_gpu_other_than_sm90_before_compiling(monkeypatch):
    from gemmgen.runtime import driver

    compiled = []

    def build_many(pairs, **kw):
        compiled.append(pairs)
        return []

    monkeypatch.setattr("gemmgen.tuning.tuner.build_many", build_many)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(driver, "device_facts", lambda index: (108, (8, 0)))
    with pytest.raises(gg.InvalidArgument, match=r"device cuda:0 has compute capability 8.0; gemmgen builds kernels "
                                                 r"for sm_90a"):
        gg.autotune(_recipe(), [(64, 64, 64)])
    assert compiled == []

"""The launch policy (`gemmgen.tuning.choose_launch`): an autotune result for the device, else the
recipe's own config, else the heuristic, for dense and grouped recipes alike, and every path that
needs the answer asks it (the op, warm-up by shapes, autotune's candidates, explain)."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen import tuning
from gemmgen.integrations import ops
from gemmgen.tuning import Source, choose_launch
from gemmgen.tuning.heuristic import choose

H200 = tuning.Device("NVIDIA H200", "13.0")
OWN = gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1))
GROUPED_OWN = gg.KernelConfig(tile=(128, 128, 64), cluster=(2, 1, 1))


@pytest.fixture(autouse=True)
def isolated_tables(monkeypatch):
    monkeypatch.setattr("gemmgen.tuning.table._TABLES", [])
    monkeypatch.setattr("gemmgen.tuning.table._ENV_LOADED", True)
    monkeypatch.setattr("gemmgen.compile.bundles._ADDED", [])
    monkeypatch.delenv("GEMMGEN_BUNDLE_PATH", raising=False)


def _dense(config=None):
    return gg.Recipe("policy_dense", lambda acc, bias: gg.relu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)},
                     config=config)


def _grouped(config=None):
    return gg.Recipe("policy_grouped", lambda acc: gg.silu(acc), grouped=True, config=config)


def _register(recipe, problem, config):
    table = tuning.TuningTable()
    table.put(tuning.entry_key(H200, recipe.ir.key, tuning.problem_bucket(recipe.ir, *problem)), config, {})
    tuning.add_tuning(table)


@pytest.mark.parametrize("make, problem, own", [(_dense, (300, 4096, 4096, 1), OWN),
                                                (_grouped, (64, 4096, 2048, 8), GROUPED_OWN)],
                         ids=["dense", "grouped"])
def test_tuned_then_the_recipes_config_then_the_heuristic(make, problem, own):
    plain, pinned = make(), make(own)
    heuristic = choose(plain.ir, *problem).config
    assert heuristic != own
    assert (choose_launch(plain, *problem).config, choose_launch(plain, *problem).source) == \
        (heuristic, Source.HEURISTIC)
    assert (choose_launch(pinned, *problem).config, choose_launch(pinned, *problem).source) == (own, Source.RECIPE)
    assert choose_launch(pinned, *problem, device=H200).config == own  # no result registered yet
    tuned = gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.PINGPONG)
    _register(pinned, problem, tuned)
    launch = choose_launch(pinned, *problem, device=H200)
    assert (launch.config, launch.source) == (tuned, Source.TUNED)
    assert choose_launch(pinned, *problem).config == own  # ahead of time (no device): the recipe's
    assert choose_launch(pinned, *problem, device=tuning.Device("NVIDIA H100", "13.0")).config == own


def test_the_op_launches_the_recipes_own_config(monkeypatch):
    """A recipe that declares config= gets that kernel from the op at every shape no autotune result
    covers (the dense op used to ignore it and launch the heuristic's)."""
    recipe = _dense(OWN)
    compiled = []

    def record(self, config=None, **kw):
        compiled.append(config)
        return config

    monkeypatch.setattr(gg.Recipe, "compile", record)
    launcher = ops.Launcher(recipe)
    for m in (8, 4096):
        a, b = torch.empty(m, 64, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.bfloat16)
        launcher.kernel_for(a, b)
    assert compiled == [OWN]  # one kernel for both shapes: the recipe's


def test_warmup_by_shapes_and_autotune_candidates_follow_the_policy():
    recipe = _dense(OWN)
    chosen = tuning.launches_for_shapes({"r": recipe}, {"policy_dense": [[8, 4096, 4096], [4096, 4096, 4096]]})
    assert [launch.config for _, launch in chosen["policy_dense"]] == [OWN, OWN]
    assert tuning.candidates(recipe.ir, 300, 4096, 4096, declared=recipe.config)[0] == OWN  # autotune times it

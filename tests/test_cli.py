"""The CLI as a user meets it in the first hour: help that lists every command and the environment
once, `explain` that a script can read (`--json`, `--top`) and that says how ties are broken,
repeated `--shape`, an `inspect` that tells a cache hit from a compile and sums up what it did, a
closed pipe, and errors whose fix is spelled as the user types it (CPU only: nothing compiles)."""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

from gemmgen import env
from gemmgen.cli import main, parser
from gemmgen.compile import KernelReport
from tests.data import EXAMPLES, ROOT

BIG = ["--shape", "4096", "4096", "4096"]


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors and --help
        rc = int(e.code or 0)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return rc, out.out, out.err


def _commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# ---- help


def test_the_top_level_help_lists_every_command_and_the_environment_once_aligned():
    p = parser()
    text = p.format_help()
    description = p.description or ""
    for name in _commands(p):
        assert f" {name}" in description, f"the description omits `gemmgen {name}`"
    width = max(len(v.name) for v in env.VARIABLES) + 2
    for v in env.VARIABLES:
        assert text.count(v.name) >= 1
        assert f"\n  {v.name.ljust(width)}" in text, f"{v.name} is not in an aligned column"
    assert "(default: (" not in text and "TTLseconds" not in text
    assert text.count("environment variables") == 1


def test_a_commands_help_does_not_repeat_the_environment():
    for name, sp in _commands(parser()).items():
        text = sp.format_help()
        assert "environment variables (" not in text, name
        assert sum(v.name in text for v in env.VARIABLES) <= 1, name  # an option's help may name one
        assert "gemmgen --help" in text, f"gemmgen {name} --help does not say where the environment is listed"


# ---- explain


def test_explain_top_shows_the_best_candidates_best_first(capsys):
    rc, out, _ = _run(["explain", str(EXAMPLES), *BIG, "--recipe", "gemm_bf16", "--top", "3"], capsys)
    assert rc == 0
    lines = out.splitlines()
    listed = [line for line in lines if line.startswith("    ")]
    assert len(listed) == 3, out
    scores = [float(line.rsplit("-> ", 1)[1]) for line in listed]
    assert scores == sorted(scores, reverse=True)
    assert "best 3 of " in out
    rc, out, _ = _run(["explain", str(EXAMPLES), *BIG, "--recipe", "gemm_bf16"], capsys)
    assert len(out.splitlines()) < 12, "the default lists a few candidates, not all of them"


def test_explain_says_how_a_tie_was_broken(capsys):
    """At 4096^3 six candidates score the same; the output names them and the rule that picked the
    winner (the first in the heuristic's candidate order), and the rule is what `choose` does."""
    from gemmgen.aot import load_recipes
    from gemmgen.tuning.heuristic import candidate_configs, choose, m_bucket, ranked

    rc, out, _ = _run(["explain", str(EXAMPLES), *BIG, "--recipe", "gemm_bf16"], capsys)
    assert rc == 0
    tie = next(line for line in out.splitlines() if line.startswith("  tie: "))
    assert "6 candidates score 0.970" in tie and "candidate order" in tie
    r = load_recipes(EXAMPLES)["gemm_bf16"].ir
    order = ranked(r, 4096, 4096, 4096)
    tied = [c for s, c, _ in order if round(s, 9) == round(order[0][0], 9)]
    listed = candidate_configs(r, m_bucket(4096))
    assert choose(r, 4096, 4096, 4096).config == min(tied, key=listed.index) == tied[0]
    assert all(c.name in tie for c in tied)
    assert "tie: " in choose(r, 4096, 4096, 4096).why
    rc, out, _ = _run(["explain", str(EXAMPLES), "--shape", "1000", "4096", "4096", "--recipe", "bias_gelu"], capsys)
    assert "tie" not in out  # the recipe's own config: no contest


def test_explain_json_is_a_documented_structure(capsys):
    rc, out, _ = _run(["explain", str(EXAMPLES), *BIG, "--shape", "64", "4096", "4096", "--json", "--top", "2",
                       "--backward", "--recipe", "bias_gelu_aux"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["format"] == 1 and [r["name"] for r in data["recipes"]] == ["bias_gelu_aux"]
    recipe = data["recipes"][0]
    assert [launch["shape"] for launch in recipe["launches"]] == [[4096, 4096, 4096, 1], [64, 4096, 4096, 1]]
    keys = {"shape", "arch", "sm_count", "built", "config", "source", "bucket", "why", "tie", "candidates",
            "candidates_total"}
    for launch in recipe["launches"]:
        assert set(launch) == keys and launch["built"] and launch["arch"] == "sm_90a" and launch["sm_count"] == 132
        assert launch["source"] == "recipe" and launch["candidates"] == [] and launch["tie"] is None
    backward = recipe["backward"]
    assert backward["description"].startswith("bias_gelu_aux_bwd") or "error" in backward
    for derived in backward.get("recipes", []):
        for launch in derived["launches"]:
            assert set(launch) == keys
    rc, out, _ = _run(["explain", str(EXAMPLES), *BIG, "--json", "--top", "2", "--recipe", "gemm_bf16"], capsys)
    launch = json.loads(out)["recipes"][0]["launches"][0]
    assert launch["source"] == "heuristic" and len(launch["candidates"]) == 2 and launch["candidates_total"] > 2
    assert set(launch["candidates"][0]) == {"config", "score", "detail"}
    assert launch["candidates"][0]["config"] == launch["config"] == launch["tie"]["configs"][0]
    assert len(launch["tie"]["configs"]) == 6 and "candidate order" in launch["tie"]["rule"]
    assert json.loads(out)["recipes"][0]["backward"] is None
    rc, out, _ = _run(["explain", str(EXAMPLES), "--shape", "64", "4096", "4096", "--json"], capsys)
    refused = [launch for r in json.loads(out)["recipes"] for launch in r["launches"] if not launch["built"]]
    assert refused and all(launch["config"] is None and "--arch sm_100a" in launch["why"] for launch in refused)


def test_explain_documents_its_json():
    text = (ROOT / "docs" / "config-selection.md").read_text()
    for key in ("format", "recipes", "launches", "candidates_total", "tie", "backward"):
        assert f'"{key}"' in text, f"docs/config-selection.md does not document explain --json's {key!r}"


# ---- inspect


def _report(name: str, origin: str, seconds: float, key: str) -> KernelReport:
    return KernelReport(name=name, entry=f"{name}_kernel", config="128x256x64_c2x1x1_cooperative_auto", cache_key=key,
                        registers=168, smem_bytes=200000, static_smem_bytes=0, local_bytes=0, stack_bytes=0,
                        sass={"HGMMA": 10}, compile_seconds=seconds, phases={}, epilogue="tree",
                        cached=origin != "compiled", origin=origin)


def test_inspect_marks_cache_hits_and_sums_up(tmp_path, capsys, monkeypatch):
    """A cached kernel's compile time is the one it took when it was compiled, on the day it was
    (its cache entry's date); the summary counts what was compiled, found and skipped, and why."""
    key = "ab" + "0" * 62
    meta = tmp_path / "sm_90a" / key[:2] / key / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text("{}")
    stamp = time.mktime((2026, 1, 2, 12, 0, 0, 0, 0, -1))
    os.utime(meta, (stamp, stamp))

    def fake_build(pairs, cache=None, jobs=None, quiet=False, allow_compile=None):
        origins = ["cache", "compiled", "bundle"]
        return [SimpleNamespace(report=_report(r.name, origins[i % 3], 12.25, key if i % 3 == 0 else "cd" * 32),
                                cache_key=key) for i, (r, _) in enumerate(pairs)]

    monkeypatch.setattr("gemmgen.cli.build", fake_build)
    rc, out, err = _run(["inspect", str(EXAMPLES), "--cache-dir", str(tmp_path), "--recipe", "gemm_bf16"], capsys)
    assert rc == 0
    assert "cached (compiled in 12.2 s on 2026-01-02)" in out, out
    rc, out, err = _run(["inspect", str(EXAMPLES), "--cache-dir", str(tmp_path)], capsys)
    assert rc == 0
    rows = out.splitlines()[2:]
    assert any(row.rstrip().endswith("compiled now") for row in rows), out
    assert any("from a bundle (compiled in 12.2 s)" in row for row in rows), out
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("gemmgen: inspect: ")
    built = sum(row.rstrip().endswith("compiled now") for row in rows)
    assert f"built {built}, cached {len(rows) - built}, skipped 3" in summary, summary
    assert "mxfp8_linear, nvfp4_linear, moe_nvfp4 on sm_90a" in summary and "not built for the arch" in summary
    rc, out, err = _run(["inspect", str(EXAMPLES), "--cache-dir", str(tmp_path), "--json"], capsys)
    assert isinstance(json.loads(out), list) and "skipped 3" in err


def test_inspect_json_help_says_what_it_prints():
    text = _commands(parser())["inspect"].format_help()
    assert "one JSON object per kernel" not in text and "JSON array" in " ".join(text.split())


def test_epilogue_direct_swaps_the_collective_where_it_computes_the_recipe(tmp_path, capsys):
    """`--epilogue direct` (build, inspect, generate): each recipe the direct epilogue computes gets it;
    over a file, the others keep their TMA epilogue with a line saying why; a recipe named by
    --recipe that it does not compute is an error naming why and the fix."""
    rc, _, err = _run(["generate", str(EXAMPLES), "--epilogue", "direct", "--out", str(tmp_path)], capsys)
    assert rc == 0
    assert "gemmgen::direct::Sm90Direct<" in (tmp_path / "bias_gelu.cu").read_text()
    assert "gemmgen::direct::Sm90Direct<" not in (tmp_path / "row_col_amax.cu").read_text()
    assert ("gemmgen: row_col_amax: --epilogue direct: does not compute output 'amax_rows': a reduction per row "
            "(amax); building its tma epilogue") in err
    rc, _, err = _run(["generate", str(EXAMPLES), "--recipe", "row_col_amax", "--epilogue", "direct", "--out",
                       str(tmp_path)], capsys)
    assert rc != 0 and "--epilogue direct: recipe 'row_col_amax': does not compute output 'amax_rows'" in err
    assert "leave out --epilogue" in err
    rc, _, err = _run(["inspect", str(EXAMPLES), "--epilogue", "fast"], capsys)
    assert rc != 0 and "invalid choice: 'fast' (choose from 'tma', 'direct')" in err

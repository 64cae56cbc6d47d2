"""`gemmgen profile` on the CPU: the metric check against `ncu --query-metrics`, the kernel filter
against gemmgen's real symbols, the raw page's CSV as Nsight Compute prints it, the pairing with
the launch log, the JSON's figures against the time model, and the whole command through a
stand-in `ncu` that runs the script and answers from what it launched (tests/gpu runs the real one)."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

import gemmgen as gg
from gemmgen.advise import gpu as gpu_named
from gemmgen.advise import profile as pf
from gemmgen.advise.analysis import timed
from gemmgen.cli import main
from gemmgen.codegen import render_kernel
from gemmgen.errors import GemmgenError, InvalidArgument, ToolchainError
from gemmgen.runtime.nvtx import LaunchRecord
from tests.advise.ncu_pages import CANONICAL, ENTRY, NCU, record_fields

#: Nsight Compute 2024.1.1's own output, run here without a GPU: `ncu --query-metrics --chips gh100`
#: (its head, the rows of the metrics profile takes and their neighbours, its last line), the raw
#: page of a public report (`--import R --csv --page raw --print-units base --print-kernel-base
#: function --metrics ...`, LC_ALL=C: an RTX 3080's kernels) and the same page under de_DE.UTF-8.
QUERY = (NCU / "query_metrics_gh100.txt").read_text()


def _record(symbol: str = ENTRY, problem: tuple[int, ...] = (4096, 4096, 4096), **kw) -> LaunchRecord:
    return LaunchRecord(**record_fields(symbol, problem, **kw))


def test_the_shared_canonical_is_gemmgens():
    assert json.loads(CANONICAL) == gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1)).canonical()


# ---- the metric set


def test_each_quantity_takes_the_first_spelling_the_chip_lists():
    listed = pf.listed_metrics(QUERY)
    assert {"gpu__time_duration", "dram__bytes_read", "sm__pipe_tensor_cycles_active"} <= listed
    assert not {"Metric", "Chip", "equals", "ops)", "==PROF=="} & listed  # headers, wrapped descriptions
    chosen = pf.check_metrics(listed, "gh100")
    assert chosen["duration_ns"] == "gpu__time_duration.sum" and chosen["grid_size"] == "launch__grid_size"
    assert chosen["tensor_pipe_pct"] == "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
    # a chip with the other spelling gets it; one with none of an optional quantity goes without
    other = (listed - {"sm__pipe_tensor_cycles_active"}) | {"sm__pipe_tc_cycles_active"}
    assert pf.check_metrics(other, "gb100")["tensor_pipe_pct"].startswith("sm__pipe_tc_cycles_active.")
    assert "tensor_pipe_pct" not in pf.check_metrics(listed - {"sm__pipe_tensor_cycles_active"}, "gh100")


def test_a_required_metric_the_chip_lacks_is_refused_by_name():
    with pytest.raises(ToolchainError, match=r"--chips gh100 lists no dram__bytes_read.sum; .*--ncu PATH"):
        pf.check_metrics(pf.listed_metrics(QUERY) - {"dram__bytes_read"}, "gh100")


# ---- the kernel filter on gemmgen's own symbols


def test_the_filter_takes_a_recipes_gemm_kernels_and_nothing_else():
    examples = gg.aot.load_recipes(Path(__file__).parents[2] / "examples" / "recipes.py")
    moe = examples["moe_up"]
    entries = {name: render_kernel(examples[name].ir, examples[name].default_config()).entry
               for name in ("gemm_bf16", "moe_up", "moe_fp8_block", "scaled_mm_fp8")}
    swapped = render_kernel(examples["gemm_bf16"].ir, gg.KernelConfig(tile=(128, 32, 64), swap_ab=True)).entry
    sm100 = render_kernel(examples["gemm_bf16"].ir, examples["gemm_bf16"].default_config(gg.Arch.SM100A)).entry
    for entry in (entries["gemm_bf16"], swapped, sm100):
        assert pf.symbol_matches(entry, "gemm_bf16") and pf.symbol_matches(entry, None), entry
    assert pf.symbol_matches(entries["moe_up"], "moe_up")
    assert not pf.symbol_matches(entries["moe_up"] + "_groups", "moe_up")  # the grouped call's setup kernel
    assert not pf.symbol_matches(entries["moe_fp8_block"], "moe")  # a recipe whose name starts alike
    assert not pf.symbol_matches(entries["scaled_mm_fp8"], "gemm_bf16") and moe.ir.gemm.grouped


def test_the_command_runs_the_script_under_ncu_with_the_filter_and_the_report():
    argv = pf.ncu_command("/opt/ncu", ["python", "train.py", "--steps", "3"], Path("r.ncu-rep"),
                          ["gpu__time_duration.sum"], recipe="gemm_bf16", skip=5, count=2, clock_control="base")
    assert argv[-4:] == ["python", "train.py", "--steps", "3"]
    flags = dict(zip(argv[1:-4:2], argv[2:-4:2], strict=False))
    assert flags["--kernel-name"] == pf.kernel_filter("gemm_bf16") and flags["--launch-skip"] == "5"
    assert flags["--launch-count"] == "2" and flags["--clock-control"] == "base" and flags["--export"] == "r.ncu-rep"
    for bad, match in ((dict(skip=-1), "expected skip >= 0"), (dict(clock_control="boost"), "expected base"),
                       (dict(command=[]), "the script to profile after --")):
        kw = dict(recipe=None, skip=0, count=1, clock_control="base", command=["python", "t.py"]) | bad
        with pytest.raises(InvalidArgument, match=match):
            pf.ncu_command("ncu", kw.pop("command"), Path("r"), ["m"], **kw)  # type: ignore[arg-type]


# ---- the raw page and the pairing


def test_the_raw_page_gives_one_row_per_launch_with_its_numbers():
    ncus_own = "==WARNING== No section files found in search paths.\n"
    rows = pf.measured_rows(ncus_own + (NCU / "raw_page.csv").read_text())
    assert [(r["ID"], r["Kernel Name"]) for r in rows] == [("0", "initRNG"), ("1", "computeValue")]  # no units row
    metrics = pf.check_metrics(pf.listed_metrics(QUERY), "gh100")
    values = [{key: pf._number(r.get(m), m, key != "sm_hz") for key, m in metrics.items() if key != "tensor_pipe_pct"}
              for r in rows]
    assert values[0] == {"duration_ns": 77686368, "dram_read_bytes": 2249523584, "dram_write_bytes": 987958016,
                         "grid_size": 1220, "sm_count": 68, "sm_hz": 1442244014.99}
    # a metric the report lacks has no column (its value None); ncu's placeholders read as None
    assert pf._number(rows[0].get(metrics["tensor_pipe_pct"]), "t", False) is None
    assert pf._number("n/a", "t", True) is None and pf._number("no data", "t", True) is None
    # the 2022.3 page's other fixed columns
    assert [r["gpu__time_duration.sum"] for r in pf.measured_rows((NCU / "raw_page_2022.3.csv").read_text())] == \
        ["77686368", "7597056"]


def test_a_page_printed_under_another_locale_is_refused_not_misread():
    row = pf.measured_rows((NCU / "raw_page_de_DE.csv").read_text())[0]
    assert row["launch__grid_size"] == "1.220"  # 1220, which a float() would read as 1.22
    with pytest.raises(GemmgenError, match=r"ncu printed '1.220' for launch__grid_size: .*LC_ALL=C"):
        pf._number(row["launch__grid_size"], "launch__grid_size", True)


def test_no_table_says_what_ncu_said():
    with pytest.raises(GemmgenError, match=r"no kernel was profiled .*No kernels were profiled"):
        pf.measured_rows("==PROF== Connected to process 1\n==WARNING== No kernels were profiled.\n")


def test_launches_pair_with_the_log_after_the_skip_and_a_stranger_is_named():
    other = ENTRY.replace("gemm_bf16", "bias_gelu")
    records = [_record(problem=(64 * i, 128, 256)) for i in range(1, 5)]
    records.insert(1, _record(other, recipe="bias_gelu"))
    rows = [{"ID": "0", "Process ID": "4242", "Kernel Name": ENTRY}, {"ID": "1", "Process ID": "4242",
                                                                        "Kernel Name": ENTRY}]
    paired = pf.pair(rows, records, "gemm_bf16", skip=2)
    assert [rec.problem[0] for _, rec in paired] == [192, 256]  # bias_gelu's launch is not one the filter counts
    with pytest.raises(GemmgenError, match=r"launch 0 \(gemmgen_bias_gelu_.* has no record in the launch log"):
        pf.pair([{"ID": "0", "Process ID": "4242", "Kernel Name": other}], records, "gemm_bf16", skip=0)


@pytest.mark.parametrize("problem, grouped, k_grouped, flops", [
    ((4096, 4096, 4096), False, False, 2 * 4096**3),
    ((512, 256, 1024, 3), False, False, 2 * 512 * 256 * 1024 * 3),  # a batch of 3 whole problems
    ((2048, 1024, 512, 8), True, False, 2 * 2048 * 1024 * 512),  # 2048 rows over 8 experts
    ((1024, 512, 4096, 8), True, True, 2 * 1024 * 512 * 4096),  # 4096 tokens over 8 experts' K
])
def test_a_launchs_figures_are_the_time_models_and_ncus(problem, grouped, k_grouped, flops):
    gpu = gpu_named("h100")
    record = _record(problem=problem, grouped=grouped, k_grouped=k_grouped)
    metrics = pf.check_metrics(pf.listed_metrics(QUERY), "gh100")
    row = {"ID": "0", metrics["duration_ns"]: "2000000", metrics["dram_read_bytes"]: "300000000",
           metrics["dram_write_bytes"]: "100000000", metrics["grid_size"]: "132", metrics["sm_count"]: "132",
           metrics["tensor_pipe_pct"]: "61.50", metrics["sm_hz"]: "1755000000.00"}
    out = pf.launch_json(row, record, metrics, gpu)
    got, model = out["measured"], out["predicted"]
    assert got["time_us"] == 2000.0 and got["dram_bytes"] == 4e8 and got["grid_size"] == 132
    assert got["tflops"] == pytest.approx(flops / 2000.0 / 1e6) and got["sm_mhz"] == 1755.0
    cfg = gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1))
    m, n, k = problem[:3]
    l = problem[3] if len(problem) > 3 else 1  # noqa: E741
    t = timed(cfg, m, n, k, l if grouped else 1, k_grouped, 16, 16, gpu, batch=1 if grouped else l)
    assert t.flops == flops and model["time_us"] == t.predicted_us and model["min_bytes"] == t.bytes
    assert out["ratio"]["time"] == pytest.approx(2000.0 / t.predicted_us)
    assert model["tensor_pipe_pct"] == pytest.approx(100 * flops / (989.4e6 * t.predicted_us))


# ---- the command, through a stand-in ncu

STAND_IN = textwrap.dedent('''\
    #!{python}
    """A stand-in for Nsight Compute: `--query-metrics` prints the recorded table; a profile runs the
    script, then keeps the launches its log shows that the filter takes (skip, count) as the
    report; `--import` prints the report as the raw page."""
    import json, os, re, subprocess, sys
    sys.path.insert(0, {tests!r})
    from ncu_pages import NCU, raw_csv
    argv = sys.argv[1:]
    if ("--query-metrics" in argv or "--import" in argv) and os.environ.get("LC_ALL") != "C":
        sys.exit("stand-in ncu: numbers are read under LC_ALL=C")
    if "--query-metrics" in argv:
        assert argv[argv.index("--query-metrics") + 1:] == ["--chips", "gh100"], argv
        print((NCU / "query_metrics_gh100.txt").read_text())
        sys.exit(0)
    flags = ("--import", "--page", "--metrics", "--kernel-name", "--launch-skip", "--launch-count", "--clock-control",
             "--target-processes", "--export")
    opts = {{f: argv[argv.index(f) + 1] for f in flags if f in argv}}
    if "--import" in argv:
        assert "--print-units" in argv and argv[argv.index("--print-units") + 1] == "base", argv
        report = json.load(open(opts["--import"]))
        print(raw_csv(report["rows"], opts["--metrics"].split(",")))
        sys.exit(0)
    command = argv[argv.index("--force-overwrite") + 1:]
    rc = subprocess.call(command)
    pattern = opts["--kernel-name"].removeprefix("regex:")
    seen = [json.loads(x) for x in open(os.environ["GEMMGEN_LAUNCH_LOG"])]
    kept = [s for s in seen if re.match(pattern, s["symbol"])]
    kept = kept[int(opts["--launch-skip"]):][:int(opts["--launch-count"])]
    if kept:
        rows = [{{"ID": str(i), "Process ID": str(s["pid"]), "Kernel Name": s["symbol"],
                  "gpu__time_duration.sum": "1500000", "dram__bytes_read.sum": "250000000",
                  "dram__bytes_write.sum": "40000000", "launch__grid_size": "132",
                  "device__attribute_multiprocessor_count": "132", "sm__cycles_elapsed.avg.per_second": "n/a",
                  "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "70.25"}}
                for i, s in enumerate(kept)]
        json.dump({{"rows": rows}}, open(opts["--export"], "w"))
    else:
        print("==WARNING== No kernels were profiled.")
    sys.exit(rc)
    ''')

#: The user's script: three launches of gemm_bf16's kernel, each after one of bias_gelu's, logged
#: as gemmgen's launch path logs them (runtime.nvtx: the variables read at the first launch; the
#: ranges, which need CUDA's NVTX, stood in for), each record with the script's process.
SCRIPT = textwrap.dedent('''\
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch
    from gemmgen.runtime import nvtx
    from ncu_pages import ENTRY, record_fields
    torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *a: None
    for m in (1024, 2048, 4096):
        for fields in (record_fields(ENTRY.replace("gemm_bf16", "bias_gelu"), recipe="bias_gelu", pid=os.getpid()),
                       record_fields(problem=(m, 4096, 4096), pid=os.getpid())):
            record = nvtx.LaunchRecord(**fields)
            if nvtx.enabled is not False and nvtx.active():
                with nvtx.named_launch(lambda: record):
                    pass
    ''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """(the stand-in ncu's path, the script's); the script's launch records carry its own pid."""
    tests = str(Path(__file__).parent)
    ncu = tmp_path / "ncu"
    ncu.write_text(STAND_IN.format(python=sys.executable, tests=tests))
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=tests))
    monkeypatch.chdir(tmp_path)
    root = str(Path(__file__).parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return ncu, script


def test_the_command_profiles_the_launches_it_is_told_to(stand_in, capsys):
    ncu, script = stand_in
    argv = ["profile", "--ncu", str(ncu), "--gpu", "h100", "--recipe", "gemm_bf16", "--launch-skip", "1",
            "--launch-count", "2", "--out", "prof", "--", sys.executable, str(script)]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    result = json.loads(Path("prof/profile.json").read_text())
    assert [launch["problem"] for launch in result["launches"]] == [[2048, 4096, 4096], [4096, 4096, 4096]]
    first = result["launches"][0]
    assert first["measured"]["time_us"] == 1500.0 and first["measured"]["dram_bytes"] == 290_000_000
    assert first["measured"]["tensor_pipe_pct"] == 70.25 and first["measured"]["sm_mhz"] is None
    assert result["format"] == pf.PROFILE_FORMAT and result["chip"] == "gh100" and result["clock_control"] == "base"
    lines = out.splitlines()
    assert lines[0].startswith("H100 SXM (gh100), clocks base") and "2048x4096x4096" in lines[2]
    assert "4096x4096x4096" in lines[3] and len(lines) == 4


def test_no_launch_of_the_recipe_is_named_and_no_ncu_gives_the_fix(stand_in, capsys, tmp_path):
    ncu, script = stand_in
    argv = ["profile", "--ncu", str(ncu), "--gpu", "h100", "--recipe", "gemm_bf16", "--launch-skip", "3",
            "--", sys.executable, str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gemmgen: error: profile: ncu wrote no report") and "after 3 skipped" in err
    assert main(["profile", "--ncu", str(tmp_path / "nowhere"), "--gpu", "h100", "--", "python", "t.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gemmgen: error: --ncu ") and "pass its path with --ncu /path/to/ncu" in err
    assert main(["profile", "--ncu", str(ncu), "--gpu", "a100", "--", "python", "t.py"]) == 2
    assert "give one of h100, h200, b200" in capsys.readouterr().err

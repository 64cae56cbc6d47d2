"""`gemmgen profile` with the real Nsight Compute on an sm_90 GPU (marker `gpu`; skipped with a reason
elsewhere, and where the machine has no `ncu`): one launch of gemm_bf16's default kernel (from the
prepared bundle) at 4096^3, profiled after one skipped, its figures beside the time model's.
scripts/gpu_check.sh runs this module as a step of its own, under a timeout of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.data import EXAMPLES, ROOT

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""\
    import torch
    from gemmgen.aot import load_recipes
    kernel = load_recipes({examples!r})["gemm_bf16"].compile()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        kernel(a, b)
    torch.cuda.synchronize()
    """)


def test_profile_measures_one_launch_beside_the_model(tmp_path):
    ncu = shutil.which("ncu") or shutil.which("/usr/local/cuda/bin/ncu")
    if ncu is None:
        pytest.skip("no ncu on this GPU machine (Nsight Compute not installed): gemmgen profile not run")
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT.format(examples=str(EXAMPLES)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "gemmgen.cli", "profile", "--ncu", ncu, "--recipe", "gemm_bf16",
                           "--launch-skip", "1", "--out", str(tmp_path / "prof"), "--", sys.executable, str(script)],
                          capture_output=True, text=True, env=env, timeout=45)
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "prof" / "profile.json").read_text())
    launch, = result["launches"]
    got, model = launch["measured"], launch["predicted"]
    assert launch["problem"] == [4096, 4096, 4096] and launch["recipe"] == "gemm_bf16"
    assert got["time_us"] > 0 and got["sm_count"] in (132, 114)  # H100/H200 SXM, H100 PCIe
    assert got["grid_size"] <= got["sm_count"]  # persistent: at most one CTA per SM
    # ncu flushes the caches before each pass: A and B come from DRAM at least once (D may stay in
    # L2 when the kernel ends), so at least 2/3 of the minimum traffic; a unit slip is off by 10^3
    assert got["dram_bytes"] >= 2 / 3 * model["min_bytes"]
    assert got["tensor_pipe_pct"] is None or 0 < got["tensor_pipe_pct"] <= 100
    print(f"measured {got['time_us']:.1f} us, model {model['time_us']:.1f} us, ratio {launch['ratio']['time']:.2f}")

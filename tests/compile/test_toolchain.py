"""What cache keys hash of the toolchain: every header a kernel can include, and nothing else."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gemmgen as gg
from gemmgen.compile.toolchain import _headers_digest, hashed_headers, toolchain
from tests.data import ROOT


def _site(tmp_path: Path, wheels: dict[str, list[str]], contents: dict[str, str]) -> Path:
    """A site-packages folder holding `contents`, each file installed by the wheel that lists it."""
    site = tmp_path / "site"
    for rel, text in contents.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    for name, files in wheels.items():
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return site


def test_headers_of_other_wheels_are_not_hashed(tmp_path, monkeypatch):
    """A CUDA build of torch installs cuBLAS, cuDNN... headers next to the CUDA runtime's: keys must
    not change with them, and must change with any header the runtime wheel (even if another wheel
    lists it too) or no wheel installed."""
    include = "nvidia/cu13/include"
    site = _site(tmp_path, {"nvidia-cuda-runtime": [f"{include}/cuda_runtime.h"],
                            "nvidia-cublas": [f"{include}/cublas_v2.h", f"{include}/cuda_runtime.h"]},
                 {f"{include}/cuda_runtime.h": "// runtime\n", f"{include}/cublas_v2.h": "// cublas\n"})
    monkeypatch.syspath_prepend(str(site))
    roots = (site / include,)
    assert [p.name for _, p in hashed_headers(roots)] == ["cuda_runtime.h"]
    digests = [_headers_digest(roots)]
    (site / include / "cublas_v2.h").write_text("// cublas, next release\n")
    _headers_digest.cache_clear()
    digests.append(_headers_digest(roots))
    (site / include / "cuda_runtime.h").write_text("// runtime, patched\n")
    _headers_digest.cache_clear()
    digests.append(_headers_digest(roots))
    (site / include / "copied_by_hand.h").write_text("// no wheel claims this\n")
    _headers_digest.cache_clear()
    digests.append(_headers_digest(roots))
    _headers_digest.cache_clear()
    assert digests[0] == digests[1] and len(set(digests)) == 3


@pytest.mark.nvrtc
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to see which headers NVRTC opens")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_keys_cover_every_header_a_compile_opens(tmp_path, arch):
    """NVRTC parses the generated kernels' preprocessor lines under strace (for bias_gelu_aux the
    same 1,921 paths tried as for the whole kernel, compared by hand, in 4.5 s instead of 37 s):
    each file it opens from the include path must be one that cache keys hash, or a change to it
    could serve a stale binary. sm_100a: an sm100 kernel's lines, with the header gemmgen generates
    in memory (its text is in the sm100 keys: `compile.rtc_headers`)."""
    if arch == "sm_90a":
        texts = [path.read_text() for path in sorted((ROOT / "generated").glob("*.cu"))]
    else:
        recipe = gg.Recipe("r", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
        texts = [recipe.source(recipe.default_config(gg.Arch.SM100A))]
    lines = [line for text in texts for line in text.splitlines() if line.lstrip().startswith("#")]
    assert sum(line.lstrip().startswith("#include") for line in lines) >= 8
    source = tmp_path / "includes.cu"
    source.write_text("\n".join(lines) + "\n")
    trace = tmp_path / "trace.txt"
    script = ("from pathlib import Path; from gemmgen.compile.nvrtc import compile_cubin; "
              "from gemmgen.compile.rtc_headers import generated_headers; "
              "from gemmgen.compile.toolchain import toolchain; "
              f"compile_cubin(Path({str(source)!r}).read_text(), 'includes', {arch!r}, toolchain().include_dirs, "
              "extra_options=('--fdevice-syntax-only',), headers=generated_headers(toolchain().cutlass_include))")
    run = subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat", "-o", str(trace),
                          sys.executable, "-c", script], capture_output=True, text=True)
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr[-2000:]
    dirs = toolchain().include_dirs
    opened = set()
    for line in trace.read_text().splitlines():
        m = re.search(r'open(?:at)?\(.*?"([^"]+)".*\)\s*=\s*\d+', line)
        if m and any(m.group(1).startswith(f"{d}/") for d in dirs):
            opened.add(Path(m.group(1)))
    hashed = {p for _, p in hashed_headers(dirs)}
    assert len(opened) > 100 and Path(f"{dirs[-1]}/cuda_runtime.h") in opened
    assert opened <= hashed, sorted(opened - hashed)[:10]


@pytest.mark.nvrtc
def test_keys_record_the_nvrtc_patch_release_and_build():
    """nvrtcVersion says only (13, 0); a patched NVRTC can generate other code, so keys record the
    identity NVRTC stamps on PTX."""
    build = toolchain().nvrtc_build
    major, minor = toolchain().nvrtc_version
    assert re.search(rf"V{major}\.{minor}\.\d+", build) and re.search(r"Build ID: CL-\d+", build), build

"""The wheel: what `pip install` gives a user carries everything a kernel needs that is not a
pinned dependency (the templates, which live at the repository's top level, and gemmgen's headers)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_an_installed_wheel_renders_a_kernel_from_the_templates_it_ships(tmp_path):
    """The wheel built from this checkout, unpacked as pip installs it, renders a kernel with the
    templates inside the package (not the checkout's), from a directory outside the checkout."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True)
    wheel, = dist.glob("gemmgen-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    assert {"gemmgen/templates/kernel.cu.j2", "gemmgen/templates/sm90/gemm_types.inc.j2",
            "gemmgen/templates/sm100/gemm_types.inc.j2", "gemmgen/include/gemmgen/epilogue.hpp"} <= names
    program = ("import gemmgen as gg\n"
               "from gemmgen.codegen import render_kernel, templates_dir\n"
               "r = gg.Recipe('t', lambda acc, bias: gg.gelu(acc + bias), operands={'bias': gg.RowVector(gg.bf16)})\n"
               "print(gg.__file__)\nprint(templates_dir())\n"
               "print(len(render_kernel(r.ir, r.default_config()).source))\n")
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}).stdout.split()
    assert Path(out[0]).is_relative_to(site), f"imported {out[0]}, not the wheel's"
    assert Path(out[1]) == site / "gemmgen" / "templates"
    assert int(out[2]) > 10_000

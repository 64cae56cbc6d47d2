"""What test_profile.py's stand-in ncu and its script share with the tests, in the standard library
alone (each runs in a process of its own: no torch or gemmgen to import there)."""

from __future__ import annotations

import json
from pathlib import Path

#: Nsight Compute 2024.1.1's own output (see test_profile.py).
NCU = Path(__file__).parents[1] / "data" / "ncu"

ENTRY = "gemmgen_gemm_bf16_128x256x64_c2x1x1_cooperative_auto_0123456789ab"
#: gemm_bf16's 128 x 256 x 64 config on a 2 x 1 cluster, as `KernelConfig.canonical` writes it.
CANONICAL = json.dumps([[128, 256, 64], [2, 1, 1], "cooperative", None, "persistent"])


def record_fields(symbol: str = ENTRY, problem: tuple[int, ...] = (4096, 4096, 4096), **kw: object) -> dict:
    """A `runtime.nvtx.LaunchRecord`'s fields: a gemm_bf16 launch unless told otherwise."""
    fields = dict(symbol=symbol, recipe="gemm_bf16", config="128x256x64_c2x1x1_cooperative_auto",
                  canonical=CANONICAL, problem=problem, arch="sm_90a", a_bits=16, d_bits=16, grouped=False,
                  k_grouped=False, pid=4242)
    return {**fields, **kw}


def raw_csv(rows: list[dict[str, str]], metrics: list[str]) -> str:
    """A raw page laid out as tests/data/ncu/raw_page.csv: the fixed columns, then the metrics, a
    units row under the header, every cell quoted; one of ncu's own lines before."""
    fixed = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
             "Grid Size", "Device", "CC"]
    units = {"gpu__time_duration.sum": "nsecond", "dram__bytes_read.sum": "byte", "dram__bytes_write.sum": "byte",
             "sm__cycles_elapsed.avg.per_second": "cycle/second"}

    def line(cells: list[str]) -> str:
        return ",".join(f'"{c}"' for c in cells)

    out = ["==PROF== Connected to process 4242 (/usr/bin/python3.11)", line(fixed + metrics),
           line([""] * len(fixed) + [units.get(m, "") for m in metrics])]
    out += [line([r.get(c, "") for c in fixed + metrics]) for r in rows]
    return "\n".join(out) + "\n"

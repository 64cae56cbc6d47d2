"""gemmgen's driver layer end to end on the CPU, against a stand-in libcuda (gemmgen/testing/stub_driver.py).

The cases (tests/runtime/stub_driver_cases.py) run in one child process, which loads the stub as its
libcuda.so.1: every encode, load and launch goes through the real cuda.bindings or ctypes calls, and
the tests check what arrived in C. This is what no other CPU test reaches: without a driver the
bindings fail at dlopen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.stub_driver_cases import CASES

CASES_FILE = Path(__file__).with_name("stub_driver_cases.py")


@pytest.fixture(scope="module")
def stub_report(compiled, sm100_kernels, session_cache, tmp_path_factory):
    """Every case's outcome ("ok" or its traceback), from one child process."""
    from gemmgen.testing.stub_driver import build

    folder = tmp_path_factory.mktemp("stub-driver")
    lib = build(folder)
    results = folder / "results.json"
    env = {**os.environ, "GEMMGEN_JIT": "0"}  # the kernels come from the session cache, never recompiled
    done = subprocess.run([sys.executable, str(CASES_FILE), str(lib), str(session_cache.root), str(results)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and results.is_file(), f"the child process failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(results.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_driver_layer_against_the_stub(stub_report, case):
    outcome = stub_report[case]
    if outcome != "ok":
        pytest.fail(f"{case}: {CASES[case].__doc__}\n{outcome}", pytrace=False)


def test_stub_map_round_trip():
    """decode_map reads back what the stub's StubMap layout holds, and rejects other bytes."""
    import struct

    from gemmgen.runtime.tma import EncodeArgs
    from gemmgen.testing.stub_driver import _MAP, decode_map

    args = EncodeArgs(9, 3, 0x7F00_0000_1000, (24, 40, 2), (64, 2560), (32, 64, 1), (1, 1, 1), 0, 2, 2, 0)
    raw = _MAP.pack(0x4D544747, 9, 3, 0, 2, 2, 0, 1, 1, 1, 0, 0, 0x7F00_0000_1000, 24, 40, 2, 0, 0, 64, 2560, 0, 0,
                    32, 64, 1, 0, 0, 7).ljust(128, b"\0")
    assert decode_map(raw) == args
    assert decode_map(b"\0" * 128) is None
    assert decode_map(struct.pack("<I", 0x4D544747).ljust(128, b"\0")) is None  # rank 0

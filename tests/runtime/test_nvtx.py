"""GEMMGEN_NVTX's reading (the ranges themselves: tests/runtime/stub_driver_cases.py's
case_nvtx_ranges_name_each_launch, through the real launch path)."""

from __future__ import annotations

import pytest

from gemmgen import env
from gemmgen.errors import InvalidArgument
from gemmgen.runtime import nvtx


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("off", False), ("1", True), ("yes", True)])
def test_the_variable_turns_ranges_on(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv("GEMMGEN_NVTX", raising=False)
    else:
        monkeypatch.setenv("GEMMGEN_NVTX", value)
    monkeypatch.setattr(nvtx, "enabled", None)
    assert nvtx.active() is on and nvtx.enabled is on


def test_a_wrong_value_is_named_with_the_fix(monkeypatch):
    monkeypatch.setenv("GEMMGEN_NVTX", "maybe")
    with pytest.raises(InvalidArgument, match=r"GEMMGEN_NVTX='maybe': expected 1 \(name each launch"):
        env.nvtx_enabled()


def test_a_range_is_pushed_and_popped_around_its_block():
    events: list = []
    with nvtx.launch_range(nvtx.range_name("r", "128x128x64", (8, 16, 32, 2)), events.append,
                           lambda: events.append("pop")):
        events.append("launch")
    assert events == ["gemmgen r 128x128x64 8x16x32x2", "launch", "pop"]

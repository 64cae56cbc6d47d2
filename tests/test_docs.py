"""The README's example runs as written."""

from __future__ import annotations

import re

import pytest

from tests.data import ROOT

pytestmark = pytest.mark.nvrtc


def test_readme_example_runs(compiled, session_cache, monkeypatch):
    import gemmgen.compile.build

    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(session_cache.root))  # the session's compiled bias_gelu
    gemmgen.compile.build.default_cache.cache_clear()
    found = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert found, "README.md has a python example"
    block = found.group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    gemmgen.compile.build.default_cache.cache_clear()
    assert scope["built"].report.cached
    assert scope["ref"].shape == (7, 16)

"""Shared fixtures. NVRTC compiles cost ~35 s and ~3.4 GB each: they happen once per session,
in parallel, into one session cache that every test reads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "recipes.py"
EXTRA = Path(__file__).resolve().parent / "data" / "extra_recipes.py"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:
        has_sm90 = False
    if not has_sm90:
        skip = pytest.mark.skip(reason="needs an sm_90 GPU (none here); run scripts/gpu_check.sh on an H100/H200")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    from gemmgen.compile.cache import KernelCache

    root = os.environ.get("GEMMGEN_TEST_CACHE_DIR") or tmp_path_factory.mktemp("gemmgen-cache")
    return KernelCache(root)


@pytest.fixture(scope="session")
def examples():
    from gemmgen.recipes_file import load_recipes

    return load_recipes(EXAMPLES)


@pytest.fixture(scope="session")
def extra():
    from gemmgen.recipes_file import load_recipes

    return load_recipes(EXTRA)


def dense(items: dict) -> dict:
    """Recipes or compiled kernels by name, but the grouped ones: tests/test_grouped.py covers those
    (they take offsets, and their groups' shapes live on the GPU)."""
    return {name: x for name, x in items.items() if not getattr(x, "recipe", x).gemm.grouped}


@pytest.fixture(scope="session")
def compiled(session_cache, examples, extra):
    """Every example kernel plus the extra-coverage kernels, compiled once (2 workers)."""
    from gemmgen.build import build_kernel
    from gemmgen.parallel import build_file

    for path in (EXAMPLES, EXTRA):
        build_file(path, session_cache, jobs=2, quiet=False)
    out = {}
    for recipes in (examples, extra):
        for r in recipes.values():
            out[r.name] = build_kernel(r, r.default_config(), session_cache)
    print(file=sys.stderr)
    return out

"""Shared fixtures. NVRTC compiles cost ~35 s and ~3.4 GB each: they happen once per session,
in parallel, into one session cache that every test reads."""

from __future__ import annotations

import os
import sys

import pytest

from tests.data import EXAMPLES, EXTRA

_ORACLES = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:
        has_sm90 = False
    if not has_sm90:
        skip = pytest.mark.skip(reason="needs an sm_90 GPU (none here); run scripts/gpu_check.sh on an H100/H200")
        for item in items:
            if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds tests/gpu's name too
                item.add_marker(skip)
    config.stash[_ORACLES] = any(item.get_closest_marker("oracle") is not None for item in items)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    from gemmgen.compile import KernelCache

    root = os.environ.get("GEMMGEN_TEST_CACHE_DIR") or tmp_path_factory.mktemp("gemmgen-cache")
    return KernelCache(root)


@pytest.fixture(scope="session")
def examples():
    from gemmgen.aot import load_recipes

    return load_recipes(EXAMPLES)


@pytest.fixture(scope="session")
def extra():
    from gemmgen.aot import load_recipes

    return load_recipes(EXTRA)


@pytest.fixture(scope="session", autouse=True)
def oracles_in_the_background(request, examples, extra, tmp_path_factory):
    """Where the session runs oracle tests: nvcc builds their programs from the start, at the lowest
    CPU priority (tests/data/oracle_sets.py), so that they take the core the session's
    single-threaded work leaves idle rather than time of their own; killed at the session's end."""
    if not request.config.stash.get(_ORACLES, False):
        yield
        return
    from gemmgen.testing import oracle
    from tests.data.oracle_sets import oracle_kernels

    build = tmp_path_factory.mktemp("oracles")
    for kernels in oracle_kernels(examples, extra):
        oracle.start_all([oracle.OracleProgram(k, build) for k in kernels], build)
    yield
    oracle.stop_background()


@pytest.fixture(scope="session")
def compiled(session_cache, examples, extra):
    """Every example kernel plus the extra-coverage kernels, compiled once (2 workers)."""
    from gemmgen.aot import build_file
    from gemmgen.compile import build_kernel

    for path in (EXAMPLES, EXTRA):
        build_file(path, session_cache, jobs=2, quiet=False)
    out = {}
    for recipes in (examples, extra):
        for r in recipes.values():
            out[r.name] = build_kernel(r.ir, r.default_config(), session_cache)
    print(file=sys.stderr)
    return out


@pytest.fixture(scope="session")
def sm100_kernels(session_cache, examples):
    """tests/data/sm100.py's sm_100a kernels, compiled once (2 workers, about a minute)."""
    from gemmgen.aot import build
    from gemmgen.config import Arch
    from tests.data.sm100 import SM100_KERNELS

    pairs = [(examples[n], c or examples[n].default_config(Arch.SM100A)) for n, c in SM100_KERNELS.items()]
    return dict(zip(SM100_KERNELS, build(pairs, session_cache, jobs=2, allow_compile=True), strict=True))


# ---- grouped kernels (tests of several layers use them)


@pytest.fixture(scope="session")
def grouped_families(session_cache, examples):
    """The grouped test kernels of tests/data/gpu_matrix.py, compiled together (2 workers; from the
    bundle on the GPU): `moe_recipe()` under CHECKED_GROUPED_CONFIGS (its default is compiled with
    the examples, of which it is moe_up), moe_fp8 under FP8_GROUPED_CONFIGS, the example
    moe_fp8_block under BLOCK_GROUPED_CONFIGS (its default also compiled with the examples), the
    example moe_swiglu, gated experts over column pairs (its default, compiled with the examples),
    and GroupedLinear's derived backward kernel, which reads C."""
    from gemmgen.aot import build
    from gemmgen.testing.grouped import moe_recipe
    from tests.data.gpu_matrix import (
        BLOCK_GROUPED_CONFIGS,
        CHECKED_GROUPED_CONFIGS,
        DERIVED_GROUPED_CONFIG,
        FP8_GROUPED_CONFIGS,
        derived_grouped_recipe,
        moe_fp8_recipe,
    )

    families = {"grouped": [(moe_recipe(), c) for c in CHECKED_GROUPED_CONFIGS],
                "fp8": [(moe_fp8_recipe(), c) for c in FP8_GROUPED_CONFIGS],
                "block": [(examples["moe_fp8_block"], c) for c in BLOCK_GROUPED_CONFIGS],
                "gated": [(examples["moe_swiglu"], examples["moe_swiglu"].default_config())],
                "derived": [(derived_grouped_recipe(), DERIVED_GROUPED_CONFIG)]}
    kernels = iter(build([p for pairs in families.values() for p in pairs], session_cache, jobs=2,
                         allow_compile=True))
    return {name: [next(kernels) for _ in pairs] for name, pairs in families.items()}


@pytest.fixture(scope="session")
def grouped_kernels(grouped_families):
    """moe_up under CHECKED_GROUPED_CONFIGS, by config name."""
    return {ck.config.name: ck for ck in grouped_families["grouped"]}


@pytest.fixture(scope="session")
def grouped_kernel(grouped_families):
    return grouped_families["grouped"][0]


@pytest.fixture(scope="session")
def derived_grouped_kernel(grouped_families):
    """GroupedLinear's derived backward kernel (it reads C), under DERIVED_GROUPED_CONFIG."""
    return grouped_families["derived"][0]


@pytest.fixture(scope="session")
def fp8_kernels(grouped_families):
    """moe_fp8 under FP8_GROUPED_CONFIGS: its default and swapped."""
    return grouped_families["fp8"]


@pytest.fixture(scope="session")
def gated_grouped_kernel(grouped_families):
    """The gated experts' grouped kernel over column pairs (moe_swiglu, its default)."""
    return grouped_families["gated"][0]


@pytest.fixture(scope="session")
def block_kernels(grouped_families):
    """The example moe_fp8_block under BLOCK_GROUPED_CONFIGS: its default, a pingpong kernel with a
    2 x 1 cluster, and swapped."""
    return grouped_families["block"]


@pytest.fixture(scope="session")
def block_kernel(block_kernels):
    return block_kernels[0]

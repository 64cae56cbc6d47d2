"""Shared fixtures. NVRTC compiles cost ~35 s and ~3.4 GB each: the session's pool
(tests/background.py) runs every one its tests need, and the two type checks, from the session's
start, into one session cache that every test reads; the modules that need none of it run first."""

from __future__ import annotations

import os
import time

import pytest

from tests.background import Background, Job
from tests.data import EXAMPLES, EXTRA

_ORACLES = pytest.StashKey[bool]()
_NEEDS = pytest.StashKey[list[str]]()
_THREADS = pytest.StashKey[tuple[Background, int]]()
#: The session fixtures whose NVRTC work the background pool does.
POOL_FIXTURES = ("compiled", "type_checks", "sm100_kernels", "grouped_families")


@pytest.hookimpl(trylast=True)  # after -k and -m deselect: only the tests that run decide the pool's work
def pytest_collection_modifyitems(config, items):
    try:
        import torch

        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    except Exception:
        capability = None
    # each GPU marker's device, and what runs its tests there
    devices = {"gpu": ((9, 0), "needs an sm_90 GPU (none here); run scripts/gpu_check.sh on an H100/H200"),
             "gpu_sm100": ((10, 0), "needs an sm_100 GPU (none here); run scripts/gpu_check.sh on a B200/GB200, "
                                    'its bundle prepared with GEMMGEN_GPU_ARCHES="sm_90a sm_100a"')}
    for marker, (device, reason) in devices.items():
        if capability != device:
            for item in items:
                if item.get_closest_marker(marker) is not None:  # not item.keywords: it holds tests/gpu's name too
                    item.add_marker(pytest.mark.skip(reason=reason))
    live = [item for item in items if item.get_closest_marker("skip") is None]
    config.stash[_ORACLES] = any(item.get_closest_marker("oracle") is not None for item in live)

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    waiting = {module(item) for item in live if any(n in item.fixturenames for n in POOL_FIXTURES)}
    items[:] = [i for i in items if module(i) not in waiting] + [i for i in items if module(i) in waiting]
    needs: list[str] = []  # in the order the tests will first ask
    for item in items:
        if item.get_closest_marker("skip") is None:
            needs += [n for n in POOL_FIXTURES if n in item.fixturenames and n not in needs]
    config.stash[_NEEDS] = needs


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    from gemmgen.compile import KernelCache

    root = os.environ.get("GEMMGEN_TEST_CACHE_DIR") or tmp_path_factory.mktemp("gemmgen-cache")
    return KernelCache(root)


@pytest.fixture(scope="session")
def sm100_examples():
    """Every recipe of examples/recipes.py: what the sm_100a tests take."""
    from gemmgen.aot import load_recipes

    return load_recipes(EXAMPLES)


@pytest.fixture(scope="session")
def examples(sm100_examples):
    """The example recipes sm_90a builds: all but the microscaled one (sm_100a's block-scaled MMA)."""
    return {name: r for name, r in sm100_examples.items() if r.ir.gemm.microscaling is None}


@pytest.fixture(scope="session")
def extra():
    from gemmgen.aot import load_recipes

    return load_recipes(EXTRA)


@pytest.fixture(scope="session")
def type_check_seed() -> int:
    return int(os.environ.get("GEMMGEN_TEST_SEED") or time.time_ns() % 2**32)


@pytest.fixture(scope="session")
def type_check_unit(examples, extra, type_check_seed):
    """tests/data/type_checks.py's kernels, by check, and the translation unit checking them."""
    from tests.data.type_checks import type_checks

    return type_checks(examples, extra, type_check_seed)


def _type_check_job(unit) -> Job:
    """The type check's compile, first in its phase (it is the session's longest)."""
    from tests.data.type_checks import compile_check

    return Job("type_check", float("inf"), compile_check, (unit[1],))


def _kernel_jobs(pairs, cache) -> list[Job]:
    """A compile job for each kernel of `pairs` the cache lacks."""
    from gemmgen.codegen import render_kernel
    from gemmgen.compile.parallel import expected_compile_seconds, missing_kernels
    from tests.background import compile_into

    todo, _ = missing_kernels([render_kernel(r.ir, c) for r, c in pairs], cache)
    return [Job(key, expected_compile_seconds(k), compile_into, (str(cache.root), key, k)) for key, k in todo.items()]


@pytest.fixture(scope="session", autouse=True)
def session_pool(request, session_cache, examples, sm100_examples, extra):
    """The background pool (tests/background.py), given the NVRTC work of each pool fixture the
    session's tests ask for, in the order they ask."""
    from tests.data import session_kernels as sk

    pool = Background(workers=2)
    phases = {"compiled": lambda: _kernel_jobs(sk.compiled_pairs(examples, extra), session_cache),
              "type_checks": lambda: [_type_check_job(request.getfixturevalue("type_check_unit"))],
              "sm100_kernels": lambda: _kernel_jobs(sk.sm100_pairs(sm100_examples), session_cache),
              "grouped_families": lambda: _kernel_jobs(sk.compiled_grouped_pairs(examples), session_cache)}
    pool.start({name: phases[name]() for name in request.config.stash.get(_NEEDS, [])})
    if pool.busy:
        # While the pool's two workers hold both cores, the session's torch ops run on one thread:
        # two OpenMP threads sharing a core with the compiles spin (a loss-parity run beside two busy
        # processes, 2026-12-06: 12.0 s on 2 threads, 7.5 s on 1); `pytest_runtest_setup` gives the
        # threads back once the pool is done.
        import torch

        request.config.stash[_THREADS] = (pool, torch.get_num_threads())
        torch.set_num_threads(1)
    yield pool
    pool.close()


def pytest_runtest_setup(item):
    held = item.config.stash.get(_THREADS, None)
    if held is not None and not held[0].busy:
        import torch

        torch.set_num_threads(held[1])
        del item.config.stash[_THREADS]


@pytest.fixture(scope="session", autouse=True)
def oracles_in_the_background(request, examples, sm100_examples, extra, tmp_path_factory):
    """Where the session runs oracle tests: nvcc builds their programs from the start, at the lowest
    CPU priority (tests/data/oracle_sets.py), so that they take what CPU the session's other work
    leaves idle; killed at the session's end."""
    if not request.config.stash.get(_ORACLES, False):
        yield
        return
    from gemmgen.testing import oracle
    from tests.data.oracle_sets import oracle_kernels

    build = tmp_path_factory.mktemp("oracles")
    for kernels in oracle_kernels(sm100_examples, extra):
        oracle.start_all([oracle.OracleProgram(k, build) for k in kernels], build)
    yield
    oracle.stop_background()


def _built(pool: Background, phase: str, pairs, cache) -> list:
    """`pairs` built from the cache once the pool's jobs of `phase` have ended (what they could not
    compile is compiled here, and its error raised here)."""
    from gemmgen.aot import build

    pool.wait_phase(phase)
    return build(pairs, cache, jobs=2, allow_compile=True, quiet=True)


@pytest.fixture(scope="session")
def compiled(session_pool, session_cache, examples, extra):
    """The kernels of tests/data/session_kernels.COMPILED, by recipe name."""
    from tests.data.session_kernels import compiled_pairs

    pairs = compiled_pairs(examples, extra)
    return {r.name: k for (r, _), k in zip(pairs, _built(session_pool, "compiled", pairs, session_cache), strict=True)}


@pytest.fixture(scope="session")
def recipe_kernels(compiled, examples, extra):
    """Every example and coverage recipe's kernel under its default, by recipe name: the compiled
    one where the session compiles it (`compiled`), else the rendered one (`testing.checks.uncompiled`:
    its source and Params fields, no cubin), for the checks of arguments and data flow."""
    from gemmgen.testing.checks import uncompiled
    from tests.data.session_kernels import recipe_pairs

    return {r.name: compiled.get(r.name) or uncompiled(r, c) for r, c in recipe_pairs(examples, extra)}


@pytest.fixture(scope="session")
def type_checks(session_pool, type_check_unit, type_check_seed) -> dict:
    """{"examples": (kernels, the compile's future), "random": (kernels, the future, seed)}: one
    compile checks both lists."""
    kernels, _ = type_check_unit
    session_pool.start({"type_checks": [_type_check_job(type_check_unit)]})  # a no-op where it was planned
    future = session_pool.future("type_check")
    return {"examples": (kernels["examples"], future), "random": (kernels["random"], future, type_check_seed)}


@pytest.fixture(scope="session")
def sm100_kernels(session_pool, session_cache, sm100_examples):
    """tests/data/sm100.py's sm_100a kernels, by example name."""
    from tests.data.session_kernels import sm100_pairs
    from tests.data.sm100 import SM100_KERNELS

    return dict(zip(SM100_KERNELS, _built(session_pool, "sm100_kernels", sm100_pairs(sm100_examples), session_cache),
                    strict=True))


# ---- grouped kernels (tests of several layers use them)


@pytest.fixture(scope="session")
def grouped_families(session_pool, session_cache, examples):
    """tests/data/session_kernels.py's grouped families, by family name: compiled, but for the
    configs of UNCOMPILED_GROUPED, rendered (`testing.checks.uncompiled`: no cubin)."""
    from gemmgen.testing.checks import uncompiled
    from tests.data.session_kernels import UNCOMPILED_GROUPED, compiled_grouped_pairs, grouped_pairs

    pairs = compiled_grouped_pairs(examples)
    kernels = _built(session_pool, "grouped_families", pairs, session_cache)
    built = {(r.name, c): k for (r, c), k in zip(pairs, kernels, strict=True)}
    return {name: [uncompiled(r, c) if (r.name, c) in UNCOMPILED_GROUPED else built[r.name, c] for r, c in family]
            for name, family in grouped_pairs(examples).items()}


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
def k_grouped_kernel(grouped_families):
    """The experts' K-grouped weight gradient into main_grad (its default)."""
    return grouped_families["k_grouped"][0]


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

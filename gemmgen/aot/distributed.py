"""Warm-up across the ranks of a torch.distributed job: each kernel the job lacks is compiled once.

Every rank makes the same collective calls in the same order, whatever its own cache holds, so no
rank can desynchronise the job:

1. gather: from each rank, the kernels it needs (key, name, expected compile seconds), which of
   them it holds (a bundle, its cache, the remote tier), its host and cache folder, whether it may
   compile (GEMMGEN_JIT), and any error it met preparing;
2. plan, computed identically on every rank from what was gathered: for each kernel some rank
   lacks, a source: the lowest rank holding it, else a rank that needs it and may compile it,
   the costliest kernels first, each to the least loaded rank (longest processing time first);
3. compile: each rank compiles its share in its worker processes, the host's workers split
   between the host's ranks;
4. exchange: one broadcast per kernel from its source; each cache folder is written once (by the
   lowest receiving rank using it; not at all where the source's folder is), its other ranks keep
   the kernel in memory;
5. outcome: a failed compile, a rank that could not prepare, or (GEMMGEN_JIT=0) a kernel that no
   rank holds makes every rank raise the same error, after the exchange of everything else.

The collectives run over a gloo group (CPU, with GEMMGEN_WARMUP_TIMEOUT as its timeout) made from
the default group, as the default group may be NCCL, whose watchdog is shorter than a compile; a
group passed explicitly must be a gloo group, and is used as it is (with its own timeout). A rank
that dies makes the others' next collective fail (gloo notices a closed connection at once); a
rank that hangs, after the timeout.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import env
from ..codegen import GeneratedKernel, render_kernel
from ..compile import KernelCache, default_cache
from ..compile import bundles as bundle_store
from ..compile.blob import pack, unpack
from ..compile.build import cache_key, fetch_remote, kernel_check
from ..compile.cache import Artifact
from ..compile.parallel import compile_kernels, default_jobs, expected_compile_seconds, missing_kernels
from ..compile.validate import report_damaged
from ..config import KernelConfig
from ..errors import GemmgenError, InvalidArgument, KernelNotAvailable
from ..ir import RecipeIR


@dataclass(frozen=True)
class RankState:
    """What one rank contributes to the plan (gathered from every rank)."""

    rank: int
    host: str
    cache: str  # the cache folder: ranks with the same (host, cache) share one
    kernels: dict[str, tuple[str, float]]  # key -> (what it is, expected compile seconds)
    have: frozenset[str]
    may_compile: bool
    error: str | None = None


@dataclass(frozen=True)
class Transfer:
    """One kernel some rank lacks: where it comes from, who takes it, who stores it."""

    key: str
    label: str
    source: int | None  # None: no rank holds it and none may compile it
    compile: bool  # the source compiles it first
    receivers: tuple[int, ...]
    writers: tuple[int, ...]  # of the receivers, one per cache folder


@dataclass
class ShareReport:
    """What a distributed warm-up did, as this rank saw it."""

    rank: int
    world: int
    kernels: int  # distinct kernels the job needs
    compiled_by_rank: dict[int, int] = field(default_factory=dict)
    compiled_here: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    fetched: set[str] = field(default_factory=set)
    seconds: dict[str, float] = field(default_factory=dict)  # prepare, gather, compile, exchange

    def origin(self, key: str, found: str) -> str:
        """How this rank got kernel `key`, for its report (`found`: where the local build found it)."""
        return "compiled" if key in self.compiled_here else "peer" if key in self.received \
            else "remote" if key in self.fetched else found

    def summary(self) -> str:
        per_rank = ", ".join(f"{r}: {n}" for r, n in sorted(self.compiled_by_rank.items()) if n) or "none"
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return (f"gemmgen: distributed warm-up over {self.world} ranks: {self.kernels} kernel(s), compiled per "
                f"rank {per_rank}; {phases}")


def make_plan(states: Sequence[RankState]) -> list[Transfer]:
    """The transfers, the same on every rank given the same gathered states (pure: no I/O)."""
    states = sorted(states, key=lambda s: s.rank)
    needed: dict[str, tuple[str, float]] = {}
    for s in states:
        needed.update(s.kernels)
    load = {s.rank: 0.0 for s in states}
    plan = []
    for key in sorted(needed, key=lambda k: (-needed[k][1], k)):
        label, cost = needed[key]
        holders = sorted(s.rank for s in states if key in s.have)
        lacking = [s for s in states if key in s.kernels and key not in s.have]
        if not lacking:
            continue
        compilers = [s.rank for s in states if key in s.kernels and s.may_compile]
        source = holders[0] if holders else min(compilers, key=lambda r: (load[r], r)) if compilers else None
        if source is not None and not holders:
            load[source] += cost
        receivers = tuple(s.rank for s in lacking if s.rank != source)
        stored = {(s.host, s.cache) for s in states if s.rank == source or s.rank in holders}
        writers: dict[tuple[str, str], int] = {}
        for s in lacking:
            if s.rank in receivers and (s.host, s.cache) not in stored:
                writers.setdefault((s.host, s.cache), s.rank)
        plan.append(Transfer(key, label, source, not holders and source is not None, receivers,
                             tuple(sorted(writers.values()))))
    return plan


def process_group(group: Any = None, distributed: bool | None = None) -> Any:
    """The group a warm-up shares its kernels over, or None to warm up alone."""
    if distributed is False or (distributed is None and not env.distributed_enabled()):
        return None
    dist = sys.modules.get("torch.distributed")  # no process group can exist unless torch.distributed was imported
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if group is None and not initialized:
        if distributed:
            raise InvalidArgument("distributed=True: expected an initialised torch.distributed process group; call "
                                  "torch.distributed.init_process_group(...) first, or pass group=")
        return None
    if not initialized:
        raise InvalidArgument("group: torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group(...) before gemmgen.warmup(..., group=...)")
    assert dist is not None
    if (dist.get_world_size(group) if group is not None else dist.get_world_size()) == 1:
        return None
    if group is None or group is dist.group.WORLD:
        return _gloo_world(env.warmup_timeout())
    if dist.get_backend(group) != "gloo":
        raise InvalidArgument(f"group: expected a gloo group, got a {dist.get_backend(group)} one: the warm-up sends "
                              "bytes on the CPU and waits through compiles, longer than an NCCL watchdog allows; pass "
                              "torch.distributed.new_group(ranks, backend='gloo'), or no group to use the default one")
    return group


_GLOO_GROUPS: dict[float, Any] = {}


def _gloo_world(timeout: float) -> Any:
    """A gloo group over every rank (made once per timeout; making it is itself collective)."""
    import torch.distributed as dist

    if timeout not in _GLOO_GROUPS:
        _GLOO_GROUPS[timeout] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    return _GLOO_GROUPS[timeout]


def _forget(group: Any) -> None:
    import torch.distributed as dist

    for timeout, own in list(_GLOO_GROUPS.items()):
        if own is group:
            del _GLOO_GROUPS[timeout]
            dist.destroy_process_group(group)


class _Collective:
    """Turns a failed collective into one GemmgenError that says what to look at; a gloo group of
    gemmgen's own is destroyed then (its connections to a dead rank would abort the process at exit)."""

    def __init__(self, what: str, world: int, group: Any) -> None:
        self.what, self.world, self.group = what, world, group

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        if e is not None and isinstance(e, RuntimeError) and not isinstance(e, GemmgenError):
            _forget(self.group)
            raise GemmgenError(
                f"distributed warm-up: the {self.what} over {self.world} ranks failed ({str(e).splitlines()[0]}); "
                "a rank died or stopped taking part (see the other ranks' logs); waits are bounded by "
                f"GEMMGEN_WARMUP_TIMEOUT ({env.warmup_timeout():.0f} s)") from e


def share_kernels(pairs: Sequence[tuple[RecipeIR, KernelConfig]], group: Any, cache: KernelCache | None = None,
                  jobs: int | None = None, quiet: bool = False) -> ShareReport:
    """Make every rank's cache hold the kernels of `pairs`, compiling each missing one once in the
    job (see the module's docstring). Every rank of `group` must call it, with its own pairs."""
    import torch.distributed as dist

    cache = cache or default_cache()
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start = time.perf_counter()
    state, kernels = _prepare(rank, pairs, cache)
    prepared = time.perf_counter()
    states: list[Any] = [None] * world
    with _Collective("gather of what each rank holds", world, group):
        dist.all_gather_object(states, state, group=group)
    report = ShareReport(rank, world, len({k for s in states for k in s.kernels}))
    report.fetched = {k for k in state.have if k in kernels and kernels[k][1] == "remote"}
    if errors := [f"rank {s.rank} ({s.host}): {s.error}" for s in states if s.error]:
        raise GemmgenError("distributed warm-up: a rank could not prepare its kernels: " + "; ".join(errors))
    plan = make_plan(states)
    report.compiled_by_rank = {s.rank: sum(1 for t in plan if t.compile and t.source == s.rank) for s in states}
    report.seconds["prepare"] = prepared - start
    report.seconds["gather"] = time.perf_counter() - prepared

    start = time.perf_counter()
    mine = {t.key: kernels[t.key][0] for t in plan if t.compile and t.source == rank}
    ranks_here = sum(1 for s in states if s.host == state.host)
    done, failed = compile_kernels(mine, cache, jobs or max(1, default_jobs() // ranks_here), quiet,
                                   {t.key: t.label for t in plan})
    report.compiled_here = set(done)
    report.seconds["compile"] = time.perf_counter() - start

    start = time.perf_counter()
    failures: list[str] = []
    for t in plan:
        if t.source is None:
            continue
        payload: list[Any] = [None]
        if t.source == rank:
            payload[0] = _payload(t, kernels, cache, failed)
        with _Collective(f"exchange of {t.label}", world, group):
            dist.broadcast_object_list(payload, src=dist.get_global_rank(group, t.source), group=group)
        kind, value = payload[0]
        if kind == "error":
            failures.append(f"{t.label} on rank {t.source}: {value}")
        elif rank in t.receivers:
            _receive(t, value, kernels[t.key][0], cache, writer=rank in t.writers)
            report.received.add(t.key)
    report.seconds["exchange"] = time.perf_counter() - start
    if failures:
        raise GemmgenError(f"distributed warm-up: {len(failures)} kernel(s) failed to compile: " + "; ".join(failures))
    if missing := [t for t in plan if t.source is None]:
        raise _none_may_compile(missing)
    return report


def _prepare(rank: int, pairs: Sequence[tuple[RecipeIR, KernelConfig]], cache: KernelCache
             ) -> tuple[RankState, dict[str, tuple[GeneratedKernel, str]]]:
    """This rank's state, and {key: (kernel, where this rank holds it: "", "local" or "remote")}."""
    host = socket.gethostname()
    try:
        rendered = [render_kernel(r, c) for r, c in pairs]
        keys = [cache_key(k) for k in rendered]
        todo, _ = missing_kernels(rendered, cache)
        kernels = {key: (k, "local") for key, k in zip(keys, rendered, strict=True)}
        for key, k in todo.items():
            fetched = fetch_remote(cache, key, kernel_check(k)) is not None
            kernels[key] = (k, "remote" if fetched else "")
        state = RankState(rank, host, str(cache.root.resolve()),
                          {key: (f"{r.name} ({c.name})", expected_compile_seconds(k))
                           for (r, c), k, key in zip(pairs, rendered, keys, strict=True)},
                          frozenset(key for key, (_, where) in kernels.items() if where), env.jit_enabled())
        return state, kernels
    except GemmgenError as e:  # every rank still takes part in the gather, and raises with the others
        return RankState(rank, host, str(cache.root), {}, frozenset(), False, f"{type(e).__name__}: {e}"), {}


def _payload(t: Transfer, kernels: dict[str, tuple[GeneratedKernel, str]], cache: KernelCache,
             failed: dict[str, BaseException]) -> tuple[str, Any]:
    if t.key in failed:
        e = failed[t.key]
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    kernel = kernels[t.key][0]
    check = kernel_check(kernel)
    art = cache.for_arch(kernel.arch).get(t.key, check) or \
        bundle_store.find(bundle_store.source_key(kernel), kernel.arch, check)
    if art is None:
        return "error", "its binary was not found after it was built (see this rank's warnings)"
    return "kernel", pack(t.key, art)


def _receive(t: Transfer, data: bytes, kernel: GeneratedKernel, cache: KernelCache, writer: bool) -> None:
    """Validate what the source sent; the cache folder's writer stores it, the others keep it in memory.
    A value that fails is reported and dropped: the build after the exchange compiles it here (or raises)."""
    check = kernel_check(kernel)
    art, problem = unpack(data, t.key)
    if art is not None:
        problem = check(art)
    if problem is not None or art is None:
        report_damaged(f"distributed warm-up: {t.label} from rank {t.source}", str(problem), "not used")
        return
    received: Artifact = art
    if writer:
        cache.get_or_build(t.key, lambda: received, check=check)
    else:
        cache.keep(t.key, received)


def _none_may_compile(missing: Iterable[Transfer]) -> KernelNotAvailable:
    names = "; ".join(t.label for t in missing)
    return KernelNotAvailable(f"distributed warm-up: no rank holds {names}, and GEMMGEN_JIT=0 forbids compiling "
                              "on every rank that needs it; build them ahead of time with `gemmgen build RECIPES.py "
                              "--out DIR` and set GEMMGEN_BUNDLE_PATH=DIR")

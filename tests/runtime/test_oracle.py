"""gemmgen's argument block against CUTLASS's own host code (nvcc-built oracle with a recording
cuTensorMapEncodeTiled), for every kernel family and a spread of problems. CPU only."""

from __future__ import annotations

import itertools

import pytest

import gemmgen as gg
from gemmgen.codegen.fields import KIND_SIZE
from gemmgen.codegen.sm90 import scale_tma
from gemmgen.ir.microscaling import blocked_shape
from gemmgen.runtime.arguments import ArgumentBuilder, field_values, pack
from gemmgen.runtime.base import STAND_IN_D_SINK
from gemmgen.runtime.problem import Problem, TensorArg
from gemmgen.testing.calls import dense
from gemmgen.testing.oracle import OracleProgram, build_all
from gemmgen.testing.recording import RecordingEncoder
from gemmgen.types import Layout, OperandKind

pytestmark = pytest.mark.oracle

# (M, N, K, L, extra padding of leading dimensions in elements; twice as many for fp8 A/B, to keep 16 bytes)
PROBLEMS = [
    (4096, 4096, 4096, 1, 0),  # tile multiples; every tensor far over 128 KiB
    (64, 64, 64, 1, 0),  # every tensor under 128 KiB
    (1, 7, 129, 1, 0),  # M = 1, odd N and K (leading dimensions rounded up to 16 bytes)
    (129, 1000, 4097, 3, 0),  # odd sizes, K tail, batch
    (1000, 129, 7, 3, 24),  # padded leading dimensions, batch
    (7, 4097, 1000, 1, 8),
    (1_000_003, 16_384, 64, 1, 0),  # 7.8 M x 64 output tiles; D alone 32 GB
    (70_001, 4_104, 264, 512, 0),  # 512 batches of 548 x 17 tiles
    # Near the limits of CUTLASS's 32-bit tile arithmetic (runtime.checks.problem_size_check
    # refuses what lies past them; past them CUTLASS's own host code wraps around):
    (2**31 - 1024, 16, 16, 1, 0),
    (16, 2**31 - 1024, 16, 1, 0),
    (16, 16, 2**31 - 1024, 1, 0),
    (8, 8, 8, 2**28, 0),
]


def _up(x: int, m: int = 8) -> int:
    return -(-x // m) * m


def make_problem(recipe, m, n, k, l, pad, sm_count=132, max_active_clusters=0) -> Problem:  # noqa: E741
    g = recipe.gemm
    n += n % 2 if recipe.epilogue.pairs else 0  # an epilogue over column pairs needs whole pairs
    k += k % g.a.packed  # packed fp4 holds K in pairs
    addr = iter(0x7F00_0000_0000 + i * (1 << 34) for i in range(64))
    # A/B leading dimensions stay multiples of 16 bytes: 8 16-bit elements, 16 fp8, 32 fp4
    per_ab = 128 // g.a.bits
    pad_ab = pad * per_ab // 8

    def batch(rows: int, ld: int) -> int:
        return rows * ld if l > 1 else 0

    if g.layout_a is Layout.ROW:
        lda = _up(k, per_ab) + pad_ab
        a = TensorArg(next(addr), (lda, 1, batch(m, lda)))
    else:
        lda = _up(m, per_ab) + pad_ab
        a = TensorArg(next(addr), (1, lda, batch(k, lda)))
    if g.layout_b is Layout.COL:  # K contiguous: B as (N, K) row-major
        ldb = _up(k, per_ab) + pad_ab
        b = TensorArg(next(addr), (ldb, 1, batch(n, ldb)))
    else:
        ldb = _up(n, per_ab) + pad_ab
        b = TensorArg(next(addr), (1, ldb, batch(k, ldb)))

    def mn(dtype, columns=gg.ir.Columns.FULL, per_batch=True) -> TensorArg:
        per, extra = (16, 2 * pad) if dtype.nbytes == 1 else (8, pad)  # fp8 rows: 16-byte multiples too
        ld = _up(columns.extent(n), per) + extra
        return TensorArg(next(addr), (ld, 1, batch(m, ld) if per_batch else 0))

    operands: dict[str, TensorArg | float] = {}
    for o in recipe.operands:
        if o.kind.block_scale and g.microscaling is not None:  # the blocked order, contiguous per batch
            rows, columns = blocked_shape(m if o.kind is OperandKind.SCALE_A else n, k, g.microscaling)
            operands[o.name] = TensorArg(next(addr), (1, 0, rows * columns if l > 1 else 0))
        elif o.kind.block_scale:  # M/N-major, the K-block stride padded to 4 (and by `pad`)
            gran = g.block_scale[0] if o.kind is OperandKind.SCALE_A else g.block_scale[1]
            blocks, k_blocks = -(-(m if o.kind is OperandKind.SCALE_A else n) // gran), -(-k // g.block_scale[2])
            ld = _up(blocks, 4) + 4 * pad
            operands[o.name] = TensorArg(next(addr), (1, ld, ld * k_blocks if l > 1 else 0))
        elif o.per_batch and o.kind is not OperandKind.MATRIX:  # (L,), (L, N), (L, M): padded per batch
            length = 1 if o.kind is OperandKind.SCALAR else _up(n if o.kind is OperandKind.ROW else m) + pad
            operands[o.name] = TensorArg(next(addr), (0, 0, length if l > 1 else 0))
        elif o.kind is OperandKind.SCALAR:
            operands[o.name] = 0.75 if o.name != "beta" else -1.5
        elif o.kind is OperandKind.SEED:  # a value on padded problems, a device int64 on the others
            operands[o.name] = TensorArg(next(addr)) if pad else 0x0123456789ABCDEF
        elif o.kind is OperandKind.MATRIX:
            operands[o.name] = mn(o.dtype, o.columns, o.per_batch)
        else:
            operands[o.name] = TensorArg(next(addr))
    def reduced(o) -> TensorArg:  # contiguous per batch: one value, a value per row (dim 1) or per column (0)
        modes = {None: (0, 0, 1), 1: (1, 0, m), 0: (0, 1, n)}[o.dim]
        return TensorArg(next(addr), (*modes[:2], modes[2] if l > 1 and not o.over_batch else 0))

    def column_blocks(o) -> TensorArg:  # gg.quantize_columns's copy (N, M) and its scales (N, M blocks), N-major
        return TensorArg(next(addr), (_up(m, 16) + 16 * pad, 1, 0) if o.reduce is None else (1, _up(n, 4) + 4 * pad, 0))

    aux = {o.name: column_blocks(o) if o.column_blocks else mn(o.dtype, o.columns) if o.reduce is None else reduced(o)
           for o in recipe.outputs[1:]}
    return Problem(m, n, k, l, a, b, mn(g.d, recipe.outputs[0].columns), operands, aux, 0, sm_count,
                   max_active_clusters, STAND_IN_D_SINK)


@pytest.fixture(scope="session")
def oracles(recipe_kernels, tmp_path_factory):
    """An nvcc-built oracle for every example and coverage recipe's kernel, compiled or not (one
    program, built in the background from the session's start: tests/data/oracle_sets.py)."""
    build = tmp_path_factory.mktemp("oracle")
    programs = {name: OracleProgram(k.generated, build) for name, k in dense(recipe_kernels).items()}
    build_all(list(programs.values()), build)
    return programs


def _decode(data: bytes, offset: int, kind: str) -> int:
    raw = data[offset:offset + KIND_SIZE[kind]]
    if kind in ("i32", "i64"):
        return int.from_bytes(raw, "little", signed=True) & (2**64 - 1)
    return int.from_bytes(raw, "little")


def _extents_aligned(kernel, p: Problem) -> bool:
    """CUTLASS's can_implement also wants contiguous *extents* in multiples of 16 bytes; TMA itself
    needs only 16-byte strides (gemmgen's rule). Where both hold, CUTLASS must accept the problem."""
    g = kernel.generated.kernel_recipe.gemm
    a_contig = p.k if g.layout_a is Layout.ROW else p.m
    b_contig = p.k if g.layout_b is Layout.COL else p.n
    d_contig = p.n if g.layout_d is Layout.ROW else p.m
    scales = True  # block scales read in vectors: their contiguous extent (blocks along M or N) in whole vectors
    for vector, extent, gran in zip(_scale_vectors(kernel), (p.m, p.n), g.block_scale[:2] if g.block_scale else (),
                                    strict=False):
        scales = scales and -(-extent // gran) % vector == 0
    return a_contig % (128 // g.a.bits) == 0 and b_contig % (128 // g.b.bits) == 0 and \
        d_contig % max(8, 16 // g.d.nbytes) == 0 and scales


def _scale_vectors(kernel) -> tuple[int, int]:
    """Scales per vector the main loop reads A's and B's block scales in: sm90's TMA, 4 (16 bytes)
    where it uses it; sm100's cp.async, up to 4 where a CTA's tile reads at least 32 of them per K
    step (its copy atom: a warp reads the tile's scales, at most 16 bytes a thread)."""
    recipe, config = kernel.generated.kernel_recipe, kernel.config
    if recipe.gemm.block_scale is None:
        return 1, 1
    if config.arch is gg.Arch.SM90A:
        return tuple(4 if loaded else 1 for loaded in scale_tma(config, recipe))  # type: ignore[return-value]
    gm, gn, _ = recipe.gemm.block_scale
    per_tile = (config.cta_tile[0] // gm, config.cta_tile[1] // gn)
    return tuple(min(n // 8, 4) if n >= 32 else 1 for n in per_tile)  # type: ignore[return-value]


def kernel_problem(kernel, *shape, **hardware) -> Problem:
    """A problem of the recipe as declared, in the kernel's terms (transposed for a swapped kernel)."""
    p = make_problem(kernel.recipe, *shape, **hardware)
    return p.transposed(kernel.recipe.gemm.scaled) if kernel.config.swap_ab else p


WORKSPACE = 0x7E00_0000_0000  # where the workspace of a kernel with vector reductions is


def _check(kernel, oracle, problem):
    """`kernel`'s arguments for `problem` against CUTLASS's: packed in the probed layout where the
    kernel was compiled, by value where it was not (`recipe_kernels`: no compile, no layout, and
    constant fields keep the probe's defaults, which only a compile knows)."""
    compiled = bool(kernel.cubin)
    expected = oracle.run(problem, WORKSPACE)
    if _extents_aligned(kernel, problem):
        assert expected.can_implement
    builder = ArgumentBuilder(kernel.generated.kernel_recipe, kernel.config)
    tm, tn, _ = kernel.config.cta_tile  # the reductions' partials are per CTA's tile (half a pair's)
    tiles = -(-problem.m // tm) * -(-problem.n // tn) * problem.l
    partials = max((tiles * (tm if kind == "col_reduction" else tn) for kind, _, _ in builder.vector_reductions),
                   default=0)
    if partials >= 2**31:  # CUTLASS's int arithmetic wraps (its size too)
        with pytest.raises(gg.InvalidArgument, match=r"partial values for the reduction, past the 2\^31"):
            builder.workspace(problem)
        return
    assert builder.workspace(problem).size == expected.workspace_size
    enc = RecordingEncoder()
    values, grid = field_values(kernel.generated.kernel_recipe, kernel.config, problem, enc, workspace=WORKSPACE)
    params = pack(kernel.params_layout, values)
    assert len(params) == kernel.info.params_size
    by_addr = {c["addr"]: {k: v for k, v in c.items() if k != "encode"} for c in expected.encodes}
    mine = {c.addr: c.as_dict() for c in enc.calls}
    assert mine == by_addr
    regions: dict[str, dict[str, int]] = {"ours": {}, "theirs": {}}
    compared = 0
    for field, offset, _ in kernel.params_layout.fields:
        want = expected.fields[field.name]
        if not compiled and field.name not in values:
            continue
        compared += 1
        if field.kind == "desc":
            ours = enc.of(params[offset:offset + 128])
            theirs = expected.encodes[want["desc"] - 1] if want["desc"] else None
            assert (ours.addr if ours else None) == (theirs["addr"] if theirs else None), field.name
        elif field.name.endswith((".buffer", ".counters")):
            reduction, part = field.name.rsplit(".", 1)
            for side, bits in (("ours", _decode(params, offset, field.kind)), ("theirs", want["bits"])):
                regions[side][f"{reduction}.{part}"] = bits
        else:
            assert _decode(params, offset, field.kind) == want["bits"], field.name
    _check_workspace_regions(regions["ours"], regions["theirs"])
    assert compared >= 25, (kernel.recipe.name, compared)
    assert list(grid) == expected.launch["grid"]
    assert expected.launch["cluster"] == list(kernel.config.cluster)
    if compiled:  # NVRTC's figures
        assert expected.launch["block"] == [kernel.info.max_threads, 1, 1]
        assert expected.launch["smem"] == kernel.info.smem_bytes
    assert all(v == 1 for v in expected.aux_params_bytes.values()), "TMA atoms carry runtime aux params"
    if kernel.recipe.epilogue.pairs:  # every thread's registers in pairs of adjacent columns, the tile once
        pairs = expected.pairs
        assert pairs is not None and pairs["pairs"] > 0 and pairs["broken"] == 0 and pairs["uncovered"] == 0, pairs
    else:
        assert expected.pairs is None


def _check_workspace_regions(ours: dict[str, int], theirs: dict[str, int]) -> None:
    """Each vector reduction's partials and tile counters: CUTLASS places the reductions' regions in
    the order its host compiler evaluates the arguments of a pack expansion (`transform_apply` in
    Sm90VisitorImpl: unspecified in C++, right to left under g++), which the device never sees; so
    each reduction's counters must sit where CUTLASS puts them relative to its partials, the regions
    must start where CUTLASS's do, and each reduction's region (up to the next one's) must be as
    large as CUTLASS's, whatever their order (a log-sum-exp's partials are twice a sum's)."""
    names = {k.rsplit(".", 1)[0] for k in ours}
    assert names == {k.rsplit(".", 1)[0] for k in theirs}
    for name in names:
        counters, buffer = f"{name}.counters", f"{name}.buffer"
        assert ours[counters] - ours[buffer] == theirs[counters] - theirs[buffer]
    if names:
        assert min(ours.values()) == min(theirs.values())

    def region_sizes(side: dict[str, int]) -> dict[str, int]:
        starts = sorted((side[f"{n}.buffer"], n) for n in names)
        return {n: nxt - at for (at, n), (nxt, _) in itertools.pairwise(starts)}  # the last one's is open

    mine, cutlass = region_sizes(ours), region_sizes(theirs)
    for name in mine.keys() & cutlass.keys():
        assert mine[name] == cutlass[name], f"{name}: a region of {mine[name]} bytes, CUTLASS's {cutlass[name]}"


@pytest.mark.parametrize("shape", PROBLEMS, ids=lambda s: "x".join(map(str, s)))
def test_arguments_match_cutlass(recipe_kernels, oracles, shape):
    for name, kernel in dense(recipe_kernels).items():
        _check(kernel, oracles[name], kernel_problem(kernel, *shape))


@pytest.mark.parametrize("sm_count, max_active_clusters", [(132, 0), (114, 0), (132, 66), (16, 0)])
def test_grid_follows_hardware_info(recipe_kernels, oracles, sm_count, max_active_clusters):
    for name in ("bias_gelu", "gemm_bf16", "swapped"):  # a 2x1 cluster, no cluster, a swapped kernel
        kernel = recipe_kernels[name]
        _check(kernel, oracles[name], kernel_problem(kernel, 4096, 2048, 512, 2, 0, sm_count=sm_count,
                                                     max_active_clusters=max_active_clusters))


#: The stream-K kernel the suite compiles (reductions over N and atomic extrema before the scheduler's
#: workspace, a 2x1 cluster, batched)
STREAM_K = "row_extrema"
#: Problems (M, N, K, L) for which CUTLASS's stream-K heuristic picks each decomposition on each
#: of the hardware settings below, stream-K units in several groups on some (the test checks both).
STREAM_K_PROBLEMS = [(256, 1408, 4096, 1), (256, 256, 8192, 1), (200, 100, 40000, 1), (129, 1000, 4097, 3),
                     (4096, 2048, 512, 2), (300, 4096, 8192, 1), (1, 7, 129, 1), (2000, 2000, 1000, 2),
                     (1100, 2000, 4096, 1), (640, 4096, 4096, 1)]


@pytest.mark.parametrize("sm_count, max_active_clusters", [(132, 0), (114, 0), (132, 66), (16, 0)])
def test_stream_k_decompositions_match_cutlass(compiled, oracles, sm_count, max_active_clusters):
    """The stream-K scheduler's Params (data-parallel, split-K and stream-K), its one-wave grid, and
    its workspace after the reductions', against CUTLASS's host code."""
    from gemmgen.runtime.scheduler import decompose, stream_k_plan

    kernel = compiled[STREAM_K]
    kinds, groups = set(), set()
    for m, n, k, l in STREAM_K_PROBLEMS:  # noqa: E741
        shape = (m, n, -(-k // kernel.config.tile[2]), l, kernel.config.tile, kernel.config.cluster, sm_count,
                 max_active_clusters)
        kinds.add(decompose(*shape).kind)
        groups.add(stream_k_plan(*shape).fields["scheduler.sk_groups.divisor"])
        _check(kernel, oracles[STREAM_K], kernel_problem(kernel, m, n, k, l, 0, sm_count=sm_count,
                                                           max_active_clusters=max_active_clusters))
    assert kinds == {"data-parallel", "split-K", "stream-K"}
    if sm_count > 16:  # 16 SMs: too few tiles along the rasterized dimension to group
        assert max(groups) > 1, groups


@pytest.mark.parametrize("splits", [2, 3, 8, 1000])
def test_stream_k_split_counts_match_cutlass(compiled, oracles, extra, session_cache, splits):
    """A split count (KernelConfig.splits, CUTLASS's `splits` argument): the same binary as the
    heuristic's kernel, and split-K Params, grid and workspace against CUTLASS's host code given
    that count, including counts it lowers (past the K tiles, past the SMs: 1000) and problems of
    a single K tile (no split: data-parallel)."""
    from dataclasses import replace

    from gemmgen.compile import build_kernel
    from gemmgen.runtime.scheduler import decompose

    base = compiled[STREAM_K]
    kernel = build_kernel(extra[STREAM_K].ir, replace(base.config, splits=splits), session_cache)
    assert kernel.cache_key == base.cache_key and kernel.entry == base.entry and kernel.config.splits == splits
    oracle = OracleProgram(kernel.generated, oracles[STREAM_K].exe.parent)
    assert oracle.exe == oracles[STREAM_K].exe  # one oracle serves every split count: an argument
    tk = kernel.config.tile[2]
    for sm_count in (132, 16):
        counts = set()
        for m, n, k, l in [*STREAM_K_PROBLEMS, (64, 64, 64, 1)]:  # noqa: E741
            d = decompose(m, n, -(-k // tk), l, kernel.config.tile, kernel.config.cluster, sm_count, 0, splits)
            assert d.splits == min(splits, sm_count, -(-k // tk))
            assert d.kind == ("split-K" if d.splits > 1 else "data-parallel")
            counts.add(d.splits)
            _check(kernel, oracle, kernel_problem(kernel, m, n, k, l, 0, sm_count=sm_count))
        assert 1 in counts and min(splits, sm_count) in counts, counts


@pytest.mark.parametrize("splits", [1, 3])
def test_nondeterministic_reduction_matches_cutlass(compiled, oracles, extra, session_cache, splits):
    """`deterministic=False` (CUTLASS's ReductionMode::Nondeterministic, a launch argument): the same
    binary, and Params, grid and workspace against CUTLASS's host code given that mode, under the
    heuristic's decompositions and a split count; the mode is the only field that changes."""
    from dataclasses import replace

    from gemmgen.compile import build_kernel
    from gemmgen.runtime.scheduler import stream_k_plan

    base = compiled[STREAM_K]
    kernel = build_kernel(extra[STREAM_K].ir, replace(base.config, splits=splits, deterministic=False), session_cache)
    assert kernel.cache_key == base.cache_key and not kernel.config.deterministic
    oracle = OracleProgram(kernel.generated, oracles[STREAM_K].exe.parent)
    assert oracle.exe == oracles[STREAM_K].exe
    for m, n, k, l in STREAM_K_PROBLEMS:  # noqa: E741
        shape = (m, n, -(-k // kernel.config.tile[2]), l, kernel.config.tile, kernel.config.cluster, 132, 0, splits)
        nondeterministic, deterministic = stream_k_plan(*shape, deterministic=False), stream_k_plan(*shape)
        assert nondeterministic.fields["scheduler.reduction_mode"] == 1
        assert deterministic.fields["scheduler.reduction_mode"] == 0
        assert nondeterministic.grid == deterministic.grid
        assert {**nondeterministic.fields, "scheduler.reduction_mode": 0} == deterministic.fields
        _check(kernel, oracle, kernel_problem(kernel, m, n, k, l, 0))

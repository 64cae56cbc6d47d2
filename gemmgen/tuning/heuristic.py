"""The heuristic: a kernel config from the problem shape, deterministic, explained, and bounded.

Candidates are a fixed set of tiles, clusters and schedules, pruned by the same constraint
functions that validate configs (`codegen.is_valid`). Each survivor is scored by the fraction of launched
work that is useful: padding waste of the last tile row/column, times wave quantization on the
GPU's SMs, times a per-tile efficiency term that favours tiles with more reuse (the MMA work per
byte loaded grows with tile_m * tile_n / (tile_m + tile_n)). M is rounded up to a bucket first,
so a model whose weights fix N and K needs at most one kernel per M bucket.

For a small M (at most SWAP_MAX_M, decode-sized batches) the swapped kernels join the candidates:
they compute D^T = B^T A^T, so M becomes the tile's N, which can be 16 or 32 wide, where an
unswapped tile is at least 64 rows of mostly zero padding. They are scored on that transposed
problem, by the same terms.

Every cooperative candidate (every sm_100a one) also has a stream-K twin (TileScheduler.STREAM_K).
Its wave term is the balance of the work as CUTLASS's stream-K scheduler would share it out for this
problem (`runtime.scheduler.config_decomposition`), less a cost per split tile and a margin (STREAM_K_MARGIN): where
the tiles fill whole waves the persistent kernel wins; where they leave a wave mostly idle (a few
tokens against large weights) the K iterations spread over every SM and the twin wins.

On sm_100a the candidates are tcgen05 tiles (`SM100_CANDIDATES`): a pair of SMs computing a 256-row
tile (Schedule.TWO_SM) or one SM a 128-row one, swapped tiles for small M, and their stream-K
twins (CUTLASS's sm100 stream-K scheduler over cluster launch control). A pair's tile occupies two SMs of a wave;
its reuse is the MMA tile's (each SM loads half of A and half of B for half of the output).

A grouped (MoE) kernel serves every split of its rows, which only the GPU knows; the host knows
the rows and the groups. When the groups average at most GROUPED_SWAP_MAX_ROWS rows (decode: a few
tokens per expert), `choose` gives GROUPED_SWAP_CONFIG (sm_100a: SM100_GROUPED_SWAP_CONFIG),
swapped, each group's rows along the tile's N (not for an epilogue over column pairs, which must
stay the kernel's columns); otherwise gemmgen's default. So a grouped recipe needs at most two
kernels, unless autotune (`grouped_candidates`) found others faster.

Ties: candidates whose scores agree to SCORE_PLACES decimals tie (a smaller difference is float
noise, not a preference), and the tie-break is the candidate order: the first of them in
`candidate_configs` (the arch's table, most preferred first) wins, every time. `ties` lists them
and `tie_summary` says so in words; `choose`'s reasons and `gemmgen explain` include it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..codegen import fitting_default, is_valid, validate
from ..config import DEFAULT_ARCH, Arch, KernelConfig, Schedule, TileScheduler, needs_swap, tile_k
from ..ir import RecipeIR
from ..runtime.scheduler import config_decomposition

COOP, PING = Schedule.COOPERATIVE, Schedule.PINGPONG

#: (tile, cluster, schedule) candidates, most preferred first (ties keep this order). Tile K is
#: given for 16-bit A and B; `candidate_configs` sets it to 128 bytes for the recipe's element width.
CANDIDATES: tuple[KernelConfig, ...] = tuple(
    KernelConfig(tile=t, cluster=c, schedule=s)
    for t, s in (((128, 256, 64), COOP), ((256, 128, 64), COOP), ((128, 128, 64), COOP), ((128, 128, 64), PING),
                 ((64, 256, 64), PING), ((128, 64, 64), PING), ((64, 128, 64), PING), ((64, 64, 64), PING))
    for c in ((2, 1, 1), (1, 2, 1), (1, 1, 1))
)

#: Swapped (D^T = B^T A^T) candidates for small M: narrow tile N for M, cluster along the weights.
SWAP_CANDIDATES: tuple[KernelConfig, ...] = tuple(
    KernelConfig(tile=t, cluster=c, schedule=s, swap_ab=True)
    for t, s in (((128, 16, 64), COOP), ((128, 32, 64), COOP), ((128, 64, 64), COOP), ((64, 16, 64), PING),
                 ((64, 32, 64), PING), ((64, 64, 64), PING))
    for c in ((2, 1, 1), (1, 1, 1))
)
SWAP_MAX_M = 64  # swapped kernels are considered up to this M

ONE, TWO = Schedule.ONE_SM, Schedule.TWO_SM
#: sm_100a's (tile, cluster, schedule) candidates, most preferred first: pairs of SMs on 256-row
#: tiles, then one SM's 128-row tiles (tile K as CANDIDATES').
SM100_CANDIDATES: tuple[KernelConfig, ...] = tuple(
    KernelConfig(tile=t, cluster=c, schedule=s, arch=Arch.SM100A)
    for t, s, clusters in (((256, 256, 64), TWO, ((2, 1, 1),)), ((256, 128, 64), TWO, ((2, 1, 1), (4, 1, 1))),
                           ((128, 256, 64), ONE, ((1, 1, 1), (2, 1, 1))), ((128, 128, 64), ONE, ((1, 1, 1), (2, 1, 1))),
                           ((128, 64, 64), ONE, ((1, 1, 1),)), ((64, 128, 64), ONE, ((1, 1, 1),)))
    for c in clusters
)
#: sm_100a's swapped candidates for small M: M along a narrow tile N.
SM100_SWAP_CANDIDATES: tuple[KernelConfig, ...] = tuple(
    KernelConfig(tile=t, cluster=c, schedule=s, swap_ab=True, arch=Arch.SM100A)
    for t, s, c in (((128, 16, 64), ONE, (1, 1, 1)), ((128, 32, 64), ONE, (1, 1, 1)), ((128, 64, 64), ONE, (1, 1, 1)),
                    ((256, 32, 64), TWO, (2, 1, 1)), ((256, 64, 64), TWO, (2, 1, 1)))
)

#: The grouped kernel for groups of few rows: 128 rows of the weights by 32 of a group's rows per
#: tile, where an unswapped tile spans at least 64 of a group's rows. (Tile K: `tile_k`.)
GROUPED_SWAP_CONFIG = KernelConfig(tile=(128, 32, 64), swap_ab=True)
#: ...sm_100a's: one SM's 128 x 32 MMA.
SM100_GROUPED_SWAP_CONFIG = KernelConfig(tile=(128, 32, 64), schedule=Schedule.ONE_SM, swap_ab=True,
                                         arch=Arch.SM100A)
GROUPED_SWAP_MAX_ROWS = 32  # groups averaging at most this many rows get GROUPED_SWAP_CONFIG
#: What autotune times for a grouped recipe besides `grouped_choice`'s two picks: wider and narrower
#: tiles either way round, pingpong, a 2 x 1 cluster (`grouped_candidates` orders them).
GROUPED_CANDIDATES: tuple[KernelConfig, ...] = (
    KernelConfig(tile=(128, 256, 64)), KernelConfig(tile=(64, 128, 64), cluster=(2, 1, 1), schedule=PING),
    KernelConfig(tile=(128, 128, 64), cluster=(2, 1, 1)), KernelConfig(tile=(128, 16, 64), swap_ab=True),
    KernelConfig(tile=(128, 64, 64), swap_ab=True), KernelConfig(tile=(64, 32, 64), schedule=PING, swap_ab=True),
)
#: ...and sm_100a's: a pair of SMs on 256 x 128 tiles, one SM's 128 x 256, swapped narrower and wider.
SM100_GROUPED_CANDIDATES: tuple[KernelConfig, ...] = (
    KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1), schedule=Schedule.TWO_SM, arch=Arch.SM100A),
    KernelConfig(tile=(128, 256, 64), schedule=Schedule.ONE_SM, arch=Arch.SM100A),
    KernelConfig(tile=(128, 16, 64), schedule=Schedule.ONE_SM, swap_ab=True, arch=Arch.SM100A),
    KernelConfig(tile=(128, 64, 64), schedule=Schedule.ONE_SM, swap_ab=True, arch=Arch.SM100A),
)

#: Upper bounds of the M buckets; beyond the last, M is rounded up to a multiple of it. The
#: buckets under 64 exist for the swapped kernels, whose tile N follows M.
M_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return -(-m // M_BUCKETS[-1]) * M_BUCKETS[-1]


@dataclass(frozen=True)
class Choice:
    config: KernelConfig
    m_bucket: int
    score: float
    why: str


#: What a split tile costs the stream-K scheduler, in K tiles of work: its partial sums (fp32, the
#: whole tile) are written to the workspace and read back through L2 by the next peer, about the
#: bytes of two or four K tiles of A and B. A model constant, not a measurement.
STREAM_K_FIXUP_K_TILES = 2
#: The share of a stream-K kernel's score it gives up for what the model leaves out (a workspace
#: allocated and its barriers zeroed per call, fixups waiting on their peers), so that it replaces
#: the persistent kernel only where it balances the work clearly better, never on a near tie.
STREAM_K_MARGIN = 0.03


@dataclass(frozen=True)
class Waves:
    """How a config's kernel covers a problem, in the heuristic's terms: MMA tiles along the
    kernel's M and N (swapped: the problem's N and M; rounded up to whole clusters), `waves` of them
    on the SMs (a pair's tile takes two), `useful` the fraction of the tiles' area the problem
    covers, and `quantization` the fraction of the SMs' time that does work: the last wave's
    emptiness for a persistent kernel, the stream-K decomposition's balance for a stream-K one."""

    tiles_m: int
    tiles_n: int
    tiles: int
    waves: float
    useful: float
    quantization: float
    how: str

    @property
    def efficiency(self) -> float:
        """useful x quantization: the share of the launched MMA work that is the problem's."""
        return self.useful * self.quantization


def wave_model(cfg: KernelConfig, m: int, n: int, k: int, l: int, sm_count: int) -> Waves:  # noqa: E741
    """`cfg`'s kernel on the problem (M, N, K, L) on `sm_count` SMs (see Waves)."""
    if cfg.swap_ab:  # the kernel's problem is N x M
        m, n = n, m
    tm, tn, _ = cfg.tile
    cm, cn, _ = cfg.cluster
    tiles_m = -(-m // (tm * cm)) * cm
    tiles_n = -(-n // (tn * cn)) * cn
    tiles = tiles_m * tiles_n * l
    useful = (m * n) / (tiles_m * tm * tiles_n * tn)
    waves = tiles * (2 if cfg.schedule is Schedule.TWO_SM else 1) / sm_count  # a pair's tile takes two SMs
    quantization = waves / math.ceil(waves)
    how = f"{tiles} tiles = {waves:.2f} waves on {sm_count} SMs"
    if cfg.tile_scheduler is TileScheduler.STREAM_K:
        quantization, how = _stream_k_balance(m, n, k, l, cfg, sm_count)
    return Waves(tiles_m, tiles_n, tiles, waves, useful, quantization, how)


def _score(cfg: KernelConfig, m: int, n: int, k: int, l: int, sm_count: int) -> tuple[float, str]:  # noqa: E741
    w = wave_model(cfg, m, n, k, l, sm_count)
    tm, tn, _ = cfg.tile
    reuse = (tm * tn / (tm + tn)) / (256 * 128 / (256 + 128))
    score = w.useful * w.quantization * reuse
    why = (f"{cfg.name}: {w.how} (quantization {w.quantization:.2f}), useful fraction {w.useful:.2f}, "
           f"reuse {reuse:.2f} -> {score:.3f}")
    return score, why


def _stream_k_balance(m: int, n: int, k: int, l: int, cfg: KernelConfig, sm_count: int  # noqa: E741
                      ) -> tuple[float, str]:
    """(useful fraction of the CTAs' time, description) under the decomposition CUTLASS's stream-K
    scheduler picks for the problem (`runtime.scheduler.decompose`): data-parallel waves of whole
    tiles, then the split tiles' K iterations shared over one wave, each share paying
    STREAM_K_FIXUP_K_TILES; less STREAM_K_MARGIN."""
    d = config_decomposition(cfg, m, n, k, l, sm_count)
    if d.splits > 1:  # every tile in `splits` parts
        time = -(-d.output_tiles * d.splits // d.ctas_per_wave) * (-(-d.k_tiles // d.splits) + STREAM_K_FIXUP_K_TILES)
    else:
        time = -(-(d.output_tiles - d.sk_tiles) // d.ctas_per_wave) * d.k_tiles
        if d.sk_tiles:
            time += -(-d.sk_tiles * d.k_tiles // d.sk_units) + STREAM_K_FIXUP_K_TILES
    balance = d.output_tiles * d.k_tiles / (d.ctas_per_wave * time) * (1 - STREAM_K_MARGIN)
    how = f"{d.output_tiles} tiles x {d.k_tiles} K tiles, {d.kind}"
    if d.sk_tiles:
        how += f" ({d.sk_tiles} tiles over {d.sk_units} CTAs)"
    return balance, how


#: Split counts autotune also times for a stream-K candidate whose tiles fill less than one wave
#: (`split_variants`): the same binary with another launch argument, so a timing each, no compile.
SPLITS_TIMED = (2, 4, 8)


def split_variants(configs: list[KernelConfig], m: int, n: int, k: int, l: int = 1,  # noqa: E741
                   sm_count: int = DEFAULT_ARCH.sm_count) -> list[KernelConfig]:
    """For each stream-K config among `configs` whose tiles leave SMs idle on this problem (fewer
    output tiles than CTAs in a wave: a decode step against large weights), the same config with
    each of SPLITS_TIMED that K's tiles allow, but the count CUTLASS's heuristic already picks:
    split-K choices the heuristic does not make, for autotune to time."""
    out = []
    for c in configs:
        if c.tile_scheduler is not TileScheduler.STREAM_K or c.splits > 1:
            continue
        mm, nn = (n, m) if c.swap_ab else (m, n)
        k_tiles = -(-max(k, 1) // c.tile[2])
        d = config_decomposition(c, max(mm, 1), max(nn, 1), max(k, 1), max(l, 1), sm_count)
        if d.output_tiles < d.ctas_per_wave:
            out += [replace(c, splits=s) for s in SPLITS_TIMED if s <= k_tiles and s != d.splits]
    return list(dict.fromkeys(out))


def candidate_configs(recipe: RecipeIR, m_bucket: int, arch: Arch = DEFAULT_ARCH) -> tuple[KernelConfig, ...]:
    """The configs considered for an M bucket on `arch`, most preferred first, with K steps of 128
    bytes. A recipe that only a swapped kernel computes on `arch` (`config.needs_swap`) gets every
    tile swapped."""
    # swapped kernels take the recipe's rows as their columns: not for an epilogue over a row's columns
    small_m = m_bucket <= SWAP_MAX_M and not recipe.epilogue.along_rows
    return _candidates(small_m, needs_swap(recipe, arch), tile_k(recipe), arch)


@functools.cache
def _candidates(small_m: bool, swapped_only: bool, k: int, arch: Arch) -> tuple[KernelConfig, ...]:
    base, swapped = (SM100_CANDIDATES, SM100_SWAP_CANDIDATES) if arch is Arch.SM100A else (CANDIDATES, SWAP_CANDIDATES)
    listed = base
    if swapped_only:  # each tile as the unswapped problem would be tiled (a pair's M stays the pair's)
        listed = tuple(replace(c, swap_ab=True) if c.schedule is TWO else
                       replace(c, tile=(c.tile[1], c.tile[0], c.tile[2]), cluster=(c.cluster[1], c.cluster[0], 1),
                               swap_ab=True) for c in base)
    if small_m:
        listed += swapped
    listed += tuple(replace(c, tile_scheduler=TileScheduler.STREAM_K) for c in listed if c.schedule is not PING)
    return tuple(replace(c, tile=(c.tile[0], c.tile[1], k)) for c in listed)


#: Scores equal to this many decimal places tie; the candidate order breaks the tie (`ties`).
SCORE_PLACES = 9
#: The tie-break, in words (`tie_summary`, `gemmgen explain`).
TIE_BREAK = "candidate order, the first in gemmgen/tuning/heuristic.py's list (most preferred first) wins"


def ranked(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1, sm_count: int | None = None,  # noqa: E741
           arch: Arch = DEFAULT_ARCH) -> list[tuple[float, KernelConfig, str]]:
    """Every valid candidate on `arch` for the M bucket of `m`, best first (ties, to SCORE_PLACES,
    in candidate order); `sm_count` defaults to the arch's reference GPU's."""
    mb = m_bucket(max(m, 1))
    sms = sm_count or arch.sm_count
    scored = [(*_score(cfg, mb, max(n, 1), max(k, 1), max(l, 1), sms), i, cfg)
              for i, cfg in enumerate(candidate_configs(recipe, mb, arch)) if is_valid(cfg, recipe)]
    if not scored:  # the recipe's family is not built on this arch: the default config's ConfigError says so
        validate(fitting_default(recipe, arch), recipe)
        raise AssertionError(f"no candidate config on {arch.value} is valid for {recipe.name!r}, but the default is")
    scored.sort(key=lambda t: (-round(t[0], SCORE_PLACES), t[2]))
    return [(score, cfg, why) for score, why, _, cfg in scored]


def ties(order: list[tuple[float, KernelConfig, str]]) -> list[KernelConfig]:
    """The configs of a `ranked` order that tie with its first on the score (to SCORE_PLACES), in
    candidate order: the tie-break chose the first. One config when nothing ties."""
    best = round(order[0][0], SCORE_PLACES)
    return [cfg for score, cfg, _ in order if round(score, SCORE_PLACES) == best]


def tie_summary(names: Sequence[str], score: float) -> str:
    """The words for a tie of `names` (the winner first) at `score`, and how it was broken."""
    return f"{len(names)} candidates score {score:.3f} ({', '.join(names)}); tie-break: {TIE_BREAK}"


def choose(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1, sm_count: int | None = None,  # noqa: E741
           arch: Arch = DEFAULT_ARCH) -> Choice:
    """The config on `arch` for a problem (M rounded up to its bucket), with the reasons. For a
    grouped recipe, M is the rows of A and L the number of groups (`grouped_choice`)."""
    if recipe.gemm.grouped:
        grouped = grouped_choice(recipe, m, l, arch)
        validate(grouped.config, recipe)  # a family the arch does not build: its ConfigError
        return grouped
    mb = m_bucket(max(m, 1))
    order = ranked(recipe, m, n, k, l, sm_count, arch)
    score, cfg, why = order[0]
    listed = candidate_configs(recipe, mb, arch)
    lines = [w for _, _, w in sorted(order, key=lambda t: listed.index(t[1]))]
    swapped = "; a reduction over M: swapped kernels only (codegen.sm100.constraints.reduction_violations)" \
        if needs_swap(recipe, arch) else ""
    tied = ties(order)
    tie = tie_summary([c.name for c in tied], score) if len(tied) > 1 else None
    return Choice(cfg, mb, score, f"M={m} -> bucket {mb}{swapped}; chose {why}\n" + (f"  tie: {tie}\n" if tie else "")
                  + "  considered:\n    " + "\n    ".join(lines))


def few_rows_per_group(rows: int, groups: int) -> bool:
    """Whether `groups` groups of `rows` rows in all average at most GROUPED_SWAP_MAX_ROWS rows:
    the swapped grouped kernel's case (cheap: the grouped op asks on every call)."""
    return rows <= GROUPED_SWAP_MAX_ROWS * max(groups, 1)  # ceil(rows / groups) <= GROUPED_SWAP_MAX_ROWS


def grouped_choice(recipe: RecipeIR, rows: int, groups: int, arch: Arch = DEFAULT_ARCH) -> Choice:
    """A grouped kernel's config from the rows of A and the number of groups (not how the rows
    split, which only the GPU knows): swapped when the groups average at most
    GROUPED_SWAP_MAX_ROWS rows, else gemmgen's default."""
    if recipe.gemm.k_grouped:  # every group an M x N problem: nothing for a swap to gain
        default = fitting_default(recipe, arch)
        return Choice(default, m_bucket(max(rows, 1)), 0.0,
                      f"K-grouped: each group's {rows} rows of D in full; chose {default.name}, gemmgen's default")
    average = -(-max(rows, 0) // max(groups, 1))
    head = f"grouped: {rows} rows in {groups} groups, {average} per group on average"
    if not few_rows_per_group(rows, groups):
        default = fitting_default(recipe, arch)
        return Choice(default, m_bucket(max(rows, 1)), 0.0,
                      f"{head} > {GROUPED_SWAP_MAX_ROWS}; chose {default.name}, gemmgen's default")
    if recipe.epilogue.pairs:  # a swapped kernel would take the column pairs from rows
        default = fitting_default(recipe, arch)
        return Choice(default, m_bucket(max(rows, 1)), 0.0,
                      f"{head} <= {GROUPED_SWAP_MAX_ROWS}; chose {default.name}, gemmgen's default: the epilogue "
                      "works on column pairs, which a swapped kernel would take from rows")
    swap = SM100_GROUPED_SWAP_CONFIG if arch is Arch.SM100A else GROUPED_SWAP_CONFIG
    # the narrowest tile N the recipe's kernels take (a microscaled main loop's: 64)
    swapped = next((c for width in (swap.tile[1], 64)
                    if is_valid(c := replace(swap, tile=(swap.tile[0], width, tile_k(recipe))), recipe)),
                   fitting_default(recipe, arch))
    if not swapped.swap_ab:
        return Choice(swapped, m_bucket(max(rows, 1)), 0.0,
                      f"{head} <= {GROUPED_SWAP_MAX_ROWS}; chose {swapped.name}, gemmgen's default: no swapped "
                      "kernel of this recipe is valid")
    return Choice(swapped, m_bucket(max(rows, 1)), 0.0,
                  f"{head} <= {GROUPED_SWAP_MAX_ROWS}; chose {swapped.name}: swapped (D_g^T = B_g^T A_g^T), "
                  f"a group's rows along the tile's N ({swapped.tile[1]} wide)")


def grouped_candidates(recipe: RecipeIR, rows: int, groups: int, arch: Arch = DEFAULT_ARCH) -> list[KernelConfig]:
    """The configs autotune times for a grouped problem on `arch`, most promising first:
    `grouped_choice`'s, the one it makes on the other side of GROUPED_SWAP_MAX_ROWS (so timing two
    settles which side wins), then the arch's grouped candidates of the choice's kind (swapped or
    not), then the others; each valid for the recipe, tile K as `tile_k`'s."""
    few = few_rows_per_group(rows, groups)
    first = grouped_choice(recipe, rows, groups, arch).config
    other = grouped_choice(recipe, 1 if not few else GROUPED_SWAP_MAX_ROWS * max(groups, 1) + 1, groups,
                           arch).config
    k = tile_k(recipe)
    table = SM100_GROUPED_CANDIDATES if arch is Arch.SM100A else GROUPED_CANDIDATES
    rest = sorted((replace(c, tile=(*c.tile[:2], k)) for c in table), key=lambda c: c.swap_ab != few)
    listed = dict.fromkeys([first, other, *rest])
    return [c for c in listed if is_valid(c, recipe)]

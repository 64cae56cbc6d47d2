"""Kernel configurations and the constraints they must satisfy.

Each `*_violations` function checks one constraint set and returns human-readable problems;
`validate` raises them as one ConfigError, and a config search can use the same functions to
prune candidates (`is_valid`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from .errors import ConfigError
from .ir import RecipeIR

SM90_SMEM_CAPACITY = 232448  # bytes of shared memory per block on sm_90 (cutlass::gemm::collective::detail)
_STAGE_ALIGN = 128  # compute_stage_count_or_override rounds stage and carveout bytes to this (its default)
#: A grouped mainloop's stages leave out A's and B's tensor maps and the group scheduler's 8-stage
#: pipeline barriers (the builder's KernelSmemCarveout)...
_GROUPED_CARVEOUT = 2 * 128 + 16 * 8
#: ...and the grouped kernel's shared storage adds those and the epilogue's tensor maps: at most this
#: much over the stages and the epilogue storage (measured: 928 bytes for a 128 x 128 tile).
_GROUPED_KERNEL_EXTRA = 1024


class Schedule(enum.Enum):
    """Warp-specialized mainloop schedules of CUTLASS 3.x on sm_90."""

    COOPERATIVE = "cooperative"  # two consumer warpgroups share one tile (tile M = 128 or 256)
    PINGPONG = "pingpong"  # two consumer warpgroups alternate tiles (tile M = 64 or 128)

    def kernel(self, grouped: bool = False, block_scaled: bool = False) -> str:
        """CUTLASS's kernel schedule; the pointer-array variant for a grouped GEMM, the blockwise
        fp8 one (which selects its main loop) for block scales."""
        array = "PtrArray" if grouped else ""
        blockwise = "FP8Blockwise" if block_scaled else ""
        return f"cutlass::gemm::Kernel{array}TmaWarpSpecialized{self.value.capitalize()}{blockwise}"

    def epilogue(self, grouped: bool = False) -> str:
        if grouped:
            return f"cutlass::epilogue::PtrArrayTmaWarpSpecialized{self.value.capitalize()}"
        return {Schedule.COOPERATIVE: "cutlass::epilogue::TmaWarpSpecializedCooperative",
                Schedule.PINGPONG: "cutlass::epilogue::TmaWarpSpecialized"}[self]


class TileScheduler(enum.Enum):
    """How a persistent kernel's CTAs share out the output tiles.

    PERSISTENT: each CTA computes whole tiles in turn (data-parallel). STREAM_K: CUTLASS's stream-K
    scheduler; per problem, the host picks data-parallel work when the tiles fill whole waves (or K
    is short), else splits the K loop of the last two waves' tiles over one wave of CTAs (split-K,
    or stream-K when the CTAs do not divide evenly among the tiles), which reduce their fp32
    partial sums in a workspace, in a fixed order unless the config says `deterministic=False`.
    It fills the GPU when there are fewer tiles than SMs (decode: a few tokens, large N and K) and
    evens out a last wave that is mostly empty.
    """

    PERSISTENT = "persistent"
    STREAM_K = "stream_k"

    def cutlass(self, grouped: bool = False) -> str:
        """A grouped kernel's persistent scheduler walks the tiles of every group in turn."""
        if grouped:
            return "cutlass::gemm::GroupScheduler"
        return {TileScheduler.PERSISTENT: "cutlass::gemm::PersistentScheduler",
                TileScheduler.STREAM_K: "cutlass::gemm::StreamKScheduler"}[self]


@dataclass(frozen=True)
class KernelConfig:
    """How one recipe is mapped onto the machine. `stages=None` lets CUTLASS fill shared memory.

    With `swap_ab` the kernel computes D^T = B^T A^T (`RecipeIR.transposed`): the tile, cluster
    and schedule then apply to that problem, whose M is the recipe's N. A small M (decode, a
    few tokens) becomes the tile's N, which WGMMA can make as narrow as 16, instead of a
    64-row tile mostly padded with zeros.

    `splits` (stream-K only) is CUTLASS's split count: above 1, every output tile's K loop is
    split into that many parts (a split-K decomposition, fewer where K has fewer tiles); 1 lets
    CUTLASS's heuristic decompose each problem. `deterministic=False` (stream-K only) lets the CTAs
    that share a tile add their partial sums into the workspace in whatever order they finish
    (CUTLASS's ReductionMode::Nondeterministic): no CTA waits for the split before it, but the
    rounding, so the output's low bits, can change from run to run. Both are launch arguments, not
    code: configs that differ only in them share one binary (`binary`).
    """

    tile: tuple[int, int, int] = (128, 128, 64)
    cluster: tuple[int, int, int] = (1, 1, 1)
    schedule: Schedule = Schedule.COOPERATIVE
    stages: int | None = None
    tile_scheduler: TileScheduler = field(default=TileScheduler.PERSISTENT)
    swap_ab: bool = False
    splits: int = 1
    deterministic: bool = True

    def __post_init__(self) -> None:
        for what, t in (("tile", self.tile), ("cluster", self.cluster)):
            if not (isinstance(t, tuple) and len(t) == 3 and all(isinstance(x, int) and x > 0 for x in t)):
                raise ConfigError(f"{what}: expected a tuple of three positive ints, got {t!r}")
        if not isinstance(self.schedule, Schedule):
            raise ConfigError(f"schedule: expected a gemmgen.Schedule, got {self.schedule!r}")
        if self.stages is not None and (not isinstance(self.stages, int) or self.stages < 1):
            raise ConfigError(f"stages: expected None (auto) or a positive int, got {self.stages!r}")
        if not isinstance(self.tile_scheduler, TileScheduler):
            raise ConfigError(f"tile_scheduler: expected a gemmgen.TileScheduler, got {self.tile_scheduler!r}")
        if not isinstance(self.swap_ab, bool):
            raise ConfigError(f"swap_ab: expected True or False, got {self.swap_ab!r}")
        if not isinstance(self.splits, int) or isinstance(self.splits, bool) or self.splits < 1:
            raise ConfigError(f"splits: expected a positive int (1: CUTLASS's heuristic decomposition), "
                              f"got {self.splits!r}")
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"deterministic: expected True or False, got {self.deterministic!r}")

    @property
    def name(self) -> str:
        """A short, stable, identifier-safe description, used in kernel names."""
        tm, tn, tk = self.tile
        cm, cn, ck = self.cluster
        stages = "auto" if self.stages is None else f"s{self.stages}"
        swap = "_swapab" if self.swap_ab else ""
        stream_k = "_streamk" if self.tile_scheduler is TileScheduler.STREAM_K else ""
        splits = f"_splits{self.splits}" if self.splits > 1 else ""
        nondeterministic = "" if self.deterministic else "_nondet"
        return (f"{tm}x{tn}x{tk}_c{cm}x{cn}x{ck}_{self.schedule.value}_{stages}{swap}{stream_k}{splits}"
                f"{nondeterministic}")

    def binary(self) -> KernelConfig:
        """The part of the config the kernel's code depends on (all but the launch arguments `splits`
        and `deterministic`): what is rendered, compiled, cached and bundled."""
        launch_only = self.splits > 1 or not self.deterministic
        return replace(self, splits=1, deterministic=True) if launch_only else self

    def canonical(self) -> list:
        """A JSON-able form: the code's fields, then `swap_ab`, `splits` and `deterministic` up to the
        last that is not its default, so configs from before a field keep their keys."""
        out = [list(self.tile), list(self.cluster), self.schedule.value, self.stages, self.tile_scheduler.value]
        optional = [self.swap_ab, self.splits, self.deterministic]
        while optional and optional[-1] == _OPTIONAL_DEFAULTS[len(optional) - 1]:
            optional.pop()
        return [*out, *optional]

    @classmethod
    def from_canonical(cls, raw: list) -> KernelConfig:
        """The inverse of `canonical`; raises ConfigError (via the constructor) or ValueError/TypeError."""
        tile, cluster, schedule, stages, scheduler, *rest = raw
        if len(rest) > len(_OPTIONAL_DEFAULTS) or (rest and rest[-1] == _OPTIONAL_DEFAULTS[len(rest) - 1]) or \
                any(type(x) is not type(d) for x, d in zip(rest, _OPTIONAL_DEFAULTS, strict=False)):
            raise ValueError(f"unexpected trailing fields {rest!r}: expected up to [swap_ab, splits, deterministic], "
                             "the last not its default")
        fields: list = [*rest, *_OPTIONAL_DEFAULTS[len(rest):]]
        return cls(tile=tuple(tile), cluster=tuple(cluster), schedule=Schedule(schedule), stages=stages,
                   tile_scheduler=TileScheduler(scheduler), swap_ab=fields[0], splits=fields[1],
                   deterministic=fields[2])


#: The defaults of KernelConfig's trailing canonical fields: swap_ab, splits, deterministic.
_OPTIONAL_DEFAULTS = (False, 1, True)


def tile_k(recipe: RecipeIR) -> int:
    """The K extent of one 128-byte row of A/B: the full TMA swizzle span, and the tile K gemmgen
    picks by default (64 for 16-bit A and B, 128 for fp8)."""
    return 1024 // recipe.gemm.a.bits


def default_config(recipe: RecipeIR) -> KernelConfig:
    """A recipe's config when it names none: 128 x 128 output tiles, cooperative, K steps of 128
    bytes; swapped when the recipe reduces over M (see `reduction_violations`)."""
    return KernelConfig(tile=(128, 128, tile_k(recipe)), swap_ab=needs_swap(recipe))


def needs_swap(recipe: RecipeIR) -> bool:
    """Whether only a swapped kernel computes the recipe: it reduces over M (`reduction_violations`)."""
    return any(o.dim == 0 for o in recipe.epilogue.outputs)


def kernel_recipe(cfg: KernelConfig, recipe: RecipeIR) -> RecipeIR:
    """The recipe in the kernel's own terms: transposed under `swap_ab`. Every constraint, the
    generated types and the argument builder work on this view; only the runtime's checks and the
    caller see the recipe as declared."""
    return recipe.transposed() if cfg.swap_ab else recipe


# ----------------------------------------------------------------------------- constraint sets
# Each takes the kernel-side recipe (`kernel_recipe`); `violations` applies the view.


def tile_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """WGMMA and TMA shape rules for A/B of the recipe's element width."""
    tm, tn, tk = cfg.tile
    bits = recipe.gemm.a.bits
    out = []
    if tm not in (64, 128, 256):
        out.append(f"tile M = {tm}: must be 64, 128 or 256 (multiples of the 64-row WGMMA atom)")
    if tn % 16 or not 16 <= tn <= 256:
        out.append(f"tile N = {tn}: must be a multiple of 16 between 16 and 256 (WGMMA N)")
    k_atom = 256 // bits  # WGMMA K is 32 bytes
    swizzle_k = 1024 // bits  # 128-byte swizzle span in elements
    if tk % k_atom or tk < k_atom:
        out.append(f"tile K = {tk}: must be a multiple of {k_atom} for {recipe.gemm.a.value} (WGMMA K)")
    elif tk % swizzle_k and swizzle_k % tk:
        out.append(f"tile K = {tk}: must divide or be a multiple of {swizzle_k} (128-byte TMA swizzle)")
    return out


def schedule_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    tm = cfg.tile[0]
    if cfg.schedule is Schedule.COOPERATIVE and tm % 128:
        return [f"schedule cooperative: tile M = {tm} must be 128 or 256 (two consumer warpgroups split M); "
                "use Schedule.PINGPONG for tile M = 64"]
    if cfg.schedule is Schedule.PINGPONG and tm not in (64, 128):
        return [f"schedule pingpong: tile M = {tm} must be 64 or 128 (each consumer warpgroup owns a tile)"]
    return []


def tile_scheduler_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """CUTLASS's stream-K scheduler runs in its cooperative kernel only (the pingpong kernel
    static_asserts against it), and a grouped kernel has its own scheduler; a split count is the
    stream-K scheduler's argument, and so is its reduction order."""
    if cfg.tile_scheduler is not TileScheduler.STREAM_K:
        out = [f"splits {cfg.splits}: a split count is the stream-K scheduler's; use "
               "tile_scheduler=TileScheduler.STREAM_K, or splits=1"] if cfg.splits > 1 else []
        if not cfg.deterministic:
            out.append("deterministic False: only the stream-K scheduler reduces partial sums; use "
                       "tile_scheduler=TileScheduler.STREAM_K, or deterministic=True")
        return out
    if recipe.gemm.grouped:
        return ["tile scheduler stream_k: a grouped kernel walks its groups with CUTLASS's group scheduler; "
                "use TileScheduler.PERSISTENT"]
    if cfg.schedule is not Schedule.COOPERATIVE:
        return [f"tile scheduler stream_k: needs the cooperative schedule (CUTLASS's {cfg.schedule.value} kernel "
                "does not support stream-K); use Schedule.COOPERATIVE or TileScheduler.PERSISTENT"]
    return []


def cluster_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    cm, cn, ck = cfg.cluster
    out = []
    if ck != 1:
        out.append(f"cluster K = {ck}: must be 1")
    for what, c in (("M", cm), ("N", cn)):
        if c not in (1, 2, 4):
            out.append(f"cluster {what} = {c}: must be 1, 2 or 4 (TMA multicast)")
    if cm * cn > 8:
        out.append(f"cluster {cm}x{cn}: at most 8 CTAs per cluster (portable cluster size)")
    return out


#: fp32 accumulators a consumer thread can hold without spilling: it has 240 registers (setmaxnreg),
#: and the mainloop's addressing and the epilogue need the rest. Measured with NVRTC 13.0 (CUTLASS
#: 4.2): 128 never spilled in gemmgen's kernels; bf16 pingpong 128x192 (192) spills 8 bytes, fp8
#: cooperative 128x256 (2 x 128) 256 bytes.
MAX_ACCUMULATORS_PER_THREAD = 128


def accumulators_per_thread(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """fp32 accumulator registers per consumer thread: its warpgroup's part of the tile (half of it
    under the cooperative schedule, all of it under pingpong) over 128 threads, twice for fp8 A/B,
    whose mainloop keeps WGMMA's partial sums apart from the promoted fp32 sums."""
    tm, tn, _ = cfg.tile
    per_warpgroup = tm * tn // (2 if cfg.schedule is Schedule.COOPERATIVE else 1)
    return per_warpgroup // 128 * (2 if recipe.gemm.fp8 else 1)


def register_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    n = accumulators_per_thread(cfg, recipe)
    if n <= MAX_ACCUMULATORS_PER_THREAD:
        return []
    fp8 = " (fp8 keeps two copies)" if recipe.gemm.fp8 else ""
    return [f"registers: tile {cfg.tile[0]}x{cfg.tile[1]} under the {cfg.schedule.value} schedule keeps {n} fp32 "
            f"accumulators per consumer thread{fp8}, over the {MAX_ACCUMULATORS_PER_THREAD} that fit without "
            "spilling; use a smaller tile M or N"
            + (", or the cooperative schedule" if cfg.schedule is Schedule.PINGPONG else "")]


def epilogue_tile(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int]:
    """CUTLASS's EpilogueTileAuto (sm90_compute_tile_shape_or_override)."""
    tm, tn, _ = cfg.tile
    if cfg.schedule is Schedule.COOPERATIVE:
        n = min(32, tn)
        return min(128, tm), _gcd(n, tn)
    n = 64 if recipe.gemm.d.bits == 8 and tn % 64 == 0 else 32
    return min(64, tm), _gcd(min(n, tn), tn)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def swizzle_span(extent: int, bits: int) -> int:
    """The widest TMA swizzle span (128, 64 or 32 bytes; 0 for none) whose atom width in elements
    divides a tile's contiguous `extent` (ss_smem_selector, and the epilogue's smem atoms)."""
    for span in (128, 64, 32):
        if extent % (span * 8 // bits) == 0:
            return span
    return 0


def epilogue_smem_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """sizeof(CollectiveEpilogue::SharedStorage): C/D tiles, the visitors' storage, padding and
    barriers, as CUTLASS lays them out (`codegen.storage`)."""
    from .codegen.storage import epilogue_storage_bytes  # the visitors codegen builds; codegen imports config

    return epilogue_storage_bytes(cfg, recipe)


def scales_per_tile(cfg: KernelConfig, recipe: RecipeIR) -> tuple[int, int]:
    """Block scales of A and of B one tile reads per K step (CUTLASS's ScaleMsPerTile and
    ScaleNsPerTile); (0, 0) without block scaling."""
    g = recipe.gemm.block_scale
    if g is None:
        return 0, 0
    return cfg.tile[0] // g[0], cfg.tile[1] // g[1]


#: CUTLASS's blockwise main loop loads the scales of A (of B) with TMA when a tile reads at least this
#: many of them per K step and fewer than this many of the other's (its ScaleTmaThreshold), else with
#: cp.async by the producer warp.
SCALE_TMA_THRESHOLD = 32


def scale_tma(cfg: KernelConfig, recipe: RecipeIR) -> tuple[bool, bool]:
    """Whether the kernel loads A's and B's block scales with TMA (IsTmaLoadSFA/SFB; both are
    M/N-major in gemmgen's one-GEMM kernels). A grouped kernel's main loop reads them with cp.async
    only, as each group's scales start at its own first row."""
    if recipe.gemm.grouped:
        return False, False
    ms, ns = scales_per_tile(cfg, recipe)
    t = SCALE_TMA_THRESHOLD
    return ms >= t and ns < t, ns >= t and ms < t


def mainloop_stage_bytes(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """One stage's A and B tiles and block scales, as compute_stage_count_or_override (and
    compute_stage_count_with_blockwise_scale) count them to choose the stage count."""
    return _stage_bytes(cfg, recipe, sum(scales_per_tile(cfg, recipe)))


def _stage_bytes(cfg: KernelConfig, recipe: RecipeIR, scales: int) -> int:
    tm, tn, tk = cfg.tile
    g = recipe.gemm
    raw = tm * tk * g.a.nbytes + tn * tk * g.b.nbytes + 4 * scales
    return _round_up(raw, _STAGE_ALIGN) + 16  # + the pipeline's full/empty barriers


def stage_count(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """Mainloop stages: the explicit count, or what StageCountAutoCarveout will choose
    (compute_stage_count_or_override)."""
    if cfg.stages is not None:
        return cfg.stages
    return _stages(cfg, recipe, epilogue_smem_bytes(cfg, recipe))


def _stages(cfg: KernelConfig, recipe: RecipeIR, epilogue_bytes: int) -> int:
    if cfg.stages is not None:
        return cfg.stages
    carveout = -(-epilogue_bytes // _STAGE_ALIGN) * _STAGE_ALIGN
    capacity = SM90_SMEM_CAPACITY - (_GROUPED_CARVEOUT if recipe.gemm.grouped else 0)
    return (capacity // _STAGE_ALIGN * _STAGE_ALIGN - carveout) // mainloop_stage_bytes(cfg, recipe)


def smem_need(cfg: KernelConfig, recipe: RecipeIR) -> int:
    """The kernel's shared memory: its stages (tiles and barriers) and the epilogue's storage. An
    upper bound on GemmKernel::SharedStorageSize, at most 1 KB over (NVRTC checks both for every
    kernel of tests/test_codegen.py's translation unit).

    Block scales are stored apart from the tiles, one 128-byte aligned array per operand for all
    stages, and they leave the kernel's tensors off the 512- or 1024-byte alignment the epilogue's
    swizzled buffers give them: bounded by rounding the two arrays up to 1 KB together."""
    epilogue_bytes = epilogue_smem_bytes(cfg, recipe)
    extra = _GROUPED_KERNEL_EXTRA if recipe.gemm.grouped else 0
    stages = _stages(cfg, recipe, epilogue_bytes)
    ms, ns = scales_per_tile(cfg, recipe)
    scales = _round_up(_round_up(4 * ms * stages, _STAGE_ALIGN) + _round_up(4 * ns * stages, _STAGE_ALIGN), 1024) \
        if ms + ns else 0
    return stages * _stage_bytes(cfg, recipe, 0) + scales + epilogue_bytes + extra


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def smem_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    stages = stage_count(cfg, recipe)
    need = smem_need(cfg, recipe)
    if stages < 2:
        return [f"shared memory: tile {cfg.tile} leaves room for {stages} mainloop stage(s), need at least 2; "
                "use a smaller tile K or N"]
    if need > SM90_SMEM_CAPACITY:
        return [f"shared memory: {stages} stages of tile {cfg.tile} plus the epilogue need up to {need} bytes, "
                f"more than the {SM90_SMEM_CAPACITY} an sm_90 block can use; lower stages or the tile"]
    return []


def reduction_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Vector reductions are built over the kernel's N only (CUTLASS's Sm90ColReduction). Its
    Sm90RowReduction, over the kernel's M, kept 480-688 bytes of its state on the stack, with
    226-541 local loads and stores in the SASS, in five of the six configs compiled with it
    (cooperative and pingpong, tile M 64 to 256, bf16 and e4m3 D; only pingpong 64 x 256 with an
    e4m3 D stayed in registers), where the column form kept it in registers in every config
    (NVRTC 13.0.88, CUTLASS 4.2.0, 2026-11-30). A
    reduction over the recipe's M (dim=0) is therefore computed by a swapped kernel, in which it
    is a reduction over the kernel's N."""
    over_m = [o.name for o in recipe.epilogue.outputs if o.dim == 0]
    if over_m:
        dim, swap = (1, "False") if cfg.swap_ab else (0, "True")
        return [f"aux output {over_m[0]!r}: its reduction (dim={dim}) is over the kernel's M, and gemmgen builds "
                f"reductions over the kernel's N only (CUTLASS's reduction over M spills to local memory); "
                f"use swap_ab={swap}"]
    return []


def block_scale_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """CUTLASS's blockwise fp8 main loop rescales once per K tile, so the tile's K is the scales' K
    granularity, and each tile covers whole scale blocks along the kernel's M and N (a swapped
    kernel's M is the caller's N: DeepSeek-V3's 128 x 128 weight blocks then need a tile M of 128
    or 256)."""
    g = recipe.gemm.block_scale
    if g is None:
        return []
    gm, gn, gk = g
    tm, tn, tk = cfg.tile
    out = []
    if tk != gk:
        out.append(f"tile K = {tk}: must equal the block scales' K granularity {gk} (the main loop rescales once "
                   "per K tile)")
    for what, t, gran in (("M", tm, gm), ("N", tn, gn)):
        if t % gran:
            swapped = " (swapped: the kernel's M is the recipe's N)" if cfg.swap_ab and what == "M" else \
                " (swapped: the kernel's N is the recipe's M)" if cfg.swap_ab else ""
            out.append(f"tile {what} = {t}: must be a multiple of the block scales' granularity {gran} along the "
                       f"kernel's {what}{swapped}")
    return out


CONSTRAINTS = (tile_violations, schedule_violations, tile_scheduler_violations, cluster_violations,
               register_violations, smem_violations, reduction_violations, block_scale_violations)


def violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Every constraint `cfg` breaks for the recipe as declared."""
    view = kernel_recipe(cfg, recipe)
    return [v for check in CONSTRAINTS for v in check(cfg, view)]


def is_valid(cfg: KernelConfig, recipe: RecipeIR) -> bool:
    return not violations(cfg, recipe)


def validate(cfg: KernelConfig, recipe: RecipeIR) -> None:
    if not isinstance(cfg, KernelConfig):
        raise ConfigError(f"config: expected a gemmgen.KernelConfig, got {cfg!r}")
    problems = violations(cfg, recipe)
    if problems:
        raise ConfigError(f"config {cfg.name} is invalid for recipe {recipe.name!r}:\n  - " + "\n  - ".join(problems))

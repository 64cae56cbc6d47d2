"""What a kernel config is: the tile, cluster and schedules a recipe is mapped onto the machine with.

A config is plain data. Which configs an architecture accepts, and what they cost in registers and
shared memory, is that architecture's emitter's knowledge (`gemmgen.codegen.sm90.constraints`,
`gemmgen.codegen.sm100.constraints`: one function per rule, used both to validate and to prune
candidates). `arch` (`config.arch.Arch`) says which emitter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..ir import RecipeIR, content_key
from .arch import DEFAULT_ARCH, Arch


class Schedule(enum.Enum):
    """Warp-specialized mainloop schedules of CUTLASS 3.x, each of one architecture (`arch`)."""

    COOPERATIVE = "cooperative"  # sm_90a: two consumer warpgroups share one tile (tile M = 128 or 256)
    PINGPONG = "pingpong"  # sm_90a: two consumer warpgroups alternate tiles (tile M = 64 or 128)
    ONE_SM = "1sm"  # sm_100a: one SM's tcgen05 MMA computes the tile (tile M = 64 or 128)
    TWO_SM = "2sm"  # sm_100a: a pair of SMs in the cluster computes one tile together (tile M = 128 or 256)

    @property
    def arch(self) -> Arch:
        return Arch.SM100A if self in (Schedule.ONE_SM, Schedule.TWO_SM) else Arch.SM90A


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


class EpilogueCollective(enum.Enum):
    """Which epilogue collective a kernel instantiates.

    TMA: CUTLASS's warp-specialized TMA epilogue with the recipe's visitor tree: subtiles staged
    through shared memory and stored with TMA; every epilogue gemmgen can declare. DIRECT: gemmgen's
    own (gemmgen/include/gemmgen/direct_epilogue.hpp): each accumulator element goes through a
    functor generated from the recipe, from registers to global memory, with no shared memory. It
    compiles in a fraction of the time (docs/design/measurements.md) but stores element by element
    instead of with TMA, and takes elementwise epilogues and max-like reductions over M and N only
    (`codegen.direct.unsupported`): what you iterate on, not what you ship before you have measured it.
    """

    TMA = "tma"
    DIRECT = "direct"


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

    `arch` is the GPU architecture the kernel is built for (`gemmgen.Arch`); the schedule must be
    one of its own. On sm_100a `tile` is the MMA's tile: under `Schedule.TWO_SM` the pair of SMs
    computes it, each an M/2 x N half (`cta_tile`).

    `epilogue` picks the epilogue collective (`EpilogueCollective`): CUTLASS's TMA one by default.
    """

    tile: tuple[int, int, int] = (128, 128, 64)
    cluster: tuple[int, int, int] = (1, 1, 1)
    schedule: Schedule = Schedule.COOPERATIVE
    stages: int | None = None
    tile_scheduler: TileScheduler = field(default=TileScheduler.PERSISTENT)
    swap_ab: bool = False
    splits: int = 1
    deterministic: bool = True
    arch: Arch = DEFAULT_ARCH
    epilogue: EpilogueCollective = EpilogueCollective.TMA

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
        object.__setattr__(self, "arch", Arch.parse(self.arch, "arch"))  # "sm_100a" is accepted as Arch.SM100A
        if not isinstance(self.epilogue, EpilogueCollective):
            raise ConfigError(f"epilogue: expected gemmgen.EpilogueCollective.TMA or .DIRECT, got {self.epilogue!r}")

    @property
    def cta_tile(self) -> tuple[int, int, int]:
        """The part of `tile` one CTA computes: half of it along M when two SMs share the MMA."""
        tm, tn, tk = self.tile
        return (tm // 2, tn, tk) if self.schedule is Schedule.TWO_SM else self.tile

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
        arch = "" if self.arch is DEFAULT_ARCH else f"_{self.arch.value}"
        direct = "_direct" if self.epilogue is EpilogueCollective.DIRECT else ""
        return (f"{tm}x{tn}x{tk}_c{cm}x{cn}x{ck}_{self.schedule.value}_{stages}{swap}{stream_k}{splits}"
                f"{nondeterministic}{arch}{direct}")

    def binary(self) -> KernelConfig:
        """The part of the config the kernel's code depends on (all but the launch arguments `splits`
        and `deterministic`): what is rendered, compiled, cached and bundled."""
        launch_only = self.splits > 1 or not self.deterministic
        return replace(self, splits=1, deterministic=True) if launch_only else self

    def canonical(self) -> list:
        """A JSON-able form: the code's fields, then `swap_ab`, `splits`, `deterministic`, `arch` and
        `epilogue` up to the last that is not its default, so configs from before a field keep their keys."""
        out = [list(self.tile), list(self.cluster), self.schedule.value, self.stages, self.tile_scheduler.value]
        optional = [self.swap_ab, self.splits, self.deterministic, self.arch.value, self.epilogue.value]
        while optional and optional[-1] == _OPTIONAL_DEFAULTS[len(optional) - 1]:
            optional.pop()
        return [*out, *optional]

    @classmethod
    def from_canonical(cls, raw: list) -> KernelConfig:
        """The inverse of `canonical`; raises ConfigError (via the constructor) or ValueError/TypeError."""
        tile, cluster, schedule, stages, scheduler, *rest = raw
        if len(rest) > len(_OPTIONAL_DEFAULTS) or (rest and rest[-1] == _OPTIONAL_DEFAULTS[len(rest) - 1]) or \
                any(type(x) is not type(d) for x, d in zip(rest, _OPTIONAL_DEFAULTS, strict=False)):
            raise ValueError(f"unexpected trailing fields {rest!r}: expected up to [swap_ab, splits, deterministic, "
                             "arch, epilogue], the last not its default")
        fields: list = [*rest, *_OPTIONAL_DEFAULTS[len(rest):]]
        return cls(tile=tuple(tile), cluster=tuple(cluster), schedule=Schedule(schedule), stages=stages,
                   tile_scheduler=TileScheduler(scheduler), swap_ab=fields[0], splits=fields[1],
                   deterministic=fields[2], arch=Arch.parse(fields[3]), epilogue=EpilogueCollective(fields[4]))


#: The defaults of KernelConfig's trailing canonical fields: swap_ab, splits, deterministic, arch, epilogue.
_OPTIONAL_DEFAULTS = (False, 1, True, DEFAULT_ARCH.value, EpilogueCollective.TMA.value)


def tile_k(recipe: RecipeIR) -> int:
    """The K extent of one 128-byte row of A/B: the full TMA swizzle span, and the tile K gemmgen
    picks by default (64 for 16-bit A and B, 128 for fp8)."""
    return 1024 // recipe.gemm.a.bits


def default_config(recipe: RecipeIR, arch: Arch = DEFAULT_ARCH) -> KernelConfig:
    """A recipe's config when it names none: 128 x 128 output tiles, K steps of 128 bytes (sm_90a:
    cooperative; sm_100a: one SM's MMA); swapped where only a swapped kernel computes it (`needs_swap`)."""
    schedule = Schedule.ONE_SM if arch is Arch.SM100A else Schedule.COOPERATIVE
    return KernelConfig(tile=(128, 128, tile_k(recipe)), schedule=schedule, swap_ab=needs_swap(recipe, arch), arch=arch)


def needs_swap(recipe: RecipeIR, arch: Arch = DEFAULT_ARCH) -> bool:
    """Whether only a swapped kernel computes the recipe on `arch`: on sm_100a, one reducing over M
    (its kernels reduce over their N only: `codegen.sm100.constraints.reduction_violations`); sm_90a
    kernels reduce over either."""
    return arch is Arch.SM100A and any(o.dim == 0 and o.blocks is None for o in recipe.epilogue.outputs)


def kernel_recipe(cfg: KernelConfig, recipe: RecipeIR) -> RecipeIR:
    """The recipe in the kernel's own terms: transposed under `swap_ab`. Every constraint, the
    generated types and the argument builder work on this view; only the runtime's checks and the
    caller see the recipe as declared."""
    return recipe.transposed() if cfg.swap_ab else recipe


def kernel_id(recipe: RecipeIR, config: KernelConfig) -> str:
    """A short content id for (math, config): part of the kernel symbol."""
    return content_key([recipe.key, config.canonical()])[:12]

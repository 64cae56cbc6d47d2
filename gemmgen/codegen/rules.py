"""Constraints that hold on every architecture, and how a config is checked against its own.

Each rule is a function of (config, kernel-side recipe) returning what the config breaks, in
words that name the fix; each architecture's `constraints` module lists its rules (`CONSTRAINTS`)
and may include these. `violations` applies an architecture's list to the kernel's view of the
recipe (`config.kernel_recipe`: transposed under swap_ab).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config import Arch, EpilogueCollective, KernelConfig, Schedule, TileScheduler, kernel_recipe
from ..errors import ConfigError
from ..ir import RecipeIR
from ..types import Layout, OperandKind
from .direct import unsupported

Rule = Callable[[KernelConfig, RecipeIR], list[str]]


def arch_schedule_violations(cfg: KernelConfig) -> list[str]:
    """A schedule belongs to one architecture's kernels (`Schedule.arch`)."""
    own = " or ".join(f"Schedule.{s.name}" for s in Schedule if s.arch is cfg.arch)
    return [f"schedule {cfg.schedule.value}: an {cfg.schedule.arch.value} schedule, and the config targets "
            f"{cfg.arch.value}; use {own}"]


def direct_epilogue_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """gemmgen's direct epilogue (`EpilogueCollective.DIRECT`): sm_90a's persistent kernels, and the
    epilogues its generated functor computes (`direct.unsupported`)."""
    if cfg.epilogue is not EpilogueCollective.DIRECT:
        return []
    fix = "use EpilogueCollective.TMA"
    if cfg.arch is not Arch.SM90A:
        return [f"epilogue direct: built for sm_90a only, and the config targets {cfg.arch.value}; {fix}"]
    out = []
    if cfg.tile_scheduler is not TileScheduler.PERSISTENT:
        out.append(f"epilogue direct: with the persistent tile scheduler only, not {cfg.tile_scheduler.value}; "
                   f"{fix} or TileScheduler.PERSISTENT")
    out += [f"epilogue direct: does not compute {what}; {fix}" for what in unsupported(recipe)]
    column_major = recipe.gemm.layout_d is Layout.COL  # the kernel's view: transposed under swap_ab
    tensors = sum(o.kind is OperandKind.MATRIX for o in recipe.epilogue.operands) + \
        sum(o.reduce is None for o in recipe.epilogue.outputs)
    if cfg.schedule is Schedule.PINGPONG and column_major and cfg.tile[1] >= 128 and tensors > 1:
        # measured (NVRTC 13.0.88, 2026-12-07): one warpgroup's 128 x 128 accumulators, each with its
        # own column's 64-bit offset into two M x N tensors, spill 48-88 bytes; every other direct
        # kernel tried keeps 0 (docs/design/measurements.md, the direct epilogue)
        out.append(f"epilogue direct: a pingpong {cfg.tile[0]}x{cfg.tile[1]} tile storing D column-major "
                   f"({'swap_ab' if cfg.swap_ab else 'layout_d col'}) with {tensors} M x N tensors spills "
                   f"registers; {fix}, Schedule.COOPERATIVE or a tile N of 64")
    return out


def tile_k_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """K steps of the MMA (WGMMA and tcgen05.mma alike: 32 bytes of A and B), dividing or filling the
    128-byte TMA swizzle span."""
    tk, bits = cfg.tile[2], recipe.gemm.a.bits
    k_atom, swizzle_k = 256 // bits, 1024 // bits
    if tk % k_atom or tk < k_atom:
        return [f"tile K = {tk}: must be a multiple of {k_atom} for {recipe.gemm.a.value} (the MMA's 32-byte K step)"]
    if tk % swizzle_k and swizzle_k % tk:
        return [f"tile K = {tk}: must divide or be a multiple of {swizzle_k} (128-byte TMA swizzle)"]
    return []


def cluster_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Cluster shapes of TMA multicast: 1, 2 or 4 CTAs along M and N, at most 8 in all (the
    portable cluster size), none along K."""
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


def tile_scheduler_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """A split count and a reduction order are the stream-K scheduler's arguments; a grouped kernel
    walks its groups with its own scheduler. (Each arch adds which of its kernels take stream-K.)"""
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
    return []


def k_grouped_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """A K-grouped kernel (a weight gradient: `GemmSpec.k_grouped`) is built unswapped: its M and N
    are a layer's features, never the small dimension a swap is for."""
    if recipe.gemm.k_grouped and cfg.swap_ab:
        return ["swap_ab=True: a K-grouped GEMM's M and N are a layer's features, and its swapped form is not "
                "built; use swap_ab=False"]
    return []


def row_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """An epilogue over neighbouring columns of a row (column pairs, D's quantization blocks:
    `EpilogueIR.along_rows`) takes them from the accumulator's columns, which are the recipe's only in
    an unswapped kernel (a swapped kernel's columns are the recipe's rows)."""
    ir = recipe.epilogue
    if ir.along_rows and cfg.swap_ab:
        what = "adjacent column pairs (gg.pairs)" if ir.pairs else \
            "blocks of columns of a row (gg.quantize, gg.rms_norm, gg.exp_minus_max)" if ir.row_blocks else \
            "blocks of rows of a column (gg.quantize_columns)"
        return [f"swap_ab=True: this recipe's epilogue works on {what}, which a swapped kernel would take from "
                "rows; use swap_ab=False"]
    return []


def row_block_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """D's row blocks (gg.quantize, gg.rms_norm, gg.exp_minus_max) lie in one epilogue subtile, whose
    N the kernel sets to the block (`sm90.geometry.epilogue_tile`): the tile's N must hold whole
    blocks."""
    blocks = recipe.epilogue.row_blocks
    if blocks is not None and cfg.tile[1] % blocks.block:
        return [f"tile N = {cfg.tile[1]}: gg.{blocks.op.value}'s blocks of {blocks.block} columns must fit whole in "
                f"a tile; use a tile N that is a multiple of {blocks.block}"]
    return []


def block_scale_violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """CUTLASS's blockwise fp8 main loops (sm90's and sm100's) rescale once per K tile, so the tile's
    K is the scales' K granularity, and each CTA's tile covers whole scale blocks along the kernel's
    M and N (a swapped kernel's M is the caller's N: DeepSeek-V3's 128 x 128 weight blocks then need
    a CTA tile M of 128 or 256)."""
    g = recipe.gemm.block_scale
    if g is None:
        return []
    gm, gn, gk = g
    tm, tn, tk = cfg.cta_tile
    out = []
    if tk != gk:
        out.append(f"tile K = {tk}: must equal the block scales' K granularity {gk} (the main loop rescales once "
                   "per K tile)")
    for what, t, gran in (("M", tm, gm), ("N", tn, gn)):
        if t % gran:
            swapped = " (swapped: the kernel's M is the recipe's N)" if cfg.swap_ab and what == "M" else \
                " (swapped: the kernel's N is the recipe's M)" if cfg.swap_ab else ""
            cta = " (a CTA's half of the pair's tile)" if what == "M" and cfg.cta_tile != cfg.tile else ""
            out.append(f"tile {what} = {t}{cta}: must be a multiple of the block scales' granularity {gran} along "
                       f"the kernel's {what}{swapped}")
    return out


def violations(rules: Sequence[Rule], cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Every rule `cfg` breaks for the recipe as declared (only `row_violations` where a swapped
    kernel would take a row's columns from columns: such a view is no recipe to check further)."""
    along_rows = row_violations(cfg, recipe)
    if along_rows:
        return along_rows
    view = kernel_recipe(cfg, recipe)
    return [v for rule in rules for v in rule(cfg, view)]


def raise_violations(problems: list[str], cfg: KernelConfig, recipe: RecipeIR) -> None:
    """One ConfigError listing every broken rule, before anything is rendered or compiled."""
    if problems:
        raise ConfigError(f"config {cfg.name} is invalid for recipe {recipe.name!r}:\n  - " + "\n  - ".join(problems))

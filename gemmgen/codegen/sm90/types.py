"""The CUTLASS sm90 types a kernel instantiates: what templates/sm90/gemm_types.inc.j2 binds.

Collective builders' choices are spelled out (`collectives_resolved.inc.j2`: the types CUTLASS's
CollectiveBuilders resolve to, which compiles faster), checked type for type against the builders
(tests/codegen/test_codegen.py).
"""

from __future__ import annotations

from ...config import KernelConfig, Schedule, TileScheduler, kernel_id
from ...ir import GemmSpec, RecipeIR
from ...types import DType, Layout
from ..common_types import block_scale_decls, epilogue_strides, epilogue_tile_type, problem_shape
from ..evt import EpilogueCode
from .geometry import epilogue_tile_override, scales_per_tile
from .smem import blockwise_carveout, explicit_stages

#: How the kernel names its mainloop and epilogue collectives: "resolved" spells out the types
#: CUTLASS's CollectiveBuilders resolve to (what gemmgen emits: it compiles faster); "builder" names
#: the builders (the naive spelling, for measurements and for the test that the two agree).
COLLECTIVES = {"resolved": "sm90/collectives_resolved.inc.j2", "builder": "sm90/collectives_builder.inc.j2",
               "direct": "sm90/collectives_direct.inc.j2"}
#: The template that declares the kernel's types (included by kernel.cu.j2 and the oracle's host program).
TYPES_TEMPLATE = "sm90/gemm_types.inc.j2"


def type_context(recipe: RecipeIR, config: KernelConfig, epi: EpilogueCode, collectives: str = "resolved") -> dict:
    """What templates/sm90/gemm_types.inc.j2 binds: the kernel's CUTLASS types and constants.
    `recipe` is the kernel-side view (`GeneratedKernel.kernel_recipe`)."""
    g = recipe.gemm
    c_bits = DType.F32.bits if epi.element_c == "void" else _bits_of(epi.element_c)
    stages = explicit_stages(config, recipe)
    stage_count = _stage_count(config, recipe, stages)
    scale_decls, (layout_pair_a, layout_pair_b) = _block_scale_types(recipe)
    stride_c, stride_d = epilogue_strides(recipe)
    # a grouped kernel names its layouts as pointers: CUTLASS's tag for a stride per group
    per_group = " *" if g.grouped else ""
    # the direct epilogue's generated functor stands for the visitor tree (`codegen.direct`)
    functors = (epi.direct.source,) if epi.direct else tuple(f.source for f in epi.functors)
    return dict(
        namespace=f"gemmgen_{kernel_id(recipe, config)}",
        element_a=g.a.cutlass, element_b=g.b.cutlass, element_c=epi.element_c, element_d=epi.element_d,
        # the D element the collective's shared-memory types take: D's own where a PairStore writes D
        smem_element_d="ElementD" if epi.stores_d else g.d.cutlass,
        layout_a=g.layout_a.cutlass + per_group, layout_b=g.layout_b.cutlass + per_group,
        layout_d=g.layout_d.cutlass + per_group,
        alignment_a=128 // g.a.bits, alignment_b=128 // g.b.bits, alignment_c=128 // c_bits,
        alignment_d=128 // g.d.bits,
        tile=config.tile, cluster=config.cluster,
        epilogue_tile=epilogue_tile_type(epilogue_tile_override(config, recipe)),
        kernel_schedule=kernel_schedule(config.schedule, g.grouped, block_scaled=g.block_scale is not None),
        mainloop_policy=_mainloop_policy(recipe), problem_shape=problem_shape(recipe),
        epilogue_schedule=epilogue_schedule(config.schedule, g.grouped), stage_count=stage_count,
        mainloop_stages=_mainloop_stages(config, recipe, stage_count, stages),
        block_scale_decls=scale_decls, layout_pair_a=layout_pair_a, layout_pair_b=layout_pair_b,
        stride_a=_stride_pair("A", g), stride_b=_stride_pair("B", g),
        stride_c=stride_c, stride_d=stride_d,
        tile_scheduler=tile_scheduler(config.tile_scheduler, g.grouped),
        epilogue_decls=() if epi.direct else epi.decls, epilogue_functors=functors,
        epilogue_headings=() if epi.direct else ("// Epilogue visitor tree",),
        callbacks=epi.callbacks, setup_fill="gemmgen::grouped::fill",  # sm90's main loop derives the scale layouts
        collectives=COLLECTIVES["direct" if epi.direct else collectives], types_template=TYPES_TEMPLATE,
        # the builder's choices: two consumer warp groups side by side in M for the cooperative
        # schedule; TMA multicast for an operand when the cluster spans the other dimension
        mma_atoms_m=2 if config.schedule is Schedule.COOPERATIVE else 1,
        tma_load_a=_tma_load(config.cluster[1]), tma_load_b=_tma_load(config.cluster[0]))


def _mainloop_policy(recipe: RecipeIR) -> str:
    """The builder's dispatch policy: fp8 A/B get the mainloop that adds WGMMA's partial sums into
    a separate fp32 accumulator every few MMAs (Hopper's fp8 WGMMA accumulates with fewer bits),
    block-scaled fp8 the one that adds them once per K tile times the tile's scales; a grouped
    kernel's mainloop rewrites its tensor maps per group."""
    array = "Array" if recipe.gemm.grouped else ""
    if recipe.gemm.block_scale is not None:
        return f"cutlass::gemm::MainloopSm90{array}TmaGmmaWarpSpecializedBlockwise" + ("" if array else "FP8")
    return f"cutlass::gemm::MainloopSm90{array}TmaGmmaWarpSpecialized" + ("FP8" if recipe.gemm.fp8 else "")


def _block_scale_types(recipe: RecipeIR) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    """The scale layouts' declarations, and the main loop's (layout, scale layout) of A and B as the
    blockwise builder takes them (each operand's layout alone without block scales). The scales'
    majorness is `GemmSpec.scale_layouts`'; a grouped kernel names its scale layouts as pointers,
    one per group, as its strides."""
    gemm = recipe.gemm
    g = gemm.block_scale
    if g is None:
        return [], ("LayoutA", "LayoutB")
    config = f"{g[0]}, {g[1]}, {g[2]}"
    if gemm.scale_layouts[0] is Layout.ROW:  # GemmSpec.scale_layouts: a rows-grouped kernel's, both K-major
        config += ", cute::GMMA::Major::K, cute::GMMA::Major::K"
    decls = block_scale_decls(f"cutlass::detail::Sm90BlockwiseScaleConfig<{config}>")
    per_group = " *" if gemm.grouped else ""
    return decls, (f"cute::tuple<LayoutA, LayoutSFA{per_group}>", f"cute::tuple<LayoutB, LayoutSFB{per_group}>")


def _stride_pair(operand: str, gemm: GemmSpec) -> str:
    """The main loop's stride type of A or B, paired with its scales' layout when block-scaled (as
    the blockwise builder maps GmemLayoutA/B)."""
    stride = f"cutlass::detail::TagToStride{operand}_t<Layout{operand}>"
    if gemm.block_scale is None:
        return stride
    per_group = " *" if gemm.grouped else ""
    return f"cute::tuple<{stride}, cutlass::detail::TagToStride{operand}_t<LayoutSF{operand}{per_group}>>"


def _stage_count(config: KernelConfig, recipe: RecipeIR, stages: int | None) -> str:
    """The builders' StageCountType: what the epilogue leaves, or `stages` spelled out (for the
    blockwise builder, as the carveout that leaves room for exactly that many)."""
    carveout = "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))"
    if stages is None:
        return f"cutlass::gemm::collective::StageCountAutoCarveout<{carveout}>"
    if recipe.gemm.block_scale is None:
        return f"cutlass::gemm::collective::StageCount<{stages}>"
    return f"cutlass::gemm::collective::StageCountAutoCarveout<{blockwise_carveout(config, recipe, stages)}>"


def _mainloop_stages(config: KernelConfig, recipe: RecipeIR, stage_count: str, stages: int | None) -> str:
    """The builder's stage count: what fits beside the epilogue (`smem.stage_count` models it).
    The blockwise builder counts the scales too, and takes no explicit count: one is spelled out
    (`stages`, `smem.explicit_stages`)."""
    capacity = _smem_capacity(recipe.gemm.grouped)
    if recipe.gemm.block_scale is None:
        return (f"cutlass::gemm::collective::detail::compute_stage_count_or_override<\n    {capacity}, ElementA, "
                f"ElementB, TileShape>({stage_count}{{}})")
    if stages is not None:
        return str(stages)
    ms, ns = scales_per_tile(config, recipe)
    return (f"cutlass::gemm::collective::detail::compute_stage_count_with_blockwise_scale<\n    {capacity}, "
            f"ElementA, ElementB, ElementAccumulator, TileShape, {ms}, {ns}>({stage_count}{{}})")


def _smem_capacity(grouped: bool) -> str:
    """The shared memory the mainloop's stages may fill: a grouped mainloop leaves out A's and B's
    tensor maps and the group scheduler's pipeline (the builder's KernelSmemCarveout)."""
    capacity = "cutlass::gemm::collective::detail::sm90_smem_capacity_bytes"
    if not grouped:
        return capacity
    return (f"{capacity} - static_cast<int>(2 * sizeof(cute::TmaDescriptor) + "
            "sizeof(cutlass::PipelineDetail::PipelineAsyncSharedStorage<8>))")


def _tma_load(cluster_extent: int) -> str:
    return "SM90_TMA_LOAD" if cluster_extent == 1 else "SM90_TMA_LOAD_MULTICAST"



def kernel_schedule(schedule: Schedule, grouped: bool = False, block_scaled: bool = False) -> str:
    """CUTLASS's kernel schedule; the pointer-array variant for a grouped GEMM, the blockwise fp8
    one (which selects its main loop) for block scales."""
    array = "PtrArray" if grouped else ""
    blockwise = "FP8Blockwise" if block_scaled else ""
    return f"cutlass::gemm::Kernel{array}TmaWarpSpecialized{schedule.value.capitalize()}{blockwise}"


def epilogue_schedule(schedule: Schedule, grouped: bool = False) -> str:
    if grouped:
        return f"cutlass::epilogue::PtrArrayTmaWarpSpecialized{schedule.value.capitalize()}"
    return {Schedule.COOPERATIVE: "cutlass::epilogue::TmaWarpSpecializedCooperative",
            Schedule.PINGPONG: "cutlass::epilogue::TmaWarpSpecialized"}[schedule]


def tile_scheduler(scheduler: TileScheduler, grouped: bool = False) -> str:
    """A grouped kernel's persistent scheduler walks the tiles of every group in turn."""
    if grouped:
        return "cutlass::gemm::GroupScheduler"
    return {TileScheduler.PERSISTENT: "cutlass::gemm::PersistentScheduler",
            TileScheduler.STREAM_K: "cutlass::gemm::StreamKScheduler"}[scheduler]


def _bits_of(cutlass_type: str) -> int:
    return next(d.bits for d in DType if d.cutlass == cutlass_type)

"""The CUTLASS sm100 types a kernel instantiates: what templates/sm100/gemm_types.inc.j2 binds.

The mainloop and the epilogue come from CUTLASS's sm100 CollectiveBuilders, named with explicit
1-SM or 2-SM schedules (`KernelTmaWarpSpecialized{1,2}SmSm100`, `TmaWarpSpecialized{1,2}Sm`, and
their pointer-array forms for a grouped kernel); the epilogue is the same visitor tree as on sm90
(`codegen.evt`).
"""

from __future__ import annotations

from ...config import Arch, KernelConfig, Schedule, TileScheduler, kernel_id
from ...ir import RecipeIR
from ...types import DType, Layout, Microscaling
from ..common_types import block_scale_decls, epilogue_strides, epilogue_tile_type, problem_shape
from ..evt import EpilogueCode
from ..fields import D_SINK_HEADER, reads_scale_layouts, sinks_d
from .geometry import epilogue_tile_override

#: The template that declares the kernel's types (included by kernel.cu.j2).
TYPES_TEMPLATE = "sm100/gemm_types.inc.j2"


def headers(recipe: RecipeIR) -> tuple[str, ...]:
    """What an sm100 kernel's module includes besides every kernel's headers (gemmgen/include): a
    microscaled kernel also CUTLASS's block-scaled collective, one whose registers write D the sink
    of its collective's store of D."""
    return ("gemmgen/sm100.hpp", *(("gemmgen/sm100_microscaling.hpp",) if recipe.gemm.microscaling else ()),
            *((D_SINK_HEADER,) if sinks_d(recipe, Arch.SM100A) else ()))

_SM = {Schedule.ONE_SM: "1Sm", Schedule.TWO_SM: "2Sm"}


def type_context(recipe: RecipeIR, config: KernelConfig, epi: EpilogueCode, collectives: str = "builder") -> dict:
    """What templates/sm100/gemm_types.inc.j2 binds. `recipe` is the kernel-side view
    (`GeneratedKernel.kernel_recipe`). sm100 kernels are spelled through the builders only
    (`collectives` is accepted for the shared signature)."""
    g = recipe.gemm
    c_bits = DType.F32.bits if epi.element_c == "void" else next(d.bits for d in DType if d.cutlass == epi.element_c)
    stage_count = ("cutlass::gemm::collective::StageCountAutoCarveout<"
                   "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>"
                   if config.stages is None else f"cutlass::gemm::collective::StageCount<{config.stages}>")
    sm = _SM[config.schedule]
    # a grouped kernel names its layouts as pointers (CUTLASS's tag for a stride per group), reads
    # its (M, N, K) per group from device memory and takes the pointer-array schedules, whose
    # kernel pairs them with the group scheduler
    per_group, array = (" *", "PtrArray") if g.grouped else ("", "")
    scale_decls, (layout_pair_a, layout_pair_b) = _block_scale_types(recipe)
    stride_c, stride_d = epilogue_strides(recipe)
    mx = g.microscaling is not None
    return dict(
        namespace=f"gemmgen_{kernel_id(recipe, config)}",
        element_a=_mainloop_element(g.a, g.microscaling), element_b=_mainloop_element(g.b, g.microscaling),
        element_c=epi.element_c, element_d=epi.element_d, descriptor_element_d=g.d.cutlass,
        mainloop_op_class=f"cutlass::arch::OpClass{'BlockScaled' if mx else ''}TensorOp",
        layout_a=g.layout_a.cutlass + per_group, layout_b=g.layout_b.cutlass + per_group,
        layout_d=g.layout_d.cutlass + per_group,
        alignment_a=128 // g.a.bits, alignment_b=128 // g.b.bits, alignment_c=128 // c_bits,
        alignment_d=128 // g.d.bits,
        tile=config.tile, cta_tile=config.cta_tile, cluster=config.cluster,
        kernel_schedule=kernel_schedule(config.schedule, g.grouped, block_scaled=g.block_scale is not None,
                                        microscaling=g.microscaling),
        block_scale_decls=scale_decls, layout_pair_a=layout_pair_a, layout_pair_b=layout_pair_b,
        epilogue_schedule=f"cutlass::epilogue::{array}TmaWarpSpecialized{sm}",
        epilogue_tile=epilogue_tile_type(epilogue_tile_override(config, recipe)),
        problem_shape=problem_shape(recipe), stride_c=stride_c, stride_d=stride_d,
        tile_scheduler=("cutlass::gemm::StreamKScheduler" if config.tile_scheduler is TileScheduler.STREAM_K
                        else "void"),
        setup_fill=setup_fill(recipe, config),
        stage_count=stage_count, epilogue_decls=epi.decls,
        epilogue_functors=tuple(f.source for f in epi.functors), callbacks=epi.callbacks, types_template=TYPES_TEMPLATE)


def setup_fill(recipe: RecipeIR, config: KernelConfig) -> str:
    """What a grouped kernel's setup kernel runs per group (gemmgen/grouped.hpp): the shapes and
    per-group arrays, and each group's scale layouts where the main loop reads them
    (`fields.reads_scale_layouts`)."""
    if reads_scale_layouts(recipe, config):
        namespace = f"gemmgen_{kernel_id(recipe, config)}"
        types = ", ".join(f"{namespace}::{t}" for t in ("ScaleConfig", "LayoutSFA", "LayoutSFB"))
        return f"gemmgen::grouped::fill_scale_layouts<{types}>"
    return "gemmgen::grouped::fill"


def kernel_schedule(schedule: Schedule, grouped: bool = False, block_scaled: bool = False,
                    microscaling: Microscaling | None = None) -> str:
    """CUTLASS's sm100 kernel schedule: one SM's MMA or a pair's; the pointer-array form for a
    grouped GEMM; the blockwise one (whose main loop scales each K tile's partial accumulator in
    registers) for block scales; the block-scaled MMA's (scales in tensor memory) for microscaled
    A and B: kind::mxf8f6f4 for MXFP8, kind::mxf4nvf4 (packed fp4, e4m3 scales per 16) for NVFP4."""
    if microscaling is not None:
        array = "PtrArray" if grouped else ""
        return f"cutlass::gemm::Kernel{array}TmaWarpSpecialized{_SM[schedule]}{_MMA_KIND[microscaling]}Sm100"
    blockwise = "Blockwise" if block_scaled else ""
    if grouped:
        return f"cutlass::gemm::KernelPtrArrayTmaWarpSpecialized{blockwise}{_SM[schedule][0]}SmSm100"
    return f"cutlass::gemm::KernelTmaWarpSpecialized{blockwise}{_SM[schedule]}Sm100"


#: The schedule names of the block-scaled MMA's kinds, by microscaling format.
_MMA_KIND = {Microscaling.MXFP8: "Mxf8f6f4", Microscaling.NVFP4: "Nvf4"}
#: CUTLASS's pairs of element and scale type, by microscaling format.
_SCALED_ELEMENT = {Microscaling.MXFP8: "cutlass::mx_float8_t", Microscaling.NVFP4: "cutlass::nv_float4_t"}


def _mainloop_element(dtype: DType, fmt: Microscaling | None) -> str:
    """A or B as the mainloop builder takes it: the element, or CUTLASS's pair of element and
    scale type for microscaled A and B (`mx_float8_t`, `nv_float4_t`)."""
    return dtype.cutlass if fmt is None else f"{_SCALED_ELEMENT[fmt]}<{dtype.cutlass}>"


def _block_scale_types(recipe: RecipeIR) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    """The scale layouts' declarations (CUTLASS's Sm100BlockwiseScaleConfig, M/N-major for one GEMM
    and K-major for a grouped one, as `GemmSpec.scale_layouts` has them), and the main loop's
    (layout, scale layout) of A and B as the blockwise builder takes them (each operand's layout
    alone without block scales); a grouped kernel's scale layouts are per group, as its strides."""
    gemm = recipe.gemm
    if gemm.microscaling is not None:  # the builder deduces the scale layouts from the element pairs
        config = f"cutlass::detail::Sm1xxBlockScaledConfig<{gemm.microscaling.vector}>"
        return block_scale_decls(config), ("LayoutA", "LayoutB")
    g = gemm.block_scale
    if g is None:
        return [], ("LayoutA", "LayoutB")
    config = f"{g[0]}, {g[1]}, {g[2]}"
    if gemm.scale_layouts[0] is Layout.ROW:  # GemmSpec.scale_layouts: a rows-grouped kernel's, both K-major
        config += ", cute::UMMA::Major::K, cute::UMMA::Major::K"
    decls = block_scale_decls(f"cutlass::detail::Sm100BlockwiseScaleConfig<{config}>")
    per_group = " *" if gemm.grouped else ""
    return decls, (f"cute::tuple<LayoutA, LayoutSFA{per_group}>", f"cute::tuple<LayoutB, LayoutSFB{per_group}>")

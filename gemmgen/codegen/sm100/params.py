"""The fields of an sm100 GemmUniversal's Params that the host writes (see `codegen.fields`).

Against sm90's: the mainloop holds a second pair of tensor maps and the cluster shape for a
fallback cluster (gemmgen launches a static cluster: copies of the first pair), no transaction
byte counts; the epilogue holds its visitors' Params and the C and D maps; the scheduler's Params
are PersistentTileSchedulerSm100Params (cluster launch control), or for stream-K sm90's stream-K
Params beside them (PersistentTileSchedulerSm100StreamKParams); there is no workspace member.
A grouped kernel's maps are placeholders it rewrites per group (as on sm90) and its scheduler is
sm90's group scheduler inside PersistentTileSchedulerSm100GroupParams.
"""

from __future__ import annotations

from ...config import KernelConfig, TileScheduler
from ...ir import RecipeIR
from ..evt import EpilogueCode
from ..fields import (
    ParamField,
    binding_fields,
    block_scale_fields,
    clc_scheduler,
    desc,
    group_problem,
    group_scheduler,
    grouped_block_scale_fields,
    hw_info,
    microscaling_fields,
    stream_k_scheduler,
)


def param_fields(recipe: RecipeIR, config: KernelConfig, epilogue: EpilogueCode) -> tuple[ParamField, ...]:
    """Every Params field of a dense, batched or grouped sm100 TMA warp-specialized kernel."""
    grouped = recipe.gemm.grouped
    f = [ParamField("mode", "{p}.mode", "i32")]
    if grouped:
        f += group_problem("problem", "{p}.problem_shape")
    else:
        f += [ParamField(f"problem.{d}", f"cute::get<{i}>({{p}}.problem_shape)", "i32") for i, d in enumerate("mnkl")]
    m = "{p}.mainloop"
    f += [ParamField("mainloop.tma_a", desc(f"{m}.tma_load_a"), "desc"),
          ParamField("mainloop.tma_b", desc(f"{m}.tma_load_b"), "desc"),
          ParamField("mainloop.tma_a_fallback", desc(f"{m}.tma_load_a_fallback"), "desc"),
          ParamField("mainloop.tma_b_fallback", desc(f"{m}.tma_load_b_fallback"), "desc")]
    f += [ParamField(f"mainloop.cluster_shape_fallback.{a}", f"{m}.cluster_shape_fallback.{a}", "u32") for a in "xyz"]
    if recipe.gemm.block_scale is not None and not grouped:  # read with cp.async: no tensor maps
        f += block_scale_fields((False, False))
    if recipe.gemm.microscaling is not None:
        f += microscaling_fields(grouped)
    if grouped:  # the per-SM copies of the maps it rewrites, and the per-group arrays
        f += [ParamField("mainloop.tensormaps", f"{m}.tensormaps", "ptr"),
              ParamField("mainloop.ptr_a", f"{m}.ptr_A", "ptr"), ParamField("mainloop.stride_a", f"{m}.dA", "ptr"),
              ParamField("mainloop.ptr_b", f"{m}.ptr_B", "ptr"), ParamField("mainloop.stride_b", f"{m}.dB", "ptr")]
        # per group: the block scales' address and layout, read on the GPU (microscaled: above)
        if recipe.gemm.block_scale is not None:
            f += grouped_block_scale_fields(m)
    for b in epilogue.bindings:
        f += binding_fields(b)
    e = "{p}.epilogue"
    if epilogue.source is not None:
        f.append(ParamField("epilogue.tma_c", desc(f"{e}.tma_load_c"), "desc"))
    collective_d = epilogue.element_d != "void"  # else registers write each group's D (their bindings' fields)
    if collective_d:
        f.append(ParamField("epilogue.tma_d", desc(f"{e}.tma_store_d"), "desc"))
    if grouped:
        f.append(ParamField("epilogue.tensormaps", f"{e}.tensormaps", "ptr"))
        if epilogue.source is not None:
            f += [ParamField("epilogue.ptr_c", f"{e}.ptr_C", "ptr"), ParamField("epilogue.stride_c", f"{e}.dC", "ptr")]
        if collective_d:
            f += [ParamField("epilogue.ptr_d", f"{e}.ptr_D", "ptr"), ParamField("epilogue.stride_d", f"{e}.dD", "ptr")]
        return tuple(f + group_scheduler("{p}.scheduler.params_sm90_") + hw_info())
    s = "{p}.scheduler"
    if config.tile_scheduler is TileScheduler.STREAM_K:  # sm90's stream-K Params beside sm100's
        f += [ParamField("scheduler.raster_order", f"{s}.raster_order_", "i32"),
              ParamField("scheduler.log_swizzle_size", f"{s}.log_swizzle_size_", "i32")]
        f += stream_k_scheduler("scheduler.sk", f"{s}.sk_params_")
        f += clc_scheduler("scheduler.clc", f"{s}.sm100_params_")
    else:
        f += clc_scheduler("scheduler", s)
    return tuple(f + hw_info())

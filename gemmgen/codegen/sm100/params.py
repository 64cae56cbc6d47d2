"""The fields of an sm100 GemmUniversal's Params that the host writes (see `codegen.fields`).

Against sm90's: the mainloop holds a second pair of tensor maps and the cluster shape for a
fallback cluster (gemmgen launches a static cluster: copies of the first pair), no transaction
byte counts; the epilogue holds its visitors' Params and the C and D maps; the scheduler's Params
are PersistentTileSchedulerSm100Params (cluster launch control); there is no workspace member.
"""

from __future__ import annotations

from ...config import KernelConfig
from ...ir import RecipeIR
from ..evt import EpilogueCode
from ..fields import ParamField, binding_fields, desc, divmod_32, hw_info


def param_fields(recipe: RecipeIR, config: KernelConfig, epilogue: EpilogueCode) -> tuple[ParamField, ...]:
    """Every Params field of a dense or batched sm100 TMA warp-specialized kernel."""
    f = [ParamField("mode", "{p}.mode", "i32")]
    f += [ParamField(f"problem.{d}", f"cute::get<{i}>({{p}}.problem_shape)", "i32") for i, d in enumerate("mnkl")]
    m = "{p}.mainloop"
    f += [ParamField("mainloop.tma_a", desc(f"{m}.tma_load_a"), "desc"),
          ParamField("mainloop.tma_b", desc(f"{m}.tma_load_b"), "desc"),
          ParamField("mainloop.tma_a_fallback", desc(f"{m}.tma_load_a_fallback"), "desc"),
          ParamField("mainloop.tma_b_fallback", desc(f"{m}.tma_load_b_fallback"), "desc")]
    f += [ParamField(f"mainloop.cluster_shape_fallback.{a}", f"{m}.cluster_shape_fallback.{a}", "u32") for a in "xyz"]
    for b in epilogue.bindings:
        f += binding_fields(b)
    if epilogue.source is not None:
        f.append(ParamField("epilogue.tma_c", desc("{p}.epilogue.tma_load_c"), "desc"))
    f.append(ParamField("epilogue.tma_d", desc("{p}.epilogue.tma_store_d"), "desc"))
    s = "{p}.scheduler"
    f += [ParamField(f"scheduler.problem_tiles_{d}", f"{s}.problem_tiles_{d}_", "u32") for d in "mnl"]
    f += divmod_32("scheduler.cluster_shape_m", f"{s}.divmod_cluster_shape_m_")
    f += divmod_32("scheduler.cluster_shape_n", f"{s}.divmod_cluster_shape_n_")
    f += divmod_32("scheduler.swizzle_size", f"{s}.divmod_swizzle_size_")
    f += [ParamField("scheduler.raster_order", f"{s}.raster_order_", "i32"),
          ParamField("scheduler.log_swizzle_size", f"{s}.log_swizzle_size_", "i32")]
    f += hw_info()
    return tuple(f)

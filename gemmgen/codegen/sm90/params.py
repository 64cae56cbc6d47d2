"""The fields of an sm90 GemmUniversal's Params that the host writes (see `codegen.fields`)."""

from __future__ import annotations

from ...config import KernelConfig, Schedule, TileScheduler
from ...ir import RecipeIR
from ..evt import EpilogueCode
from ..fields import (
    ParamField,
    binding_fields,
    block_scale_fields,
    desc,
    direct_fields,
    divmod_pow2,
    divmod_u64,
    group_problem,
    group_scheduler,
    grouped_block_scale_fields,
    hw_info,
    stream_k_scheduler,
)
from .geometry import scale_tma


def param_fields(recipe: RecipeIR, config: KernelConfig, epilogue: EpilogueCode) -> tuple[ParamField, ...]:
    """Every Params field of a GemmUniversal sm90 TMA warp-specialized kernel with a persistent or
    stream-K scheduler."""
    schedule = config.schedule
    if recipe.gemm.grouped:
        return _grouped_fields(recipe, epilogue)
    f = [ParamField("mode", "{p}.mode", "i32")]
    f += [ParamField(f"problem.{d}", f"cute::get<{i}>({{p}}.problem_shape)", "i32") for i, d in enumerate("mnkl")]
    f += [ParamField("mainloop.tma_a", desc("{p}.mainloop.tma_load_a"), "desc"),
          ParamField("mainloop.tma_b", desc("{p}.mainloop.tma_load_b"), "desc"),
          ParamField("mainloop.tma_transaction_bytes", "{p}.mainloop.tma_transaction_bytes", "u32"),
          ParamField("mainloop.tma_transaction_bytes_mk", "{p}.mainloop.tma_transaction_bytes_mk", "u32"),
          ParamField("mainloop.tma_transaction_bytes_nk", "{p}.mainloop.tma_transaction_bytes_nk", "u32")]
    if recipe.gemm.block_scale is not None:
        f += block_scale_fields(scale_tma(config, recipe))
    elif recipe.gemm.fp8:  # the fp8 mainloop's promotion interval; the host keeps CUTLASS's default
        f.append(ParamField("mainloop.mma_promotion_interval", "{p}.mainloop.mma_promotion_interval", "u32"))
    if epilogue.direct is not None:
        f += direct_fields(epilogue.direct)
    else:
        for b in epilogue.bindings:
            f += binding_fields(b)
        if epilogue.source is not None:
            f.append(ParamField("epilogue.tma_c", desc("{p}.epilogue.tma_load_c"), "desc"))
        if epilogue.stores_d:  # else a PairStore writes D (its binding's fields)
            f.append(ParamField("epilogue.tma_d", desc("{p}.epilogue.tma_store_d"), "desc"))
        f.append(ParamField("epilogue.tma_transaction_bytes", "{p}.epilogue.tma_transaction_bytes", "u32"))
    f += hw_info()
    f += (stream_k_scheduler("scheduler", "{p}.scheduler") if config.tile_scheduler is TileScheduler.STREAM_K
          else _persistent_fields())
    if schedule is Schedule.COOPERATIVE:  # the pingpong kernel's Params has no workspace member
        f.append(ParamField("workspace", "{p}.workspace", "ptr"))
    return tuple(f)


def _persistent_fields() -> list[ParamField]:
    """PersistentTileSchedulerSm90Params."""
    s = "{p}.scheduler"
    f = divmod_pow2("scheduler.cluster_shape_major", f"{s}.divmod_cluster_shape_major_")
    f += divmod_pow2("scheduler.cluster_shape_minor", f"{s}.divmod_cluster_shape_minor_")
    f += divmod_u64("scheduler.batch", f"{s}.divmod_batch_")
    f += divmod_u64("scheduler.cluster_blk_major", f"{s}.divmod_cluster_blk_major_")
    f += [ParamField("scheduler.blocks_per_problem", f"{s}.blocks_per_problem_", "u64"),
          ParamField("scheduler.log_swizzle_size", f"{s}.log_swizzle_size_", "i32"),
          ParamField("scheduler.raster_order", f"{s}.raster_order_", "i32")]
    f += [ParamField(f"scheduler.{n}", f"{s}.{n}_", "u32") for n in (
        "problem_tiles_m", "problem_tiles_n", "problem_tiles_l", "cluster_shape_m", "cluster_shape_n")]
    return f


def _grouped_fields(recipe: RecipeIR, epilogue: EpilogueCode) -> tuple[ParamField, ...]:
    """Every Params field of a grouped (pointer-array) kernel with the group scheduler: its tensor
    maps are placeholders the kernel rewrites per group from the pointer and stride arrays, in
    per-SM copies in the workspace."""
    f = [ParamField("mode", "{p}.mode", "i32")]
    f += group_problem("problem", "{p}.problem_shape")
    m = "{p}.mainloop"
    f += [ParamField("mainloop.tma_a", desc(f"{m}.tma_load_a"), "desc"),
          ParamField("mainloop.tma_b", desc(f"{m}.tma_load_b"), "desc"),
          ParamField("mainloop.tma_transaction_bytes", f"{m}.tma_transaction_bytes", "u32"),
          ParamField("mainloop.tensormaps", f"{m}.tensormaps", "ptr"),
          ParamField("mainloop.ptr_a", f"{m}.ptr_A", "ptr"), ParamField("mainloop.stride_a", f"{m}.dA", "ptr"),
          ParamField("mainloop.ptr_b", f"{m}.ptr_B", "ptr"), ParamField("mainloop.stride_b", f"{m}.dB", "ptr")]
    if recipe.gemm.block_scale is not None:  # sm90's main loop derives each group's scale layout from its shape
        f += grouped_block_scale_fields(m)
    elif recipe.gemm.fp8:
        f.append(ParamField("mainloop.mma_promotion_interval", f"{m}.mma_promotion_interval", "u32"))
    for b in epilogue.bindings:
        f += binding_fields(b)
    e = "{p}.epilogue"
    if epilogue.source is not None:
        f += [ParamField("epilogue.tma_c", desc(f"{e}.tma_load_c"), "desc"),
              ParamField("epilogue.ptr_c", f"{e}.ptr_C", "ptr"), ParamField("epilogue.stride_c", f"{e}.dC", "ptr")]
    stores_d = epilogue.stores_d  # else a PairStore or DoubleStore writes each group's D (its binding's fields)
    f += [*([ParamField("epilogue.tma_d", desc(f"{e}.tma_store_d"), "desc")] if stores_d else []),
          ParamField("epilogue.tensormaps", f"{e}.tensormaps", "ptr"),
          *([ParamField("epilogue.ptr_d", f"{e}.ptr_D", "ptr"), ParamField("epilogue.stride_d", f"{e}.dD", "ptr")]
            if stores_d else []),
          ParamField("epilogue.tma_transaction_bytes", f"{e}.tma_transaction_bytes", "u32")]
    f += hw_info()
    f += group_scheduler("{p}.scheduler")
    f.append(ParamField("workspace", "{p}.workspace", "ptr"))
    return tuple(f)

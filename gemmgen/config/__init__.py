"""Kernel configurations: how a recipe maps onto the machine (plain data; see `kernel_config`)."""

from .kernel_config import (
    ARCH,
    KernelConfig,
    Schedule,
    TileScheduler,
    default_config,
    kernel_id,
    kernel_recipe,
    needs_swap,
    tile_k,
)

__all__ = ["ARCH", "KernelConfig", "Schedule", "TileScheduler", "default_config", "kernel_id", "kernel_recipe",
           "needs_swap", "tile_k"]

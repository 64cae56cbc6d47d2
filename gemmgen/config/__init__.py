"""Kernel configurations: how a recipe maps onto the machine (plain data; see `kernel_config`)."""

from .arch import DEFAULT_ARCH, Arch
from .kernel_config import (
    EpilogueCollective,
    KernelConfig,
    Schedule,
    TileScheduler,
    default_config,
    kernel_id,
    kernel_recipe,
    needs_swap,
    tile_k,
)

__all__ = ["DEFAULT_ARCH", "Arch", "EpilogueCollective", "KernelConfig", "Schedule", "TileScheduler", "default_config",
           "kernel_id", "kernel_recipe", "needs_swap", "tile_k"]

"""Hopper (sm_90a): CUTLASS 3.x TMA warp-specialized kernels with WGMMA and an EVT epilogue.

`constraints` says which configs this emitter accepts, `geometry` and `smem` what CUTLASS's sm90
builders derive from one, `types` the CUTLASS types a kernel instantiates, `params` the fields
of its Params the host writes.
"""

from .constraints import CONSTRAINTS, is_valid, validate, violations
from .geometry import epilogue_tile, scale_tma, scales_per_tile, swizzle_span
from .params import param_fields
from .smem import SM90_SMEM_CAPACITY, epilogue_smem_bytes, smem_need, stage_count
from .types import TYPES_TEMPLATE, type_context

__all__ = ["CONSTRAINTS", "SM90_SMEM_CAPACITY", "TYPES_TEMPLATE", "epilogue_smem_bytes", "epilogue_tile", "is_valid",
           "param_fields", "scale_tma", "scales_per_tile", "smem_need", "stage_count", "swizzle_span", "type_context",
           "validate", "violations"]

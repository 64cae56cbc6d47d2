"""Hopper (sm_90a): CUTLASS 3.x TMA warp-specialized kernels with WGMMA and an EVT epilogue (or
gemmgen's direct one: `codegen.direct`).

`constraints` says which configs this emitter accepts, `geometry` and `smem` what CUTLASS's sm90
builders derive from one, `types` the CUTLASS types a kernel instantiates, `params` the fields
of its Params the host writes.
"""

from ...config import Arch, EpilogueCollective, KernelConfig
from ...ir import Columns, RecipeIR
from ..emitter import Emitter, SassRequirement
from .constraints import CONSTRAINTS
from .geometry import epilogue_tile, scale_tma, scales_per_tile, swizzle_span
from .params import param_fields
from .smem import SM90_SMEM_CAPACITY, epilogue_smem_bytes, smem_need, stage_count
from .types import TYPES_TEMPLATE, type_context

#: WGMMA (16-bit, fp8), TMA loads and stores, register reallocation between warpgroups, mbarriers.
SASS_MARKERS = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "SYNCS")


def required_sass(config: KernelConfig, recipe: RecipeIR) -> SassRequirement:
    """Every sm90 kernel gemmgen emits multiplies with WGMMA, loads A and B with TMA and hands
    registers between its producer and consumer warpgroups; it stores D with TMA, but where D and
    every aux output have N/2 columns (`ir.columns`: written from the registers, pairs.hpp). D's
    row blocks (row_blocks.hpp), a copy's column blocks (column_blocks.hpp) and reductions over M or N
    combine across lanes: SHFL. The direct epilogue stores from the registers: STG, no TMA store;
    its reductions over M and N combine a warp's values (SHFL), then atomically (REDG or ATOMG)."""
    if config.epilogue is EpilogueCollective.DIRECT:
        reduced = ((("SHFL",), ("REDG", "ATOMG")) if any(o.reduce is not None for o in recipe.outputs) else ())
        return (("HGMMA", "QGMMA"), ("UTMALDG",), ("STG",), ("USETMAXREG",), ("SYNCS",), *reduced)
    tma_store = any(o.reduce is None and o.columns is Columns.FULL for o in recipe.outputs)
    lanes = (("SHFL",),) if any(o.dim is not None for o in recipe.outputs) or recipe.epilogue.column_blocks else ()
    return (("HGMMA", "QGMMA"), ("UTMALDG",), *((("UTMASTG",),) if tma_store else ()), ("USETMAXREG",), ("SYNCS",),
            *lanes)


EMITTER = Emitter(Arch.SM90A, CONSTRAINTS, type_context, param_fields, SASS_MARKERS, required_sass)

__all__ = ["CONSTRAINTS", "EMITTER", "SASS_MARKERS", "SM90_SMEM_CAPACITY", "TYPES_TEMPLATE", "epilogue_smem_bytes",
           "epilogue_tile", "param_fields", "required_sass", "scale_tma", "scales_per_tile", "smem_need",
           "stage_count", "swizzle_span", "type_context"]

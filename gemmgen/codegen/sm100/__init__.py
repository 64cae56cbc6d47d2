"""Blackwell (sm_100a): CUTLASS 3.x kernels with tcgen05 MMA (one SM or a pair), the accumulator in
tensor memory, TMA, cluster launch control and the same EVT epilogue as sm90.

`constraints` says which configs this emitter accepts, `smem` what they keep on chip, `types` the
CUTLASS types a kernel instantiates, `params` the fields of its Params the host writes.
"""

from ...config import Arch, KernelConfig, Schedule
from ...ir import RecipeIR
from ...types import DType
from ..emitter import Emitter, SassRequirement
from . import geometry
from .constraints import CONSTRAINTS
from .params import param_fields
from .smem import SM100_SMEM_CAPACITY, TMEM_COLUMNS, accumulator_stages, epilogue_smem_bytes, smem_need, stage_count
from .types import TYPES_TEMPLATE, headers, type_context

#: tcgen05 MMA (16-bit, fp8, fp4: UTCOMMA is kind::mxf4nvf4's), TMA loads and stores,
#: tensor-memory loads (the epilogue's), the pair's MMA, cluster launch control, mbarriers.
SASS_MARKERS = ("UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCHMMA.2CTA", "UTCQMMA.2CTA", "UTCOMMA.2CTA", "UTMALDG",
                "UTMASTG", "LDTM", "UGETNEXTWORKID", "SYNCS", "UTCCP")


def required_sass(config: KernelConfig, recipe: RecipeIR) -> SassRequirement:
    """tcgen05 MMA, issued for the pair under the 2-SM schedule (an fp4 kernel's UTCOMMA); TMA
    loads of A and B; the accumulator read from tensor memory; a microscaled kernel's scales
    copied into tensor memory for the MMA. A kernel compiled for plain sm_100 has none of them."""
    kinds = ("UTCOMMA",) if recipe.gemm.a is DType.E2M1 else ("UTCHMMA", "UTCQMMA")
    mma = tuple(f"{k}.2CTA" for k in kinds) if config.schedule is Schedule.TWO_SM else kinds
    scales = (("UTCCP",),) if recipe.gemm.microscaling is not None else ()
    return (mma, ("UTMALDG",), ("LDTM",), *scales)


EMITTER = Emitter(Arch.SM100A, CONSTRAINTS, type_context, param_fields, SASS_MARKERS, required_sass, headers)

__all__ = ["CONSTRAINTS", "EMITTER", "SASS_MARKERS", "SM100_SMEM_CAPACITY", "TMEM_COLUMNS", "TYPES_TEMPLATE",
           "accumulator_stages", "epilogue_smem_bytes", "geometry", "param_fields", "required_sass", "smem_need",
           "stage_count", "type_context"]

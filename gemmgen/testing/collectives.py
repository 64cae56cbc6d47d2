"""The check that gemmgen's spelled-out collectives are CUTLASS's builders' types, for NVRTC to run."""

from __future__ import annotations

from collections.abc import Sequence

from ..codegen import GeneratedKernel, template_environment
from ..codegen.sm90 import SM90_SMEM_CAPACITY, TYPES_TEMPLATE, epilogue_smem_bytes, smem_need, stage_count, type_context


def collectives_check_source(kernels: Sequence[GeneratedKernel]) -> str:
    """One translation unit: every kernel's types in both spellings, asserted to be the same types;
    gemmgen's model of the epilogue's shared storage and the stage count exact, its whole-kernel
    figure an upper bound within 1 KB; and every Params
    field the runtime writes a member of the kernel's Params, of the size it writes."""
    env = template_environment()
    parts = ["#include <gemmgen/nvrtc_prelude.hpp>",
             "#include <cutlass/cutlass.h>",
             "#include <cutlass/gemm/collective/collective_builder.hpp>",
             "#include <cutlass/epilogue/collective/collective_builder.hpp>",
             "#include <cutlass/gemm/kernel/gemm_universal.hpp>",
             "#include <gemmgen/nvrtc_fixups.hpp>",
             "#include <gemmgen/fusion.hpp>"]
    for i, k in enumerate(kernels):
        for spelling in ("resolved", "builder"):
            ctx = type_context(k.kernel_recipe, k.config, k.epilogue, spelling)
            ctx["namespace"] = f"k{i}_{spelling}"
            if spelling == "builder":  # the same functor types, not a second definition of each
                ctx["epilogue_functors"] = tuple(f"using k{i}_resolved::{f.name};" for f in k.epilogue.functors)
            parts.append(env.get_template(TYPES_TEMPLATE).render(**ctx))
        for t in ("CollectiveMainloop", "CollectiveEpilogue", "GemmKernel"):
            parts.append(f"static_assert(cute::is_same_v<k{i}_resolved::{t}, k{i}_builder::{t}>, "
                         f'"{k.entry}: {t} differs from the builder\'s");')
        parts.append(f"static_assert(k{i}_resolved::CollectiveMainloop::DispatchPolicy::Stages == "
                     f'{stage_count(k.config, k.kernel_recipe)}, "{k.entry}: smem.stage_count differs");')
        parts.append(f"static_assert(sizeof(k{i}_resolved::CollectiveEpilogue::SharedStorage) == "
                     f'{epilogue_smem_bytes(k.config, k.kernel_recipe)}, "{k.entry}: epilogue_smem_bytes differs");')
        parts.append(f"static_assert(sizeof(k{i}_resolved::GemmKernel::SharedStorage) <= {SM90_SMEM_CAPACITY}, "
                     f'"{k.entry}: shared storage over capacity");')
        need = smem_need(k.config, k.kernel_recipe)  # what the config check compares with the capacity
        parts.append(f"static_assert(sizeof(k{i}_resolved::GemmKernel::SharedStorage) <= {need} && "
                     f"{need} - sizeof(k{i}_resolved::GemmKernel::SharedStorage) <= 1024, "
                     f'"{k.entry}: smem_need is not a bound within 1 KB");')
        sizes = "".join(f'\n  static_assert(sizeof({f.lvalue("p")}) == {f.size}, "{k.entry}: {f.name}");'
                        for f in k.fields)
        parts.append(f"__device__ void k{i}_fields(k{i}_resolved::Params& p) {{{sizes}\n}}")
    parts.append('extern "C" __global__ void collectives_check() {}')
    return "\n".join(parts)

"""Compiling and caching kernels: NVRTC from the pinned wheels, the local cache, bundles (read side),
cubin inspection and the layout probe; `build_kernel` chooses between them."""

from .artifact import CompiledKernel, KernelInfo, KernelReport, compiled_kernel, report_table, reports_json
from .build import build_kernel, cache_key, compile_artifact, default_cache, key_material
from .cache import Artifact, KernelCache
from .parallel import build_many, default_jobs

__all__ = ["Artifact", "CompiledKernel", "KernelCache", "KernelInfo", "KernelReport", "build_kernel", "build_many",
           "cache_key", "compile_artifact", "compiled_kernel", "default_cache", "default_jobs", "key_material",
           "report_table", "reports_json"]

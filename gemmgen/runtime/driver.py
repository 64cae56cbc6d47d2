"""The CUDA driver side: loading cubins once per device, encoding tensor maps, launching.

Only the driver is called: through cuda.bindings.driver, and through ctypes for the tensor-map
encode, whose bindings wrapper misaligns the map (no runtime library, no host compiler). On the
CPU, tests run this module against a stub libcuda (gemmgen/testing/stub_driver.py), and the layers
above with a recording encoder and a fake launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import DEFAULT_ARCH, Arch
from ..errors import GemmgenError
from .tma import EncodeArgs


@functools.cache
def _cu() -> Any:
    """cuda.bindings.driver, imported on first use (an import statement per call costs a microsecond)."""
    from cuda.bindings import driver

    return driver


def _check(result: Any, what: str) -> None:
    """Raise GemmgenError naming the call and the driver's error (a CUresult, a bindings result
    tuple, or the plain int a ctypes call returns)."""
    err = result[0] if isinstance(result, tuple) else result
    if err == 0:  # CUresult is an IntEnum
        return
    cu = _cu()
    try:
        err = cu.CUresult(err)
    except ValueError:
        raise GemmgenError(f"{what} failed: CUresult {int(err)}") from None
    _, msg = cu.cuGetErrorString(err)
    raise GemmgenError(f"{what} failed: {err.name} ({msg.decode() if msg else '?'})")


def encode_tensor_map(args: EncodeArgs) -> bytes:
    """cuTensorMapEncodeTiled -> the 128-byte CUtensorMap.

    Called through ctypes into a map gemmgen aligns, not through cuda.bindings' wrapper: that one
    encodes into a CUtensorMap object which CPython allocates at 16-byte alignment (48 mod 64 for
    every object with cuda-bindings 13.0.3), while cuda.h requires the map 64-byte aligned (and
    CUDA 13 declares it alignas(128)). The map is used as encoded: the bit later CUTLASS releases
    clear on drivers up to 13.1 is reserved on Hopper (docs/design/arguments.md, Verification)."""
    buf = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGN)
    at = -ctypes.addressof(buf) % _MAP_ALIGN + ctypes.addressof(buf)
    err = _encode_tiled()(at, args.dtype, args.rank, args.addr, _u64s(args.dims), _u64s(args.strides),
                          _u32s(args.box), _u32s(args.elem_strides), args.interleave, args.swizzle, args.l2,
                          args.oob)
    if err:
        _check(err, f"cuTensorMapEncodeTiled({args})")
    return ctypes.string_at(at, _MAP_BYTES)


_MAP_BYTES, _MAP_ALIGN = 128, 128


@functools.cache
def _encode_tiled() -> Callable[..., int]:
    """The driver's cuTensorMapEncodeTiled as a ctypes function (looked up through cuda.bindings, so
    that it comes from the library the other calls use)."""
    cu = _cu()
    default = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    found = cu.cuGetProcAddress(b"cuTensorMapEncodeTiled", 12000, default)
    _check(found, "cuGetProcAddress(cuTensorMapEncodeTiled)")
    address = found[1]  # (err, pfn, status) in cuda-bindings 12 and 13
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                 u64p, u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
    return prototype(address)


@functools.lru_cache(maxsize=4096)
def _u64s(values: tuple[int, ...]) -> ctypes.Array:
    """Extents or strides as a C array (shapes repeat from call to call; the driver only reads it)."""
    return (ctypes.c_uint64 * len(values))(*values)


@functools.lru_cache(maxsize=256)
def _u32s(values: tuple[int, ...]) -> ctypes.Array:
    """A box or element strides as a C array (fixed per tensor map template)."""
    return (ctypes.c_uint32 * len(values))(*values)


@dataclass
class LoadedFunction:
    module: object
    function: object
    max_active_clusters: int


_LOCK = threading.Lock()
_LOADED: dict[tuple[str, int], LoadedFunction] = {}


def load(entry: str, cubin: bytes, device_index: int, smem_bytes: int, block: int,
         cluster: tuple[int, int, int]) -> LoadedFunction:
    """Load `cubin` into the device's primary context once; set its shared-memory limit once."""
    key = (entry, device_index)
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            return hit
        import torch

        with torch.cuda.device(device_index):
            bind_context(device_index)
            fn = _load_function(_cu(), entry, cubin, block, cluster, smem_bytes)
        _LOADED[key] = fn
        return fn


class _ThreadState(threading.local):
    has_context = False  # set once bind_context has run on the thread


THREAD = _ThreadState()


def bind_context(device_index: int) -> None:
    """Make the device's primary context current on this thread if no context is.

    The driver calls gemmgen makes (loading a module, encoding a tensor map, launching) act on the
    thread's current context, and a thread has one only after a CUDA runtime call that binds it.
    PyTorch may have made none on a thread that gemmgen is the first to launch from: a serving
    or data-parallel worker thread whose tensors come from the caching allocator, for one. The
    runtime binds the current device's primary context on its first call on a thread; this does
    the same, so the launch lands in the context torch's tensors and streams belong to. Kernels
    call it under `torch.cuda.device(device_index)`, once per thread (`THREAD.has_context`): once
    bound, only the caller's own driver calls (cuCtxPopCurrent, cuCtxSetCurrent) unbind it."""
    cu = _cu()
    with _capture_relaxed(cu):  # a first call may come while this or another thread captures a graph
        err, current = cu.cuCtxGetCurrent()
        _check(err, "cuCtxGetCurrent")
        if not int(current):
            err, device = cu.cuDeviceGet(device_index)
            _check(err, f"cuDeviceGet({device_index})")
            err, primary = cu.cuDevicePrimaryCtxRetain(device)
            _check(err, f"cuDevicePrimaryCtxRetain({device_index})")
            _check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    THREAD.has_context = True


def _load_function(cu: Any, entry: str, cubin: bytes, block: int, cluster: tuple[int, int, int],
                   smem_bytes: int) -> LoadedFunction:
    """Load the module into the current context, allow its shared memory, ask how many clusters fit."""
    with _capture_relaxed(cu):
        err, module = cu.cuModuleLoadData(cubin)
        _check(err, f"cuModuleLoadData({entry})")
        err, function = cu.cuModuleGetFunction(module, entry.encode())
        _check(err, f"cuModuleGetFunction({entry})")
        smem_attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(cu.cuFuncSetAttribute(function, smem_attr, smem_bytes), "cuFuncSetAttribute(max dynamic smem)")
        err, clusters = cu.cuOccupancyMaxActiveClusters(function, occupancy_config(block, cluster, smem_bytes))
        if err != cu.CUresult.CUDA_SUCCESS:
            warnings.warn(f"gemmgen: cuOccupancyMaxActiveClusters({entry}) failed ({err.name}); sizing its "
                          "grid from the SM count, as CUTLASS does when the query fails", stacklevel=2)
            clusters = 0
    return LoadedFunction(module, function, int(clusters))


@contextlib.contextmanager
def _capture_relaxed(cu: Any) -> Iterator[None]:
    """Lets a kernel's first call happen inside CUDA graph capture: loading a module and setting its
    attributes are not stream work, and capture's default (global) mode may refuse such calls
    while a capture is under way. The thread's mode is restored after, as PyTorch's
    CUDAStreamCaptureModeGuard does."""
    err, previous = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    _check(err, "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        cu.cuThreadExchangeStreamCaptureMode(previous)


def occupancy_config(block: int, cluster: tuple[int, int, int], smem: int) -> Any:
    """The launch config the cluster occupancy query sees: one cluster's grid, as CUTLASS's
    KernelHardwareInfo::query_device_max_active_clusters sets it (a grid the cluster does not
    divide is not a launchable config); the kernel's real dynamic shared memory."""
    return _config(cluster, block, cluster, smem, 0)


def _config(grid: tuple[int, int, int], block: int, cluster: tuple[int, int, int], smem: int, stream: int
            ) -> Any:
    """A CUlaunchConfig with the cluster dimension attribute."""
    cu = _cu()
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = smem
    cfg.hStream = cu.CUstream(stream)
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


@functools.lru_cache(maxsize=1024)
def launch_config(grid: tuple[int, int, int], block: int, cluster: tuple[int, int, int], smem: int,
                  stream: int) -> Any:
    """`_config`, built once per distinct launch shape and stream (about 3.5 us to build in Python;
    the driver only reads it during cuLaunchKernelEx)."""
    return _config(grid, block, cluster, smem, stream)


def launch(fn: LoadedFunction, params: bytes, grid: tuple[int, int, int], block: int, cluster: tuple[int, int, int],
           smem: int, stream: int) -> None:
    """cuLaunchKernelEx with the Params block as the kernel's only (by-value) parameter."""
    _launch(fn.function, params, grid, block, cluster, smem, stream)


def launch_function(function: Any, params: bytes, grid: tuple[int, int, int], block: int, smem: int,
                    stream: int) -> None:
    """`launch` for another kernel of a loaded module (`module_function`), without a cluster."""
    _launch(function, params, grid, block, (1, 1, 1), smem, stream)


def _launch(function: Any, params: bytes, grid: tuple[int, int, int], block: int, cluster: tuple[int, int, int],
            smem: int, stream: int) -> None:
    cu = _cu()
    buf = ctypes.create_string_buffer(params, len(params))
    arg = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    config = launch_config(tuple(grid), block, tuple(cluster), smem, stream)
    _check(cu.cuLaunchKernelEx(config, function, ctypes.addressof(arg), 0), "cuLaunchKernelEx")


def global_address(loaded: LoadedFunction, name: str) -> int:
    """The device address of a loaded module's `__device__` variable (extern "C": unmangled)."""
    cu = _cu()
    with _capture_relaxed(cu):
        err, address, _size = cu.cuModuleGetGlobal(loaded.module, name.encode())
    _check(err, f"cuModuleGetGlobal({name})")
    return int(address)


def module_function(loaded: LoadedFunction, entry: str) -> Any:
    """Another kernel of a loaded module (a grouped kernel's setup kernel)."""
    cu = _cu()
    with _capture_relaxed(cu):
        err, function = cu.cuModuleGetFunction(loaded.module, entry.encode())
    _check(err, f"cuModuleGetFunction({entry})")
    return function


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on a device (what a CUDA graph capture records on)."""
    return _stream_getter()(device_index)


def current_device() -> int:
    """torch's current CUDA device index (no Python-level lazy-init checks: the caller has CUDA tensors)."""
    return _device_getter()()


@functools.cache
def _device_getter() -> Callable[[], int]:
    import torch

    raw = getattr(torch._C, "_cuda_getDevice", None)
    return raw if raw is not None else torch.cuda.current_device


@functools.cache
def _stream_getter() -> Callable[[int], int]:
    """torch's raw-handle getter, as inductor's kernel launchers use it (no Stream object built per
    call); the public API where a build lacks it."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda index: torch.cuda.current_stream(index).cuda_stream)


@functools.cache
def device_facts(device_index: int) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of a device."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, (props.major, props.minor)


def current_arch() -> Arch:
    """The current CUDA device's arch (`device_arch`); sm_90a where torch sees no GPU (ahead of time)."""
    import torch

    return device_arch(torch.cuda.current_device())[0] if torch.cuda.is_available() else DEFAULT_ARCH


def device_arch(device_index: int) -> tuple[Arch, int]:
    """(the architecture whose kernels run on the device, its SM count); an InvalidArgument naming
    the device for a GPU gemmgen builds no kernels for, before anything is compiled for it."""
    sm_count, cc = device_facts(device_index)
    return Arch.of_device(cc, f"cuda:{device_index}"), sm_count

"""Launching the cast-transpose kernel (`codegen.quantize`): X (R x C, bf16 or f16) to its fp8
rows copy (R x C, per 1 x 128 block) and its transposed copy (C x R, per 128 x 1 block of X's
columns), each with its fp32 scales in the layout the consuming GEMM reads; or, per tensor
(Float8Tensorwise's current scaling), both copies over one scale from X's amax (`TensorAmax`, or
an epilogue's). The allocation and the Params bytes are plain functions (`allocate`,
`pack_params`), so tests run the host build of the same source on CPU tensors with the very bytes
a GPU launch passes."""

from __future__ import annotations

import functools
import struct
import threading
import warnings
from dataclasses import dataclass

import torch

from .. import env
from ..codegen.quantize import (
    BLOCK,
    PARAMS,
    POINTERS,
    THREADS,
    AmaxSpec,
    CastTransposeSpec,
    QuantizeSpec,
    render_cast_transpose,
)
from ..compile import KernelCache
from ..compile.quantize import CompiledQuantizeKernel, build_quantize_kernel
from ..config import DEFAULT_ARCH, Arch
from ..errors import GemmgenError, GemmgenWarning, InvalidArgument, KernelNotAvailable
from ..ir.ops import fp8_scale, quantize_blocks, round_to
from ..types import DType, Layout
from . import driver

_VECTOR = 16  # bytes per access: X's rows and the copies' rows start 16-byte aligned


@dataclass(frozen=True)
class CastTransposed:
    """The copies of X: `q` (R x C fp8) with `scale` (R x ceil(C / 128)), and `q_t` (C x R fp8)
    with `scale_t` (C x ceil(R / 128)); None where not asked for. The copies are views whose row
    stride is rounded up to 16 bytes (what TMA reads); the scales' last two dimensions are in the
    layouts asked for, their contiguous extent rounded up to 4 floats (16 bytes). Per tensor,
    `scale` and `scale_t` are one (1,) tensor."""

    q: torch.Tensor | None
    scale: torch.Tensor | None
    q_t: torch.Tensor | None
    scale_t: torch.Tensor | None


def check_input(x: object, spec: QuantizeSpec) -> torch.Tensor:
    """`x` as the kernel reads it, or an InvalidArgument naming what to change."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InvalidArgument(f"x: expected a 2-D (rows, columns) tensor, got {x!r:.80}")
    if x.dtype != spec.source.torch:
        raise InvalidArgument(f"x: expected {spec.source.torch} (the kernel's {spec.source!r}), got {x.dtype}; "
                              f"cast it with x.to({spec.source.torch})")
    rows, columns = x.shape
    per = _VECTOR // x.element_size()
    if columns % per:
        raise InvalidArgument(f"x: expected its columns a multiple of {per} (16 bytes, as the GEMMs' TMA reads "
                              f"them), got {columns}; pad them to {-(-columns // per) * per} with zeros")
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) % per) or x.data_ptr() % _VECTOR:
        raise InvalidArgument(f"x: expected rows contiguous, 16-byte aligned, each starting 16 bytes apart, got "
                              f"strides {tuple(x.stride())}; pass x.contiguous()")
    return x


def _padded_matrix(rows: int, columns: int, dtype: torch.dtype, device: torch.device, pad_to: int) -> torch.Tensor:
    """A (rows, columns) row-major view whose row stride is `columns` rounded up to `pad_to`."""
    return torch.empty(rows, -(-columns // pad_to) * pad_to, dtype=dtype, device=device)[:, :columns]


def _scales(rows: int, blocks: int, layout: Layout, device: torch.device) -> torch.Tensor:
    """(rows, blocks) fp32 in `layout`, its contiguous extent rounded up to 4 (16 bytes, for TMA)."""
    if layout is Layout.ROW:
        return _padded_matrix(rows, blocks, torch.float32, device, 4)
    return _padded_matrix(blocks, rows, torch.float32, device, 4).t()


def allocate(x: torch.Tensor, spec: CastTransposeSpec, rows: bool = True, columns: bool = True,
             scale_layout: Layout = Layout.ROW, scale_t_layout: Layout = Layout.ROW) -> CastTransposed:
    """The outputs of one call on `x` (checked), on x's device: the rows copy with `rows`, the
    transposed copy with `columns`."""
    r, c = x.shape
    fp8 = spec.target.torch
    q = _padded_matrix(r, c, fp8, x.device, _VECTOR) if rows else None
    q_t = _padded_matrix(c, r, fp8, x.device, _VECTOR) if columns else None
    if spec.per_tensor:
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        return CastTransposed(q, scale if rows else None, q_t, scale if columns else None)
    return CastTransposed(q, _scales(r, -(-c // BLOCK), scale_layout, x.device) if rows else None,
                          q_t, _scales(c, -(-r // BLOCK), scale_t_layout, x.device) if columns else None)


def pack_params(x: torch.Tensor, out: CastTransposed | None = None, amax: torch.Tensor | None = None) -> bytes:
    """`CastTransposeParams` for `x`, `out` (`allocate`'s; None for the amax kernel) and `amax` (the
    per-tensor kernels' (1,) fp32): 6 pointers, 9 int64, in order."""
    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    def strides(t: torch.Tensor | None) -> tuple[int, int]:
        return (t.stride(0), t.stride(1)) if t is not None and t.dim() == 2 else (0, 0)

    out = out or CastTransposed(None, None, None, None)
    r, c = x.shape
    values = dict(x=ptr(x), q=ptr(out.q), scale=ptr(out.scale), q_t=ptr(out.q_t), scale_t=ptr(out.scale_t),
                  amax=ptr(amax), rows=r, columns=c, ld_x=x.stride(0), ld_q=strides(out.q)[0],
                  ld_q_t=strides(out.q_t)[0])
    values["scale_row_stride"], values["scale_block_stride"] = strides(out.scale)
    values["scale_t_row_stride"], values["scale_t_block_stride"] = strides(out.scale_t)
    return struct.pack(f"<{POINTERS}Q{len(PARAMS) - POINTERS}q", *(values[name] for name in PARAMS))


def grid(x: torch.Tensor) -> tuple[int, int, int]:
    """One CTA per 128 x 128 tile of X: (tiles of its columns, tiles of its rows, 1)."""
    r, c = x.shape
    return -(-c // BLOCK), -(-r // BLOCK), 1


def cast_transposable(x: object) -> bool:
    """Whether `cast_transpose` takes `x`: a 2-D bf16 or f16 CUDA tensor whose rows the kernel reads
    16 bytes at a time (contiguous, aligned, a multiple of 8 columns)."""
    return (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[1] % 8 == 0 and x.stride(1) == 1 and (x.shape[0] <= 1 or x.stride(0) % 8 == 0)
            and x.data_ptr() % _VECTOR == 0)


class QuantizeKernel:
    """A quantize kernel of `spec`, built (or read from a bundle or the cache) on first use and
    launched on x's device and current stream; on a CPU tensor, torch ops that give its bits."""

    def __init__(self, spec: QuantizeSpec, cache: KernelCache | None = None) -> None:
        self.spec, self._cache = spec, cache
        self._compiled: CompiledQuantizeKernel | None = None
        self._loaded: dict[int, driver.LoadedFunction] = {}  # by device

    @property
    def compiled(self) -> CompiledQuantizeKernel:
        return self._compiled if self._compiled is not None else self.load()

    def load(self, allow_compile: bool | None = None) -> CompiledQuantizeKernel:
        """The binary from a bundle or the cache, else compiled (`build_quantize_kernel`)."""
        if self._compiled is None:
            self._compiled = build_quantize_kernel(render_cast_transpose(self.spec), self._cache, allow_compile)
        return self._compiled

    def _launch(self, x: torch.Tensor, params: bytes) -> None:
        """On x's device's current stream, as the GEMM kernels launch (`runtime.base`): the thread's
        context bound once, the module loaded once per device, the device switched only if needed."""
        index = x.device.index or 0
        if driver.current_device() == index:
            self._launch_on(index, x, params)
        else:  # one process driving several GPUs
            with torch.cuda.device(index):
                self._launch_on(index, x, params)

    def _launch_on(self, index: int, x: torch.Tensor, params: bytes) -> None:
        if not driver.THREAD.has_context:
            driver.bind_context(index)
        fn = self._loaded.get(index)
        if fn is None:
            compiled = self.compiled
            fn = self._loaded[index] = driver.load(compiled.entry, compiled.cubin, index, 0, THREADS, (1, 1, 1))
        driver.launch(fn, params, grid(x), THREADS, (1, 1, 1), 0, driver.current_stream(index))


class CastTranspose(QuantizeKernel):
    """X's two fp8 copies (`CastTransposeSpec`): per block, or per tensor from `amax`."""

    spec: CastTransposeSpec

    def __init__(self, spec: CastTransposeSpec, cache: KernelCache | None = None) -> None:
        super().__init__(spec, cache)

    def __call__(self, x: torch.Tensor, rows: bool = True, columns: bool = True,
                 scale_layout: Layout = Layout.ROW, scale_t_layout: Layout = Layout.ROW,
                 amax: torch.Tensor | None = None) -> CastTransposed:
        x = check_input(x, self.spec)
        if self.spec.per_tensor and not (isinstance(amax, torch.Tensor) and amax.dtype == torch.float32 and
                                         amax.numel() == 1 and amax.device == x.device):
            raise InvalidArgument(f"amax: expected x's max |x| as a one-element fp32 tensor on {x.device} (a "
                                  f"per-tensor {self.spec.name} scales by it), got {amax!r:.80}; pass "
                                  "TensorAmax(AmaxSpec(...))(x) or an epilogue's gg.amax")
        out = allocate(x, self.spec, rows, columns, scale_layout, scale_t_layout)
        if not (rows or columns):
            return out
        if not x.is_cuda:
            return _on_cpu(x, self.spec, out, amax)
        if x.numel() == 0:  # no tile writes the per-tensor scale
            return _on_cpu(x, self.spec, out, amax) if self.spec.per_tensor else out
        self._launch(x, pack_params(x, out, amax))
        return out


class TensorAmax(QuantizeKernel):
    """X's max |x| as a (1,) fp32 tensor (NaN where X holds one, 0 for an empty X) (`AmaxSpec`)."""

    spec: AmaxSpec

    def __init__(self, spec: AmaxSpec, cache: KernelCache | None = None) -> None:
        super().__init__(spec, cache)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = check_input(x, self.spec)
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        if x.numel() == 0:
            return amax
        if not x.is_cuda:
            return amax.copy_(x.float().abs().amax().reshape(1))
        self._launch(x, pack_params(x, amax=amax))
        return amax


def _on_cpu(x: torch.Tensor, spec: CastTransposeSpec, out: CastTransposed,
            amax: torch.Tensor | None) -> CastTransposed:
    """The torch quantizers into `out`: what the kernel computes, bit for bit."""
    if spec.per_tensor:
        assert amax is not None
        scale = fp8_scale(amax.float(), spec.target).reshape(1)
        for q, t in ((out.q, x), (out.q_t, x.t())):
            if q is not None:
                q.copy_(round_to(t.float() / scale, spec.target))
        for s in (out.scale, out.scale_t):
            if s is not None:
                s.copy_(scale)
        return out
    for q, s, t in ((out.q, out.scale, x), (out.q_t, out.scale_t, x.t())):
        if q is not None and s is not None:
            scaled, factor = quantize_blocks(t, (1, BLOCK), spec.target, spec.power_of_two)
            q.copy_(round_to(scaled, spec.target))
            s.copy_(factor)
    return out


@functools.cache
def _kernel(spec: QuantizeSpec) -> QuantizeKernel:
    return TensorAmax(spec) if isinstance(spec, AmaxSpec) else CastTranspose(spec)


_LOCK = threading.Lock()
_PENDING: set[QuantizeSpec] = set()  # compiling in the background (GEMMGEN_JIT=async)
_MISSING: set[QuantizeSpec] = set()  # in no bundle or cache under GEMMGEN_JIT=0 (said once)


def _spec_source(x: torch.Tensor) -> tuple[DType, Arch]:
    arch = driver.device_arch(x.device.index or 0)[0] if x.is_cuda else DEFAULT_ARCH
    return (DType.BF16 if x.dtype == torch.bfloat16 else DType.F16), arch


def cast_transpose(x: torch.Tensor, target: DType, power_of_two: bool = False, rows: bool = True,
                   columns: bool = True, scale_layout: Layout = Layout.ROW,
                   scale_t_layout: Layout = Layout.ROW, amax: torch.Tensor | None = None) -> CastTransposed | None:
    """`x`'s copies by the kernel for x's device's arch (built once per process and spec): per
    block, or with `amax` per tensor; or None where a kernel cannot launch without a compile that
    GEMMGEN_JIT rules out: under "0" one in no bundle or cache (a warning, once), under "async" one
    still compiling (in a background thread: seconds). The caller then quantizes with torch, which
    gives the same bits."""
    source, arch = _spec_source(x)
    kernel = _ready(CastTransposeSpec(source, target, power_of_two, arch, per_tensor=amax is not None))
    if not isinstance(kernel, CastTranspose):
        return None
    return kernel(x, rows, columns, scale_layout, scale_t_layout, amax)


def tensor_amax(x: torch.Tensor) -> torch.Tensor | None:
    """`x`'s max |x| by the amax kernel, or None as `cast_transpose` says."""
    kernel = _ready(AmaxSpec(*_spec_source(x)))
    return kernel(x) if isinstance(kernel, TensorAmax) else None


def _ready(spec: QuantizeSpec) -> QuantizeKernel | None:
    """The spec's kernel if it can launch now (loading or, where GEMMGEN_JIT allows, compiling it)."""
    kernel = _kernel(spec)
    if kernel._compiled is not None:
        return kernel
    mode = env.jit_mode()
    with _LOCK:
        if spec in _PENDING or spec in _MISSING:
            return None
    try:
        kernel.load(allow_compile=mode is env.JitMode.WAIT)
        return kernel
    except KernelNotAvailable as e:
        with _LOCK:
            if mode is env.JitMode.ASYNC:
                _PENDING.add(spec)
                threading.Thread(target=_compile_in_background, args=(kernel,), daemon=True,
                                 name=f"gemmgen-{spec.name}").start()
                return None
            _MISSING.add(spec)
        warnings.warn(f"gemmgen: {e}; until then its tensors are quantized by torch ops (the same bits, more "
                      "passes over memory)", GemmgenWarning, stacklevel=4)
        return None


def _compile_in_background(kernel: QuantizeKernel) -> None:
    try:
        kernel.load(allow_compile=True)
    except GemmgenError as e:
        warnings.warn(f"gemmgen: {kernel.spec.name} did not compile ({e}); its tensors stay quantized by torch ops",
                      GemmgenWarning, stacklevel=2)
        with _LOCK:
            _MISSING.add(kernel.spec)
    finally:
        with _LOCK:
            _PENDING.discard(kernel.spec)

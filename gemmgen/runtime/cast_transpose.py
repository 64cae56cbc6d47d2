"""Launching the cast-transpose kernel (`codegen.quantize`): X (R x C, bf16 or f16) to its fp8
rows copy (R x C, per 1 x 128 block) and its transposed copy (C x R, per 128 x 1 block of X's
columns), each with its fp32 scales in the layout the consuming GEMM reads. The allocation and the
Params bytes are plain functions (`allocate`, `pack_params`), so tests run the host build of the
same source on CPU tensors with the very bytes a GPU launch passes."""

from __future__ import annotations

import functools
import struct
import threading
import warnings
from dataclasses import dataclass

import torch

from .. import env
from ..codegen.quantize import BLOCK, PARAMS, POINTERS, THREADS, CastTransposeSpec, render_cast_transpose
from ..compile import KernelCache
from ..compile.quantize import CompiledQuantizeKernel, build_quantize_kernel
from ..config import DEFAULT_ARCH
from ..errors import GemmgenError, GemmgenWarning, InvalidArgument, KernelNotAvailable
from ..ir.ops import quantize_blocks, round_to
from ..types import DType, Layout
from . import driver

_VECTOR = 16  # bytes per access: X's rows and the copies' rows start 16-byte aligned


@dataclass(frozen=True)
class CastTransposed:
    """The copies of X: `q` (R x C fp8) with `scale` (R x ceil(C / 128)), and `q_t` (C x R fp8)
    with `scale_t` (C x ceil(R / 128)); None where not asked for. The copies are views whose row
    stride is rounded up to 16 bytes (what TMA reads); the scales' last two dimensions are in the
    layouts asked for, their contiguous extent rounded up to 4 floats (16 bytes)."""

    q: torch.Tensor | None
    scale: torch.Tensor | None
    q_t: torch.Tensor | None
    scale_t: torch.Tensor | None


def check_input(x: object, spec: CastTransposeSpec) -> torch.Tensor:
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
    return CastTransposed(
        _padded_matrix(r, c, fp8, x.device, _VECTOR) if rows else None,
        _scales(r, -(-c // BLOCK), scale_layout, x.device) if rows else None,
        _padded_matrix(c, r, fp8, x.device, _VECTOR) if columns else None,
        _scales(c, -(-r // BLOCK), scale_t_layout, x.device) if columns else None)


def pack_params(x: torch.Tensor, out: CastTransposed) -> bytes:
    """`CastTransposeParams` for `x` and `out` (`allocate`'s): 5 pointers, 9 int64, in order."""
    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    def strides(t: torch.Tensor | None) -> tuple[int, int]:
        return (0, 0) if t is None else (t.stride(0), t.stride(1))

    r, c = x.shape
    values = dict(x=ptr(x), q=ptr(out.q), scale=ptr(out.scale), q_t=ptr(out.q_t), scale_t=ptr(out.scale_t),
                  rows=r, columns=c, ld_x=x.stride(0), ld_q=strides(out.q)[0], ld_q_t=strides(out.q_t)[0])
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


@functools.cache
def _kernel(spec: CastTransposeSpec) -> CastTranspose:
    return CastTranspose(spec)


_LOCK = threading.Lock()
_PENDING: set[CastTransposeSpec] = set()  # compiling in the background (GEMMGEN_JIT=async)
_MISSING: set[CastTransposeSpec] = set()  # in no bundle or cache under GEMMGEN_JIT=0 (said once)


def cast_transpose(x: torch.Tensor, target: DType, power_of_two: bool = False, rows: bool = True,
                   columns: bool = True, scale_layout: Layout = Layout.ROW,
                   scale_t_layout: Layout = Layout.ROW) -> CastTransposed | None:
    """`x`'s copies by the kernel for x's device's arch (built once per process and spec), or None
    where the kernel cannot launch without a compile that GEMMGEN_JIT rules out: under "0" one in
    no bundle or cache (a warning, once), under "async" one still compiling (in a background
    thread: about a second). The caller then quantizes with torch, which gives the same bits."""
    arch = driver.device_arch(x.device.index or 0)[0] if x.is_cuda else DEFAULT_ARCH
    spec = CastTransposeSpec(DType.BF16 if x.dtype == torch.bfloat16 else DType.F16, target, power_of_two, arch)
    kernel = _kernel(spec)
    if kernel._compiled is None and not _ready(kernel):
        return None
    return kernel(x, rows, columns, scale_layout, scale_t_layout)


def _ready(kernel: CastTranspose) -> bool:
    spec = kernel.spec
    mode = env.jit_mode()
    with _LOCK:
        if spec in _PENDING or spec in _MISSING:
            return False
    try:
        kernel.load(allow_compile=mode is env.JitMode.WAIT)
        return True
    except KernelNotAvailable as e:
        with _LOCK:
            if mode is env.JitMode.ASYNC:
                _PENDING.add(spec)
                threading.Thread(target=_compile_in_background, args=(kernel,), daemon=True,
                                 name=f"gemmgen-{spec.name}").start()
                return False
            _MISSING.add(spec)
        warnings.warn(f"gemmgen: {e}; until then its tensors are quantized by torch ops (the same bits, more "
                      "passes over memory)", GemmgenWarning, stacklevel=4)
        return False


def _compile_in_background(kernel: CastTranspose) -> None:
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


class CastTranspose:
    """The cast-transpose kernel of `spec`, built (or read from the cache) on first use and launched
    on x's device and current stream. `x` on the CPU: the torch quantizer's bits, which the kernel
    reproduces (`gemmgen.ir.ops.quantize_blocks`)."""

    def __init__(self, spec: CastTransposeSpec, cache: KernelCache | None = None) -> None:
        self.spec, self._cache = spec, cache
        self._compiled: CompiledQuantizeKernel | None = None

    @property
    def compiled(self) -> CompiledQuantizeKernel:
        return self._compiled if self._compiled is not None else self.load()

    def load(self, allow_compile: bool | None = None) -> CompiledQuantizeKernel:
        """The binary from a bundle or the cache, else compiled (`build_quantize_kernel`)."""
        if self._compiled is None:
            self._compiled = build_quantize_kernel(render_cast_transpose(self.spec), self._cache, allow_compile)
        return self._compiled

    def __call__(self, x: torch.Tensor, rows: bool = True, columns: bool = True,
                 scale_layout: Layout = Layout.ROW, scale_t_layout: Layout = Layout.ROW) -> CastTransposed:
        x = check_input(x, self.spec)
        out = allocate(x, self.spec, rows, columns, scale_layout, scale_t_layout)
        if x.numel() == 0 or not (rows or columns):
            return out
        if not x.is_cuda:
            return _on_cpu(x, self.spec, out)
        index = x.device.index or 0
        compiled = self.compiled
        with torch.cuda.device(index):
            driver.bind_context(index)
            fn = driver.load(compiled.entry, compiled.cubin, index, 0, THREADS, (1, 1, 1))
            driver.launch(fn, pack_params(x, out), grid(x), THREADS, (1, 1, 1), 0, driver.current_stream(index))
        return out


def _on_cpu(x: torch.Tensor, spec: CastTransposeSpec, out: CastTransposed) -> CastTransposed:
    """The torch quantizer into `out`: what the kernel computes, bit for bit."""
    for q, scale, t in ((out.q, out.scale, x), (out.q_t, out.scale_t, x.t())):
        if q is not None and scale is not None:
            scaled, factor = quantize_blocks(t, (1, BLOCK), spec.target, spec.power_of_two)
            q.copy_(round_to(scaled, spec.target))
            scale.copy_(factor)
    return out

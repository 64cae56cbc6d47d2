"""The cast-transpose kernel's source: a 16-bit tensor X (R x C) quantized to fp8 per 1 x 128 block
of its rows and, stored transposed (C x R), per 128 x 1 block of its columns, in one read of X
(gemmgen/include/gemmgen/cast_transpose.hpp). A low-precision training step runs it on the tensors
no gemmgen epilogue writes: a layer's input and the gradient arriving from above, which the GEMMs
read along features (fprop, dgrad) and along tokens (wgrad). Not a GEMM: no recipe, no config;
its spec is the whole of what changes the binary."""

from __future__ import annotations

from dataclasses import dataclass

from .._version import __version__
from ..config import DEFAULT_ARCH, Arch
from ..errors import ConfigError
from ..ir import f32_bits
from ..ir.ops import FP8_MAX
from ..types import DType
from .emitter import SassRequirement

#: The blocks along rows and along columns, and the kernel's tile of X (rows and columns).
BLOCK = 128
#: Threads per CTA (`CastTranspose::kThreads`).
THREADS = 256
#: `CastTransposeParams`, in order: 6 pointers, then 9 int64 (8 bytes each, no padding).
PARAMS = ("x", "q", "scale", "q_t", "scale_t", "amax", "rows", "columns", "ld_x", "ld_q", "ld_q_t",
          "scale_row_stride", "scale_block_stride", "scale_t_row_stride", "scale_t_block_stride")
POINTERS = 6


@dataclass(frozen=True)
class CastTransposeSpec:
    """X's 16-bit type, the copies' fp8 type, whether each scale is rounded up to a power of two
    (Float8Blockwise(power_of_two_scales=True)), the arch, and whether one scale serves the whole
    tensor (`per_tensor`: Float8Tensorwise's current scaling, from an amax the kernel reads) in
    place of one per block."""

    source: DType = DType.BF16
    target: DType = DType.E4M3
    power_of_two: bool = False
    arch: Arch = DEFAULT_ARCH
    per_tensor: bool = False

    def __post_init__(self) -> None:
        _check_source(self.source)
        if self.target not in FP8_MAX:
            raise ConfigError(f"target: expected gg.e4m3 or gg.e5m2 (the copies' type), got {self.target!r}")
        for name in ("power_of_two", "per_tensor"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.power_of_two and self.per_tensor:
            raise ConfigError("power_of_two=True with per_tensor=True: a per-tensor scale is amax / the fp8 type's "
                              "largest value; leave power_of_two out")
        _check_arch(self.arch)

    @property
    def name(self) -> str:
        kind = "cast_transpose_tensor" if self.per_tensor else "cast_transpose"
        return f"{kind}_{self.source.value}_{self.target.value}" + "_pow2" * self.power_of_two

    @property
    def entry(self) -> str:
        """The kernel's symbol (arch-independent: each arch's binary is its own)."""
        return f"gemmgen_{self.name}"


@dataclass(frozen=True)
class AmaxSpec:
    """The max |x| of a 16-bit tensor (`TensorAmax`), which a per-tensor CastTransposeSpec reads."""

    source: DType = DType.BF16
    arch: Arch = DEFAULT_ARCH

    def __post_init__(self) -> None:
        _check_source(self.source)
        _check_arch(self.arch)

    @property
    def name(self) -> str:
        return f"amax_{self.source.value}"

    @property
    def entry(self) -> str:
        return f"gemmgen_{self.name}"


def _check_source(source: object) -> None:
    if source not in (DType.BF16, DType.F16):
        raise ConfigError(f"source: expected gg.bf16 or gg.f16 (X's type), got {source!r}")


def _check_arch(arch: object) -> None:
    if not isinstance(arch, Arch):
        raise ConfigError(f"arch: expected a gemmgen Arch such as Arch.SM90A, got {arch!r}")


QuantizeSpec = CastTransposeSpec | AmaxSpec


@dataclass(frozen=True)
class QuantizeKernelSource:
    """A spec's translation unit, its entry and what its SASS must show: the 16-byte loads (and
    stores) its speed rests on, the fp8 conversions (F2FP) of a cast, the atomic max of an amax."""

    spec: QuantizeSpec
    entry: str
    source: str
    required_sass: SassRequirement

    @property
    def arch(self) -> Arch:
        return self.spec.arch

    def __repr__(self) -> str:
        return f"QuantizeKernelSource({self.spec.name}, {self.arch.value})"


def render_cast_transpose(spec: QuantizeSpec) -> QuantizeKernelSource:
    """The spec's source: the header's kernel instantiated, one entry point. The same text builds on
    the host with g++ (`GG_CAST_TRANSPOSE_ENTRY`'s host branch), which tests run thread by thread."""
    if isinstance(spec, AmaxSpec):
        kernel = f"gemmgen::quantize::TensorAmax<{spec.source.cutlass}>"
        what = f"the max |x| of a {spec.source.value} X (R x C), into *amax"
        required: SassRequirement = (("LDG.E.128",), ("REDG", "ATOMG"), ("BAR",))
    else:
        qmax = FP8_MAX[spec.target]
        flags = ", ".join("true" if f else "false" for f in (spec.power_of_two, spec.per_tensor))
        kernel = (f"gemmgen::quantize::CastTranspose<{spec.source.cutlass}, {spec.target.cutlass}, "
                  f"{f32_bits(qmax):#010x}u /* {qmax:g} */, {flags}>")
        scales = "one fp32 scale, amax / its largest value" if spec.per_tensor else \
            f"per 1 x {BLOCK} block of its rows and, transposed, per {BLOCK} x 1 block of its columns; fp32 " \
            f"scales{', powers of two' * spec.power_of_two}"
        what = f"a {spec.source.value} X (R x C) to {spec.target.value}, and transposed (C x R): {scales}"
        required = (("F2FP",), ("LDG.E.128",), ("STG.E.128",), ("BAR",))
    source = f"""// Generated by gemmgen {__version__} -- do not edit.
// {spec.name}: {what}.
#include <gemmgen/nvrtc_prelude.hpp>

#include <gemmgen/cast_transpose.hpp>

using QuantizeKernel = {kernel};

GG_CAST_TRANSPOSE_ENTRY({spec.entry}, QuantizeKernel)
"""
    return QuantizeKernelSource(spec, spec.entry, source, required)

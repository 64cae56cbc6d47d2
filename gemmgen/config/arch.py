"""The GPU architectures gemmgen emits kernels for: part of every kernel's identity.

Each is an "a" target (`sm_90a`, `sm_100a`): the architecture-specific instructions (WGMMA,
tcgen05, TMA multicast, setmaxnreg) exist only there. The plain targets are refused: NVRTC
compiles CUTLASS's sm100 kernels for plain `sm_100` without an error into code that traps.
"""

from __future__ import annotations

import enum

from ..errors import ConfigError, InvalidArgument


class Arch(enum.Enum):
    """A kernel's target. The value is NVRTC's `-arch` and the cache's folder name."""

    SM90A = "sm_90a"  # Hopper: H100, H200 (compute capability 9.0)
    SM100A = "sm_100a"  # Blackwell datacenter: B200, GB200 (compute capability 10.0)

    @property
    def compute_capability(self) -> tuple[int, int]:
        return _CAPABILITY[self]

    @property
    def sm(self) -> int:
        """The SM number a cubin records in its ELF header (90, 100)."""
        major, minor = self.compute_capability
        return major * 10 + minor

    @property
    def family(self) -> str:
        """The codegen package name that emits this architecture's kernels."""
        return f"sm{self.sm}"

    @property
    def gpus(self) -> str:
        return _GPUS[self]

    @property
    def sm_count(self) -> int:
        """SMs of the arch's reference GPU (H100/H200 SXM: 132; B200: 148), what the heuristic
        assumes ahead of time, when no device says."""
        return _SM_COUNT[self]

    @classmethod
    def parse(cls, value: str | Arch, what: str = "arch") -> Arch:
        """`value` as an Arch; a ConfigError naming `what`, the accepted values and the fix otherwise."""
        if isinstance(value, Arch):
            return value
        for arch in cls:
            if value == arch.value:
                return arch
        plain = {a.value[:-1]: a for a in cls}
        if isinstance(value, str) and value in plain:
            fix = plain[value].value
            raise ConfigError(f"{what}: {value!r} is the plain target, whose binaries lack the architecture-specific "
                              f"instructions (an sm100 GEMM built for it is a kernel of traps); use {fix!r}")
        raise ConfigError(f"{what}: expected one of {', '.join(repr(a.value) for a in cls)}, got {value!r}")

    @classmethod
    def of_device(cls, capability: tuple[int, int], device: str) -> Arch:
        """The architecture whose kernels run on a device of this compute capability."""
        for arch in cls:
            if arch.compute_capability == tuple(capability):
                return arch
        major, minor = capability
        supported = "; ".join(f"{a.value} ({a.gpus}, compute capability {a.compute_capability[0]}."
                              f"{a.compute_capability[1]})" for a in cls)
        raise InvalidArgument(f"device {device} has compute capability {major}.{minor}; gemmgen builds kernels for "
                              f"{supported}. Run on one of those GPUs")


_CAPABILITY = {Arch.SM90A: (9, 0), Arch.SM100A: (10, 0)}
_GPUS = {Arch.SM90A: "H100/H200", Arch.SM100A: "B200/GB200"}
_SM_COUNT = {Arch.SM90A: 132, Arch.SM100A: 148}

#: The architecture a config targets unless it names one.
DEFAULT_ARCH = Arch.SM90A

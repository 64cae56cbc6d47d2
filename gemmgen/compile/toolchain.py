"""Where the headers, NVRTC and cuobjdump come from: the installed wheels, never machine paths."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ToolchainError

ARCH = "sm_90a"


def _package_dir(name: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(f"Python package {name!r} not found; install it with `pip install {wheel}`")
    return Path(next(iter(spec.submodule_search_locations)))


def _cuda_root() -> Path:
    """The `nvidia/cu13` folder that the nvidia-cuda-* 13.x wheels install into."""
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        root = Path(base) / "cu13"
        if (root / "include" / "cuda_runtime.h").is_file():
            return root
    raise ToolchainError("CUDA 13 headers not found; install the pinned wheels: `pip install"
                         " nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88`")


@dataclass(frozen=True)
class Toolchain:
    include_dirs: tuple[Path, ...]  # in search order
    nvrtc_version: tuple[int, int]
    cuobjdump: Path | None

    @property
    def header_digest(self) -> str:
        return _tree_digest(self.include_dirs)


def gemmgen_include_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "include"


@functools.cache
def toolchain() -> Toolchain:
    cutlass = _package_dir("cutlass_library", "nvidia-cutlass==4.2.0.0") / "source" / "include"
    if not (cutlass / "cutlass" / "cutlass.h").is_file():
        raise ToolchainError(f"CUTLASS headers not found under {cutlass}; reinstall nvidia-cutlass==4.2.0.0")
    cuda = _cuda_root()
    if not (cuda / "include" / "cccl" / "cuda" / "std" / "type_traits").is_file():
        raise ToolchainError("CCCL headers not found; `pip install nvidia-cuda-cccl==13.0.85`")
    if not (cuda / "include" / "crt" / "mma.h").is_file():
        raise ToolchainError("crt headers not found; `pip install nvidia-cuda-crt==13.0.88`")
    from .nvrtc import nvrtc_version

    cuobjdump = cuda / "bin" / "cuobjdump"
    return Toolchain(
        include_dirs=(gemmgen_include_dir(), cutlass, cuda / "include" / "cccl", cuda / "include"),
        nvrtc_version=nvrtc_version(),
        cuobjdump=cuobjdump if os.access(cuobjdump, os.X_OK) else None,
    )


@functools.cache
def _tree_digest(dirs: tuple[Path, ...]) -> str:
    """A digest of the contents (not paths, not mtimes) of every header under `dirs`.

    Hashing every header is a superset of what a kernel includes, so a changed header can
    never be missed. Computed once per process.
    """
    h = hashlib.sha256()
    for i, d in enumerate(dirs):
        for path in sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in ("", ".h", ".hpp", ".inl", ".cuh")):
            h.update(f"{i}:{path.relative_to(d).as_posix()}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()

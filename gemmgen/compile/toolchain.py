"""Where the headers, NVRTC and cuobjdump come from: the installed wheels, never machine paths."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ToolchainError
from .nvrtc import nvrtc_build, nvrtc_version

# The wheels whose headers kernels include. Other wheels install headers into the same folders
# (a CUDA build of torch adds cuBLAS, cuDNN, NVTX... to nvidia/cu13/include, the test extras nvcc's)
# and no kernel includes theirs: hashing them would make an unrelated upgrade miss the whole cache,
# and give every environment with CUDA torch keys that no other environment shares.
HEADER_WHEELS = frozenset({"gemmgen", "nvidia-cutlass", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl"})


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
    nvrtc_build: str  # what cache keys record: the full identity NVRTC stamps on its PTX
    cuobjdump: Path | None

    @property
    def cutlass_include(self) -> Path:
        return self.include_dirs[1]

    @property
    def header_digest(self) -> str:
        return _headers_digest(self.include_dirs)


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
    cuobjdump = cuda / "bin" / "cuobjdump"
    return Toolchain(
        include_dirs=(gemmgen_include_dir(), cutlass, cuda / "include" / "cccl", cuda / "include"),
        nvrtc_version=nvrtc_version(),
        nvrtc_build=nvrtc_build(),
        cuobjdump=cuobjdump if os.access(cuobjdump, os.X_OK) else None,
    )


def hashed_headers(dirs: tuple[Path, ...]) -> list[tuple[int, Path]]:
    """(root index, path) of each header under `dirs` that cache keys cover, in a stable order:
    every file with a header suffix, once (under the first root holding it), except files that a
    wheel outside HEADER_WHEELS installed. A file no wheel claims is covered."""
    foreign = _foreign_files(dirs)
    seen: set[Path] = set()
    out = []
    for i, d in enumerate(dirs):
        for path in sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in ("", ".h", ".hpp", ".inl", ".cuh")):
            if path not in seen and path not in foreign:
                seen.add(path)
                out.append((i, path))
    return out


@functools.cache
def _headers_digest(dirs: tuple[Path, ...]) -> str:
    """A digest of the contents (not paths, not mtimes) of the headers under `dirs` that a kernel
    can include. Computed once per process (about 0.15 s)."""
    h = hashlib.sha256()
    for i, path in hashed_headers(dirs):
        h.update(f"{i}:{path.relative_to(dirs[i]).as_posix()}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _foreign_files(dirs: tuple[Path, ...]) -> frozenset[Path]:
    """Files under `dirs` that the RECORD of a wheel outside HEADER_WHEELS lists and none of
    HEADER_WHEELS does (a file two wheels claim may be either's)."""
    roots = [(d, os.path.realpath(d)) for d in dirs]
    listed: dict[bool, set[Path]] = {True: set(), False: set()}  # by whether a header wheel lists it
    for dist in importlib.metadata.distributions():
        base = os.path.realpath(str(dist.locate_file("")))
        prefixes = [(d, Path(os.path.relpath(real, base)).as_posix() + "/")  # e.g. nvidia/cu13/include/
                    for d, real in roots if real.startswith(base + os.sep)]
        record = (dist.read_text("RECORD") or "") if prefixes else ""
        prefixes = [(d, prefix) for d, prefix in prefixes if prefix in record]  # parsing every RECORD costs 0.1 s
        if not prefixes:
            continue
        into = listed[_normalized(dist.metadata["Name"] or "") in HEADER_WHEELS]
        for f in dist.files or ():
            posix = f.as_posix()
            into.update(d / posix[len(prefix):] for d, prefix in prefixes if posix.startswith(prefix))
    return frozenset(listed[False] - listed[True])


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")

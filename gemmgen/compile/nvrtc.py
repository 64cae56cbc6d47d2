"""NVRTC through cuda.bindings: source -> cubin (sm_90a, sm_100a), with the compile-time phase split."""

from __future__ import annotations

import ctypes
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import env
from ..errors import CompileError, ToolchainError

BASE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-default-device", "-DNDEBUG")


def _nvrtc() -> Any:
    """cuda.bindings.nvrtc (an untyped extension module)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ToolchainError("cuda-python is not installed; `pip install cuda-bindings==13.0.3`") from e
    return nvrtc


def _check(result: Any, what: str) -> None:
    nvrtc = _nvrtc()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"{what} failed: {nvrtc.nvrtcGetErrorString(result)[1].decode()}")


def nvrtc_version() -> tuple[int, int]:
    try:
        err, major, minor = _nvrtc().nvrtcVersion()
    except RuntimeError as e:
        raise ToolchainError(f"libnvrtc could not be loaded ({e}); `pip install nvidia-cuda-nvrtc==13.0.88`") from e
    _check(err, "nvrtcVersion")
    return major, minor


def nvrtc_build() -> str:
    """NVRTC's identity as it stamps it on PTX ("Compiler Build ID: CL-36424714", "Cuda compilation
    tools, release 13.0, V13.0.88"): the patch release and build that nvrtcVersion's (major, minor)
    leaves out, so that binaries from one NVRTC patch are never served for another. Costs one
    compile of an empty kernel (about 30 ms)."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(b'extern "C" __global__ void gemmgen_identity() {}', b"identity.cu", 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"-arch=compute_90"])
        _check(err, "nvrtcCompileProgram (an empty kernel)")
        ptx = _output(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    header = []
    for line in ptx.splitlines():
        if not line.startswith("//"):
            break
        if line.strip("/ "):
            header.append(line.strip("/ "))
    if not header:
        raise ToolchainError("NVRTC's PTX carries no compiler identity header; cache keys need one")
    return "; ".join(header)


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class NvrtcResult:
    cubin: bytes
    ptx: str
    log: str
    wall_seconds: float
    phases: dict[str, float] = field(default_factory=dict)  # front_end / nvvm / ptx (seconds)
    peak_bytes: int | None = None  # the process's peak resident memory during the compile (`_PeakMemory`)


class _PeakMemory:
    """The peak resident memory of this process over a span, from Linux's high-water mark
    (`VmHWM`), which writing 5 to /proc/self/clear_refs resets (Linux 4.0+). NVRTC compiles in
    the calling thread, so the span's peak is the compile's, plus what the process already held
    and any other thread's allocations; elsewhere (no procfs, or the reset refused) it is None,
    not the process's lifetime peak. The heap's free memory is handed back first (glibc's
    malloc_trim): a worker that compiled before would otherwise count what an earlier compile
    freed but the allocator kept."""

    def __init__(self) -> None:
        _trim_heap()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.ok = True
        except OSError:
            self.ok = False

    def peak(self) -> int | None:
        if not self.ok:
            return None
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return None
        kb = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return int(kb) * 1024 if kb is not None else None


def compile_cubin(source: str, name: str, arch: str, include_dirs: tuple[Path, ...],
                  extra_options: tuple[str, ...] = (), source_path: Path | None = None,
                  headers: tuple[tuple[str, str], ...] = ()) -> NvrtcResult:
    """Compile one translation unit; raise CompileError with the log on failure. `headers` are
    (include name, text) pairs NVRTC finds before the include folders."""
    nvrtc = _nvrtc()
    with tempfile.TemporaryDirectory(prefix="gemmgen-nvrtc-") as tmp:
        timing = Path(tmp) / "time.csv"
        options = [f"-arch={arch}", *BASE_OPTIONS, *extra_options, f"--time={timing}"]
        options += [f"-I{d}" for d in include_dirs]
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), len(headers),
                                             [text.encode() for _, text in headers],
                                             [include.encode() for include, _ in headers])
        _check(err, "nvrtcCreateProgram")
        try:
            memory = _PeakMemory()
            start = time.perf_counter()
            (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
            wall = time.perf_counter() - start
            peak = memory.peak()
            log = _log(nvrtc, prog)
            if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CompileError(_format_failure(name, log, source_path))
            cubin = _output(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
            ptx = _output(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
            phases = parse_time_report(timing.read_text()) if timing.is_file() else {}
            return NvrtcResult(cubin, ptx.rstrip(b"\0").decode(), log, wall, phases, peak)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


def _output(prog: Any, get_size: Any, get: Any) -> bytes:
    """A compiled program's CUBIN or PTX, through its size and copy functions."""
    err, size = get_size(prog)
    _check(err, get_size.__name__)
    buf = b" " * size
    (err,) = get(prog, buf)
    _check(err, get.__name__)
    return buf


def _log(nvrtc: Any, prog: Any) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0").decode(errors="replace")


def _format_failure(name: str, log: str, source_path: Path | None) -> str:
    lines = log.splitlines()
    errors = [i for i, line in enumerate(lines) if " error" in line or line.startswith("error")]
    keep: list[str] = []
    for i in errors[:8]:
        keep.extend(lines[i:i + 3])
    shown = "\n".join(keep or lines[:40])
    where = f"\ngenerated source: {source_path}" if source_path else ""
    return f"NVRTC failed to compile kernel {name!r} ({len(errors)} error(s)):\n{shown}{where}"


def parse_time_report(text: str) -> dict[str, float]:
    """NVRTC `--time` CSV (file, phase, value, unit) -> seconds for front_end / nvvm / ptx."""
    out = {"front_end": 0.0, "nvvm": 0.0, "ptx": 0.0}
    for line in text.splitlines()[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 4:
            continue
        phase, value, unit = cells[1].lower(), cells[2], cells[3].lower()
        try:
            seconds = float(value) / (1000.0 if unit == "ms" else 1.0)
        except ValueError:
            continue
        key = "front_end" if "frontend" in phase else "ptx" if "ptx" in phase else "nvvm"
        out[key] += seconds
    return out


def write_debug_source(source: str, name: str) -> Path:
    """Where a failing kernel's source is kept for the user to read."""
    d = env.debug_dir() / "gemmgen-failed"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.cu"
    path.write_text(source)
    return path

"""A stand-in libcuda.so.1, so that gemmgen's driver layer runs end to end on a CPU (tests only).

    path = build(folder)          # compiles stub_libcuda.c with the C compiler against the wheel's cuda.h
    stub = StubDriver(path)       # loads it; from now on cuda.bindings and ctypes calls reach it

Without a driver, cuda.bindings fails at dlopen, so CPU tests could check gemmgen's driver calls
only up to the bindings' type checks. With the stub, every call goes through the bindings (or
ctypes) into C: what arrives there is what the real driver would receive. The stub checks what
cuda.h documents about each call itself (a 64-byte aligned tensor map, a cubin image that defines
the entry, dynamic shared memory within the function's limit, a context current on the calling
thread where the call acts on one), reads each entry's parameters from its cubin and copies them
at launch as the driver does, records what it received (launches per thread, so threads can each
check their own), and fills each tensor map with its encode's arguments, so `StubDriver.of` reads
a Params block's maps back as `EncodeArgs` (the interface `gemmgen.testing.emulate` uses).

A process loads the stub once and keeps it (cuda.bindings binds the driver on first use), so tests
use it in a child process. `stand_in_device` then lets CPU tensors stand for a GPU's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

from ..compile.toolchain import toolchain
from ..errors import GemmgenError
from ..runtime import driver
from ..runtime.tma import EncodeArgs

SOURCE = Path(__file__).with_name("stub_libcuda.c")
_MAP = struct.Struct("<I6B5BxQ5Q4Q5II")  # struct StubMap
_MAP_MAGIC = 0x4D544747
_MAX_PARAMS = 4096
#: Where the stub's cuModuleGetGlobal places a module's __device__ variables (plus each symbol's value).
GLOBAL_BASE = 0x7E00_0000_0000


def build(folder: Path) -> Path:
    """Compile the stub into `folder/libcuda.so.1` (about 0.2 s) and return its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise GemmgenError("the stub driver needs a C compiler: install gcc, or set CC")
    out = Path(folder) / "libcuda.so.1"
    cmd = [cc, "-O1", "-Wall", "-shared", "-fPIC", "-I", str(toolchain().include_dirs[-1]), str(SOURCE),
           "-o", str(out), "-Wl,-soname,libcuda.so.1", "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise GemmgenError(f"building the stub driver failed: {' '.join(cmd)}\n{done.stderr}")
    return out


class _Launch(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("cluster", ctypes.c_uint32 * 3),
                ("smem", ctypes.c_uint32), ("num_attrs", ctypes.c_uint32), ("params_size", ctypes.c_uint32),
                ("device", ctypes.c_int32), ("param_count", ctypes.c_int32), ("stream", ctypes.c_uint64),
                ("function", ctypes.c_uint64),
                ("params", ctypes.c_uint8 * _MAX_PARAMS)]


class Launch(NamedTuple):
    """What cuLaunchKernelEx (or the occupancy query) received. `params` holds the bytes of the
    kernel's first parameter, as many as its cubin declares (what the driver copies), and
    `param_count` how many parameters the cubin declares; `device` is that of the context current
    on the launching thread (-1 for none, and for an occupancy query)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]
    smem: int
    stream: int
    function: int
    num_attrs: int
    params: bytes
    device: int
    param_count: int


def decode_map(desc: bytes) -> EncodeArgs | None:
    """The encode arguments a stub-filled tensor map holds; None if it is not one."""
    if len(desc) < _MAP.size:
        return None
    magic, dtype, rank, interleave, swizzle, l2, oob, *rest = _MAP.unpack_from(desc)
    if magic != _MAP_MAGIC or not 1 <= rank <= 5:
        return None
    elem, addr, dims, strides, box = rest[0:5], rest[5], rest[6:11], rest[11:15], rest[15:20]
    return EncodeArgs(dtype, rank, addr, tuple(dims[:rank]), tuple(strides[:rank - 1]), tuple(box[:rank]),
                      tuple(elem[:rank]), interleave, swizzle, l2, oob)


class StubDriver:
    """The loaded stub: its controls and records."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)

    def _int(self, name: str, kind: Any = ctypes.c_int) -> Any:
        return kind.in_dll(self.lib, name)

    def of(self, desc: bytes) -> EncodeArgs | None:
        """What gemmgen.testing.emulate asks of an encoder: the arguments behind a map."""
        return decode_map(desc)

    def fail_next(self, code: int) -> None:
        """Make the next driver call return `code` (a CUresult)."""
        self._int("stub_fail_next").value = int(code)

    def answer_occupancy(self, clusters: int) -> None:
        """What cuOccupancyMaxActiveClusters answers from now on; a negative value makes it fail."""
        self._int("stub_max_active_clusters").value = clusters

    @property
    def encodes(self) -> int:
        return self._int("stub_encodes", ctypes.c_uint32).value

    @property
    def launches(self) -> int:
        return self._int("stub_launches", ctypes.c_uint32).value

    @property
    def primary_retains(self) -> int:
        return self._int("stub_primary_retains", ctypes.c_uint32).value

    def current_device(self) -> int:
        """The device of the calling thread's current context; -1 if it has none."""
        return self.lib.stub_current_device()

    @property
    def capture_mode(self) -> int:
        """The calling thread's stream capture mode."""
        return self.lib.stub_capture_mode()

    @property
    def capture_mode_at_load(self) -> int:
        return self._int("stub_capture_mode_at_load").value

    @property
    def capture_mode_at_retain(self) -> int:
        return self._int("stub_capture_mode_at_retain").value

    @property
    def smem_attribute(self) -> int:
        return self._int("stub_last_smem_attribute").value

    @property
    def entry(self) -> str:
        return ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(self.lib, "stub_last_entry"))).decode()

    @property
    def last_launch(self) -> Launch:
        """The calling thread's last launch."""
        raw = _Launch()
        self.lib.stub_read_last_launch(ctypes.byref(raw))
        return _as_launch(raw)

    @property
    def last_occupancy_query(self) -> Launch:
        return _as_launch(_Launch.in_dll(self.lib, "stub_last_occupancy"))


def _as_launch(raw: _Launch) -> Launch:
    return Launch(tuple(raw.grid), tuple(raw.block), tuple(raw.cluster), raw.smem, raw.stream, raw.function,
                  raw.num_attrs, bytes(raw.params[:raw.params_size]), raw.device, raw.param_count)


def stand_in_device(stream: int, sm_count: int = 132, capability: tuple[int, int] = (9, 0)) -> None:
    """Make CPU tensors (device -1) stand for a GPU's of this compute capability (an sm_90 one
    unless said), for the rest of the process (or until called again): torch's device and stream
    lookups, which a CPU build of torch lacks, are replaced, and launches go to the raw stream
    handle `stream`."""
    import torch

    torch.cuda.device = lambda index: contextlib.nullcontext()  # type: ignore[misc, assignment, return-value]
    torch.cuda.current_stream = lambda *args: None  # type: ignore[assignment]
    driver.device_facts = lambda index: (sm_count, capability)  # type: ignore[assignment]
    driver.current_device = lambda: -1
    driver.current_stream = lambda device_index: stream

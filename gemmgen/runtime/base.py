"""What every compiled kernel shares on the host, dense or grouped.

A kernel is called on torch tensors: `kernel(a, b, *operands, out=None)` (grouped: `a, b, offsets,
*operands`), the operands positionally in declaration order or all by name. The call checks its
arguments once per call signature (every tensor's address, shape, strides, dtype and device, and
every scalar), keeps what the checks produce as a *plan*, and launches on torch's current stream
of the tensors' device. Each subclass supplies its planning (`_prepare`) and its launch
(`_launch`); this base holds the rest: operand naming, the plan cache and its refusals, module
loading per device, the device and context a launch needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..codegen.fields import D_SINK_SYMBOL, sinks_d
from ..errors import InvalidArgument, LayoutMismatch
from ..types import Layout, OperandKind
from . import driver, nvtx
from .arguments import ParamsWriter, TensorMapEncoder
from .checks import TMA_ALIGN
from .tma import EncodeArgs

if TYPE_CHECKING:
    from ..compile import CompiledKernel

_MAX_ENTRIES = 256  # per cache: plans and layouts per kernel, output maps and checks per layout
MISSING = object()  # an operand not passed: the checks name it
Plan = TypeVar("Plan")
#: (sm count, max active clusters) of a device index: the driver's, or a stand-in's in CPU tests.
Hardware = Callable[[int], tuple[int, int]]
#: The D sink's address (`codegen.fields.sinks_d`) where a stand-in encoder replaces the driver (CPU tests).
STAND_IN_D_SINK = 0x5151_0000


class KernelBase:
    """A compiled recipe callable on torch tensors (see the module docstring)."""

    def __init__(self, compiled: CompiledKernel, *, encoder: TensorMapEncoder | None = None,
                 hardware: Hardware | None = None, require_cuda: bool = True) -> None:
        """`encoder`, `hardware` and `require_cuda=False` replace the driver for CPU tests and benchmarks."""
        self.compiled = compiled
        self.recipe = compiled.recipe
        self._ir = compiled.recipe
        self._config = compiled.config
        self._names = tuple(o.name for o in self._ir.operands)
        # where the seeds are among them: a Python int seed is keyed as an address (`seed_signature`)
        self._seeds = frozenset(i for i, o in enumerate(self._ir.operands) if o.kind is OperandKind.SEED)
        self._writer = ParamsWriter(compiled.params_layout)
        self._on_driver = encoder is None  # the driver encodes, so the thread needs a context
        self._encode = encoder or MemoEncoder(driver.encode_tensor_map)
        self._hardware = hardware or self._device_hardware
        self._require_cuda = require_cuda
        self._plans: dict[tuple, Any] = {}  # by every argument's signature, addresses included
        self._refused: dict[tuple, LayoutMismatch] = {}  # signatures the checks refused for a layout
        self._loaded: dict[int, driver.LoadedFunction] = {}  # per device index
        self._sinks_d = sinks_d(self._ir, self._config.arch)
        self._d_sinks: dict[int, int] = {}  # the module's D sink per device index, where it has one

    def __repr__(self) -> str:
        return f"<gemmgen.{type(self).__name__} {self.compiled.entry} ({self._config.name})>"

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *args: Any, out: Any = None, **operands: Any) -> Any:
        """D, or (D, aux...) when the recipe has aux outputs."""
        outputs, launch, index = self._prepare(a, b, args, out, operands)
        if launch is not None:
            if nvtx.enabled is not False and nvtx.active():  # GEMMGEN_NVTX, off by default: one global read
                with nvtx.named_launch(lambda: self._launch_record(a, b, args)):
                    self._launch_on(index, launch)
            else:
                self._launch_on(index, launch)
        return outputs[0] if len(outputs) == 1 else outputs

    def _launch_on(self, index: int, launch: tuple) -> None:
        if driver.current_device() == index:
            self._launch(index, launch)
        else:  # tensors on another GPU than the current one (one process driving several GPUs)
            with torch.cuda.device(index):
                self._launch(index, launch)

    def _launch_record(self, a: torch.Tensor, b: torch.Tensor, args: tuple) -> nvtx.LaunchRecord:
        """The launch as `runtime.nvtx` names and logs it: recipe, config, M x N x K (x L: batch or
        groups; a K-grouped call's groups are its offsets)."""
        gemm = self._ir.gemm
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        extra = (b.shape[0],) if b.dim() == 3 else (args[0].numel(),) if gemm.k_grouped else ()
        return nvtx.LaunchRecord(self.compiled.entry, self._ir.name, self._config.binary().name,
                                 json.dumps(self._config.canonical()), (m, n, k, *extra), self._config.arch.value,
                                 gemm.a.bits, gemm.d.bits, gemm.grouped, gemm.k_grouped, os.getpid())

    # ---- what each kind of kernel supplies

    def _prepare(self, a: Any, b: Any, args: tuple, out: Any, operands: dict
                 ) -> tuple[tuple[torch.Tensor, ...], tuple | None, int]:
        """(outputs, what `_launch` takes, or None when nothing is launched, device index): the call
        path's hot loop, everything but the driver calls."""
        raise NotImplementedError

    def _launch(self, device_index: int, launch: tuple) -> None:
        """On the current stream of the tensors' device, which is the current device (the module was
        loaded into its context)."""
        raise NotImplementedError

    # ---- shared by both

    def _operand_values(self, args: tuple, operands: dict) -> tuple | None:
        """The operands in declaration order, however they were passed; None when their number is
        off by name (the checks then say which is missing or unknown)."""
        names = self._names
        if args:
            if operands or len(args) != len(names):
                raise InvalidArgument(f"operands: pass all {len(names)} of {list(names)} positionally in this order, "
                                      f"or all by name; got {len(args)} positional and {sorted(operands)} by name")
            return args
        if len(operands) == len(names):
            return tuple(operands.get(name, MISSING) for name in names)
        return None

    def _named(self, args: tuple, operands: dict) -> dict[str, Any]:
        """The operands by name, however they were passed (built off the hot path only)."""
        return dict(zip(self._names, args, strict=True)) if args else operands

    def _remember(self, key: tuple | None, make: Callable[[], Plan]) -> Plan:
        """The plan `make` builds for a call signature, kept; a signature the checks refused for a
        layout is refused again at once (the torch op copies the tensor and calls again)."""
        if key is None:
            return make()
        refused = self._refused.get(key)
        if refused is not None:
            raise LayoutMismatch(refused.argument, str(refused))
        try:
            plan = make()
        except LayoutMismatch as e:
            put_bounded(self._refused, key, e)
            raise
        put_bounded(self._plans, key, plan)
        return plan

    def _device_index(self, device: torch.device) -> int:
        """The CUDA device index of a checked call, checked to be a GPU of the kernel's arch; -1 for a
        CPU stand-in."""
        index = (device.index or 0) if device.type == "cuda" else -1
        if self._require_cuda:
            self._check_arch(index)
        return index

    def _check_arch(self, device_index: int) -> int:
        """The device's SM count, once it is known to run this kernel's arch."""
        arch, sm_count = driver.device_arch(device_index)
        built = self._config.arch
        if arch is not built:
            raise InvalidArgument(f"kernel {self.compiled.entry} is built for {built.value} ({built.gpus}); device "
                                  f"cuda:{device_index} is {arch.value} ({arch.gpus}). Build it for the device: "
                                  f"KernelConfig(arch=Arch.{arch.name}, ...), or call through the torch op, which "
                                  "chooses the device's arch")
        return sm_count

    def _bind_context(self, a: Any) -> None:
        """A thread's first call: make a context current before any driver call (`driver.bind_context`),
        the primary context of the device the call's tensors are on."""
        if isinstance(a, torch.Tensor) and (a.is_cuda or not self._require_cuda):  # else the checks refuse it
            index = (a.device.index or 0) if a.is_cuda else 0  # a CPU tensor stands in for device 0's
            with torch.cuda.device(index):
                driver.bind_context(index)

    def _device_hardware(self, device_index: int) -> tuple[int, int]:
        return self._check_arch(device_index), self._function(device_index).max_active_clusters

    def _d_sink(self, device_index: int) -> int:
        """Where the kernel's collective stores D when registers write it (`codegen.fields.sinks_d`):
        its module's sink on the device, asked of the driver once; 0 for a kernel without one."""
        if not self._sinks_d:
            return 0
        address = self._d_sinks.get(device_index)
        if address is None:
            if self._on_driver:
                address = driver.global_address(self._function(device_index), D_SINK_SYMBOL)
            else:  # a stand-in encoder's map: no module is loaded
                address = STAND_IN_D_SINK
            self._d_sinks[device_index] = address
        return address

    def _function(self, device_index: int) -> driver.LoadedFunction:
        """The kernel's module, loaded once per device."""
        fn = self._loaded.get(device_index)
        if fn is None:
            info = self.compiled.info
            fn = self._loaded[device_index] = driver.load(self.compiled.entry, self.compiled.cubin, device_index,
                                                          info.smem_bytes, info.max_threads, self._config.cluster)
        return fn


class MemoEncoder:
    """An encoder memoized by its arguments, which determine the map: when activations move, a
    weight's map is not encoded again (a driver call of a few microseconds per map)."""

    def __init__(self, encode: TensorMapEncoder) -> None:
        self._encode = encode
        self._maps: dict[EncodeArgs, bytes] = {}

    def __call__(self, args: EncodeArgs) -> bytes:
        desc = self._maps.get(args)
        if desc is None:
            desc = self._encode(args)
            put_bounded(self._maps, args, desc, 4 * _MAX_ENTRIES)
        return desc


def put_bounded(cache: dict, key: Any, value: Any, limit: int = _MAX_ENTRIES) -> None:
    """Insert into a cache of at most `limit` entries, dropping the oldest entry when full. Threads
    may share a kernel: if another one changes the cache while the oldest entry is looked up, the
    eviction is skipped (the bound is approximate), never the insert."""
    if len(cache) >= limit:
        try:
            del cache[next(iter(cache))]
        except (RuntimeError, KeyError, StopIteration):
            pass
    cache[key] = value


def seed_signature(t: Any) -> tuple[int, tuple]:
    """A seed's: a Python int is, like a tensor's address, what a cached plan is rebound to (a
    training step's new seed re-encodes nothing)."""
    if isinstance(t, int) and not isinstance(t, bool):
        return t, (int,)
    return argument_signature(t)


def argument_signature(t: Any) -> tuple[int, tuple]:
    """(address, everything else the checks read) of one argument; a scalar has no address."""
    if isinstance(t, torch.Tensor):
        return t.data_ptr(), (t.shape, t.stride(), t.dtype, t.device)
    if isinstance(t, float | int) and not isinstance(t, bool):
        return 0, (type(t), t)
    raise TypeError  # not cacheable: let the checks report it


def padded_strides(shape: tuple[int, ...], dtype: torch.dtype, layout: Layout = Layout.ROW) -> tuple[int, ...]:
    """Row-major strides, rows padded to 16 bytes when N is not a multiple (TMA needs it, N = 1
    included: a 2-byte row stride is as unreadable to TMA as any other); column-major ones, columns
    padded to 16 bytes, for `Layout.COL`."""
    rows, cols = shape[-2], shape[-1]
    per = TMA_ALIGN // ITEMSIZE[dtype]
    if layout is Layout.ROW:
        ld = -(-cols // per) * per
        return (ld, 1) if len(shape) == 2 else (rows * ld, ld, 1)
    ld = -(-rows // per) * per
    return (1, ld) if len(shape) == 2 else (cols * ld, 1, ld)


def allocate_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                    layout: Layout = Layout.ROW) -> torch.Tensor:
    """An output tensor gemmgen can write in `layout` (D's), its leading dimension padded to 16
    bytes if needed."""
    return torch.empty_strided(shape, padded_strides(shape, dtype, layout), dtype=dtype, device=device)


ITEMSIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float8_e4m3fn: 1, torch.float8_e5m2: 1}

"""`recipe.compile()`: a compiled kernel callable on torch tensors.

    kernel = recipe.compile()
    d = kernel(a, b, bias=bias)            # or (d, aux...) when the recipe has aux outputs

A call checks its arguments (raising gemmgen.InvalidArgument before any launch), allocates the
outputs, builds the Params block in Python and launches on torch's current stream: no host
synchronisation and nothing allocated besides the outputs (and the workspace of row and column
reductions and of stream-K kernels), all from torch's caching allocator, so it can be captured in a
CUDA graph.

The host path is cached at two levels. Per call signature (every tensor's address, shape,
strides, dtype and device, and every scalar) a repeated call reuses the checked problem, the input
tensor maps and the scheduler's values, and only the output tensor maps are looked up (by address
and strides). A call that differs from an earlier one only in addresses (new activations of the
same shape) redoes only the address checks and the input tensor maps, and maps are memoized by
their encode arguments, so only a map of an address not seen before costs a driver call. Each key
holds everything the values cached under it derive from, so a hit cannot serve stale arguments.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import InvalidArgument, NotDeterministic
from ..ir import Output, Reduction
from ..ir.reference import evaluate_epilogue
from ..types import Layout
from . import driver
from .arguments import ArgumentBuilder, TensorMapEncoder
from .base import Hardware, KernelBase, argument_signature, padded_strides, put_bounded, seed_signature
from .checks import CheckedCall, Span, check_call, input_spans, problem_size_check, rebind
from .grouped import GroupedKernel
from .output_checks import (
    block_factors_layout,
    check_block_factors_output,
    check_no_alias,
    check_output,
    check_outputs_disjoint,
    check_reduction_output,
    output_span,
)
from .problem import Problem, TensorArg

if TYPE_CHECKING:
    from ..compile import CompiledKernel

OutputArg = tuple[int, tuple[int, int, int]]  # an output's (address, strides): a TensorArg's fields, or one


@dataclass
class _Plan:
    """The input side of a call: everything that does not depend on the output tensors."""

    shape: tuple[int, ...]
    device: torch.device
    device_index: int
    call: CheckedCall
    base: bytearray | None  # Params with every field but the output tensor maps; None: nothing to launch
    grid: tuple[int, int, int]
    problem: Problem | None
    fresh: tuple = ()  # what _fresh_outputs gives for this shape
    zero_k: bool = False  # K = 0 with a non-empty output: computed as the epilogue of zero
    # Shared by the plans of one layout (signature without addresses), as they depend on nothing else:
    # (output, addr, strides) -> its fields' (offset, bytes): a tensor map, or a pointer and strides
    out_maps: dict[tuple, tuple[tuple[int, bytes], ...]] = field(default_factory=dict)
    out_checked: dict[tuple, tuple] = field(default_factory=dict)  # (output, signature) -> (TensorArg, span)
    input_spans: tuple[Span, ...] | None = None  # per plan, computed when an output is first given
    last: tuple[tuple[OutputArg, ...], int, bytes] | None = None  # the last call's outputs, workspace, Params
    workspace: int = 0  # bytes of workspace a launch needs (vector reductions, stream-K partial sums)
    workspace_zeroed: tuple[tuple[int, int], ...] = ()  # byte ranges of it that must be 0 (counters, barriers)
    workspace_slots: tuple[tuple[int, int], ...] = ()  # (Params offset, offset into the workspace) per pointer


#: An output gemmgen allocates: (shape, template, torch strides, (M, N, L) mode strides, reduced),
#: the template an empty tensor of its dtype on the call's device (`new_empty_strided` of it costs
#: less than `torch.empty_strided`), `reduced` one of: an M x N output; a reduction the launch writes
#: whole (per row or column); a reduction that starts from its identity (`Reduction.identity`: an
#: atomic max over M and N, or nothing to reduce); the factors of D's row blocks, written whole.
MATRIX, REDUCED, REDUCED_FROM_IDENTITY, BLOCK_FACTORS = 0, 1, 2, 3
_FreshOutput = tuple[tuple[int, ...], torch.Tensor, tuple[int, ...], tuple[int, int, int], int]


class PreparedCall(NamedTuple):
    """Everything a launch needs; `params is None` when there is nothing to launch (empty problem).
    `workspace` is the memory the Params point into (vector reductions, stream-K), kept alive until
    the launch is enqueued."""

    outputs: tuple[torch.Tensor, ...]
    params: bytes | None
    grid: tuple[int, int, int]
    device_index: int
    workspace: torch.Tensor | None = None


class Kernel(KernelBase):
    """A compiled dense (or batched) recipe, callable on torch tensors: `kernel(a, b, *operands)`."""

    def __init__(self, compiled: CompiledKernel, *, encoder: TensorMapEncoder | None = None,
                 hardware: Hardware | None = None, require_cuda: bool = True) -> None:
        super().__init__(compiled, encoder=encoder, hardware=hardware, require_cuda=require_cuda)
        self._block = compiled.info.max_threads
        self._smem = compiled.info.smem_bytes
        self._identities = tuple(o.reduce.identity if o.reduce is not None else 0.0 for o in self._ir.epilogue.outputs)
        self._builder = ArgumentBuilder(compiled.generated.kernel_recipe, self._config)
        self._swap = self._config.swap_ab  # the kernel computes D^T = B^T A^T on the same memory
        source = self._ir.epilogue.source  # D may be written over C, the very same tensor: beta = 1 in place
        self._in_place = source if source and self._ir.epilogue.operand(source).dtype is self._ir.gemm.d else ""
        self._size_check = problem_size_check(self._config.tile, self._config.cluster, self._swap)
        self._nondeterministic = not self._config.deterministic
        self._layouts: dict[tuple, _Plan] = {}  # the latest plan per signature without addresses

    def _launch(self, index: int, launch: tuple) -> None:
        """(Params, grid, workspace): the workspace is the memory the Params point into, kept alive
        until the launch is enqueued."""
        params, grid, _workspace = launch
        driver.launch(self._function(index), params, grid, self._block, self._config.cluster, self._smem,
                      driver.current_stream(index))

    # ---- the host path

    def prepare(self, a: torch.Tensor, b: torch.Tensor, *args: Any, out: Any = None, **operands: Any) -> PreparedCall:
        """Check, allocate and build the launch (everything but the driver call)."""
        outputs, launch, index = self._prepare(a, b, args, out, operands)
        if launch is None:
            return PreparedCall(outputs, None, (0, 0, 0), index, None)
        return PreparedCall(outputs, launch[0], launch[1], index, launch[2])

    def _prepare(self, a: Any, b: Any, args: tuple, out: Any, operands: dict
                 ) -> tuple[tuple[torch.Tensor, ...], tuple | None, int]:
        if self._nondeterministic and torch.are_deterministic_algorithms_enabled():
            self._alert_nondeterministic()
        if self._on_driver and not driver.THREAD.has_context:
            self._bind_context(a)
        values = self._operand_values(args, operands)
        try:
            if values is None:
                key = None
            elif self._seeds:
                seeds = self._seeds
                key = (argument_signature(a), argument_signature(b),
                       *(seed_signature(v) if i in seeds else argument_signature(v) for i, v in enumerate(values)))
            else:
                key = (argument_signature(a), argument_signature(b), *map(argument_signature, values))
        except (TypeError, RuntimeError):  # not a number or a strided tensor: the checks say what
            key = None
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            plan = self._new_plan(key, a, b, self._named(args, operands))
        outputs, targs = self._outputs(plan, out)
        if plan.base is None:
            if plan.zero_k:
                self._epilogue_of_zero(outputs, plan.shape, self._named(args, operands), plan.device)
            return outputs, None, plan.device_index
        if not plan.workspace:
            return outputs, (self._params(plan, targs, 0), plan.grid, None), plan.device_index
        # from torch's caching allocator, on the current stream; its counters and barriers must start at 0
        if plan.workspace_zeroed == ((0, plan.workspace),):  # vector reductions only: one fill, no views
            workspace = torch.zeros(plan.workspace, dtype=torch.uint8, device=plan.device)
        else:
            workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=plan.device)
            for start, end in plan.workspace_zeroed:
                workspace[start:end].zero_()
        return outputs, (self._params(plan, targs, workspace.data_ptr()), plan.grid, workspace), plan.device_index

    def _alert_nondeterministic(self) -> None:
        """As torch's nondeterministic ops do under torch.use_deterministic_algorithms(True): raise,
        or warn with warn_only=True."""
        message = (f"{self!r} adds split tiles' partial sums in no fixed order (deterministic=False), so its "
                   "output can change from run to run, and torch.use_deterministic_algorithms(True) is set; "
                   "use a config with deterministic=True (the default), or turn deterministic algorithms off")
        if torch.is_deterministic_algorithms_warn_only_enabled():
            warnings.warn(message, stacklevel=4)
        else:
            raise NotDeterministic(message)

    def _params(self, plan: _Plan, targs: tuple[OutputArg, ...], workspace: int) -> bytes:
        """The plan's Params with the output tensor maps for `targs` and the workspace pointers
        patched in; the last block built is reused when the outputs and the workspace are where they
        were (CUDA's caching allocator often hands the same block back to a fresh tensor)."""
        last = plan.last
        if last is not None and last[0] == targs and last[1] == workspace:
            return last[2]
        buf = bytearray(plan.base)  # type: ignore[arg-type]
        for at, offset in plan.workspace_slots:
            _POINTER.pack_into(buf, at, workspace + offset)
        for i, (ptr, strides) in enumerate(targs):
            mkey = (i, ptr, strides)
            hit = plan.out_maps.get(mkey)
            if hit is None:
                t = TensorArg(ptr, strides)
                fields = self._builder.output_map(i, plan.problem, t.transposed() if self._swap else t,  # type: ignore[arg-type]
                                                  self._encode)
                hit = tuple((self._writer.slots[field][0], value) for field, value in fields)
                put_bounded(plan.out_maps, mkey, hit)
            for at, value in hit:
                buf[at:at + len(value)] = value
        params = bytes(buf)
        plan.last = (targs, workspace, params)
        return params

    def _new_plan(self, key: tuple | None, a: Any, b: Any, operands: dict) -> _Plan:
        """The plan for a call signature not seen (or no longer cached): rebound from a plan of the
        same layout (the signature without addresses) if there is one, else built from scratch."""
        if key is None:
            return self._plan(a, b, operands)
        layout = tuple(sig[1] for sig in key)
        same = self._layouts.get(layout)
        plan = self._remember(key, lambda: self._rebind(same, a, b, operands) if same is not None and
                              same.base is not None else self._plan(a, b, operands))
        put_bounded(self._layouts, layout, plan)
        return plan

    def _plan(self, a: Any, b: Any, operands: dict) -> _Plan:
        """Check every argument and build the input side of the Params from scratch."""
        ir = self._ir
        call = check_call(ir, a, b, operands, require_cuda=self._require_cuda, size_check=self._size_check)
        device_index = self._device_index(call.device)
        shape = (call.l, call.m, call.n) if ir.gemm.batched else (call.m, call.n)
        fresh = self._fresh_outputs(shape, call.l, call.device)
        if 0 in (call.m, call.n, call.l, call.k):
            zero_k = call.k == 0 and 0 not in (call.m, call.n, call.l)
            return _Plan(shape, call.device, device_index, call, None, (0, 0, 0), None, fresh, zero_k)
        problem = self._problem(call, device_index, *self._hardware(device_index))
        values, grid = self._builder.values(problem, self._encode, outputs=False)
        workspace = self._builder.workspace(problem)
        return _Plan(shape, call.device, device_index, call, self._writer.write(values), grid, problem, fresh,
                     workspace=workspace.size, workspace_zeroed=workspace.zeroed,
                     workspace_slots=tuple((self._writer.slots[f][0], o) for f, o in workspace.pointers))

    def _rebind(self, same: _Plan, a: Any, b: Any, operands: dict) -> _Plan:
        """The plan of a call whose arguments differ from `same`'s only in their addresses: the
        address checks and the input tensor maps are redone; everything else is `same`'s."""
        call = rebind(same.call, a, b, operands)
        problem = self._problem(call, same.device_index, same.problem.sm_count,  # type: ignore[union-attr]
                                same.problem.max_active_clusters)  # type: ignore[union-attr]
        base = self._writer.write(self._builder.input_values(problem, self._encode), into=bytearray(same.base))  # type: ignore[arg-type]
        return _Plan(same.shape, same.device, same.device_index, call, base, same.grid, problem, same.fresh,
                     out_maps=same.out_maps, out_checked=same.out_checked, workspace=same.workspace,
                     workspace_zeroed=same.workspace_zeroed, workspace_slots=same.workspace_slots)

    def _problem(self, call: CheckedCall, device_index: int, sm_count: int, clusters: int) -> Problem:
        """The checked call in the kernel's terms (transposed for a swapped kernel); the outputs'
        addresses are placeholders, written per call."""
        placeholder = TensorArg(0)
        problem = Problem(call.m, call.n, call.k, call.l, call.a, call.b, placeholder, call.operands,
                          {o.name: placeholder for o in self._ir.epilogue.outputs[1:]}, max(device_index, 0), sm_count,
                          clusters, self._d_sink(device_index))
        return problem.transposed(self._ir.gemm.scaled) if self._swap else problem

    def _outputs(self, plan: _Plan, out: Any) -> tuple[tuple[torch.Tensor, ...], tuple[OutputArg, ...]]:
        tensors: list[torch.Tensor] = []
        targs: list[OutputArg] = []
        if out is None:  # fresh memory: right by construction, cannot alias an input (a plain loop: hot path)
            for identity, (shape, template, strides, modes, reduced) in zip(self._identities, plan.fresh, strict=True):
                tensor = template.new_empty_strided(shape, strides)
                if reduced == REDUCED_FROM_IDENTITY:
                    tensor.fill_(identity)
                tensors.append(tensor)
                targs.append((tensor.data_ptr(), modes))  # a TensorArg's fields (building one costs 0.3 us)
            return tuple(tensors), tuple(targs)
        given: list[tuple[str, tuple[int, int] | None]] = []
        for o, identity, t, (shape, template, strides, modes, reduced) in zip(
                self._ir.epilogue.outputs, self._identities, _given_outputs(out, len(plan.fresh)), plan.fresh,
                strict=True):
            if t is None:
                t = template.new_empty_strided(shape, strides)
                if reduced == REDUCED_FROM_IDENTITY:
                    t.fill_(identity)
                targs.append((t.data_ptr(), modes))
            else:  # checked once per (layout, output signature); the alias check follows the inputs
                name = "out" if o.name == "d" else f"out[{o.name}]"
                try:
                    okey: tuple | None = (o.name, argument_signature(t))
                except (TypeError, RuntimeError):  # not a strided tensor: the checks say what
                    okey = None
                hit = plan.out_checked.get(okey) if okey is not None else None
                if hit is None:
                    targ = check_block_factors_output(name, t, shape, plan.device) if reduced == BLOCK_FACTORS \
                        else check_reduction_output(name, t, shape, plan.device, modes) if reduced else \
                        check_output(name, t, o.dtype, shape, plan.device, self._ir.gemm.batched, plan.call.l,
                                     self._layout(o))
                    hit = (targ, output_span(t))
                    put_bounded(plan.out_checked, okey, hit)
                if plan.input_spans is None:
                    plan.input_spans = input_spans(plan.call)
                over_c = o.name == "d" and plan.call.operands.get(self._in_place) == hit[0]
                check_no_alias(name, hit[1], plan.input_spans, same_as=self._in_place if over_c else None)
                given.append((name, hit[1]))
                targs.append(hit[0])
                if reduced == REDUCED_FROM_IDENTITY:  # filled on the stream before every launch
                    t.fill_(identity)
            tensors.append(t)
        if len(given) > 1:
            check_outputs_disjoint(given)
        return tuple(tensors), tuple(targs)

    def _layout(self, o: Output) -> Layout:
        """An M x N output's memory order: D's, but a column-quantized copy's, (N, M) row-major."""
        return Layout.ROW if o.column_blocks else self._ir.gemm.layout_d

    def _fresh_outputs(self, shape: tuple[int, ...], l: int, device: torch.device  # noqa: E741
                       ) -> tuple[_FreshOutput, ...]:
        """(shape, template, torch strides, (M, N, L) mode strides, reduced) of each output gemmgen
        allocates for an M x N `shape`: in D's layout, rows (columns) padded to 16 bytes if needed; a
        reduction's contiguous per batch: (L,) or () over M and N, (L, M) or (M,) per row, (L, N) or
        (N,) per column (`checks.check_reduction_output`)."""
        layouts: list[_FreshOutput] = []
        m, n = shape[-2], shape[-1]
        for o in self._ir.epilogue.outputs:
            if o.reduce in (Reduction.BLOCK_SCALE, Reduction.COLUMN_BLOCK_SCALE):
                # as a block-scaled GEMM reads its scales (`block_factors_layout`)
                bshape = o.shape(shape)
                strides, modes = block_factors_layout(bshape, l)
                layouts.append((bshape, torch.empty(0, dtype=torch.float32, device=device), strides, modes,
                                BLOCK_FACTORS))
                continue
            if o.reduce is not None:
                rshape = o.shape(shape)
                vector = (0, 0, 1) if o.dim is None else (1, 0, m) if o.dim == 1 else (0, 1, n)
                modes = (vector[0], vector[1], vector[2] if l > 1 and not o.over_batch else 0)  # 0: over the batch
                zero = o.dim is None or 0 in shape  # an atomic max over M and N, or nothing to reduce
                strides = (rshape[-1], 1) if len(rshape) == 2 else (1,) * len(rshape)
                template = torch.empty(0, dtype=o.dtype.torch, device=device)
                layouts.append((rshape, template, strides, modes, REDUCED_FROM_IDENTITY if zero else REDUCED))
                continue
            oshape = o.shape(shape)  # N/2 columns for a pair's half (`ir.columns`)
            strides = padded_strides(oshape, o.dtype.torch, self._layout(o))
            layouts.append((oshape, torch.empty(0, dtype=o.dtype.torch, device=device), strides,
                            (strides[-2], strides[-1], strides[0] if len(shape) == 3 and l > 1 else 0), MATRIX))
        return tuple(layouts)

    def _epilogue_of_zero(self, outputs: tuple[torch.Tensor, ...], shape: tuple[int, ...], operands: dict,
                          device: torch.device) -> None:
        """K = 0: the epilogue applied to a zero accumulator, like torch's matmul over an empty K."""
        acc = torch.zeros(shape, dtype=torch.float32, device=device)
        for dst, src in zip(outputs, evaluate_epilogue(self._ir.epilogue, acc, operands),
                            strict=True):
            dst.copy_(src)


def _given_outputs(out: Any, n: int) -> list[torch.Tensor | None]:
    if out is None:
        return [None] * n
    if isinstance(out, torch.Tensor):
        return [out] + [None] * (n - 1)
    if isinstance(out, tuple | list) and len(out) == n:
        return list(out)
    raise InvalidArgument(f"out: expected a tensor for D or a tuple of {n} tensors (D and the aux outputs), "
                          f"got {type(out).__name__}")


_POINTER = struct.Struct("<Q")


def kernel_for_compiled(compiled: CompiledKernel) -> KernelBase:
    """The callable for a compiled kernel: a GroupedKernel for a grouped recipe, else a Kernel."""
    return GroupedKernel(compiled) if compiled.recipe.gemm.grouped else Kernel(compiled)

"""Each recipe as a `torch.library` op in the `gemmgen` namespace.

    op = gemmgen.op(recipe)          # torch.ops.gemmgen.<recipe name>_<key prefix>
    d = op(a, b, bias)               # operands positionally, in declaration order (grouped: a, b, offsets, ...)

One definition serves dense and grouped recipes; what differs (schema inputs, output shapes,
checks, the problem the launch policy sees, the reference, the backward) is the recipe's
`OpKind` (`dense.DenseOp`, `grouped.GroupedOp`). The op has a fake (meta) implementation with
the exact output shapes, dtypes and strides, so `torch.compile(fullgraph=True)` and export trace
through it without graph breaks. The CUDA implementation launches the kernel the launch policy
picks (`tuning.choose_launch`: an autotune result, else the recipe's config, else the
heuristic), compiled or loaded once per device and config; the CPU implementation evaluates the
recipe's reference, so models using gemmgen run (slowly) anywhere; both refuse what the kernel
refuses, except a tensor whose memory layout alone TMA cannot read, which they copy into one it
can (`call_realigning`), as torch ops accept any strides.

`caller(recipe)` returns what modules call: in eager code with nothing to differentiate and no
dispatch mode active it launches the kernel directly (the dispatcher costs a few microseconds per
call: docs/design/measurements.md); anything torch must see (tracing, fake tensors, modes, autograd, CPU
tensors) goes through the op.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import env, tuning
from ..compile import default_cache
from ..compile.background import BACKGROUND
from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..dsl import Recipe
from ..errors import InvalidArgument, LayoutMismatch
from ..ir import RecipeIR
from ..runtime import driver
from ..runtime.base import KernelBase, put_bounded
from ..runtime.checks import copy_in_layout, tma_readable
from ..types import Layout, OperandKind
from .dense import DenseOp
from .grouped import GroupedOp, KGroupedOp
from .kinds import OpKind
from .pending import PendingKernel, run_unfused

_LIB: torch.library.Library | None = None
_LOCK = threading.Lock()
_OPS: dict[str, Any] = {}
_LAUNCHERS: dict[str, Launcher] = {}  # by recipe key: the op and the modules' direct calls share the kernels
_MAX_SHAPES = 1024  # exact shapes remembered per recipe (each maps to its bucket's kernel)
_DEVICES: dict[int, tuple[tuning.Device | None, int, Arch]] = {}  # device index -> (tuning.Device, SM count, arch)


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("gemmgen", "FRAGMENT")
    return _LIB


def kind_of(recipe: Recipe) -> OpKind:
    if recipe.ir.gemm.k_grouped:
        return KGroupedOp(recipe)
    return GroupedOp(recipe) if recipe.ir.gemm.grouped else DenseOp(recipe)


def op_name(recipe: Recipe) -> str:
    return f"{recipe.name}_{recipe.key[:12]}"


def schema(recipe: Recipe) -> str:
    args = ["Tensor a", "Tensor b", *kind_of(recipe).extra_inputs]
    args += [f"float {o.name}" if o.kind is OperandKind.SCALAR and not o.per_batch else f"Tensor {o.name}"
             for o in recipe.operands]
    n = len(recipe.outputs)
    returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"{op_name(recipe)}({', '.join(args)}) -> {returns}"


def op(recipe: Recipe) -> Any:
    """Register (once) and return the op for `recipe`."""
    if not isinstance(recipe, Recipe):
        raise InvalidArgument(f"recipe: expected a gemmgen.Recipe, got {type(recipe).__name__}")
    name = op_name(recipe)
    with _LOCK:
        packet = _OPS.get(name)
        if packet is None:
            packet = _OPS[name] = _define_op(recipe)
        return packet


def _define_op(recipe: Recipe) -> Any:
    kind = kind_of(recipe)
    launcher = launcher_for(recipe)

    def cuda_impl(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        return call_realigning(recipe.ir, launcher, a, b, args)

    def cpu_impl(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        return call_realigning(recipe.ir, lambda a, b, *args: run_unfused(kind, a, b, args), a, b, args)

    def fake_impl(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        outs = kind.outputs(a, b, args, a.device)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def backward(ctx: Any, *grads: Any) -> tuple:
        return kind.vjp(saved_inputs(ctx), grads, ctx.needs_input_grad, caller)

    return define(schema(recipe), {"CUDA": cuda_impl, "CPU": cpu_impl}, fake_impl, backward, save_inputs)


def save_inputs(ctx: Any, inputs: tuple, output: Any) -> None:
    """An op's setup_context: every input for backward, tensors saved as autograd saves them."""
    ctx.scalars = [None if isinstance(x, torch.Tensor) else x for x in inputs]
    ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])


def saved_inputs(ctx: Any) -> list:
    """The inputs `save_inputs` kept, in order."""
    saved = iter(ctx.saved_tensors)
    return [next(saved) if is_t else s for is_t, s in zip(ctx.is_tensor, ctx.scalars, strict=True)]


class Launcher:
    """Runs a recipe's kernel for each call, as the op and the modules call it: kernels by exact
    call shape (`OpKind.key`: one dict lookup per call), by the problem's tuning bucket on a miss
    (the launch policy decides per bucket), each config compiled or loaded once per device."""

    __slots__ = ("_by_bucket", "_by_config", "_by_shape", "_key", "_kind", "recipe")

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self._kind = kind_of(recipe)
        self._key = self._kind.key  # bound once: asked on every call
        self._by_shape: dict[tuple, KernelBase | PendingKernel] = {}
        self._by_bucket: dict[tuple, KernelBase | PendingKernel] = {}
        self._by_config: dict[tuple[int, KernelConfig], KernelBase | PendingKernel] = {}

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        kernel = self._by_shape.get(self._key(a, b))
        if kernel is None:
            kernel = self.kernel_for(a, b, args)
        return kernel(a, b, *args)

    def kernel_for(self, a: torch.Tensor, b: torch.Tensor, args: tuple | None = None
                   ) -> KernelBase | PendingKernel:
        """The kernel for this call's problem. `args` (the operands, positionally) are checked with A
        and B before a kernel is compiled for them, so a mistake costs no half-minute compile."""
        key = self._kind.key(a, b)
        kernel = self._by_shape.get(key)
        if kernel is not None:
            return kernel
        with _LOCK:
            m, n, k, l = self._kind.problem(a, b)  # noqa: E741
            index = (a.device.index or 0) if a.device.type == "cuda" else -1
            bucket = (index, tuning.problem_bucket(self.recipe.ir, m, n, k, l), tuning.generation())
            kernel = self._by_bucket.get(bucket)
            if kernel is None:
                device, sms, arch = device_and_sms(index)
                config = tuning.config_for(self.recipe, m, n, k, l, device=device, sm_count=sms, arch=arch)
                if args is not None:  # the kernel's own checks, before compiling it
                    self._kind.check(a, b, args, require_cuda=index >= 0, config=config)
                kernel = self._by_config.get((index, config))
                if kernel is None:
                    kernel = self._by_config[index, config] = self._obtain(config)
                put_bounded(self._by_bucket, bucket, kernel, _MAX_SHAPES)
            put_bounded(self._by_shape, key, kernel, _MAX_SHAPES)
        return kernel


    def _obtain(self, config: KernelConfig) -> KernelBase | PendingKernel:
        """The kernel of `config`: loaded or compiled now, or (GEMMGEN_JIT=async, and nothing holds
        it yet) a PendingKernel that runs the recipe unfused while a worker compiles it."""
        if env.jit_mode() is env.JitMode.ASYNC:
            build = BACKGROUND.request(self.recipe.ir, config, default_cache(), self.recipe.name)
            if build is not None:
                return PendingKernel(self.recipe, config, self._kind, build)
        return self.recipe.compile(config)


def launcher_for(recipe: Recipe) -> Launcher:
    """The recipe's launcher, shared by its op and its modules' direct calls."""
    launcher = _LAUNCHERS.get(recipe.key)
    if launcher is None:
        launcher = _LAUNCHERS.setdefault(recipe.key, Launcher(recipe))
    return launcher


def kernel_for(recipe: Recipe, a: torch.Tensor, b: torch.Tensor, args: tuple | None = None
               ) -> KernelBase | PendingKernel:
    """The kernel a call of `recipe` on these tensors launches (`Launcher.kernel_for`)."""
    return launcher_for(recipe).kernel_for(a, b, args)


def device_and_sms(index: int) -> tuple[tuning.Device | None, int, Arch]:
    """(the device tuning results are keyed by, its SM count, its arch) for a CUDA device index,
    checked to be a GPU gemmgen builds for before anything is compiled for it; for the CPU (index
    -1, tests' stand-in) the default arch's reference GPU."""
    facts = _DEVICES.get(index)
    if facts is None:
        if index >= 0:
            arch, sms = driver.device_arch(index)
            facts = (tuning.Device.current(index), sms, arch)
        else:
            facts = (None, DEFAULT_ARCH.sm_count, DEFAULT_ARCH)
        _DEVICES[index] = facts
    return facts


def call_realigning(recipe: RecipeIR, call: Any, a: torch.Tensor, b: torch.Tensor, args: tuple) -> Any:
    """`call(a, b, *args)`, first copying into a TMA-readable layout (`tma_readable`) each tensor the
    checks refuse only for its layout, as torch ops accept any strides: an odd-width residual that
    torch.compile materialised unpadded, a slice at an odd offset. The hot path pays nothing: a
    kernel checks a call signature once, and only a refusal leads here to a copy and a retry."""
    try:
        return call(a, b, *args)
    except LayoutMismatch as refused:
        a, b, args = _realigned(recipe, refused, a, b, args)
    for _ in range(1 + len(args)):  # each further refusal names another argument
        try:
            return call(a, b, *args)
        except LayoutMismatch as refused:
            a, b, args = _realigned(recipe, refused, a, b, args)
    return call(a, b, *args)


def _realigned(recipe: RecipeIR, refused: LayoutMismatch, a: torch.Tensor, b: torch.Tensor, args: tuple
               ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The arguments with the one `refused` names replaced by a TMA-readable copy."""
    g = recipe.gemm
    names = ["offsets"] * g.grouped + [o.name for o in recipe.operands]  # as `args` holds them
    if refused.argument == "a":
        return tma_readable(a, g.layout_a), b, args
    if refused.argument == "b":
        return a, tma_readable(b, g.layout_b), args
    if refused.argument not in names:
        raise refused
    i = names.index(refused.argument)
    if refused.argument in ("scale_a", "scale_b") and g.microscaling:  # the blocked order, packed
        copy = args[i].contiguous()
    elif refused.argument in ("scale_a", "scale_b") and g.block_scale:
        layout = g.scale_layouts[refused.argument == "scale_b"]
        copy = copy_in_layout(args[i], layout, 1) if g.grouped else tma_readable(args[i], layout)  # unpadded
    else:  # every other operand: an M x N matrix in D's layout, a vector per batch row-major, a
        # grouped column vector (one entry per row of A: the masked layout's is (groups, max_m)) contiguous
        kind = next(o.kind for o in recipe.operands if o.name == refused.argument)
        copy = args[i].contiguous() if kind is OperandKind.COL and g.grouped else \
            tma_readable(args[i], g.layout_d if kind is OperandKind.MATRIX else Layout.ROW)
    return a, b, (*args[:i], copy, *args[i + 1:])


def define(op_schema: str, backends: dict[str, Any], fake: Any, backward: Any, setup_context: Any) -> Any:
    """Define `gemmgen::<op_schema>` with a kernel per backend ("CPU", "CUDA"), a fake kernel and
    an autograd formula (as `torch.library.register_autograd` takes them); returns the op packet.

    The Autograd kernel does what `register_autograd`'s does (an autograd.Function that redispatches
    below autograd when an input requires grad), except that a call with nothing to differentiate
    whose next dispatch key is one of `backends` runs that backend's function at once. Torch would
    redispatch there, a second trip through the dispatcher into Python (about 2 us per call, torch
    2.13 on the CPU machine). Anything else between autograd and the backend (fake tensors,
    dispatch modes, functionalization) still gets the redispatch, so torch sees the op as before.
    On a torch without the internals this builds on, `register_autograd` is used as it is.
    """
    lib = _library()
    lib.define(op_schema)
    name = op_schema.split("(", 1)[0]
    for key, fn in backends.items():
        lib.impl(name, fn, key)
    torch.library.register_fake(f"gemmgen::{name}", fake, lib=lib)
    packet = getattr(torch.ops.gemmgen, name)
    if _shortcut_supported():
        lib.impl(name, _autograd_kernel(packet.default, backends, backward, setup_context), "Autograd",
                 with_keyset=True)
    else:
        torch.library.register_autograd(f"gemmgen::{name}", backward, setup_context=setup_context, lib=lib)
    return packet


def _shortcut_supported() -> bool:
    """Whether this torch has the dispatcher internals `_autograd_kernel` uses (torch 2.13 has; the
    public `register_autograd` serves elsewhere, without the shortcut)."""
    c = torch._C
    return (all(hasattr(c, n) for n in ("_after_autograd_keyset", "_any_requires_grad", "_AutoDispatchBelowAutograd"))
            and all(hasattr(c.DispatchKeySet, n) for n in ("highestPriorityTypeId", "raw_repr")))


_UNSEEN = object()


def _autograd_kernel(overload: Any, backends: dict[str, Any], backward: Any, setup_context: Any) -> Any:
    """`define`'s Autograd kernel (called with the dispatch keyset first, as `with_keyset=True` asks)."""
    after_autograd = torch._C._after_autograd_keyset
    direct = {getattr(torch._C.DispatchKey, key): fn for key, fn in backends.items()}

    class Differentiable(torch.autograd.Function):
        """The op below autograd, recorded for backward: what register_autograd's kernel builds."""

        @staticmethod
        def forward(ctx: Any, keyset: Any, *args: Any) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                out = overload.redispatch(keyset & after_autograd, *args)
            setup_context(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple:
            ctx.needs_input_grad = ctx.needs_input_grad[1:]  # the op's own inputs, as its formula expects
            return (None, *backward(ctx, *grads))

    # The backend function a keyset dispatches to next, or None: what to do is a function of the
    # keyset alone, so it is worked out once per keyset seen (its raw bits: keysets do not hash).
    # Computing it per call (DispatchKeySet objects, an enum-keyed lookup) cost 1.2-1.8 us.
    next_function: dict[int, Any] = {}

    def kernel(keyset: Any, *args: Any) -> Any:
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Differentiable.apply(keyset, *args)
        raw = keyset.raw_repr()
        fn = next_function.get(raw, _UNSEEN)
        if fn is _UNSEEN:
            fn = next_function[raw] = direct.get((keyset & after_autograd).highestPriorityTypeId())
        if fn is not None:
            return fn(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & after_autograd, *args)

    return kernel


def direct_call_allowed(args: tuple, device_type: str = "cuda") -> bool:
    """True when calling the kernel directly is indistinguishable from calling the op: eager mode,
    no torch dispatch mode, nothing requiring grad, every tensor a plain tensor on `device_type`."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return False
    on_device = f"is_{device_type}"  # Tensor.is_cuda / is_cpu: a flag read, no torch.device built
    for x in args:
        if isinstance(x, torch.Tensor) and (type(x) is not torch.Tensor or not getattr(x, on_device)):
            return False
    return True


class OpCaller:
    """What modules call in forward: the op's overload, or the kernel directly when allowed."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.overload = op(recipe).default
        self._run_kernel = launcher_for(recipe)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        if direct_call_allowed((a, b, *args)):
            return call_realigning(self.recipe.ir, self._run_kernel, a, b, args)
        return self.overload(a, b, *args)

    def by_name(self, a: torch.Tensor, b: torch.Tensor, operands: dict[str, Any], *between: Any
                ) -> dict[str, torch.Tensor]:
        """A call with the operands by name (extra names ignored), its outputs by name: how the
        backward passes call derived kernels, whose operand order is the derivation's. `between`:
        the inputs between B and the operands (`OpKind.extra_inputs`: a grouped op's offsets)."""
        got = self(a, b, *between, *[operands[o.name] for o in self.recipe.operands])
        return dict(zip([o.name for o in self.recipe.outputs], got if isinstance(got, tuple) else (got,), strict=True))


def caller(recipe: Recipe) -> OpCaller:
    return OpCaller(recipe)


__all__ = ["Launcher", "OpCaller", "OpKind", "call_realigning", "caller", "define", "device_and_sms",
           "direct_call_allowed", "kernel_for", "launcher_for", "op", "op_name", "save_inputs", "saved_inputs",
           "schema"]

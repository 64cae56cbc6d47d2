"""Each recipe as a `torch.library` op in the `gemmgen` namespace.

    op = gemmgen.op(recipe)          # torch.ops.gemmgen.<recipe name>_<key prefix>
    d = op(a, b, bias)               # operands positionally, in declaration order

The op has a fake (meta) implementation with the exact output shapes, dtypes and strides, so
`torch.compile(fullgraph=True)` and export trace through it without graph breaks. The CUDA
implementation launches the compiled kernel (compiled or loaded on first use); the CPU
implementation evaluates the recipe's reference, so models using gemmgen run (slowly) anywhere;
both refuse what the kernel refuses, except a tensor whose memory layout alone TMA cannot read,
which they copy into one it can (`call_realigning`), as torch ops accept any strides.

`gemmgen.integrations.ops.caller(recipe)` returns what modules call: in eager code with nothing
to differentiate and no dispatch mode active it launches the kernel directly (the dispatcher
costs 2.6-3.6 us per call on the CPU machine with torch 2.13 and 2.11, 2026-11-30, measured by
scripts/op_overhead.py); anything torch must see (tracing, fake tensors, modes, autograd, CPU
tensors) goes through the op.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from .. import tuning
from ..errors import InvalidArgument, LayoutMismatch
from ..runtime import driver
from ..runtime.checks import check_call, check_problem_size, copy_in_layout, tma_readable
from ..runtime.kernel import allocate_output, put_bounded
from ..types import Layout, OperandKind

if TYPE_CHECKING:
    from ..dsl import Recipe

_LIB: torch.library.Library | None = None
_LOCK = threading.Lock()
_OPS: dict[str, Any] = {}
_KERNELS: dict[str, dict[tuple, Any]] = {}  # recipe key -> (A's shape, N, device, tuning generation) -> Kernel
_BY_BUCKET: dict[tuple, Any] = {}  # (recipe key, device index, shape bucket, tuning generation) -> gemmgen.Kernel
_MAX_SHAPES = 1024  # exact shapes remembered per recipe (each maps to its bucket's kernel)
_DEVICES: dict[int, tuple[Any, int]] = {}  # device index -> (tuning.Device, SM count)


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("gemmgen", "FRAGMENT")
    return _LIB


def op_name(recipe: Recipe) -> str:
    return f"{recipe.name}_{recipe.key[:12]}"


def schema(recipe: Recipe) -> str:
    args = ["Tensor a", "Tensor b"]
    for o in recipe.operands:
        args.append(f"float {o.name}" if o.kind is OperandKind.SCALAR else f"Tensor {o.name}")
    n = len(recipe.outputs)
    returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"{op_name(recipe)}({', '.join(args)}) -> {returns}"


def op(recipe: Recipe) -> Any:
    """Register (once) and return the op for `recipe`."""
    from ..dsl import Recipe

    if not isinstance(recipe, Recipe):
        raise InvalidArgument(f"recipe: expected a gemmgen.Recipe, got {type(recipe).__name__}")
    name = op_name(recipe)
    with _LOCK:
        if name in _OPS:
            return _OPS[name]
        if recipe.ir.gemm.grouped:
            from .grouped_ops import grouped_backends, grouped_schema

            _OPS[name] = define(grouped_schema(name, recipe), *grouped_backends(recipe))
            return _OPS[name]
        names = [o.name for o in recipe.operands]

        def outputs_like(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
            shape = (*((a.shape[0],) if recipe.ir.gemm.batched else ()), a.shape[-2], b.shape[-1])
            return [allocate_output(shape, o.dtype.torch, device) if o.reduce is None
                    else torch.zeros(o.shape(shape), dtype=o.dtype.torch, device=device) for o in recipe.outputs]

        run_kernel = Launcher(recipe)

        def cuda_impl(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
            return call_realigning(recipe, run_kernel, a, b, args)

        def evaluate(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
            operands = dict(zip(names, args, strict=True))
            check_call(recipe.ir, a, b, operands, require_cuda=False)  # what the GPU path would refuse
            with torch.autocast("cpu", enabled=False):  # the recipe's own precision, as the kernel computes
                return recipe.reference(a, b, **operands)

        def cpu_impl(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
            ref = call_realigning(recipe, evaluate, a, b, args)
            ref = ref if isinstance(ref, tuple) else (ref,)
            outs = outputs_like(a, b, a.device)
            for dst, src in zip(outs, ref, strict=True):
                dst.copy_(src)
            return outs[0] if len(outs) == 1 else tuple(outs)

        def fake_impl(a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
            outs = outputs_like(a, b, a.device)
            return outs[0] if len(outs) == 1 else tuple(outs)

        def backward(ctx: Any, *grads: Any) -> tuple:
            return epilogue_vjp(recipe, saved_inputs(ctx), grads, ctx.needs_input_grad)

        packet = define(schema(recipe), {"CUDA": cuda_impl, "CPU": cpu_impl}, fake_impl, backward, save_inputs)
        _OPS[name] = packet
        return packet


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
    """Runs a recipe's kernel for each problem (`kernel_for`) on the given tensors, as the op and the
    modules call it: the recipe's table of kernels by exact shapes is held, not looked up per call
    (0.3 us per call)."""

    __slots__ = ("_by_shape", "recipe")

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self._by_shape = _shape_table(recipe)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        kernel = self._by_shape.get((a.shape, b.shape[-1], a.device, tuning.generation()))
        if kernel is None:
            kernel = kernel_for(self.recipe, a, b, args)
        return kernel(a, b, *args)


def call_realigning(recipe: Recipe, call: Any, a: torch.Tensor, b: torch.Tensor, args: tuple) -> Any:
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


def _realigned(recipe: Recipe, refused: LayoutMismatch, a: torch.Tensor, b: torch.Tensor, args: tuple
               ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The arguments with the one `refused` names replaced by a TMA-readable copy."""
    g = recipe.ir.gemm
    names = ["offsets"] * g.grouped + [o.name for o in recipe.ir.operands]  # as `args` holds them
    if refused.argument == "a":
        return tma_readable(a, g.layout_a), b, args
    if refused.argument == "b":
        return a, tma_readable(b, g.layout_b), args
    if refused.argument not in names:
        raise refused
    i = names.index(refused.argument)
    if refused.argument in ("scale_a", "scale_b") and g.block_scale:
        layout = g.scale_layouts[refused.argument == "scale_b"]
        copy = copy_in_layout(args[i], layout, 1) if g.grouped else tma_readable(args[i], layout)  # unpadded
    else:  # every other operand row-major
        copy = tma_readable(args[i], Layout.ROW)
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


def kernel_for(recipe: Recipe, a: torch.Tensor, b: torch.Tensor, args: tuple | None = None) -> Any:
    """The kernel for this problem: config per shape bucket (autotune result, else the heuristic),
    compiled or loaded once per (recipe, device, bucket, registered tuning tables).

    Looked up first by the exact shapes (per call: no bucketing, no device query), then by bucket,
    so every shape of a bucket shares one kernel. `args` (the operands, positionally) are checked
    with A and B before a kernel is compiled for them, so a mistake costs no half-minute compile."""
    by_shape = _shape_table(recipe)
    key = (a.shape, b.shape[-1], a.device, tuning.generation())
    kernel = by_shape.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _kernel_for_bucket(recipe, a, b, args)
            put_bounded(by_shape, key, kernel, _MAX_SHAPES)
    return kernel


def _shape_table(recipe: Recipe) -> dict[tuple, Any]:
    """The recipe's kernels by exact shapes: (A's shape, N, device, tuning generation) -> Kernel."""
    table = _KERNELS.get(recipe.key)
    return table if table is not None else _KERNELS.setdefault(recipe.key, {})


def _kernel_for_bucket(recipe: Recipe, a: torch.Tensor, b: torch.Tensor, args: tuple | None) -> Any:
    """`kernel_for` by shape bucket; the caller holds _LOCK."""
    batched = recipe.ir.gemm.batched
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    l = a.shape[0] if batched and a.dim() == 3 else 1  # noqa: E741
    index = (a.device.index or 0) if a.device.type == "cuda" else -1
    key = (recipe.key, index, tuning.bucket(m, n, k, l), tuning.generation())
    kernel = _BY_BUCKET.get(key)
    if kernel is None:
        device, sms = device_and_sms(index)
        config = tuning.config_for(recipe.ir, m, n, k, l, device, sms)
        if args is not None:  # the kernel's own checks, before compiling it
            names = [o.name for o in recipe.ir.operands]
            call = check_call(recipe.ir, a, b, dict(zip(names, args, strict=False)), require_cuda=index >= 0)
            check_problem_size(call, config.tile, config.cluster, config.swap_ab)
        kernel = _BY_BUCKET[key] = recipe.compile(config)
    return kernel


def device_and_sms(index: int) -> tuple[tuning.Device | None, int]:
    """(the device tuning results are keyed by, its SM count) for a CUDA device index, checked to
    be an sm_90 GPU before anything is compiled for it; (None, 132) for the CPU (index -1)."""
    facts = _DEVICES.get(index)
    if facts is None:
        if index >= 0:
            sms = driver.require_sm90(index)
            facts = (tuning.Device.current(index), sms)
        else:
            facts = (None, 132)
        _DEVICES[index] = facts
    return facts


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
        self._run_kernel = Launcher(recipe)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *args: Any) -> Any:
        if direct_call_allowed((a, b, *args)):
            return call_realigning(self.recipe, self._run_kernel, a, b, args)
        return self.overload(a, b, *args)


def caller(recipe: Recipe) -> OpCaller:
    return OpCaller(recipe)


def epilogue_vjp(recipe: Recipe, inputs: list, grads: tuple, needed: tuple[bool, ...] | None = None) -> tuple:
    """Gradients of the fused op, the way torch differentiates the unfused layers: the accumulator
    is recomputed by a GEMM in the operands' precision (what the unfused model would have saved),
    the epilogue is differentiated in fp32 with autograd, and dacc maps back to A and B through
    GEMMs in the operands' precision (fp32 accumulation), like nn.Linear's backward; fp32 GEMMs
    would be far slower on a GPU and gain nothing over the unfused model's gradients. `needed`
    (per input, autograd's needs_input_grad) skips what nobody asked for: a frozen weight costs
    no weight-gradient GEMM."""
    from ..reference import accumulate, evaluate_epilogue

    needed = needed or (True,) * len(inputs)
    a, b, *rest = inputs
    names = [o.name for o in recipe.operands]
    ops = dict(zip(names, rest, strict=True))
    fp8 = recipe.ir.gemm.fp8
    if fp8 and (needed[0] or needed[1]):
        raise InvalidArgument(f"{'a' if needed[0] else 'b'}: gemmgen has no gradient for fp8 A or B (fp8 training "
                              "scales its gradients, which a plain derivative cannot know); detach them, or "
                              "differentiate a bf16 copy")
    scales = [o.name for o, need in zip(recipe.operands, needed[2:], strict=True) if need and o.kind.block_scale]
    if scales:
        raise InvalidArgument(f"{scales[0]}: gemmgen has no gradient for block scales (they come from quantizing "
                              "A and B, which is not differentiated either); detach them")
    with torch.enable_grad():
        # torch has no plain fp8 GEMM; the fp8 values are exact in fp32, as the kernel reads them
        acc = (accumulate(recipe.ir.gemm, a.detach(), b.detach(), ops) if fp8
               else torch.matmul(a.detach(), b.detach()).float()).requires_grad_(True)
        leaves = {k: v.detach().float().requires_grad_(True)
                  for (k, v), need in zip(ops.items(), needed[2:], strict=True)
                  if need and isinstance(v, torch.Tensor) and v.is_floating_point()}
        outs = evaluate_epilogue(recipe.ir.epilogue, acc, {**ops, **leaves}, round_outputs=False)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
        wrt = [acc, *leaves.values()]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g.float() for _, g in pairs], allow_unused=True)
    g_leaf = dict(zip(leaves, got[1:], strict=True))
    ga = gb = None
    if needed[0] or needed[1]:
        g_acc = (got[0] if got[0] is not None else torch.zeros_like(acc)).to(a.dtype)
        ga = torch.matmul(g_acc, b.transpose(-1, -2)) if needed[0] else None
        gb = torch.matmul(a.transpose(-1, -2), g_acc) if needed[1] else None
    # autograd already summed broadcast operands (row/col vectors) back to their own shapes
    rest = [None if g_leaf.get(k) is None else g_leaf[k].to(v.dtype) for k, v in ops.items()]
    return (ga, gb, *rest)

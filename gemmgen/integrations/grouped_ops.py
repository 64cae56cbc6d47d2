"""A grouped (MoE) recipe as a `torch.library` op: `op(a, b, offsets, *operands) -> d`.

The same contract as ops.py's ops: a fake implementation with D's exact shape and strides (traced
by torch.compile without graph breaks), a CUDA implementation that launches the kernel (per device:
an autotune result for the rows per group on average if one is registered, else the recipe's
config, else `select.grouped_choice`'s from the rows and groups; never from the groups' sizes,
which only the GPU knows), a CPU implementation that evaluates the reference, and gradients.
Rows of D after the last group's end are not written (unspecified), as with `torch._grouped_mm`.

Gradients follow the unfused model with torch's own grouped GEMM (`torch._grouped_mm`, which takes
the same offsets), so backward never reads the offsets on the host either: the accumulator is
recomputed, the epilogue differentiated in fp32 with autograd (row vectors gathered per row of A by
each row's group, so their gradients sum back per group), and dacc maps back to A (per group, dacc
B_g^T) and to B (per group, A_g^T dacc).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from .. import tuning
from ..config import KernelConfig
from ..errors import InvalidArgument
from ..runtime.checks import check_grouped_call
from ..runtime.grouped import operands_per_row, row_groups, vectors_as_matrices
from ..runtime.kernel import allocate_output, put_bounded
from ..select import grouped_choice
from ..types import OperandKind

if TYPE_CHECKING:
    from ..dsl import Recipe

_LOCK = threading.Lock()
_MAX_SHAPES = 1024  # exact shapes remembered per op (each maps to its bucket's kernel)


def grouped_schema(name: str, recipe: Recipe) -> str:
    args = ["Tensor a", "Tensor b", "Tensor offsets"]
    args += [f"float {o.name}" if o.kind is OperandKind.SCALAR else f"Tensor {o.name}" for o in recipe.operands]
    return f"{name}({', '.join(args)}) -> Tensor"


def grouped_config(recipe: Recipe, rows: int, n: int, k: int, groups: int, device: tuning.Device | None = None
                   ) -> KernelConfig:
    """The config a call of `rows` rows in `groups` groups (of K x N weights) launches: an autotune
    result for `device` and the rows per group on average (`tuning.grouped_bucket`) if one is
    registered, else the recipe's own config, else the heuristic's (`select.grouped_choice`)."""
    tuned = tuning.tuned_config(recipe.ir, device, rows, n, k, groups) if device is not None else None
    if tuned is not None:
        return tuned
    return recipe.config if recipe.config is not None else grouped_choice(recipe.ir, rows, groups).config


def kernel_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """What the op's kernel for a call depends on, as exact shapes: A's rows, B's shape (groups,
    K, N), the device and the tuning generation (`grouped_config` buckets them). Asked on every
    call (0.3 us on the CPU machine: scripts/op_overhead.py, 2026-12-01)."""
    return a.shape[0], b.shape, a.get_device(), tuning.generation()


def grouped_backends(recipe: Recipe) -> tuple[dict[str, Any], Any, Any, Any]:
    """(backends, fake, backward, setup_context) for `ops.define`."""
    from .ops import call_realigning, device_and_sms, save_inputs, saved_inputs

    names = [o.name for o in recipe.operands]
    kernels: dict[tuple, Any] = {}  # `kernel_key` -> kernel (bounded)
    by_config: dict[tuple[int, KernelConfig], Any] = {}  # (device index, config) -> kernel, compiled once

    def launch(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *args: Any) -> torch.Tensor:
        key = kernel_key(a, b)
        kernel = kernels.get(key)
        if kernel is None:
            check_grouped_call(recipe.ir, a, b, offsets, dict(zip(names, args, strict=True)))  # before compiling
            with _LOCK:
                device, _ = device_and_sms(key[2])
                config = grouped_config(recipe, a.shape[0], b.shape[-1], b.shape[-2], b.shape[0], device)
                kernel = by_config.get((key[2], config))
                if kernel is None:
                    kernel = by_config[key[2], config] = recipe.compile(config)
                put_bounded(kernels, key, kernel, _MAX_SHAPES)
        return kernel(a, b, offsets, *args)

    def cuda_impl(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *args: Any) -> torch.Tensor:
        return call_realigning(recipe, launch, a, b, (offsets, *args))

    def evaluate(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *args: Any) -> torch.Tensor:
        operands = dict(zip(names, args, strict=True))
        check_grouped_call(recipe.ir, a, b, offsets, operands, require_cuda=False)
        with torch.autocast("cpu", enabled=False):
            return recipe.reference(a, b, offsets, **operands)

    def cpu_impl(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *args: Any) -> torch.Tensor:
        d = fake_impl(a, b, offsets, *args)
        return d.copy_(call_realigning(recipe, evaluate, a, b, (offsets, *args)))

    def fake_impl(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *args: Any) -> torch.Tensor:
        return allocate_output((a.shape[0], b.shape[-1]), recipe.ir.gemm.d.torch, a.device)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grouped_vjp(recipe, saved_inputs(ctx), grad, ctx.needs_input_grad)

    return {"CUDA": cuda_impl, "CPU": cpu_impl}, fake_impl, backward, save_inputs


def grouped_vjp(recipe: Recipe, inputs: list, grad: torch.Tensor, needed: tuple[bool, ...]) -> tuple:
    from ..reference import evaluate_epilogue

    a, b, offsets, *rest = inputs
    gemm = recipe.ir.gemm
    if gemm.fp8 and (needed[0] or needed[1]):
        raise InvalidArgument(f"{'a' if needed[0] else 'b'}: gemmgen has no gradient for fp8 A or B (fp8 training "
                              "scales its gradients, which a plain derivative cannot know); detach them")
    scales = [o.name for o, need in zip(recipe.operands, needed[3:], strict=True) if need and o.kind.block_scale]
    if scales:
        raise InvalidArgument(f"{scales[0]}: gemmgen has no gradient for block scales (they come from quantizing "
                              "A and B, which is not differentiated either); detach them")
    mm_dtype = torch.bfloat16 if gemm.fp8 else a.dtype  # e4m3 and e5m2 values are exact in bf16
    if a.is_cuda and mm_dtype != torch.bfloat16:
        raise InvalidArgument(f"a: gradients of a grouped recipe use torch._grouped_mm, which takes bf16 on the GPU, "
                              f"not {a.dtype}; declare the recipe with a=gg.bf16, b=gg.bf16, or detach the inputs")
    names = [o.name for o in recipe.operands]
    rows, groups = a.shape[0], b.shape[0]
    if rows == 0 or groups == 0:
        return (torch.zeros_like(a) if needed[0] else None, torch.zeros_like(b) if needed[1] else None, None,
                *[torch.zeros_like(v) if isinstance(v, torch.Tensor) and need else None
                  for v, need in zip(rest, needed[3:], strict=True)])
    ops = {o.name: v for o, v in zip(recipe.operands, rest, strict=True) if not o.kind.block_scale}
    needs = dict(zip(names, needed[3:], strict=True))
    a_mm, b_mm = a.detach().to(mm_dtype), b.detach().to(mm_dtype)
    if gemm.block_scale is not None:  # dequantized, as the unfused model would multiply them
        from ..reference import expand_block_scale

        _, gn, gk = gemm.block_scale
        scale_a, scale_b = rest[:2]  # the first operands (RecipeIR.operands)
        a_mm = (a.float() * expand_block_scale(scale_a, 1, gk, a.shape)).to(mm_dtype)
        b_mm = (b.float() * expand_block_scale(scale_b, gk, gn, b.shape)).to(mm_dtype)
    ends, group, covered = row_groups(offsets, rows, groups)
    covered = covered.unsqueeze(1)
    with torch.enable_grad():
        acc = torch._grouped_mm(a_mm, b_mm, offs=ends).float()
        acc = torch.where(covered, acc, 0.0).requires_grad_(True)  # rows in no group: not computed
        leaves = {k: v.detach().float().requires_grad_(True) for k, v in ops.items()
                  if needs[k] and isinstance(v, torch.Tensor)}
        per_row = operands_per_row(recipe.ir, {**ops, **leaves}, group)
        out = evaluate_epilogue(vectors_as_matrices(recipe.ir), acc, per_row, round_outputs=False)[0]
        got = torch.autograd.grad(out, [acc, *leaves.values()], torch.where(covered, grad.float(), 0.0),
                                  allow_unused=True)
    g_leaf = dict(zip(leaves, got[1:], strict=True))
    ga = gb = None
    if needed[0] or needed[1]:
        if got[0] is None:  # D does not depend on the accumulator
            g_acc = a.new_zeros(rows, b.shape[-1])
        else:
            g_acc = torch.where(covered, got[0], 0.0).to(a.dtype)
        g_acc = _rows_16_bytes_apart(g_acc)  # torch._grouped_mm wants 16-byte strides (N odd: padded)
        if needed[0]:
            ga = torch.where(covered, torch._grouped_mm(g_acc, b.transpose(-1, -2), offs=ends), 0.0).to(a.dtype)
        if needed[1]:
            gb = torch._grouped_mm(a.t(), g_acc, offs=ends).to(b.dtype)
    grads = {k: g_leaf[k].to(v.dtype) for k, v in ops.items() if g_leaf.get(k) is not None}
    return (ga, gb, None, *[grads.get(name) for name in names])


def _rows_16_bytes_apart(t: torch.Tensor) -> torch.Tensor:
    """`t` (rows, N), or a copy of it whose rows are padded to a multiple of 16 bytes."""
    per = 16 // t.element_size()
    if t.shape[1] % per == 0:
        return t
    return t.new_zeros(t.shape[0], t.shape[1] + (-t.shape[1] % per))[:, :t.shape[1]].copy_(t)

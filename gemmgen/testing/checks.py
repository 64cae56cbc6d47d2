"""Whole-call checks on the CPU: a kernel as the runtime sees it without NVRTC (`uncompiled`), one
call emulated through the Params the runtime builds (`emulated_call`), and its outputs against the
recipe's reference (`assert_computes`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..codegen import GeneratedKernel, render_kernel
from ..codegen.fields import ParamsLayout
from ..compile import CompiledKernel, KernelInfo
from ..config import KernelConfig
from ..dsl import Recipe
from ..ir.reference import reference
from ..runtime.kernel import Kernel
from .calls import args_with_nonzero_reference, cpu_kernel, given_outputs, output_tolerance
from .emulate import emulate
from .recording import RecordingEncoder
from .tensors import assert_outputs_close


def uncompiled(recipe: Recipe, config: KernelConfig,
                mutate: Callable[[GeneratedKernel], GeneratedKernel] | None = None) -> CompiledKernel:
    """A kernel as the runtime sees it, without NVRTC: the generated source and Params fields, each
    field at its own offset (only the writer and the reader need them to agree), no cubin.
    `mutate` changes the generated kernel first (to check that the check can fail)."""
    generated = render_kernel(recipe.ir, config)
    if mutate is not None:
        generated = mutate(generated)
    fields, offset = [], 0
    for f in generated.fields:
        align = 64 if f.kind == "desc" else f.size
        offset = -(-offset // align) * align
        fields.append((f, offset, 0))
        offset += f.size
    info = KernelInfo(params_size=offset, params_align=64, smem_bytes=0, max_threads=384, min_blocks=1,
                      cluster_size=config.cluster[0] * config.cluster[1])
    return CompiledKernel(recipe.ir, config, generated.entry, "", b"", generated.source, info, None,  # type: ignore[arg-type]
                          generated, ParamsLayout(offset, tuple(fields)), "rendered")


def source_replaced(old: str, new: str) -> Callable[[GeneratedKernel], GeneratedKernel]:
    """An `uncompiled` mutation: the generated source with `old` replaced by `new` (which must be
    there: a mistake that changes nothing would make its check pass vacuously)."""

    def mutate(generated: GeneratedKernel) -> GeneratedKernel:
        assert old in generated.source, f"{old!r} is not in the kernel's source: the mistake would change nothing"
        return dataclasses.replace(generated, source=generated.source.replace(old, new))

    return mutate


def uncompiled_kernel(recipe: Recipe) -> Any:
    """The runtime's kernel of `recipe`'s default config without NVRTC (`uncompiled`), on the CPU
    stand-ins (`calls.cpu_kernel`): for the checks of a call's arguments."""
    return cpu_kernel(uncompiled(recipe, recipe.default_config()))


def emulated_call(ck: CompiledKernel, shape: tuple[int, int, int, int], drawn: tuple | None = None
         ) -> tuple[tuple, tuple, tuple]:
    """(outputs, reference, the reference's magnitudes) of one emulated call on `drawn` (A, B,
    operands, reference), or fresh inputs, with NaN-filled outputs."""
    m, n, k, batch = shape
    recipe = ck.recipe
    lead = (batch,) if recipe.gemm.batched else ()
    a, b, ops, want = drawn or args_with_nonzero_reference(recipe, m, n, k, lead)
    outs = given_outputs(recipe, m, n, lead)
    enc = RecordingEncoder()
    kernel = Kernel(ck, encoder=enc, hardware=lambda i: (132, 0), require_cuda=False)
    prep = kernel.prepare(a, b, out=outs if len(outs) > 1 else outs[0], **ops)
    assert prep.params is not None, "every emulated shape launches"
    workspace = [prep.workspace] if prep.workspace is not None else []
    emulate(ck, prep.params, enc, [a, b, *outs, *(v for v in ops.values() if isinstance(v, torch.Tensor)), *workspace])
    return outs, want, reference(recipe, a, b, ops, magnitudes=True)


def assert_computes(ck: CompiledKernel, shape: tuple[int, int, int, int], what: str,
                    drawn: tuple | None = None) -> None:
    """Outputs all written and within their tolerance of the reference (`output_tolerance`: that of
    the narrowest type a cast rounds the value to on its way)."""
    outs, want, scale = emulated_call(ck, shape, drawn)
    outputs = ck.recipe.epilogue.outputs
    for o, got in zip(outputs, outs, strict=True):
        assert not got.isnan().any(), f"{what} {shape}: {o.name} has elements the kernel would not write"
    assert_outputs_close(outputs, outs, want, scale, shape[:2],
                         lambda o, _: (output_tolerance(ck.recipe, o),) * 2, f"{what} {shape}")

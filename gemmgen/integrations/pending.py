"""A kernel not compiled yet, under GEMMGEN_JIT=async: calls run the recipe unfused until it is.

The unfused path is the recipe's own semantics (`Recipe.reference`: the GEMM with fp32
accumulation in torch, then the epilogue's ops, each output rounded to its dtype) on the caller's
tensors and device. It gives the same math as the fused kernel up to rounding order, not the same
bits, so numerics change once, when the kernel arrives: why async is not the default
(docs/design/deployment.md). Under CUDA-graph capture (a graph would keep the unfused path forever) and in
deterministic mode (results must not depend on when a compile ends) a call waits for the compile
instead, and says so once per kernel.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..compile import CompiledKernel
from ..compile.background import PendingBuild
from ..config import KernelConfig
from ..dsl import Recipe
from ..errors import GemmgenWarning
from .kinds import OpKind


def run_unfused(kind: OpKind, a: torch.Tensor, b: torch.Tensor, args: tuple) -> Any:
    """The recipe's outputs computed by its reference in torch, in the outputs' dtypes and layouts
    (what the op returns), on `a`'s device."""
    kind.check(a, b, args, require_cuda=False)  # what the kernel's path would refuse
    outs = kind.outputs(a, b, args, a.device)
    with torch.autocast(a.device.type, enabled=False):  # the recipe's own precision, as the kernel computes
        refs = kind.reference(a, b, args)
    for dst, src in zip(outs, refs, strict=True):
        dst.copy_(src)
    return outs[0] if len(outs) == 1 else tuple(outs)


def must_wait() -> str | None:
    """Why a call cannot run unfused now, if it cannot."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph being captured would keep the unfused path for good"
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic mode (torch.use_deterministic_algorithms): results must not depend on when a " \
               "compile ends"
    return None


class PendingKernel:
    """Stands for a recipe's kernel while `build` compiles it: each call runs the recipe unfused
    (`run_unfused`) until the build is ready, then the kernel, loaded from the cache once."""

    def __init__(self, recipe: Recipe, config: KernelConfig, kind: OpKind, build: PendingBuild) -> None:
        self.recipe = recipe
        self.config = config
        self.build = build
        self._kind = kind
        self._kernel: Any = None
        self._said_why = False

    def __repr__(self) -> str:
        return f"<gemmgen.PendingKernel {self.recipe.name} ({self.config.name}): {self.build.state}>"

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *args: Any, out: Any = None, **operands: Any) -> Any:
        """As the kernel's call (`KernelBase.__call__`): D, or (D, aux...); into `out` where given."""
        kernel = self._kernel
        if kernel is None:
            why = None if self.build.ready() else must_wait()
            if why is None and not self.build.future.done():
                self.build.unfused_calls += 1
                args = (*args, *(operands[n] for n in self._kind.names[len(args):] if n in operands))
                got = run_unfused(self._kind, a, b, args)
                if out is None:
                    return got
                for dst, src in zip(out if isinstance(out, (tuple, list)) else (out,),
                                    got if isinstance(got, tuple) else (got,), strict=True):
                    dst.copy_(src)
                return out
            if why is not None and not self._said_why:
                self._said_why = True
                warnings.warn(f"gemmgen: waiting for {self.recipe.name}'s kernel ({self.config.name}) to compile "
                              f"(GEMMGEN_JIT=async): {why}", GemmgenWarning, stacklevel=2)
            kernel = self._resolve()
        return kernel(a, b, *args, out=out, **operands)

    @property
    def compiled(self) -> CompiledKernel:
        """The compiled kernel (waiting for its build)."""
        return (self._kernel or self._resolve()).compiled

    def _resolve(self) -> Any:
        """The compiled kernel: waits for the build (raising its error), then loads it from the cache."""
        self.build.wait()
        self._kernel = self.recipe.compile(self.config)
        return self._kernel

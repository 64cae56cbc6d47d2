"""What the op definition (`ops`) needs to know of a recipe's kind: dense (`dense.DenseOp`) or
grouped (`grouped.GroupedOp`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import KernelConfig
from ..dsl import Recipe
from ..errors import InvalidArgument


class OpKind:
    """The op's inputs after A and B, its outputs' shapes, its checks, the problem the launch policy
    sees, its reference and its backward, for one recipe."""

    #: Schema inputs between B and the operands.
    extra_inputs: tuple[str, ...] = ()

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.names = [o.name for o in recipe.operands]

    def outputs(self, a: torch.Tensor, b: torch.Tensor, args: tuple, device: torch.device) -> list[torch.Tensor]:
        """Fresh outputs with the kernel's shapes, dtypes and strides (the fake implementation's);
        `args` are the inputs after A and B (a K-grouped op's offsets say how many groups D has)."""
        raise NotImplementedError

    def check(self, a: Any, b: Any, args: tuple, require_cuda: bool, config: KernelConfig | None = None) -> None:
        """Refuse what the kernel (under `config`, when given) would refuse, before compiling it."""
        raise NotImplementedError

    def key(self, a: torch.Tensor, b: torch.Tensor) -> tuple:
        """What the kernel a call launches depends on, as exact shapes (asked on every call)."""
        raise NotImplementedError

    def problem(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
        """(M, N, K, L) as the launch policy takes it."""
        raise NotImplementedError

    def reference(self, a: torch.Tensor, b: torch.Tensor, args: tuple) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def vjp(self, inputs: list, grads: tuple, needed: tuple[bool, ...], call: Callable[[Recipe], Any]) -> tuple:
        """Gradients of every input, None where `needed` (autograd's needs_input_grad) says no;
        `call(recipe)` is how another recipe's kernel is launched (`ops.caller`: a derived
        backward kernel)."""
        raise NotImplementedError

    def refuse_undifferentiable(self, needed: tuple[bool, ...]) -> None:
        """fp8 A and B, block scales and D's row blocks have no gradient gemmgen computes: say so."""
        if self.recipe.ir.epilogue.column_blocks is not None and any(needed):
            raise InvalidArgument(f"{self.recipe.name}: it writes a column-quantized copy (gg.quantize_columns), "
                                  "which gemmgen does not differentiate; call it on tensors that do not require "
                                  "grad (torch.no_grad()), as a low-precision layer's forward does")
        if self.recipe.ir.epilogue.row_blocks is not None and any(needed):
            raise InvalidArgument(f"{self.recipe.name}: D is computed per block of its rows (gg.quantize, "
                                  "gg.rms_norm, gg.exp_minus_max), which gemmgen does not differentiate; call it on "
                                  "tensors that do not require grad (torch.no_grad()), or differentiate a recipe "
                                  "without them")
        if self.recipe.ir.gemm.quantized and (needed[0] or needed[1]):
            raise InvalidArgument(f"{'a' if needed[0] else 'b'}: gemmgen has no gradient for fp8 or fp4 A or B (such "
                                  "training scales its gradients, which a plain derivative cannot know); detach "
                                  "them, or differentiate a bf16 copy")
        offset = len(needed) - len(self.recipe.operands)  # the operands come last
        scales = [o.name for o, need in zip(self.recipe.operands, needed[offset:], strict=True)
                  if need and o.kind.block_scale]
        if scales:
            raise InvalidArgument(f"{scales[0]}: gemmgen has no gradient for block scales (they come from "
                                  "quantizing A and B, which is not differentiated either); detach them")

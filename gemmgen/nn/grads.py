"""Weight gradients as the modules return or accumulate them (`accumulate_grad=True`)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..dsl import Matrix, Recipe
from ..errors import InvalidArgument
from ..integrations.ops import caller, direct_call_allowed, kernel_for
from ..types import DType, Layout, as_dtype
from .pairs import interleave_pairs, split_pairs


@functools.cache
def weight_grad_recipe(dtype: torch.dtype) -> Recipe:
    """main_grad + dL/dY^T @ X in fp32, as one GEMM whose C is main_grad (A = dL/dY^T, a
    column-major view of dL/dY; B = X, row-major), on the GPU written over main_grad itself."""
    d = as_dtype(dtype, "dtype")
    return Recipe(f"weight_grad_accumulate_{d.value}", lambda acc, main_grad: acc + main_grad, a=d, b=d,
                  d=DType.F32, layout_a=Layout.COL, layout_b=Layout.ROW, operands={"main_grad": Matrix(DType.F32)})


def main_grad(weight: torch.Tensor) -> torch.Tensor:
    """`weight.main_grad`, Megatron-LM's and Transformer Engine's fp32 gradient-accumulation buffer:
    created as zeros if the weight has none, refused by name if it is not fp32 of the weight's shape."""
    buffer = getattr(weight, "main_grad", None)
    if buffer is None:
        buffer = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        weight.main_grad = buffer  # type: ignore[attr-defined]
    elif not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32 or buffer.shape != weight.shape:
        raise InvalidArgument(f"main_grad: expected an fp32 tensor of the weight's shape {tuple(weight.shape)}, got "
                              f"{getattr(buffer, 'dtype', type(buffer).__name__)} "
                              f"{tuple(getattr(buffer, 'shape', ()))}; delete it to have gemmgen create one")
    return buffer


def weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, accumulate: bool,
                weight_in_out: bool = False) -> torch.Tensor | None:
    """The gradient of the kernel's B (in x out: W^T, or W itself where the weight is stored
    `weight_in_out`, as GPT-2's Conv1D) for y = x B: x^T @ dL/dy, in the parameters' precision as
    nn.Linear's backward; or with `accumulate`, None after adding dL/dW in fp32 into
    `weight.main_grad` (`main_grad`): dL/dy^T @ x, or x^T @ dL/dy for a weight stored in x out."""
    if not accumulate:
        return torch.matmul(x.t(), grad_out)
    if weight_in_out:
        accumulate_into(main_grad(weight), x, grad_out)
    else:
        accumulate_into(main_grad(weight), grad_out, x)
    return None


def pairs_weight_grad(even: torch.Tensor, odd: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor,
                      accumulate: bool) -> torch.Tensor | None:
    """`weight_grad` for a kernel whose W interleaves the rows of two parameters kept apart (a
    gated MLP's gate and up, `interleave_pairs`): the interleaved gradient of B (autograd takes it
    apart), or with `accumulate`, None after adding each half into its own weight's `main_grad`
    (through an interleaved fp32 copy of the two: two more weight-sized copies per backward)."""
    if not accumulate:
        return torch.matmul(x.t(), grad_out)
    into_even, into_odd = main_grad(even), main_grad(odd)
    both = interleave_pairs(into_even, into_odd)
    accumulate_into(both, grad_out, x)
    from_even, from_odd = split_pairs(both)
    into_even.copy_(from_even)
    into_odd.copy_(from_odd)
    return None


def halves_weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, accumulate: bool
                       ) -> torch.Tensor | None:
    """`pairs_weight_grad` for gate and up held as the two halves of one weight's rows (a chunked
    GLU's): the interleaved gradient of B (autograd takes it apart into the halves' views), or
    with `accumulate`, None after adding it into the weight's own `main_grad`, half by half."""
    if not accumulate:
        return torch.matmul(x.t(), grad_out)
    buffer = main_grad(weight)
    half = buffer.shape[0] // 2
    both = interleave_pairs(buffer[:half], buffer[half:])
    accumulate_into(both, grad_out, x)
    from_even, from_odd = split_pairs(both)
    buffer[:half].copy_(from_even)
    buffer[half:].copy_(from_odd)
    return None


def accumulate_into(buffer: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """buffer += left^T @ right in fp32 (dL/dy^T @ x for an out x in weight), as one GEMM whose C
    is the buffer (`weight_grad_recipe`: the tokens are its K)."""
    recipe, a = weight_grad_recipe(left.dtype), left.t()
    if buffer.is_cuda and direct_call_allowed((a, right, buffer)):  # D written over C: beta = 1 in place
        kernel_for(recipe, a, right, (buffer,))(a, right, buffer, out=buffer)
    else:  # the op (tracing, a dispatch mode, the CPU): a new tensor, copied back
        buffer.copy_(caller(recipe)(a, right, buffer))


class _IntoMainGrad(torch.autograd.Function):
    """The identity on a weight, whose gradient goes into its fp32 `main_grad` instead of `.grad`."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        main_grad(ctx.weight).add_(grad.float())
        return None


def accumulating(weight: torch.Tensor) -> torch.Tensor:
    """`weight` for torch math (a layer's reference path, where gemmgen has no kernel for its
    dtype) whose gradient autograd adds into `weight.main_grad` in fp32, as `accumulate_grad=True`
    promises, instead of setting `.grad`."""
    return _IntoMainGrad.apply(weight)

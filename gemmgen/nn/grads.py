"""Weight gradients as the modules return or accumulate them (`accumulate_grad=True`)."""

from __future__ import annotations

import functools

import torch

from ..dsl import Matrix, Recipe
from ..errors import InvalidArgument
from ..integrations.ops import caller, direct_call_allowed, kernel_for
from ..types import DType, Layout, as_dtype


@functools.cache
def weight_grad_recipe(dtype: torch.dtype) -> Recipe:
    """main_grad + dL/dY^T @ X in fp32, as one GEMM whose C is main_grad (A = dL/dY^T, a
    column-major view of dL/dY; B = X, row-major), on the GPU written over main_grad itself."""
    d = as_dtype(dtype, "dtype")
    return Recipe(f"weight_grad_accumulate_{d.value}", lambda acc, main_grad: acc + main_grad, a=d, b=d,
                  d=DType.F32, layout_a=Layout.COL, layout_b=Layout.ROW, operands={"main_grad": Matrix(DType.F32)})


def weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, accumulate: bool
                ) -> torch.Tensor | None:
    """The gradient of the kernel's B = W^T (in x out) for y = x W^T: x^T @ dL/dy, in the
    parameters' precision as nn.Linear's backward; or with `accumulate`, None after adding
    dL/dW = dL/dy^T @ x in fp32 into `weight.main_grad` (Megatron-LM's and Transformer Engine's
    gradient-accumulation buffer, created as zeros if the weight has none)."""
    if not accumulate:
        return torch.matmul(x.t(), grad_out)
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        weight.main_grad = main_grad  # type: ignore[attr-defined]
    elif not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32 or \
            main_grad.shape != weight.shape:
        raise InvalidArgument(f"main_grad: expected an fp32 tensor of the weight's shape {tuple(weight.shape)}, got "
                              f"{getattr(main_grad, 'dtype', type(main_grad).__name__)} "
                              f"{tuple(getattr(main_grad, 'shape', ()))}; delete it to have gemmgen create one")
    recipe, a = weight_grad_recipe(grad_out.dtype), grad_out.t()
    if main_grad.is_cuda and direct_call_allowed((a, x, main_grad)):  # D written over C: beta = 1 in place
        kernel_for(recipe, a, x, (main_grad,))(a, x, main_grad, out=main_grad)
    else:  # the op (tracing, a dispatch mode, the CPU): a new tensor, copied back
        main_grad.copy_(caller(recipe)(a, x, main_grad))
    return None

"""Drop-in modules: `FusedLinear` (one fused gemmgen kernel per forward) and `fuse(model)`.

    layer = gemmgen.nn.FusedLinear(4096, 14336, activation="silu", dtype=torch.bfloat16)
    model, replaced = gemmgen.nn.fuse(model)   # Linear + activation pairs -> FusedLinear

Forward is `activation(x @ W^T + b)` as one gemmgen op (torch.ops.gemmgen.*): the GPU launches
the fused kernel; elsewhere the op evaluates the recipe's reference. Backward is the op's
registered autograd formula: torch GEMMs in the operands' precision, like nn.Linear's
backward, around the epilogue differentiated in fp32 (`gemmgen.integrations.ops.epilogue_vjp`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from . import dsl
from .config import KernelConfig
from .dsl import Recipe
from .integrations.ops import caller
from .types import as_dtype

ACTIVATIONS = {
    None: lambda x: x,
    "relu": dsl.relu,
    "gelu": dsl.gelu,
    "gelu_tanh": dsl.gelu_tanh,
    "silu": dsl.silu,
}


@functools.cache
def linear_recipe(activation: str | None, bias: bool, dtype: torch.dtype) -> Recipe:
    """The recipe of a Linear layer (x @ W^T with W stored out x in) plus bias and activation."""
    if activation not in ACTIVATIONS:
        from .errors import RecipeError

        raise RecipeError(f"activation: expected one of {sorted(k for k in ACTIVATIONS if k)} or None, "
                          f"got {activation!r}")
    act = ACTIVATIONS[activation]
    d = as_dtype(dtype, "dtype")
    name = f"linear_{activation or 'none'}{'_bias' if bias else ''}_{d.value}"
    if bias:
        return Recipe(name, lambda acc, bias: act(acc + bias), a=d, b=d, d=d, layout_a="row", layout_b="col",
                      operands={"bias": dsl.RowVector(d)})
    return Recipe(name, lambda acc: act(acc), a=d, b=d, d=d, layout_a="row", layout_b="col")


class FusedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.recipe = linear_recipe(activation, bias, dtype)
        self._op = caller(self.recipe)  # resolved once: forward stays traceable by torch.compile
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str | None = None) -> FusedLinear:
        """A FusedLinear sharing `linear`'s parameters (no copy)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features, fused.activation = linear.in_features, linear.out_features, activation
        fused.recipe = linear_recipe(activation, linear.bias is not None, linear.weight.dtype)
        fused._op = caller(fused.recipe)
        fused.weight = linear.weight
        fused.bias = linear.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = self.weight.t()
        y = self._op(x2, w) if self.bias is None else self._op(x2, w, self.bias)
        return y.reshape(*lead, self.out_features)

    def config_for(self, tokens: int, sm_count: int = 132) -> KernelConfig:
        """The config forward launches for an input of `tokens` rows when no autotune table applies
        (the heuristic's choice): what to build ahead of time, e.g.
        `gg.warmup([(layer.recipe, layer.config_for(t)) for t in (1, 512, 4096)])`."""
        from .select import choose

        return choose(self.recipe.ir, tokens, self.out_features, self.in_features, 1, sm_count).config

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}")


def _activation_of(module: nn.Module) -> str | bool | None:
    """The activation name a module computes, or False if it is not one FusedLinear fuses."""
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    if isinstance(module, nn.SiLU):
        return "silu"
    return False


def fuse(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """Replace Linear + activation pairs inside every nn.Sequential of `model` (in place).

    Returns the model and one line per replacement. Linear layers whose dtype gemmgen cannot
    run (not bf16/f16) are left alone and reported as such.
    """
    report: list[str] = []
    for name, seq in list(model.named_modules()):
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        out: list[tuple[str, nn.Module]] = []
        i = 0
        while i < len(children):
            key, mod = children[i]
            if isinstance(mod, nn.Linear) and not isinstance(mod, FusedLinear):
                nxt = children[i + 1][1] if i + 1 < len(children) else None
                act = _activation_of(nxt) if nxt is not None else False
                where = f"{name + '.' if name else ''}{key}"
                if mod.weight.dtype not in (torch.bfloat16, torch.float16):
                    report.append(f"{where}: kept (weights are {mod.weight.dtype}; gemmgen runs bf16/f16)")
                else:
                    fused = FusedLinear.from_linear(mod, activation=act if act is not False else None)
                    out.append((key, fused))
                    consumed = 2 if act is not False else 1
                    report.append(f"{where}: Linear{' + ' + type(nxt).__name__ if consumed == 2 else ''} -> "
                                  f"FusedLinear({fused.recipe.name})")
                    i += consumed
                    continue
            out.append((key, mod))
            i += 1
        if len(out) != len(children):
            for k, _ in children:
                delattr(seq, k)
            for k, m in out:
                seq.add_module(k, m)
    return model, report

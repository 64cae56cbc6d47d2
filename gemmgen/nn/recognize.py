"""What `fuse` recognises in a model's modules: the activation a module computes (by its traced
forward, or by its values where it spells a formula out), and whether hooks are registered on it."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn


class ChildrenAsLeaves(fx.Tracer):
    """Traces one module's own forward: each submodule it calls stays a single call_module node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def activation_of(module: nn.Module) -> str | None:
    """The FusedLinear activation that `module` computes, or None. It has no parameters, buffers or
    submodules, and its traced forward is either one relu, gelu or silu call on its input, or a
    formula of its input alone that computes one of them: transformers' gelu_new and gelu_fast
    spell the tanh GELU out (`_formula_activation`)."""
    if any(True for _ in module.children()) or any(True for _ in module.parameters()) \
            or any(True for _ in module.buffers()):
        return None
    try:
        graph = fx.symbolic_trace(module).graph
    except Exception:  # a forward that refuses tracing is not one of ours
        return None
    nodes = list(graph.nodes)
    if [n.op for n in nodes].count("placeholder") != 1 or nodes[-1].op != "output":
        return None
    if len(nodes) != 3:
        return _formula_activation(module, nodes)
    x, call, out = nodes
    if out.args[0] is not call or not call.args or call.args[0] is not x:
        return None
    if any(isinstance(a, fx.Node) for a in (*call.args[1:], *call.kwargs.values())):
        return None
    return activation_of_call(call)


#: What a formula module may call: elementwise functions of tensors and Python numbers.
_ELEMENTWISE = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.neg,
                          torch.tanh, torch.sigmoid, torch.erf, torch.exp, torch.pow, torch.mul, torch.add,
                          F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, torch.relu})
_ELEMENTWISE_METHODS = frozenset({"tanh", "sigmoid", "erf", "exp", "pow", "mul", "add", "relu"})
#: The activations a formula is compared with, each in fp64 (gelu_tanh: transformers' gelu_new).
_FORMULAS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
             "relu": F.relu}


def _formula_activation(module: nn.Module, nodes: list[fx.Node]) -> str | None:
    """The activation a traced formula computes: every call elementwise (`_ELEMENTWISE`), and its
    values on a probe of 4000 fp64 points over [-30, 30] and at +-1e4 within 1e-7 (relative) of one
    activation's, shape kept; None otherwise."""
    for n in nodes[1:-1]:
        if not ((n.op == "call_function" and n.target in _ELEMENTWISE)
                or (n.op == "call_method" and n.target in _ELEMENTWISE_METHODS)):
            return None
    probe = torch.cat([torch.linspace(-30, 30, 4000, dtype=torch.float64),
                       torch.tensor([-1e4, 1e4], dtype=torch.float64)]).reshape(-1, 3)
    try:
        with torch.no_grad():
            got = module(probe)
    except Exception:
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape or got.dtype != torch.float64:
        return None
    for name, fn in _FORMULAS.items():
        want = fn(probe)
        if torch.allclose(got, want, rtol=1e-7, atol=1e-9):
            return name
    return None


def activation_of_call(call: fx.Node) -> str | None:
    """The activation an fx call node applies to its first argument, or None."""
    if call.op == "call_method":
        return "relu" if call.target == "relu" else None
    if call.op != "call_function":
        return None
    if call.target in (F.relu, torch.relu):
        return "relu"
    if call.target is F.silu:
        return "silu"
    if call.target is F.gelu:
        approximate = call.kwargs.get("approximate", call.args[1] if len(call.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(str(approximate))
    return None


def hooked(module: nn.Module) -> bool:
    """Whether hooks are registered on `module` itself (a replacement would silently drop them)."""
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))

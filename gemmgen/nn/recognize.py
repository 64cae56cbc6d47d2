"""What `fuse` recognises in a model's modules: the activation a module computes (by its traced
forward, or by its values where it spells a formula out), gated and chunked-GLU MLPs by their
traced forwards, transformers' Conv1D and other GEMM layers, and whether hooks are registered."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from .base import RecipeModule, conv1d_sizes
from .mlp import MLPSecondLayer


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


def _down_call(owner: nn.Module) -> tuple[list[fx.Node], fx.Node] | None:
    """`owner.forward` traced with its children as calls (its nodes) and the child call whose one
    argument-only result it returns (an MLP's down projection), or None: what the gated and
    chunked-GLU matchers read."""
    try:
        graph = ChildrenAsLeaves().trace(owner)
    except Exception:  # not traceable: not provably an MLP
        return None
    nodes = list(graph.nodes)
    down = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else None
    if not isinstance(down, fx.Node) or down.op != "call_module" or len(down.args) != 1 or down.kwargs:
        return None
    return nodes, down


def gated_children(owner: nn.Module) -> tuple[str, str, str, str] | None:
    """(gate, up, down, act) child names if `owner.forward` is exactly down(act(gate(x)) * up(x))
    (either order of the product) and they are all its children, else None."""
    children = dict(owner.named_children())
    if len(children) != 4:
        return None
    traced = _down_call(owner)
    if traced is None:
        return None
    nodes, down = traced
    if sorted(n.op for n in nodes) != ["call_function", *["call_module"] * 4, "output", "placeholder"]:
        return None
    x = nodes[0]
    mul = down.args[0]
    if not isinstance(mul, fx.Node) or mul.target not in (operator.mul, torch.mul) or mul.kwargs:
        return None
    for act, up in (mul.args, reversed(mul.args)):
        if (isinstance(act, fx.Node) and isinstance(up, fx.Node) and act.op == up.op == "call_module"
                and up.args == (x,) and len(act.args) == 1 and isinstance(act.args[0], fx.Node)
                and act.args[0].op == "call_module" and act.args[0].args == (x,)):
            names = (str(act.args[0].target), str(up.target), str(down.target), str(act.target))
            return names if set(names) == set(children) else None
    return None


def chunked_children(owner: nn.Module) -> tuple[str, str, str, str] | None:
    """(wi, wi, down, act) child names if `owner.forward` is exactly a chunked GLU,
    `down(act(a) * b)` with `a, b = wi(x).chunk(2, dim=-1)` (ModernBERT's MLP; a Dropout child of
    p = 0 may stand before down), else None."""
    children = dict(owner.named_children())
    if len(children) not in (3, 4):  # wi, act, down and perhaps a dropout
        return None
    traced = _down_call(owner)
    if traced is None:
        return None
    nodes, down = traced
    if [n.op for n in nodes].count("placeholder") != 1 or len(nodes) not in (9, 10):
        return None
    x = nodes[0]
    mul = down.args[0]
    used = {str(down.target)}
    if isinstance(mul, fx.Node) and mul.op == "call_module":  # a dropout that drops nothing
        drop = children.get(str(mul.target))
        if not isinstance(drop, nn.Dropout) or drop.p != 0 or len(mul.args) != 1:
            return None
        used.add(str(mul.target))
        mul = mul.args[0]
    if not isinstance(mul, fx.Node) or mul.target not in (operator.mul, torch.mul) or mul.kwargs or len(mul.args) != 2:
        return None
    act, second = mul.args
    if not (isinstance(act, fx.Node) and isinstance(second, fx.Node) and act.op == "call_module"
            and len(act.args) == 1 and isinstance(act.args[0], fx.Node)):
        return None
    first = act.args[0]
    pieces = [(p.target, p.args) for p in (first, second)]
    if any(target is not operator.getitem for target, _ in pieces) or first.args[0] is not second.args[0] \
            or (first.args[1], second.args[1]) != (0, 1):
        return None
    chunk = first.args[0]
    if not (isinstance(chunk, fx.Node) and chunk.op == "call_method" and chunk.target == "chunk"
            and chunk.args[1:] in ((2,), (2, -1)) and chunk.kwargs in ({}, {"dim": -1})
            and (chunk.args[1:] == (2, -1) or chunk.kwargs == {"dim": -1})):
        return None
    wi = chunk.args[0]
    if not (isinstance(wi, fx.Node) and wi.op == "call_module" and wi.args == (x,) and not wi.kwargs):
        return None
    names = (str(wi.target), str(wi.target), str(down.target), str(act.target))
    return names if used | {names[0], names[3]} == set(children) else None


def is_conv1d(m: nn.Module) -> bool:
    """Whether `m` is transformers' Conv1D (`base.conv1d_sizes`)."""
    return conv1d_sizes(m) is not None


def is_gemm_layer(m: nn.Module) -> bool:
    """Whether fuse may replace `m` by a FusedLinear: an nn.Linear (of any class; `kept_because`
    refuses subclasses by name) or transformers' Conv1D."""
    return isinstance(m, nn.Linear) or is_conv1d(m)


def features(m: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    sizes = conv1d_sizes(m)
    assert sizes is not None, f"{type(m).__name__} is neither an nn.Linear nor a Conv1D"
    return sizes


def linear_like(m: nn.Module) -> bool:
    """Whether `m`, not an nn.Linear, holds a 2-d `weight` that is not an embedding table: a GEMM
    of its own (GPT-2's Conv1D, a router) that the report names as kept."""
    weight = m._parameters.get("weight")
    return (weight is not None and weight.dim() == 2 and not isinstance(m, nn.Embedding | nn.EmbeddingBag)
            and not isinstance(m, RecipeModule | MLPSecondLayer))

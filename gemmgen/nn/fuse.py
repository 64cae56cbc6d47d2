"""`fuse(model)`: Linear + activation pairs become one FusedLinear each, in place, with a report.

Which pairs fuse is read from the forward of each module that owns a Linear, traced by torch.fx
with every submodule kept as one call: a Linear whose output goes only to an activation module
becomes `FusedLinear(activation=...)`, and the activation module becomes `nn.Identity` (so keys,
and positions in an nn.Sequential, stay as they were). Forward code is left as it is, so a pair
fuses only where that provably keeps the function: the Linear is registered once and runs once,
the activation module is registered once and runs only on outputs of Linears fused with it, and
neither has hooks (a replacement would drop them). An activation module is recognised by what it
computes (its own trace is one relu, gelu or silu call, or an elementwise formula equal to one of
them), so wrappers such as Hugging Face's GELUActivation count, and GPT-2's gelu_new written out,
not just nn.ReLU/GELU/SiLU.

transformers' Conv1D (GPT-2's) counts as a Linear, its weight read as stored (in x out). With
`mlp=True`, Conv1D -> activation -> Conv1D becomes one FusedMLP as two Linears do, and gated and
chunked-GLU MLPs become FusedMLPs; transformers 5's 3-d experts modules
become GroupedExperts whatever the options (`_experts`). Other Linears stay as they are, unless
`unpaired=True` swaps them too. With
`quantize="fp8_block"` the replacements are BlockScaledLinear layers instead (e4m3 weights in
128 x 128 blocks, inputs quantized per call: an fp8 inference model), with `quantize="mxfp8"`
MXFP8Linear layers (a UE8M0 exponent per 32 values: B200s), with `quantize="nvfp4"` NVFP4Linear
layers (packed fp4, an e4m3 scale per 16 values: B200s). A forward fx cannot trace
(Python control flow on tensor values, say) keeps its activations separate, and the report says
why when it owns an activation module. fuse assumes, as torch.fx users do, that a module is
called from its parent's forward: it checks what it can see (calls and registrations) and cannot
see calls made from other modules' forwards.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..errors import InvalidArgument
from ..training import Precision, as_precision
from .base import RecipeModule, check_compute_dtype, unsupported
from .block_scaled import BlockScaledLinear, QuantizedLinear
from .experts import GroupedExperts, experts_call
from .linear import FusedLinear
from .low_precision import check_recompute
from .microscaled import MXFP8Linear, NVFP4Linear
from .mlp import FusedMLP, MLPSecondLayer
from .recognize import (
    ChildrenAsLeaves,
    activation_of,
    activation_of_call,
    chunked_children,
    features,
    gated_children,
    hooked,
    is_conv1d,
    is_gemm_layer,
    linear_like,
)

#: `quantize=`'s formats, and the inference layer each makes of a Linear.
QUANTIZE: dict[str, type[QuantizedLinear]] = {"fp8_block": BlockScaledLinear, "mxfp8": MXFP8Linear,
                                              "nvfp4": NVFP4Linear}


#: Where the activation modules torch and transformers define live: one of theirs that fuse does not
#: recognise is named in the report as an unknown activation.
ACTIVATION_MODULES = frozenset({"torch.nn.modules.activation", "transformers.activations"})

#: The report's line for a Linear no activation module follows.
KEPT_UNPAIRED = "kept (no activation module follows it; unpaired=True swaps it for a FusedLinear)"


@dataclass(frozen=True)
class _Target:
    """What fuse turns a Linear into: a FusedLinear computing in `compute_dtype` (default: the
    weights' dtype), or with `quantize` that format's inference layer (`QUANTIZE`; output in
    `compute_dtype`, default the weights' dtype if bf16/f16, else bf16)."""

    compute_dtype: torch.dtype | None
    quantize: str | None
    precision: Precision | None = None

    def kept_because(self, linear: nn.Module) -> str | None:
        """Why this nn.Linear (or transformers' Conv1D) cannot be replaced, or None if it can."""
        conv = is_conv1d(linear)
        if type(linear) is not nn.Linear and not conv:
            return f"{type(linear).__name__} subclasses nn.Linear; its forward may differ"
        if hooked(linear):
            return "it has hooks, which a replacement would drop"
        in_features, out_features = features(linear)
        if conv and (self.quantize is not None or self.precision is not None):
            return (f"{'quantize' if self.quantize else 'precision'}= takes weights stored out x in (nn.Linear's); "
                    "this Conv1D stores its weight in x out")
        if self.quantize is not None:  # TMA reads inputs in 16-byte rows: 16 fp8 values, 32 fp4
            multiple = 32 if self.quantize == "nvfp4" else 16
            return None if in_features % multiple == 0 else \
                f"in_features {in_features} is not a multiple of {multiple} (TMA reads the quantized inputs " \
                "in 16-byte rows)"
        w = linear.get_parameter("weight")
        reason = unsupported(in_features, self.compute_dtype or w.dtype)
        if reason:
            return reason
        if self.precision is not None:
            odd = [f"{n} {v}" for n, v in (("in_features", in_features), ("out_features", out_features))
                   if v % 16]
            if odd:
                return f"{' and '.join(odd)} not a multiple of 16 ({self.precision} reads fp8 rows along both)"
        cast = self.compute_dtype not in (None, w.dtype)  # then a fresh aligned copy is used
        if not cast and w.device.type != "meta" and (
                w.data_ptr() % 16 or w.stride(1) != 1 or (w.stride(0) * w.element_size()) % 16):
            return "weight: not in 16-byte aligned rows (a view into other memory?); the op would copy it every call"
        return None

    def replace(self, linear: nn.Module, activation: str | None) -> nn.Module:
        if is_conv1d(linear):
            return FusedLinear.from_conv1d(linear, activation, self.compute_dtype)
        assert isinstance(linear, nn.Linear)
        if self.quantize is not None:
            return QUANTIZE[self.quantize].from_linear(linear, activation, self.compute_dtype)
        return FusedLinear.from_linear(linear, activation, self.compute_dtype, precision=self.precision)


@dataclass(frozen=True)
class _Pair:
    """The activation module that alone consumes a Linear's output in its owner's forward."""

    act_name: str  # qualified, as model.named_modules() names it
    act: nn.Module
    activation: str
    then: tuple[str, nn.Module] | None = None  # (qualified name, Linear) alone consuming the activation's output


def _qualified(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def fuse(model: nn.Module, *, unpaired: bool = False, compute_dtype: torch.dtype | None = None,
         quantize: str | None = None, mlp: bool = False, precision: Precision | None = None,
         recompute: bool = False, accumulate_grad: bool = False) -> tuple[nn.Module, list[str]]:
    """Replace each nn.Linear (bf16/f16 weights) whose output only an activation module consumes
    by a FusedLinear that computes both (see the module docstring for the rules). `unpaired=True`
    also swaps the other such Linears for FusedLinear without activation: the same math launched
    by gemmgen instead of cuBLAS, at the cost of compiling their kernels too. `compute_dtype`
    (bf16/f16) is what the FusedLinears compute in: by default their weights' dtype, so fp32
    Linears are kept; with it, their weights are cast per call, as under autocast (mixed-precision
    training with fp32 master weights). `quantize="fp8_block"` makes the replacements
    BlockScaledLinear layers, `quantize="mxfp8"` MXFP8Linear and `quantize="nvfp4"` NVFP4Linear
    layers (quantized inference: no gradients; MXFP8 and NVFP4 on B200s only), their output in
    `compute_dtype`; with
    `unpaired=True` every Linear of the model is quantized. `mlp=True` makes each fused pair whose
    activation's output only a further Linear consumes (Linear -> activation -> Linear) one
    FusedMLP, trained with the first layer's backward fused into the second's dgrad GEMM: the
    FusedMLP takes the first Linear's place, holding its parameters as its own `weight` and `bias`,
    the activation becomes Identity and the second Linear an MLPSecondLayer holding that Linear's
    parameters, which the FusedMLP runs (`FusedMLP.chain`). With `mlp=True` a gated MLP too, a
    module whose whole forward is `down(act(gate(x)) * up(x))` (Llama's, Qwen's, Mistral's; act a
    SiLU or erf-GELU module), or a chunked GLU's `down(act(a) * b)`, `a, b = wi(x).chunk(2, -1)`
    (ModernBERT's), becomes one gated FusedMLP ("swiglu", "geglu") in its place, with the module's
    children as its own (`FusedMLP.gated`): its fc1 is gate's and up's rows interleaved at call
    time. Each experts module of transformers 5 (Mixtral's, Qwen-MoE's, DeepSeek's routed experts:
    3-d gate_up_proj and down_proj) becomes a GroupedExperts sharing its parameters, the router
    left as it is. Either way the parameters stay where the model had them: fusion
    never changes the model's state_dict (keys, shapes, layouts), so checkpoints load strictly
    into the fused model and its state_dict into the unfused one, and the parameters an optimizer
    already holds are the ones that get the gradients. Modules inside gemmgen's own (a model
    fused before) are left alone. `precision` (`gemmgen.training.Float8Blockwise()`, say) trains
    the FusedLinears and FusedMLPs in that low precision (docs/training.md), gated ones included
    (without biases, as Llama's); a Linear whose features are not multiples of 16 is then kept.
    `recompute` and `accumulate_grad` set those options (FusedLinear's, FusedMLP's)
    on every layer fuse makes: backward recomputes the fused GEMM instead of keeping its
    accumulator, and weight gradients are added in fp32 into each weight's `main_grad`.

    Returns the model (changed in place; a bare nn.Linear with `unpaired` comes back as a new
    FusedLinear) and a report: a line per fused pair or MLP, per swapped Linear, per Linear kept
    (for its dtype, class or sizes, or with no activation after it), per pair not fused (and why),
    and per forward fx could not trace: every Linear outside gemmgen's modules is named.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_compute_dtype(compute_dtype)
    if quantize not in (None, *QUANTIZE):
        raise InvalidArgument(f"quantize: expected None or one of {list(QUANTIZE)}, got {quantize!r}")
    if not isinstance(mlp, bool):
        raise InvalidArgument(f"mlp: expected True or False, got {mlp!r}")
    if mlp and quantize is not None:
        raise InvalidArgument(f"mlp: FusedMLP trains bf16/f16 layers; quantize={quantize!r} makes inference layers, "
                              "so give one of mlp=True and quantize=")
    if precision is not None and quantize is not None:
        raise InvalidArgument(f"precision: trains layers in a low precision; quantize={quantize!r} makes inference "
                              "layers, so give one of precision= and quantize=")
    for name, value in (("recompute", recompute), ("accumulate_grad", accumulate_grad)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name}: expected True or False, got {value!r}")
        if value and quantize is not None:
            raise InvalidArgument(f"{name}: a training option; quantize={quantize!r} makes inference layers (no "
                                  f"gradients), so give one of {name}=True and quantize=")
    target = _Target(compute_dtype, quantize, as_precision(precision, "fuse"))
    check_recompute(recompute, target.precision, "fuse")
    done = {id(c) for m in model.modules() if isinstance(m, RecipeModule | MLPSecondLayer)
            for c in m.modules() if c is not m}
    modules = [(n, m) for n, m in model.named_modules() if id(m) not in done]
    report: list[str] = []
    replacement: dict[int, nn.Module] = {}
    gated = _gated_mlps(model, modules, target) if mlp else {}
    experts = _experts(model, modules, target)
    inside = {id(c) for made in (gated, experts) for qualified, (layer, _) in made.items() if layer is not None
              for c in model.get_submodule(qualified).modules()}
    pairs, notes, untraced, calls = _find_pairs(model, modules, target)
    seconds, not_mlps = _mlp_seconds(model, pairs, target, calls) if mlp else ({}, {})
    inside |= {id(fc2) for _, fc2 in seconds.values()}  # the second layers of FusedMLPs
    first_of = {id(seconds[id(m)][1]): qualified for qualified, m in modules if id(m) in seconds}  # fc2 -> fc1's name
    for qualified, m in modules:
        name = qualified or "(model)"
        if qualified in gated:
            mlp_made, line = gated[qualified]
            report.append(line)
            if mlp_made is not None:
                replacement[id(m)] = mlp_made
                continue
        if qualified in experts:
            grouped, line = experts[qualified]
            if grouped is not None:
                replacement[id(m)] = grouped
            report.append(line)
            continue
        if qualified in untraced:
            report.append(untraced[qualified])
        if id(m) in first_of:
            report.append(f"{name}: the second layer of the FusedMLP at {first_of[id(m)]} (now an MLPSecondLayer "
                          "holding its parameters)")
        if id(m) in inside:
            continue
        if not is_gemm_layer(m):
            if linear_like(m):
                report.append(f"{name}: kept ({type(m).__name__} is not an nn.Linear: fuse swaps nn.Linear, "
                              "transformers' Conv1D and its experts modules)")
            continue
        why_kept = target.kept_because(m)
        if why_kept:
            report.append(f"{name}: kept ({why_kept})")
            continue
        pair = pairs.get(id(m))
        if pair is None:
            note = f"not fused ({notes[id(m)]})" if id(m) in notes else ""
            if unpaired:
                fused = replacement[id(m)] = target.replace(m, None)
                report.append(f"{name}: {note + '; ' if note else ''}{type(m).__name__} -> {_described(fused)}")
            else:
                owner = qualified.rpartition(".")[0]
                kept = (f"kept ({owner or 'the model'}'s forward was not traced; unpaired=True swaps it for a "
                        "FusedLinear)" if owner in untraced else KEPT_UNPAIRED)
                report.append(f"{name}: {note or kept}")
            continue
        second = seconds.get(id(m))
        if second is not None:
            fc2_name, fc2 = second
            holder = MLPSecondLayer(fc2, fc2_name, name)
            fused_mlp = replacement[id(m)] = FusedMLP.chain(m, pair.activation, fc2, holder, compute_dtype,
                                                            target.precision)
            replacement[id(pair.act)], replacement[id(fc2)] = nn.Identity(), holder
            kind = type(m).__name__
            report.append(f"{name}: {kind} + {type(pair.act).__name__} + {kind} ({fc2_name}) -> FusedMLP("
                          f"{fused_mlp.fc1.recipe.name}, {fused_mlp.fc2.recipe.name}) ({pair.act_name} is now "
                          f"Identity, {fc2_name} an MLPSecondLayer holding its parameters; state_dict unchanged)")
            continue
        fused = replacement[id(m)] = target.replace(m, pair.activation)
        replacement.setdefault(id(pair.act), nn.Identity())
        not_mlp = f"; not a FusedMLP: {not_mlps[id(m)]}" if id(m) in not_mlps else ""
        report.append(f"{name}: {type(m).__name__} + {type(pair.act).__name__} -> {_described(fused)}"
                      + f" ({pair.act_name} is now Identity{not_mlp})")
    for made in replacement.values():  # the layers' own setters check each option against the layer
        if isinstance(made, FusedLinear | FusedMLP):
            if recompute:
                made.recompute = True
            if accumulate_grad:
                made.accumulate_grad = True
    _replace(model, replacement)
    return replacement.get(id(model), model), report


def _find_pairs(model: nn.Module, modules: list[tuple[str, nn.Module]], target: _Target
                ) -> tuple[dict[int, _Pair], dict[int, str], dict[str, str], Counter[int]]:
    """The pairs safe to fuse (by id of the Linear), why other Linears followed by an activation
    are not (by id), the report line of each owner whose forward fx could not trace (by name), and
    how often each module is called in the traced forwards (by id)."""
    registered = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    calls: Counter[int] = Counter()
    pairs: dict[int, _Pair] = {}
    notes: dict[int, str] = {}
    untraced: dict[str, str] = {}
    for owner_name, owner in modules:
        children = list(owner.children())
        if isinstance(owner, RecipeModule) or not any(is_gemm_layer(c) for c in children):
            continue
        try:
            graph = ChildrenAsLeaves().trace(owner)
        except Exception as e:  # forwards fail to trace in many ways; the report names it
            if not any(activation_of(c) for c in children):
                continue  # nothing lost: no activation module here to fuse
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
            untraced[owner_name] = (f"{owner_name or type(owner).__name__}: forward not traced by torch.fx "
                                    f"({type(e).__name__}{': ' + reason if reason else ''}); activations in it "
                                    f"stay separate")
            continue
        for node in graph.nodes:
            if node.op == "call_module":
                calls[id(owner.get_submodule(node.target))] += 1
        for node in graph.nodes:
            _pair_from(node, owner_name, owner, target, pairs, notes)
    while True:  # refusing one pair can leave a shared activation with a run that is not fused
        pairs_per_act = Counter(id(p.act) for p in pairs.values())
        refused = {lin_id: problem for lin_id, pair in pairs.items()
                   if (problem := _unsafe(pair, lin_id, calls, registered, pairs_per_act))}
        if not refused:
            return pairs, notes, untraced, calls
        notes.update(refused)
        for lin_id in refused:
            del pairs[lin_id]


#: The gated FusedMLP activation of each activation module a gated MLP may apply to its gate.
_GATED = {"silu": "swiglu", "gelu": "geglu"}


def _gated_mlps(model: nn.Module, modules: list[tuple[str, nn.Module]], target: _Target
                ) -> dict[str, tuple[FusedMLP | None, str]]:
    """Each module whose forward is exactly `down(act(gate(x)) * up(x))` (or a chunked GLU's) over
    children of its own, by name: its gated FusedMLP (None where it is not made: its children are
    then fused one by one) and the report line, which says why where it is not."""
    registered = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    out: dict[str, tuple[FusedMLP | None, str]] = {}
    for qualified, owner in modules:
        found = None if isinstance(owner, RecipeModule) else gated_children(owner) or chunked_children(owner)
        if found is None:
            continue
        name = qualified or "(model)"
        why = _gated_kept_because(owner, found, target, registered)
        if why is not None:
            out[qualified] = (None, f"{name}: not a FusedMLP ({why}); its Linears are fused one by one")
            continue
        activation = _GATED[activation_of(owner.get_submodule(found[3])) or ""]
        try:
            fused = FusedMLP.gated(owner, found, activation, target.compute_dtype, found[0] == found[1],
                                   target.precision)
        except InvalidArgument as e:  # down does not take gate's outputs: not the MLP it looks like
            out[qualified] = (None, f"{name}: not a FusedMLP ({e}); its Linears are fused one by one")
            continue
        chunked = found[0] == found[1]
        g, u, d, a = found
        kernels = f"FusedMLP({fused.fc1.recipe.name}, {fused.fc2.recipe.name})"
        if chunked:
            out[qualified] = (fused, f"{name}: {d}({a}(a) * b), a, b = {g}(x).chunk(2) -> {kernels} ({g}, {d} and "
                                     f"{a} are its children, state_dict unchanged; {g}'s halves interleaved at call "
                                     "time)")
        else:
            out[qualified] = (fused, f"{name}: {d}({a}({g}(x)) * {u}(x)) -> {kernels} ({g}, {u}, {d} and {a} are its "
                                     f"children, state_dict unchanged; {g}'s and {u}'s rows interleaved at call time)")
    return out


def _gated_kept_because(owner: nn.Module, found: tuple[str, str, str, str], target: _Target,
                        registered: Counter[int]) -> str | None:
    """Why the gated MLP `owner` (children `found`: gate, up, down, act) is not made a FusedMLP."""
    gate, up, down = (owner.get_submodule(n) for n in found[:3])
    act = owner.get_submodule(found[3])
    linears = (gate, up, down)
    if not all(isinstance(m, nn.Linear) for m in linears):
        return "its projections are not all nn.Linear"
    if any(registered[id(m)] > 1 or hooked(m) for m in (owner, *linears, act)):
        return "a module of it is registered under several names or has hooks, which a replacement would drop"
    for child, m in zip(found, linears, strict=False):
        if why := target.kept_because(m):
            return f"{child}: {why}"
    if len({m.weight.dtype for m in linears}) > 1 or len({m.bias is None for m in linears}) > 1:
        return "its Linears differ in dtype or in having a bias"
    if gate.weight.shape != up.weight.shape:
        return "gate and up differ in shape"
    if next(owner.parameters(recurse=False), None) is not None or next(owner.buffers(recurse=False), None) is not None:
        return "it holds parameters or buffers of its own, which its forward may read"
    if _GATED.get(activation_of(act) or "") is None:
        return f"its activation {type(act).__name__} has no gated kernel (gemmgen gates with silu or erf-gelu)"
    return None


def _experts(model: nn.Module, modules: list[tuple[str, nn.Module]], target: _Target
             ) -> dict[str, tuple[GroupedExperts | None, str]]:
    """Each experts module of transformers 5 (3-d `gate_up_proj` and `down_proj`, called with the
    routed tokens: `experts.EXPERTS_CALL`), by name: its GroupedExperts (None where kept) and the
    report line."""
    registered = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    out: dict[str, tuple[GroupedExperts | None, str]] = {}
    for qualified, m in modules:
        params = m._parameters
        if isinstance(m, RecipeModule) or not experts_call(m) or not any(
                (p := params.get(n)) is not None and p.dim() == 3 for n in ("gate_up_proj", "up_proj")):
            continue
        name = qualified or "(model)"
        act = getattr(m, "act_fn", None)
        activation = _GATED.get(activation_of(act) or "") if isinstance(act, nn.Module) else None
        why = _experts_kept_because(m, activation, target, registered[id(m)])
        if why is not None:
            out[qualified] = (None, f"{name}: kept ({why})")
            continue
        assert activation is not None
        made = GroupedExperts.from_experts(m, activation, target.compute_dtype, concatenated=bool(m.is_concatenated),
                                           precision=target.precision)
        up, down = made.projections()
        out[qualified] = (made, f"{name}: {type(m).__name__} -> GroupedExperts({up.recipe.name}, {down.recipe.name}) "
                                f"(routed tokens sorted by expert, no padding; its parameters, state_dict unchanged)")
    return out


def _experts_kept_because(m: nn.Module, activation: str | None, target: _Target, registered: int) -> str | None:
    """Why the experts module `m` (whose activation module computes `activation`'s gate) is kept."""
    if target.quantize is not None:
        return f"quantize={target.quantize!r} makes Linears; no layer of it holds 3-d experts"
    if target.precision is not None and not target.precision.grouped:
        return f"{target.precision} has no grouped kernels yet (Float8Blockwise has)"
    if registered > 1 or hooked(m):
        return "it is registered under several names or has hooks, which a replacement would drop"
    if not getattr(m, "has_gate", False) or "gate_up_proj" not in m._parameters:
        return "experts without a gate (an up projection only) have no grouped layer in gemmgen yet"
    if getattr(m, "is_transposed", True) or getattr(m, "has_post_expert_norm", True) \
            or getattr(m, "_is_expert_parallel", True) or not isinstance(getattr(m, "is_concatenated", None), bool):
        return ("its layout is not transformers' default (is_transposed, has_post_expert_norm or expert "
                "parallelism), which GroupedExperts does not run")
    gate = getattr(type(m), "_apply_gate", None)
    if getattr(gate, "__name__", None) != "_default_apply_gate":
        return f"{type(m).__name__} computes its own gate (_apply_gate), which no gemmgen activation matches"
    if activation is None:
        return (f"its activation {type(getattr(m, 'act_fn', None)).__name__} has no gated kernel (gemmgen gates "
                "with silu or erf-gelu)")
    params = [p for p in m.parameters(recurse=False)]
    if len({p.dtype for p in params}) > 1:
        return "its parameters differ in dtype"
    dtype = target.compute_dtype or params[0].dtype
    _, hidden, intermediate = m._parameters["down_proj"].shape  # type: ignore[union-attr]
    for what, size in (("hidden size", hidden), ("intermediate size", intermediate)):
        reason = unsupported(size, dtype)
        if reason:
            return f"{what} {size}: {reason}"
        if target.precision is not None and size % 16:
            return f"{what} {size} is not a multiple of 16 ({target.precision} reads fp8 rows along it)"
    return None


def _mlp_seconds(model: nn.Module, pairs: dict[int, _Pair], target: _Target, calls: Counter[int]
                 ) -> tuple[dict[int, tuple[str, nn.Module]], dict[int, str]]:
    """For each fusable pair followed by a Linear that can join it as a FusedMLP's second layer (a
    plain, unhooked Linear registered and called once, that no other pair starts, of the first
    one's compute dtype and bias, taking its outputs), that Linear, by the id of the first; and
    for each pair followed by a Linear or Conv1D that cannot, why not."""
    registered = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    starts = {lin_id for lin_id in pairs}
    out, why_not = {}, {}
    for lin_id, pair in pairs.items():
        if pair.then is None:
            continue
        name, fc2 = pair.then
        first = next(m for m in model.modules() if id(m) == lin_id)
        if is_conv1d(first) != is_conv1d(fc2):
            why_not[lin_id] = (f"a FusedMLP's layers are two nn.Linear or two Conv1D, and these are a "
                               f"{type(first).__name__} and a {type(fc2).__name__}")
        elif why := target.kept_because(fc2):
            why_not[lin_id] = f"{name}: {why}"
        elif id(fc2) in starts or registered[id(fc2)] != 1 or calls[id(fc2)] != 1:
            why_not[lin_id] = f"{name} starts a pair of its own, or is registered or called more than once"
        elif (first.bias is None) != (fc2.bias is None) or features(first)[1] != features(fc2)[0]:
            why_not[lin_id] = f"{name} differs from it in having a bias, or does not take its outputs"
        elif (target.compute_dtype or first.weight.dtype) != (target.compute_dtype or fc2.weight.dtype):
            why_not[lin_id] = f"{name} computes in another dtype"
        else:
            out[lin_id] = (name, fc2)
    return out, why_not


def _described(module: nn.Module) -> str:
    if isinstance(module, QuantizedLinear):
        return f"{type(module).__name__}({module.recipe.name})"
    assert isinstance(module, FusedLinear)
    cast = f", {module.weight.dtype} weights cast per call" if module.weight.dtype != module.compute_dtype else ""
    return f"FusedLinear({module.recipe.name}{cast})"


def _pair_from(node: fx.Node, owner_name: str, owner: nn.Module, target: _Target,
               pairs: dict[int, _Pair], notes: dict[int, str]) -> None:
    """Record the pair (or why there is none) if `node` calls a Linear child of `owner` whose
    output goes to an activation."""
    if node.op != "call_module" or "." in str(node.target):
        return
    linear = owner.get_submodule(str(node.target))
    if not is_gemm_layer(linear):
        return
    users = list(node.users)
    user = users[0] if len(users) == 1 else None
    if user is not None and user.op == "call_module" and "." not in str(user.target):
        act = owner.get_submodule(str(user.target))
        activation = activation_of(act)
        if activation is not None:
            if why_kept := target.kept_because(linear):
                notes[id(linear)] = why_kept
            elif user.args != (node,) or user.kwargs:
                notes[id(linear)] = f"{_qualified(owner_name, str(user.target))} is called with further arguments"
            else:
                pairs[id(linear)] = _Pair(_qualified(owner_name, str(user.target)), act, activation,
                                          _next_linear(user, owner_name, owner))
            return
        if type(act).__module__ in ACTIVATION_MODULES:
            notes[id(linear)] = (f"{_qualified(owner_name, str(user.target))} ({type(act).__name__}) computes no "
                                 "activation gemmgen fuses (relu, gelu, gelu_tanh, silu)")
            return
    for u in users:
        if u.args and u.args[0] is node and activation_of_call(u) is not None:
            name = getattr(u.target, "__name__", u.target)
            notes[id(linear)] = (f"{type(owner).__name__}.forward applies {name} to it in code; fuse swaps modules, "
                                 f"so make the activation a module")
            return
    if any(_chunked_into_activation(u, owner) for u in users):
        notes[id(linear)] = ("its output is split (chunk) and one half goes through an activation: a chunked GLU "
                             "(ModernBERT's Wi), which fuse(mlp=True) fuses as a whole MLP")
        return
    if len(users) > 1 and any(u.op == "call_module" and activation_of(owner.get_submodule(str(u.target)))
                              for u in users if "." not in str(u.target)):
        notes[id(linear)] = "its output also feeds other ops than the activation"


def _chunked_into_activation(node: fx.Node, owner: nn.Module) -> bool:
    """Whether `node` chunks its input and a piece goes to an activation module of `owner`."""
    if not ((node.op == "call_method" and node.target == "chunk") or
            (node.op == "call_function" and node.target is torch.chunk)):
        return False
    return any(a.op == "call_module" and "." not in str(a.target) and activation_of(owner.get_submodule(str(a.target)))
               for piece in node.users if piece.target is operator.getitem for a in piece.users)


def _next_linear(act: fx.Node, owner_name: str, owner: nn.Module) -> tuple[str, nn.Module] | None:
    """The Linear (or Conv1D) child of `owner` that alone consumes the activation node's output, as
    its only argument (a FusedMLP's second layer, if it is a plain Linear), or None."""
    users = list(act.users)
    if len(users) != 1 or users[0].op != "call_module" or "." in str(users[0].target):
        return None
    nxt = users[0]
    linear = owner.get_submodule(str(nxt.target))
    if not is_gemm_layer(linear) or nxt.args != (act,) or nxt.kwargs:
        return None
    return _qualified(owner_name, str(nxt.target)), linear


def _unsafe(pair: _Pair, lin_id: int, calls: Counter[int], registered: Counter[int],
            pairs_per_act: Counter[int]) -> str | None:
    """Why fusing `pair` could change what the model computes, or None. An activation module may
    run several times (one module shared by a layer's Linears) if every run is on a fusable pair's
    output, since it becomes Identity for all of them."""
    if registered[lin_id] > 1:
        return f"it is registered under {registered[lin_id]} names"
    if calls[lin_id] > 1:
        return f"it runs {calls[lin_id]} times in traced forwards"
    act_id = id(pair.act)
    if hooked(pair.act):
        return f"{pair.act_name} has hooks, which Identity would drop"
    if registered[act_id] > 1:
        return f"{pair.act_name} is registered under {registered[act_id]} names"
    if calls[act_id] > pairs_per_act[act_id]:
        return (f"{pair.act_name} runs {calls[act_id]} times in traced forwards, "
                f"{calls[act_id] - pairs_per_act[act_id]} of them on other values")
    return None


def _replace(model: nn.Module, replacement: dict[int, nn.Module]) -> None:
    """Put each replacement wherever its module is registered (shared modules stay shared)."""
    for parent in list(model.modules()):
        for key, child in list(parent._modules.items()):
            if child is not None and id(child) in replacement:
                parent._modules[key] = replacement[id(child)]

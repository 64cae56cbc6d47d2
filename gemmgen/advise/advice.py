"""`advise`: a rank's training step as GEMMs (`analysis`), the rules they break with what each
costs, the nearest cliffs in tokens, FFN size and hidden size, and the parallel plans ranked."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import GemmgenError, InvalidArgument
from ..nn import FusedLinear, FusedMLP, GroupedLinear
from ..nn.plan import PlannedGemm, grouped_plan, linear_plan, mlp_plan
from .analysis import GemmAnalysis, analyze, waves_of
from .gpus import Gpu
from .model import ModelSpec, ParallelPlan, RankLayer, rank_layers

#: Below these, a GEMM's padding or its last wave is worth a line of advice.
USEFUL_FLOOR = 0.9
QUANTIZATION_FLOOR = 0.8
#: Megatron-LM's make_vocab_size_divisible_by: the vocabulary padded to this times TP.
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Finding:
    """One piece of advice: the rule (a stable id), where it applies, what was found, the FLOPs per
    step and rank it costs (0 where the cost is not FLOPs), and the fix."""

    rule: str
    where: str
    detail: str
    flops_lost: int
    fix: str


@dataclass(frozen=True)
class Cliff:
    """The nearest cliffs in one dimension: `drop_to` the largest value below `current` where some
    GEMM runs a wave fewer, `fill_to` the largest value with the current waves, `next_cliff` the
    value that adds one; for sizes scanned by the time model those are None and `detail` names the
    best size and its gain."""

    dimension: str
    current: int
    drop_to: int | None
    fill_to: int | None
    next_cliff: int | None
    detail: str


@dataclass(frozen=True)
class RankedPlan:
    """A parallel plan with its rank's GEMM time per step and the GPU time a token costs."""

    plan: ParallelPlan
    step_us: float  # one rank's GEMMs per step, the model's
    gpu_us_per_token: float  # step_us x TP / tokens: the GPU time a token costs
    broken: tuple[str, ...]


@dataclass(frozen=True)
class Advice:
    """What `advise` found: the step's GEMMs, findings, cliffs and ranked plans, and its inputs."""

    spec: ModelSpec
    plan: ParallelPlan
    tokens: int
    precision: str
    gpu: Gpu
    gemms: tuple[GemmAnalysis, ...]
    findings: tuple[Finding, ...]
    cliffs: tuple[Cliff, ...]
    plans: tuple[RankedPlan, ...]

    @property
    def step_us(self) -> float:
        """One rank's GEMMs per step, the model's."""
        return step_us(self.gemms)

    def layer_us(self) -> dict[str, float]:
        """Modelled time per layer name, over the model's layers that repeat it."""
        out: dict[str, float] = {}
        for g in self.gemms:
            out[g.gemm.layer] = out.get(g.gemm.layer, 0.0) + g.predicted_us * g.repeats
        return out


def step_us(gemms: tuple[GemmAnalysis, ...] | list[GemmAnalysis]) -> float:
    """The GEMMs' modelled time, each times the layers that repeat it."""
    return sum(g.predicted_us * g.repeats for g in gemms)


def planned(layer: RankLayer) -> list[PlannedGemm]:
    """The GEMMs of one of a rank's layers (`gemmgen.nn.plan`), named for the layer."""
    module = layer.module
    if isinstance(module, FusedMLP):
        return mlp_plan(module, layer.rows, name=layer.name)
    if isinstance(module, GroupedLinear):
        return grouped_plan(module, layer.rows, name=layer.name)
    if isinstance(module, FusedLinear):
        return linear_plan(module, layer.rows, name=layer.name)
    raise GemmgenError(f"advise: no plan for a {type(module).__name__}")


def step(spec: ModelSpec, plan: ParallelPlan, tokens: int, precision: Any, gpu: Gpu) -> list[GemmAnalysis]:
    """Every GEMM of one rank's training step for `tokens` tokens per step."""
    return [analyze(g, layer.repeats, gpu) for layer in rank_layers(spec, plan, tokens, precision)
            for g in planned(layer)]


def advise(spec: ModelSpec, tokens: int, gpu: Gpu, plan: ParallelPlan | None = None, precision: Any = None,
           precision_name: str = "bf16", scan: bool = True) -> Advice:
    """The advice for `spec` trained at `tokens` tokens per step and rank (micro-batch x sequence)
    under `plan` (default: one GPU) and `precision` (None: bf16) on `gpu`. `scan`: also the FFN and
    hidden size cliffs and the plan ranking (each analyses the step again at other sizes)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise InvalidArgument(f"tokens: expected a positive int (micro-batch x sequence), got {tokens!r}")
    plan = plan or ParallelPlan()
    gemms = step(spec, plan, tokens, precision, gpu)
    findings = rules(spec, plan, gemms)
    cliffs: list[Cliff | None] = [token_cliff(gemms, -(-tokens // plan.cp), gpu)]
    plans: list[RankedPlan] = []
    if scan:
        cliffs += [size_cliff("ffn", spec, plan, tokens, precision, gpu),
                   size_cliff("hidden", spec, plan, tokens, precision, gpu)]
        plans = rank_plans(spec, tokens, precision, gpu, plan)
    return Advice(spec, plan, tokens, precision_name, gpu, tuple(gemms), tuple(findings),
                  tuple(c for c in cliffs if c is not None), tuple(plans))


# ---- rules ------------------------------------------------------------------------------------------

def rules(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """Every rule's findings (RULES), in that order."""
    return [f for rule in RULES for f in rule(spec, plan, gemms)]


def tma_strides(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """TMA needs every row of A, B and D 16 bytes apart: K and N multiples of 16 bytes of their
    element. gemmgen pads an unaligned D's rows (a non-contiguous view) and refuses an unaligned K."""
    out = []
    for a in gemms:
        g, bits = a.gemm, 8 if a.kind == "fp8" else 16
        per = 128 // bits
        for dim, value in (("K", g.k), ("N", g.n)):
            if value % per:
                pad = -(-value // per) * per
                out.append(Finding("tma-16-byte-rows", f"{g.layer} {g.pass_.value}",
                                   f"{dim} = {value} is not a multiple of {per} ({a.kind}): rows not 16 bytes "
                                   "apart", 0, f"make the size behind {dim} a multiple of {per} (here {pad})"))
    return out


def tile_padding(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """A tile grid that overhangs the problem by more than 1 - USEFUL_FLOOR of its area."""
    out = []
    for a in gemms:
        if a.waves is not None and a.config is not None and a.waves.useful < USEFUL_FLOOR:
            g, (tm, tn, _) = a.gemm, a.config.tile
            swapped = " (swapped: M along the tile's N)" if a.config.swap_ab else ""
            narrow = min(g.m, g.n) * 4 < min(tm, tn)
            out.append(Finding("tile-quantization", f"{g.layer} {g.pass_.value}",
                               f"{g.m}x{g.n} on {tm}x{tn} tiles{swapped}: {a.waves.useful:.0%} of the tiles' area "
                               "is the problem's", round(a.flops * (1 / a.waves.useful - 1)) * a.repeats,
                               "leave this layer to torch (cuBLAS has narrow tiles), or join it to a wider GEMM"
                               if narrow else "a size behind M or N nearer a multiple of the tile (see the cliffs)"))
    return out


def wave_quantization(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """A last wave (or a stream-K share) that leaves more than 1 - QUANTIZATION_FLOOR of the SMs'
    time idle."""
    out = []
    for a in gemms:
        if a.waves is not None and a.waves.quantization < QUANTIZATION_FLOOR:
            g = a.gemm
            out.append(Finding("wave-quantization", f"{g.layer} {g.pass_.value}",
                               f"{a.waves.how}: the SMs do work {a.waves.quantization:.0%} of the time",
                               round(a.flops * (1 / a.waves.quantization - 1)) * a.repeats,
                               "change the tokens per step to the cliffs' fill_to or drop_to"))
    return out


def vocabulary(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """Megatron-LM pads the vocabulary to a multiple of 128 x TP (each rank's share a multiple of 128)."""
    multiple = VOCAB_MULTIPLE * plan.tp
    if spec.vocab % multiple == 0:
        return []
    padded = -(-spec.vocab // multiple) * multiple
    head = [a for a in gemms if a.gemm.layer == "lm_head"]
    extra = sum(a.flops for a in head) * (padded - spec.vocab) // spec.vocab
    return [Finding("vocabulary-padding", "lm_head", f"vocabulary {spec.vocab} is not a multiple of "
                    f"{VOCAB_MULTIPLE} x TP {plan.tp} = {multiple}; each rank's share is {-(-spec.vocab // plan.tp)}",
                    0, f"pad the vocabulary to {padded} (+{extra / 1e9:.1f} GFLOP per step and rank, in tiles the "
                    f"kernels fill)")]


def parallel_plan(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    return [Finding("parallel-plan", plan.name, rule, 0, "choose degrees that divide the model (see the ranked plans)")
            for rule in plan.broken_rules(spec)]


def torch_gemms(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """GEMMs of the step that leave gemmgen (bf16 dgrad and wgrad unless the layer's backward fuses
    them): their share of the step's FLOPs."""
    total = sum(a.flops * a.repeats for a in gemms)
    left = [a for a in gemms if a.config is None]
    flops = sum(a.flops * a.repeats for a in left)
    if not left:
        return []
    fixes = []
    if any(a.gemm.groups == 1 for a in left):
        fixes.append("accumulate_grad=True moves the bf16 weight gradients into gemmgen kernels, a low-precision "
                     "precision= dgrad and wgrad too")
    return [Finding("gemms-outside-gemmgen", "step", f"{len(left)} of the step's {len(gemms)} GEMMs "
                    f"({flops / total:.0%} of its FLOPs) run in torch (cuBLAS); the table lists them", 0,
                    "; ".join(fixes))]


def precision_coverage(spec: ModelSpec, plan: ParallelPlan, gemms: list[GemmAnalysis]) -> list[Finding]:
    """Layers a low-precision step leaves in bf16 where the precision has no kernel for them (MXFP8's
    experts); the MoE router stays bf16 by design, as Transformer Engine and DeepSeek-V3 keep it."""
    if not any(a.kind == "fp8" for a in gemms):
        return []
    left = sorted({a.gemm.layer for a in gemms if a.config is not None and a.kind == "bf16"} - {"moe.router"})
    return [Finding("precision-coverage", ", ".join(left), f"{len(left)} layer(s) run bf16 kernels in the "
                    "low-precision step: the precision has no kernels for them yet", 0,
                    "--precision fp8-blockwise or fp8-tensorwise runs the experts in fp8")] if left else []


RULES: tuple[Callable[[ModelSpec, ParallelPlan, list[GemmAnalysis]], list[Finding]], ...] = (
    tma_strides, tile_padding, wave_quantization, vocabulary, parallel_plan, torch_gemms, precision_coverage)


# ---- cliffs -----------------------------------------------------------------------------------------

def _waves_at(a: GemmAnalysis, rows: int, gpu: Gpu) -> int:
    """The launched config's whole waves if the GEMM had `rows` rows (M) instead."""
    assert a.config is not None
    return math.ceil(waves_of(a.config, replace(a.gemm, m=rows), gpu).waves)


def token_cliff(gemms: list[GemmAnalysis], tokens: int, gpu: Gpu) -> Cliff:
    """Where the tokens per step (and rank) add or remove a wave of some gemmgen GEMM whose M is
    the tokens (or the routed rows, tokens x top-k), each under the config it launches now; within
    half and twice the tokens."""
    scaled = [(a, a.gemm.m / tokens) for a in gemms if a.config is not None and a.gemm.m % tokens == 0]
    now = [_waves_at(a, a.gemm.m, gpu) for a, _ in scaled]

    def changed(t: int, more: bool) -> bool:
        return any((_waves_at(a, round(t * f), gpu) > w) if more else (_waves_at(a, round(t * f), gpu) < w)
                   for (a, f), w in zip(scaled, now, strict=True))

    up = next((t for t in range(tokens + 1, 2 * tokens + 1) if changed(t, True)), None)
    down = next((t for t in range(tokens - 1, tokens // 2, -1) if changed(t, False)), None)
    where = [a.gemm for (a, f), w in zip(scaled, now, strict=True) if up and _waves_at(a, round(up * f), gpu) > w]
    detail = (f"{up} tokens add a wave to {where[0].layer} {where[0].pass_.value}" if up and where else
              "no wave added below twice the tokens")
    if down:
        detail += f"; {down} tokens run a wave fewer"
    return Cliff("tokens", tokens, down, up - 1 if up else None, up, detail)


def size_cliff(dimension: str, spec: ModelSpec, plan: ParallelPlan, tokens: int, precision: Any, gpu: Gpu
               ) -> Cliff | None:
    """The FFN or hidden size within 1/8 of the model's, in steps of 128 x TP, at which the model
    puts the step's GEMMs nearest the roof (FLOPs per second), against the model's own size."""
    current = spec.intermediate if dimension == "ffn" else spec.hidden
    if dimension == "ffn" and spec.experts and not spec.dense_layers:
        current = spec.moe_intermediate
    unit = 128 * plan.tp
    sizes = sorted({current, *range(max(unit, (current - current // 8) // unit * unit), current + current // 8 + 1,
                                     unit)})
    rate: dict[int, float] = {}
    for size in sizes:
        changed = _resized(spec, dimension, size)
        try:
            gemms = step(changed, plan, tokens, precision, gpu)
        except GemmgenError:
            continue
        rate[size] = sum(a.flops * a.repeats for a in gemms) / step_us(gemms)
    if current not in rate:
        return None
    best = max(rate, key=lambda s: rate[s])
    gain = rate[best] / rate[current] - 1
    return Cliff(dimension, current, None, None, None,
                 f"{best} reaches {gain:+.1%} of the model's FLOP/s at {current}" if best != current else
                 f"{current} is the best size within 1/8 (steps of {unit})")


def _resized(spec: ModelSpec, dimension: str, size: int) -> ModelSpec:
    if dimension == "hidden":
        return replace(spec, hidden=size, head_dim=spec.head_dim if spec.kv_lora_rank else size // spec.heads)
    if spec.experts and not spec.dense_layers:
        return replace(spec, moe_intermediate=size)
    return replace(spec, intermediate=size)


# ---- parallel plans ---------------------------------------------------------------------------------

def rank_plans(spec: ModelSpec, tokens: int, precision: Any, gpu: Gpu, given: ParallelPlan) -> list[RankedPlan]:
    """TP 1, 2, 4, 8 (and for an MoE model EP 1 to 64, dividing its experts) that divide the model,
    ranked by GPU time per token of their GEMMs (TP ranks share a token's work; EP ranks each take
    their own tokens): communication is not modelled."""
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if spec.experts % e == 0] if spec.experts else [1]
    out = []
    for tp in (1, 2, 4, 8):
        for ep in eps:
            plan = replace(given, tp=tp, ep=ep)
            broken = tuple(plan.broken_rules(spec))
            try:
                us = step_us(step(spec, plan, tokens, precision, gpu))
            except GemmgenError:
                continue
            out.append(RankedPlan(plan, us, us * tp / tokens, broken))
    return sorted(out, key=lambda r: (r.gpu_us_per_token, r.plan.tp, r.plan.ep))

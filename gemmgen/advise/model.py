"""A transformer's GEMM-bearing layers from a Hugging Face config, split over a parallel plan: the
gemmgen layers one rank holds (on the meta device: no weights), each with how many of the model's
layers repeat it. Llama-style dense models (GQA, gated or plain MLPs), Mixtral- and Qwen-MoE-style
experts, and DeepSeek-V3's MLA attention with shared and routed experts are read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgument
from ..nn import FusedLinear, FusedMLP, GroupedLinear

#: Hugging Face `hidden_act` values of the gated MLPs (gate and up, then down), by gemmgen's name.
_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu"}
#: ...and of plain MLPs (GPT-2, BERT) by gemmgen's activation.
_PLAIN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a decoder's GEMMs, as its Hugging Face config gives them."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    activation: str  # gemmgen's name: "swiglu", "geglu" (gated) or a plain one
    attention_bias: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model (DeepSeek-V3's first_k_dense_replace)
    q_lora_rank: int = 0  # MLA (DeepSeek-V3): q through a low-rank pair when > 0
    kv_lora_rank: int = 0  # MLA: k and v through a low-rank pair when > 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0


def load_config(source: str | Path | dict) -> ModelSpec:
    """A ModelSpec from a config.json (a path) or its dict."""
    if isinstance(source, dict):
        raw, where = source, "config"
    else:
        path = Path(source)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise InvalidArgument(f"config: no file {str(path)!r}; give a Hugging Face config.json") from None
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"config: {str(path)!r} is not JSON ({e})") from None
        where = str(path)
    if not isinstance(raw, dict):
        raise InvalidArgument(f"config: {where} holds a {type(raw).__name__}, expected a JSON object")
    return _spec(raw, where)


def _int(raw: dict, where: str, *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"config: {where}'s {key} is {value!r}, expected a non-negative int")
            return value
    if default is None:
        raise InvalidArgument(f"config: {where} has none of {', '.join(keys)}; a decoder's config.json gives it")
    return default


def _spec(raw: dict, where: str) -> ModelSpec:
    hidden = _int(raw, where, "hidden_size", "n_embd", "d_model")
    heads = _int(raw, where, "num_attention_heads", "n_head")
    act = str(raw.get("hidden_act") or raw.get("activation_function") or "silu")
    model_type = str(raw.get("model_type", ""))
    gated = model_type not in ("gpt2", "bert", "gpt_neox", "opt") and act in _GATED
    activation = _GATED[act] if gated else _PLAIN.get(act)
    if activation is None:
        raise InvalidArgument(f"config: {where}'s activation {act!r} is none gemmgen advises on; known: "
                              f"{sorted(set(_GATED) | set(_PLAIN))}")
    experts = _int(raw, where, "num_local_experts", "n_routed_experts", "num_experts", default=0)
    return ModelSpec(
        name=str(raw.get("_name_or_path") or model_type or Path(where).stem),
        hidden=hidden, layers=_int(raw, where, "num_hidden_layers", "n_layer"), heads=heads,
        kv_heads=_int(raw, where, "num_key_value_heads", default=heads),
        head_dim=(_int(raw, where, "qk_nope_head_dim") if raw.get("kv_lora_rank") else
                  _int(raw, where, "head_dim", default=hidden // heads)),
        intermediate=_int(raw, where, "intermediate_size", "n_inner", default=4 * hidden),
        vocab=_int(raw, where, "vocab_size"), activation=activation,
        attention_bias=bool(raw.get("attention_bias", False) or model_type in ("qwen2", "qwen2_moe")),
        experts=experts, experts_per_token=_int(raw, where, "num_experts_per_tok", default=0) if experts else 0,
        moe_intermediate=_int(raw, where, "moe_intermediate_size", default=_int(raw, where, "intermediate_size",
                                                                                 default=0)) if experts else 0,
        shared_experts=_int(raw, where, "n_shared_experts", default=0) if experts else 0,
        dense_layers=_int(raw, where, "first_k_dense_replace", default=0) if experts else 0,
        q_lora_rank=_int(raw, where, "q_lora_rank", default=0),
        kv_lora_rank=_int(raw, where, "kv_lora_rank", default=0),
        qk_rope_dim=_int(raw, where, "qk_rope_head_dim", default=0),
        v_head_dim=_int(raw, where, "v_head_dim", default=0))


@dataclass(frozen=True)
class ParallelPlan:
    """How the model is split: tensor (`tp`), context (`cp`) and expert (`ep`) parallel degrees,
    and sequence parallelism (`sp`: it changes communication, not the GEMMs' shapes)."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{name}: expected a positive int, got {value!r}")

    @property
    def name(self) -> str:
        return f"tp{self.tp}" + (f"-cp{self.cp}" if self.cp > 1 else "") + (f"-ep{self.ep}" if self.ep > 1 else "") \
            + ("-sp" if self.sp else "")

    def indivisible(self, spec: ModelSpec) -> list[str]:
        """The sizes this plan cannot split evenly (no rank's layers exist then), each a sentence."""
        out = []
        if spec.heads % self.tp:
            out.append(f"attention heads ({spec.heads}) not divisible by TP {self.tp}")
        ffn = spec.moe_intermediate if spec.experts and not spec.dense_layers else spec.intermediate
        if ffn % self.tp:
            out.append(f"FFN size ({ffn}) not divisible by TP {self.tp}")
        if spec.experts and spec.experts % self.ep:
            out.append(f"experts ({spec.experts}) not divisible by EP {self.ep}")
        return out

    def broken_rules(self, spec: ModelSpec) -> list[str]:
        """The rules of Megatron-LM's argument checks this plan breaks for `spec`, each a sentence:
        `indivisible`'s, and those a rank can still run (KV heads replicated, EP on a dense model)."""
        out = self.indivisible(spec)
        if spec.kv_heads % self.tp and self.tp % spec.kv_heads:
            out.insert(1 if spec.heads % self.tp else 0,
                       f"KV heads ({spec.kv_heads}) neither a multiple nor a divisor of TP {self.tp}")
        if not spec.experts and self.ep > 1:
            out.append(f"EP {self.ep} on a dense model (no experts to split)")
        return out


@dataclass(frozen=True)
class RankLayer:
    """One gemmgen layer a rank holds and how many of the model's layers repeat it; `rows`: the
    rows it sees per step (tokens, or a grouped layer's routed rows)."""

    name: str
    module: nn.Module
    repeats: int
    rows: int


def rank_layers(spec: ModelSpec, plan: ParallelPlan, tokens: int, precision: Any = None) -> list[RankLayer]:
    """The layers one rank runs for `tokens` tokens per step (micro-batch x sequence; the rank's
    share with context parallelism), TP-split as Megatron-LM splits them: column-parallel q, k, v,
    gate and up, row-parallel o and down, a vocabulary-parallel LM head; KV heads replicated where
    there are fewer than TP. Routed experts: `experts / ep` per rank, each rank's tokens x top-k
    rows spread over them (balanced routing, as the model's load-balancing loss aims for)."""
    if plan.indivisible(spec):
        raise InvalidArgument(f"plan {plan.name}: {'; '.join(plan.broken_rules(spec))}; choose degrees that divide "
                              "the model")
    t = -(-tokens // plan.cp)
    tp = plan.tp

    def linear(n_in: int, n_out: int, bias: bool = False) -> FusedLinear:
        return FusedLinear(n_in, n_out, bias=bias, device="meta", dtype=torch.bfloat16, precision=precision)

    def mlp(name: str, n_in: int, hidden: int, act: str, repeats: int) -> list[RankLayer]:
        """A FusedMLP, as `fuse(mlp=True)` makes of the model's MLP (gated ones under every precision)."""
        return [RankLayer(name, FusedMLP(n_in, hidden, n_in, activation=act, bias=False, device="meta",
                                         dtype=torch.bfloat16, precision=precision), repeats, t)]

    out: list[RankLayer] = []
    layers, heads = spec.layers, spec.heads // tp
    kv = max(spec.kv_heads // tp, 1)
    if spec.kv_lora_rank:  # MLA
        q_dim = heads * (spec.head_dim + spec.qk_rope_dim)
        if spec.q_lora_rank:
            out += [RankLayer("attn.q_a", linear(spec.hidden, spec.q_lora_rank), layers, t),
                    RankLayer("attn.q_b", linear(spec.q_lora_rank, q_dim), layers, t)]
        else:
            out.append(RankLayer("attn.q", linear(spec.hidden, q_dim), layers, t))
        out += [RankLayer("attn.kv_a", linear(spec.hidden, spec.kv_lora_rank + spec.qk_rope_dim), layers, t),
                RankLayer("attn.kv_b", linear(spec.kv_lora_rank, heads * (spec.head_dim + spec.v_head_dim)),
                          layers, t),
                RankLayer("attn.o", linear(heads * spec.v_head_dim, spec.hidden), layers, t)]
    else:
        bias = spec.attention_bias
        out += [RankLayer("attn.q", linear(spec.hidden, heads * spec.head_dim, bias), layers, t),
                RankLayer("attn.k", linear(spec.hidden, kv * spec.head_dim, bias), layers, t),
                RankLayer("attn.v", linear(spec.hidden, kv * spec.head_dim, bias), layers, t),
                RankLayer("attn.o", linear(heads * spec.head_dim, spec.hidden), layers, t)]
    dense = spec.layers - spec.moe_layers
    if dense:
        out += mlp("mlp", spec.hidden, spec.intermediate // tp, spec.activation, dense)
    if spec.moe_layers:
        local = spec.experts // plan.ep
        rows = t * spec.experts_per_token  # balanced: the EP group's tokens x top-k over its experts
        ffn = spec.moe_intermediate // tp
        experts = precision if precision is not None and precision.grouped else None  # what fuse gives them
        out += [RankLayer("moe.router", FusedLinear(spec.hidden, spec.experts, bias=False, device="meta",
                                                     dtype=torch.bfloat16), spec.moe_layers, t),
                RankLayer("moe.experts.up", GroupedLinear(local, spec.hidden, ffn, bias=False,
                                                          activation=spec.activation if spec.gated else None,
                                                          device="meta", precision=experts), spec.moe_layers, rows),
                RankLayer("moe.experts.down", GroupedLinear(local, ffn, spec.hidden, bias=False, device="meta",
                                                            precision=experts), spec.moe_layers, rows)]
        if spec.shared_experts:
            out += mlp("moe.shared", spec.hidden, spec.moe_intermediate * spec.shared_experts // tp, spec.activation,
                       spec.moe_layers)
    out.append(RankLayer("lm_head", linear(spec.hidden, -(-spec.vocab // tp)), 1, t))
    return out

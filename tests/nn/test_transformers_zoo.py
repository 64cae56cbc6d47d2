"""`fuse()` on real model code (issue 59): Hugging Face transformers' own modeling files, tiny
configs, random init, nothing downloaded. Per family: what fuse makes of it and a report line for
every GEMM it keeps; logits and gradients as close to the fp64 model as the unfused bf16 model's;
the state_dict unchanged, loading strictly both ways and through save_pretrained/from_pretrained of
the plain class; generate(); dtype conversions; a fused Mixtral trains. CPU: gemmgen's ops
evaluate their recipes' references (the grouped experts' too)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import gemmgen as gg

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pyproject's [test])")

SMALL: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                         "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _configs() -> dict[str, Any]:
    tf = transformers
    ids = {k: SMALL[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    return {
        "llama": tf.LlamaConfig(**SMALL),
        "qwen2": tf.Qwen2Config(**SMALL),
        "qwen3": tf.Qwen3Config(**SMALL, head_dim=16),
        "mixtral": tf.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": tf.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                       decoder_sparse_step=1, head_dim=16),
        "deepseek_v3": tf.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, moe_intermediate_size=64,
                                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                           first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
                                           kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
        "gpt2": tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, **ids),
        "bert": tf.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              vocab_size=128, pad_token_id=0),
        "modernbert": tf.ModernBertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, vocab_size=128, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2, cls_token_id=1, sep_token_id=2),
    }


MASKED = ("bert", "modernbert")  # the encoders: AutoModelForMaskedLM
FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "gpt2", "bert", "modernbert")

#: What fuse(mlp=True) makes of each family's MLPs and experts, counted by the report's lines.
EXPECTED = {
    "llama": {"FusedMLP": 2}, "qwen2": {"FusedMLP": 2}, "qwen3": {"FusedMLP": 2},
    "mixtral": {"GroupedExperts": 2}, "qwen3_moe": {"GroupedExperts": 2},
    "deepseek_v3": {"FusedMLP": 2, "GroupedExperts": 1},  # a dense layer, the shared experts, the routed ones
    "gpt2": {"FusedMLP": 2}, "bert": {"FusedLinear": 3},  # GPT-2's: Conv1D + GELU + Conv1D
    "modernbert": {"FusedMLP": 2, "FusedLinear": 1},  # chunked GLUs; its head's dense + GELU
}

#: What the report says of the MLPs fuse makes from spellings of their own, by family: a phrase of
#: each such MLP's line.
KEPT = {"gpt2": ("mlp.c_fc", "Conv1D + NewGELUActivation + Conv1D (transformer.h.0.mlp.c_proj) -> FusedMLP("
                             "linear_gelu_tanh_bias_bf16_kn, linear_none_bias_bf16_kn)"),
        "modernbert": ("mlp", "Wo(act(a) * b), a, b = Wi(x).chunk(2) -> FusedMLP(linear_geglu_bf16")}


def _model(family: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    config = _configs()[family]
    auto = transformers.AutoModelForMaskedLM if family in MASKED else transformers.AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes on tiny configs
        model = auto.from_config(config)
    return model.to(dtype).eval()


def _ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (2, 9), generator=g)


def _fp64(model: nn.Module) -> nn.Module:
    """The model in fp64, its experts run by transformers' eager loop (its grouped_mm is 16/32-bit)."""
    exact = copy.deepcopy(model).double()
    for m in exact.modules():
        config: Any = getattr(m, "config", None)
        if getattr(config, "_experts_implementation", None) is not None:
            config._experts_implementation = "eager"
    return exact


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.double()


def _gemm_modules(model: nn.Module) -> list[str]:
    """Every module a report must name: nn.Linear, other modules with a 2-d weight (GPT-2's Conv1D,
    routers) and transformers' 3-d experts."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) or (isinstance(m._parameters.get("weight"), torch.Tensor)
                                             and m._parameters["weight"].dim() == 2 and not isinstance(m, nn.Embedding))
            or "gate_up_proj" in m._parameters]


@pytest.fixture(scope="module", params=FAMILIES)
def zoo(request: pytest.FixtureRequest) -> tuple[str, nn.Module, nn.Module, list[str]]:
    family = request.param
    model = _model(family)
    fused, report = gg.nn.fuse(copy.deepcopy(model), mlp=True)
    return family, model, fused, report


def test_fuse_makes_what_each_family_allows_and_names_every_other_gemm(zoo) -> None:
    family, model, _, report = zoo
    made = {kind: sum(f"-> {kind}(" in line for line in report) for kind in ("FusedMLP", "GroupedExperts",
                                                                          "FusedLinear")}
    assert {k: v for k, v in made.items() if v} == EXPECTED[family], report
    named = {line.split(":")[0] for line in report}
    mlps = [line.split(":")[0] + "." for line in report if "are its children" in line]
    missing = [n for n in _gemm_modules(model) if n not in named and not n.startswith(tuple(mlps))]
    assert not missing, f"{family}: the report names no line for {missing}"
    if family in KEPT:
        module, phrase = KEPT[family]
        lines = [line for line in report if line.split(":")[0].endswith(module)]
        assert lines and phrase in lines[0] and all(phrase.split(" (")[0] in line for line in lines), lines


def test_fused_logits_are_as_close_to_fp64_as_the_unfused_models(zoo) -> None:
    family, model, fused, _ = zoo
    exact = _fp64(model)
    ids = _ids()
    want = _logits(exact, ids)
    unfused_err = (_logits(model, ids) - want).abs().max().item()
    got = fused(ids).logits
    assert got.is_contiguous() and got.dtype == torch.bfloat16
    fused_err = (got.double() - want).abs().max().item()
    assert fused_err <= 2 * unfused_err + 1e-2, (family, fused_err, unfused_err)


def test_fused_gradients_are_as_close_to_fp64_as_the_unfused_models(zoo) -> None:
    family, model, fused, _ = zoo
    exact = _fp64(model)
    ids = _ids(2)
    grads = []
    for m in (exact, model, fused):
        m.zero_grad()
        _logits(m, ids).logsumexp(-1).mean().backward()
        grads.append({n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None})
    want, unfused, got = grads
    assert set(got) == set(want) == set(unfused)
    for name, g in want.items():
        scale = g.norm().item() + 1e-12
        unfused_err = (unfused[name] - g).norm().item() / scale
        fused_err = (got[name] - g).norm().item() / scale
        assert fused_err <= 2 * unfused_err + 2e-2, (family, name, fused_err, unfused_err)


def test_the_state_dict_is_unchanged_and_loads_strictly_both_ways(zoo, tmp_path) -> None:
    family, model, fused, _ = zoo
    assert [(k, v.shape) for k, v in fused.state_dict().items()] == \
        [(k, v.shape) for k, v in model.state_dict().items()]
    plain = _model(family)
    plain.load_state_dict(fused.state_dict(), strict=True)
    fresh, _ = gg.nn.fuse(_model(family), mlp=True)
    fresh.load_state_dict(model.state_dict(), strict=True)
    ids = _ids()
    assert torch.equal(_logits(fresh, ids), _logits(fused, ids))
    fused.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if family in MASKED else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name  # nothing initialised afresh


def test_generate_gives_the_unfused_models_tokens(zoo) -> None:
    family, model, fused, _ = zoo
    if family in MASKED:
        pytest.skip("an encoder: no generate()")
    ids = _ids(3)
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(fused.generate(ids, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("family", ["mixtral", "llama"])
def test_fused_models_follow_dtype_conversions(family: str) -> None:
    model = _model(family)
    fused, _ = gg.nn.fuse(copy.deepcopy(model), mlp=True)
    ids = _ids()
    with pytest.warns(gg.GemmgenWarning, match="no kernel computing in torch.float32"):
        got = fused.float()(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, model.float()(ids).logits, rtol=1e-5, atol=1e-5)
    half = fused.half()(ids).logits
    assert half.dtype == torch.float16 and torch.isfinite(half).all()


def test_a_fused_mixtral_trains_as_the_unfused_one() -> None:
    model = _model("mixtral").train()
    fused, report = gg.nn.fuse(copy.deepcopy(model), mlp=True)
    assert sum("GroupedExperts" in line for line in report) == 2
    losses = []
    for m in (model, fused):
        torch.manual_seed(5)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        curve = []
        for _ in range(12):
            ids = _ids(100)
            loss = m(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    unfused, got = losses
    assert got[-1] < got[0] - 0.1, got  # it learns
    assert abs(got[-1] - unfused[-1]) / unfused[-1] < 0.02, (got, unfused)


@pytest.mark.parametrize("precision", [gg.training.Float8Blockwise(), gg.training.Float8Tensorwise()], ids=repr)
def test_a_fused_mixtral_trains_its_experts_in_fp8(precision: gg.training.Precision) -> None:
    """fuse(precision=...) with fp32 master weights: each experts module becomes a GroupedExperts
    whose both projections run fp8 kernels (forward, dL/dacc, dgrad and the K-grouped weight
    gradient: 7 gemmgen ops per layer, no torch._grouped_mm); 12 AdamW steps end within 2% of the
    bf16 fused model's loss (measured 2026-12-07: 0.013% Float8Blockwise, 0.71% Float8Tensorwise)."""
    from tests.nn.dispatched import DispatchedOps

    model = _model("mixtral", torch.float32).train()
    fp8, report = gg.nn.fuse(copy.deepcopy(model), mlp=True, compute_dtype=torch.bfloat16, precision=precision)
    fprop = f"GroupedExperts(grouped_linear_swiglu_bf16_{precision.suffix}_fprop"
    assert sum(fprop in line for line in report) == 2
    bf16, _ = gg.nn.fuse(copy.deepcopy(model), mlp=True, compute_dtype=torch.bfloat16)
    with DispatchedOps() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        fp8(_ids(), labels=_ids()).loss.backward()
    assert seen.ops["gemmgen"] == 14 and "_grouped_mm" not in seen.ops
    experts = fp8.get_submodule("model.layers.0.mlp.experts")
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.dtype == torch.float32
    losses = []
    for m in (bf16, fp8):
        torch.manual_seed(5)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        for _ in range(12):
            ids = _ids(100)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    print(f"{precision}: loss {losses[1]:.5f}, bf16 {losses[0]:.5f}, {abs(losses[1] - losses[0]) / losses[0]:.4%}")
    assert abs(losses[1] - losses[0]) / losses[0] < 0.02, losses


@pytest.mark.parametrize(("recompute", "accumulate_grad"), [(False, False), (True, False), (False, True)])
def test_a_conv1d_fuses_with_its_weight_as_stored(recompute: bool, accumulate_grad: bool) -> None:
    """GPT-2's Conv1D (x @ W + b, W in x out) as a FusedLinear reading W N-major: the same
    parameters (no copy, no transpose), forward and every gradient as the Conv1D + GELU's in fp64."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(4)
    conv = Conv1D(72, 48).bfloat16()  # nf = 72 out, nx = 48 in
    fused = gg.nn.FusedLinear.from_conv1d(conv, "gelu_tanh", recompute=recompute, accumulate_grad=accumulate_grad)
    assert fused.weight is conv.weight and fused.weight.shape == (48, 72)
    assert fused.recipe.ir.gemm.layout_b.value == "row"
    x = torch.randn(3, 5, 48).bfloat16().requires_grad_()
    y = fused(x)
    assert y.shape == (3, 5, 72) and y.dtype == torch.bfloat16 and y.is_contiguous()
    exact = copy.deepcopy(conv).double()
    xd = x.detach().double().requires_grad_()
    want = torch.nn.functional.gelu(exact(xd), approximate="tanh")
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(want)
    y.backward(g.bfloat16())
    want.backward(g)
    weight: Any = conv.weight
    got_w = weight.main_grad if accumulate_grad else weight.grad
    assert got_w is not None and exact.weight.grad is not None and xd.grad is not None and x.grad is not None
    assert got_w.shape == (48, 72)
    for got, ref in ((got_w, exact.weight.grad), (x.grad, xd.grad), (conv.bias.grad, exact.bias.grad)):
        assert got is not None and ref is not None
        assert (got.double() - ref).norm() / ref.norm() < 2e-2


def test_the_report_says_why_an_mlp_is_left() -> None:
    """An activation gemmgen has no kernel for (GPT-2 with quick_gelu) and a gated MLP whose
    intermediate size TMA cannot read (100) are named with their reasons."""
    tf = transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2 = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(
            n_embd=64, n_layer=1, n_head=4, vocab_size=128, activation_function="quick_gelu", bos_token_id=1,
            eos_token_id=2)).bfloat16()
        llama = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**{**SMALL, "intermediate_size": 100,
                                                                      "num_hidden_layers": 1})).bfloat16()
    _, report = gg.nn.fuse(gpt2, mlp=True)
    assert "transformer.h.0.mlp.c_fc: not fused (transformer.h.0.mlp.act (QuickGELUActivation) computes no " \
           "activation gemmgen fuses" in "\n".join(report), report
    _, report = gg.nn.fuse(llama, mlp=True)
    assert "model.layers.0.mlp: not a FusedMLP (down_proj: in_features 100 is not a multiple of 8" \
           in "\n".join(report), report


def test_a_fused_mixtral_compiles_whole_and_gives_eager_bits() -> None:
    """torch.compile(fullgraph=True) over the fused model, GroupedExperts' routing included (no
    graph break, no host sync): the same logits and gradients as eager (aot_eager: torch's own
    kernels for the rest, gemmgen's ops as in eager)."""
    fused, _ = gg.nn.fuse(_model("mixtral").train(), mlp=True)
    compiled_copy = copy.deepcopy(fused)
    ids = _ids(7)
    fused(ids, labels=ids).loss.backward()
    compiled = torch.compile(compiled_copy, fullgraph=True, backend="aot_eager")
    compiled(ids, labels=ids).loss.backward()
    for (name, eager), got in zip(fused.named_parameters(), compiled_copy.parameters(), strict=True):
        if eager.grad is None or got.grad is None:
            assert eager.grad is None and got.grad is None, name
        else:
            assert torch.equal(eager.grad, got.grad), name


def test_from_conv1d_refuses_what_it_cannot_run_by_name() -> None:
    from transformers.pytorch_utils import Conv1D

    from gemmgen.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="conv: expected transformers' Conv1D"):
        gg.nn.FusedLinear.from_conv1d(nn.Linear(16, 16))
    with pytest.raises(InvalidArgument, match="activation: swiglu reads gate and up interleaved"):
        gg.nn.FusedLinear.from_conv1d(Conv1D(32, 16).bfloat16(), "swiglu")


@pytest.mark.parametrize(("recompute", "accumulate_grad"), [(False, False), (True, False), (False, True)])
def test_gpt2s_mlp_is_one_fused_mlp_over_its_conv1ds(recompute: bool, accumulate_grad: bool) -> None:
    """transformers' GPT2MLP (Conv1D -> gelu_new -> Conv1D, weights in x out) made one FusedMLP: its
    kernels read both weights as stored (fc1 and fc2 N-major, the derived dgrad's B, W2 as out x
    hidden, column-major); forward and every gradient as the module's in fp64; the state_dict
    unchanged; the second Conv1D named in the report."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(5)
    config = transformers.GPT2Config(n_embd=48, resid_pdrop=0.0)
    block = nn.Module()
    block.mlp = GPT2MLP(80, config).bfloat16()
    keys = {k: v.shape for k, v in block.state_dict().items()}
    exact = copy.deepcopy(block.mlp).double()
    fused: Any
    fused, report = gg.nn.fuse(block, mlp=True, recompute=recompute, accumulate_grad=accumulate_grad)
    mlp = fused.mlp.c_fc
    assert isinstance(mlp, gg.nn.FusedMLP) and mlp.fc1.weight_in_out and mlp.fc2.weight_in_out, report
    assert mlp.weight is block.mlp.c_fc.weight and mlp.weight.shape == (48, 80)
    assert mlp._backward.kernel.ir.gemm.layout_b.value == ("row" if recompute else "col")
    assert "mlp.c_proj: the second layer of the FusedMLP at mlp.c_fc" in "\n".join(report), report
    assert {k: v.shape for k, v in fused.state_dict().items()} == keys
    x = torch.randn(3, 7, 48).bfloat16().requires_grad_()
    y = fused.mlp(x)
    assert y.shape == (3, 7, 48) and y.dtype == torch.bfloat16 and y.is_contiguous()
    xd = x.detach().double().requires_grad_()
    want = exact(xd)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(want)
    y.backward(g.bfloat16())
    want.backward(g)
    got_grads = {n: (getattr(p, "main_grad", None) if accumulate_grad and p.dim() == 2 else p.grad)
                 for n, p in block.mlp.named_parameters()}
    for name, ref in [*((n, p.grad) for n, p in exact.named_parameters()), ("x", xd.grad)]:
        got = x.grad if name == "x" else got_grads[name]
        assert got is not None and ref is not None, name
        assert got.shape == ref.shape and (got.double() - ref).norm() / ref.norm() < 2e-2, name


def test_a_conv1d_and_a_linear_make_no_fused_mlp_and_the_report_says_why() -> None:
    from transformers.pytorch_utils import Conv1D

    from gemmgen.errors import InvalidArgument
    from gemmgen.training import Float8Blockwise

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = Conv1D(64, 32), nn.GELU(), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.act(self.up(x)))

    _, report = gg.nn.fuse(Mixed().bfloat16(), mlp=True)
    assert "not a FusedMLP: a FusedMLP's layers are two nn.Linear or two Conv1D, and these are a Conv1D and a " \
           "Linear" in report[0], report
    up, down = Conv1D(64, 32).bfloat16(), Conv1D(32, 64).bfloat16()
    second = gg.nn.MLPSecondLayer(down, "down", "up")
    with pytest.raises(InvalidArgument, match=r"precision: Float8Blockwise.* fc1 and fc2 are Conv1D layers"):
        gg.nn.FusedMLP.chain(up, "gelu", down, second, precision=Float8Blockwise())
    with pytest.raises(InvalidArgument, match="fc2: expected transformers' Conv1D"):
        gg.nn.FusedMLP.chain(up, "gelu", nn.Linear(64, 32).bfloat16(), second)

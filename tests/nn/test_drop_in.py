"""gemmgen's layers as drop-in replacements of the modules they replace (issue 59): `fuse()` never
changes a model's state_dict, the layers follow dtype conversions and autocast and return what the
replaced module returned, their options are read-only or take effect, and their outputs are
contiguous tensors of the replaced module's shape. Small hand-built models in the style of
Llama's (gated MLP: gate_proj, up_proj, down_proj, act_fn) and GPT's (Linear -> GELU -> Linear
inside a larger forward); CPU: the ops evaluate their recipes' references."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemmgen as gg
from gemmgen.testing.grouped import experts_loop

BF16_TOL: dict[str, Any] = {"rtol": 2e-2, "atol": 2e-2}


class LlamaMLP(nn.Module):
    """As transformers writes Llama's MLP."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Two gated-MLP blocks and an lm_head of 100 columns (not a multiple of 8)."""

    def __init__(self, hidden: int = 64, intermediate: int = 96, vocab: int = 100) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LlamaBlock(hidden, intermediate) for _ in range(2)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class GPTBlock(nn.Module):
    """GPT-style: the MLP's Linear -> GELU -> Linear inside a larger forward (residual, dropout)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.c_proj(self.act(self.c_fc(self.ln(x)))))


class TinyGPT(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.h = nn.ModuleList([GPTBlock(hidden) for _ in range(2)])
        self.head = nn.Sequential(nn.Linear(hidden, 128), nn.ReLU(), nn.Linear(128, 24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.head(x)


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": TinyLlama, "gpt": TinyGPT}


def _model(kind: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]().to(dtype)


def _fused(model: nn.Module, **kw: Any) -> Any:
    """fuse(mlp=True) of a deep copy (typed Any: tests look its submodules up by name)."""
    fused, report = gg.nn.fuse(copy.deepcopy(model), mlp=True, **kw)
    assert any("FusedMLP" in line for line in report), report
    return fused


def _saved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict through torch.save and torch.load, as a checkpoint on disk."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _layout(model: nn.Module) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype, v.stride()) for k, v in model.state_dict().items()}


def _x(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# 1. Fusion never changes a model's state_dict.

@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fusing_keeps_the_state_dict_keys_shapes_and_layouts(kind):
    """The fused model's state_dict is the unfused one's: the same keys in the same order, shapes,
    dtypes and strides, each tensor in storage of its own (as a safetensors writer wants them),
    and the very parameter objects the model had."""
    model = _model(kind)
    params = dict(model.named_parameters())
    fused, report = gg.nn.fuse(model, mlp=True, unpaired=True)
    assert sum("-> FusedMLP" in line for line in report) == (2 if kind == "llama" else 3), report
    assert _layout(fused) == _layout(copy.deepcopy(_model(kind)))
    state = fused.state_dict()
    assert len({v.untyped_storage().data_ptr() for v in state.values()}) == len(state)
    assert all(v.is_contiguous() for v in state.values())
    assert dict(fused.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in fused.named_parameters())


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_checkpoints_load_strictly_both_ways(kind):
    """A checkpoint of the unfused model loads strictly into the fused one (also after the fused
    model has served, so a gated MLP's interleaved copy of gate and up must follow the new
    weights), and the fused model's saved state_dict loads strictly into a fresh unfused model
    (save_pretrained, then from_pretrained of the plain class): same outputs either way."""
    fused = _fused(_model(kind, seed=0))
    x = _x(3, 5, 64)
    with torch.no_grad():
        fused(x)  # serves with its first weights
        other = _model(kind, seed=1)
        fused.load_state_dict(_saved(other.state_dict()), strict=True)
        want = other(x)
        assert want.float().abs().max() > 0
        torch.testing.assert_close(fused(x), want, **BF16_TOL)
        plain = _model(kind, seed=2)
        plain.load_state_dict(_saved(fused.state_dict()), strict=True)
        for k, v in fused.state_dict().items():
            assert torch.equal(plain.state_dict()[k], v), k
        torch.testing.assert_close(fused(x), plain(x), **BF16_TOL)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fused_models_pickle_and_take_assigned_parameters(kind):
    """torch.save of the whole model, pickle and deepcopy keep a FusedMLP reading the parameters its
    model registers (not copies of its own); load_state_dict(assign=True), which puts new tensors
    in their place, and .half() reach it; fusing the fused model again changes nothing (the
    Linears a gated FusedMLP keeps as its children included)."""
    fused = _fused(_model(kind), unpaired=True)
    x = _x(4, 64)
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    with torch.no_grad():
        want = fused(x)
        for other in (torch.load(buf, weights_only=False), copy.deepcopy(fused)):
            assert torch.equal(other(x), want)
            new = _model(kind, seed=5)
            other.load_state_dict(new.state_dict(), strict=True, assign=True)
            torch.testing.assert_close(other(x), new(x), **BF16_TOL)
            other.half()
            torch.testing.assert_close(other(x.half()), new.half()(x.half()), **BF16_TOL)
    again, report = gg.nn.fuse(fused, mlp=True, unpaired=True)
    assert again is fused and report == []


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_an_optimizer_made_before_fusing_trains_the_fused_model(kind):
    """Gradients reach the parameters the model had (an optimizer built before fuse holds them):
    two SGD steps of the fused model move them as the unfused model's steps move its own, and the
    next forward without gradients reads the updated weights."""
    ref = _model(kind)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fused, _ = gg.nn.fuse(model, mlp=True)
    x, g = _x(4, 64), _x(4, 100 if kind == "llama" else 24, seed=2)
    for _ in range(2):
        for net, o in ((ref, opt_ref), (fused, opt)):
            o.zero_grad()
            net(x).backward(g)
            o.step()
    for (name, mine), theirs in zip(fused.named_parameters(), ref.parameters(), strict=True):
        assert mine.grad is not None, name
        moved = (theirs.float() - _model(kind).state_dict()[name].float()).abs().max()
        assert moved > 0, name
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=0.02, atol=0.05 * moved.item(),
                                   msg=lambda s: f"{name}: {s}")  # noqa: B023
    with torch.no_grad():
        want = ref(x)
        torch.testing.assert_close(fused(x), want, rtol=0.02, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_accumulate_grad_adds_into_the_kept_parameters_main_grad(kind):
    """accumulate_grad=True on a fused MLP (set after fuse: it takes effect) adds each weight's
    gradient in fp32 into that parameter's own `main_grad`, gate's and up's apart, `.grad` unset:
    the gradient the same fused model without it sets as `.grad` (in bf16)."""
    ref = _fused(_model(kind))
    fused = copy.deepcopy(ref)
    mlps = [m for m in fused.modules() if isinstance(m, gg.nn.FusedMLP)]
    for mlp in mlps:
        mlp.accumulate_grad = True
    x, g = _x(6, 64), _x(6, 100 if kind == "llama" else 24, seed=2)
    fused(x).backward(g)
    ref(x).backward(g)
    mains = 0
    for (name, mine), theirs in zip(fused.named_parameters(), ref.parameters(), strict=True):
        main_grad = getattr(mine, "main_grad", None)
        if main_grad is None:
            continue
        mains += 1
        assert mine.grad is None and main_grad.dtype == torch.float32, name
        assert theirs.grad is not None
        scale = theirs.grad.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(main_grad, theirs.grad.float(), rtol=2**-7, atol=2**-7 * scale)
    assert mains == 6  # llama: gate, up, down per block; gpt: c_fc, c_proj per block, and the head's two


# 2. Dtype-faithful layers.

@pytest.mark.parametrize("kind", sorted(MODELS))
def test_half_after_fuse_computes_and_returns_fp16(kind):
    """model.half() after fuse(): the fused layers compute in fp16 and return it, as the unfused
    model.half() does (no dtype error in the next layer)."""
    ref = _model(kind)
    fused = _fused(ref, unpaired=True).half()
    x = _x(3, 64, dtype=torch.float16)
    want = copy.deepcopy(ref).half()(x)
    got = fused(x)
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_float_after_fuse_computes_in_fp32_and_says_so_once(kind):
    """model.float() after fuse(): gemmgen has no fp32 kernel, so each fused layer says so once
    (a GemmgenWarning naming the dtype), and computes in fp32 as the unfused fp32 model does (to
    fp32 rounding, far closer than bf16 would be), gradients included."""
    ref = _model(kind)
    fused = _fused(ref, unpaired=True).float()
    ref = copy.deepcopy(ref).float()
    layers = [m for m in fused.modules() if isinstance(m, gg.nn.FusedLinear | gg.nn.FusedMLP)]
    assert layers
    x = _x(3, 64, dtype=torch.float32).requires_grad_()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = fused(x)
        fused(x)
    said = [str(w.message) for w in seen if issubclass(w.category, gg.GemmgenWarning)]
    assert len(said) == len(layers) and all("no kernel computing in torch.float32" in s for s in said), said
    want = ref(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    for mine, theirs in zip(torch.autograd.grad(got, [x, *fused.parameters()], g),
                            torch.autograd.grad(want, [x, *ref.parameters()], g), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_compute_dtype_returns_what_nn_linear_returned():
    """fuse(compute_dtype=bf16) on an fp32 model: without autocast each layer computes in bf16 but
    returns fp32, as the nn.Linear it replaced did, so the fp32 layers after it still run; under
    autocast it returns autocast's dtype, as nn.Linear does."""
    ref = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32), nn.SiLU(), nn.Linear(32, 8))
    fused: Any
    fused, report = gg.nn.fuse(copy.deepcopy(ref), compute_dtype=torch.bfloat16)
    assert len(report) == 3 and report[2] == "4: kept (no activation module follows it; unpaired=True swaps it " \
        "for a FusedLinear)" and type(fused[4]) is nn.Linear, report
    x = _x(5, 64, dtype=torch.float32)
    first = fused[0](x)
    assert first.dtype == ref[0](x).dtype == torch.float32
    y = fused(x)  # the fp32 Linear at the end takes it
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref(x), **BF16_TOL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused[0](x).dtype == ref[0](x).dtype == torch.bfloat16


def test_a_fused_layer_computes_in_autocasts_dtype():
    """A bf16 layer under fp16 autocast computes in and returns fp16, as nn.Linear does."""
    linear = nn.Linear(64, 32, dtype=torch.bfloat16)
    fused = gg.nn.FusedLinear.from_linear(copy.deepcopy(linear), activation="relu")
    mlp = gg.nn.FusedMLP(64, 48, 16, activation="silu")
    x = _x(5, 64)
    with torch.autocast("cpu", dtype=torch.float16):
        want = F.relu(linear(x))
        got = fused(x)
        assert got.dtype == want.dtype == torch.float16 and mlp(x).dtype == torch.float16
    torch.testing.assert_close(got, want, **BF16_TOL)


def test_grouped_linear_follows_dtype_conversions():
    """GroupedLinear.half() computes in fp16; .float() says once that it has no fp32 kernel and
    computes each expert's rows in fp32, as the experts' own Linears do."""
    torch.manual_seed(0)
    experts = gg.nn.GroupedLinear(3, 32, 24, activation="silu")
    linears = [nn.Linear(32, 24) for _ in range(3)]
    with torch.no_grad():
        for e, linear in enumerate(linears):
            linear.weight.copy_(experts.weight[e])
            assert experts.bias is not None
            linear.bias.copy_(experts.bias[e])
    x, offsets = _x(10, 32, dtype=torch.float32), torch.tensor([4, 4, 10], dtype=torch.int32)
    want = experts_loop(linears, x, offsets, "silu")
    half = copy.deepcopy(experts).half()
    got = half(x.half(), offsets)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), want, **BF16_TOL)
    single = copy.deepcopy(experts).float()
    with pytest.warns(gg.GemmgenWarning, match=r"GroupedLinear: gemmgen has no kernel computing in torch\.float32"):
        got = single(x, offsets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_quantized_layers_keep_their_format_across_conversions():
    """BlockScaledLinear.half(): the e4m3 weight and its fp32 scales stay as they are (a cast would
    undo the quantization) and the layer returns fp16; after .float() it returns fp32."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, dtype=torch.bfloat16)
    layer = gg.nn.BlockScaledLinear.from_linear(linear)
    x = _x(4, 128)
    want = layer(x)
    half = copy.deepcopy(layer).half()
    assert half.weight.dtype == torch.float8_e4m3fn and half.weight_scale.dtype == torch.float32
    got = half(x.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    single = copy.deepcopy(layer).float()
    assert single.weight.dtype == torch.float8_e4m3fn and single(x.float()).dtype == torch.float32


# 4. Options are read-only or take effect.

READ_ONLY: list[tuple[str, Callable[[], nn.Module], str, Any]] = [
    ("FusedLinear", lambda: gg.nn.FusedLinear(64, 32, activation="silu"), "activation", "gelu"),
    ("FusedLinear", lambda: gg.nn.FusedLinear(64, 32), "out_features", 16),
    ("FusedLinear", lambda: gg.nn.FusedLinear(64, 32), "compute_dtype", torch.float16),
    ("FusedMLP", lambda: gg.nn.FusedMLP(64, 32, 16, activation="silu"), "activation", "relu"),
    ("GroupedLinear", lambda: gg.nn.GroupedLinear(2, 32, 16), "num_experts", 4),
    ("GroupedLinear", lambda: gg.nn.GroupedLinear(2, 32, 16), "activation", "silu"),
    ("BlockScaledLinear", lambda: gg.nn.BlockScaledLinear(128, 64), "dtype", torch.float16),
]


@pytest.mark.parametrize(("layer", "make", "option", "value"), READ_ONLY,
                         ids=[f"{layer}.{option}" for layer, _, option, _ in READ_ONLY])
def test_options_the_kernels_were_made_for_are_read_only(layer, make, option, value):
    """Assigning such an option is refused by name with the fix (a new layer), as a gemmgen error
    that is also an AttributeError; the layer still runs as it was built."""
    module = make()
    before = getattr(module, option)
    with pytest.raises(gg.InvalidArgument, match=rf"{layer}\.{option} is read-only: .* construct a new layer "
                                                 rf"with the {option}= argument instead") as raised:
        setattr(module, option, value)
    assert isinstance(raised.value, AttributeError)
    assert getattr(module, option) == before


def test_recompute_and_accumulate_grad_take_effect_when_changed():
    """`recompute` (shown in the repr) changed after construction applies from the next forward,
    also when changed between a forward and its backward (which runs what its forward saved);
    the gradients are the saving layer's."""
    torch.manual_seed(0)
    for make in (lambda: gg.nn.FusedLinear(40, 72, activation="silu"),
                 lambda: gg.nn.FusedMLP(40, 72, 24, activation="silu")):
        saving = make()
        changed = copy.deepcopy(saving)
        changed.recompute = True
        assert "recompute=True" in repr(changed)
        x = _x(21, 40)
        g = torch.randn(21, saving(x).shape[-1]).bfloat16()
        want = torch.autograd.grad(saving(x), list(saving.parameters()), g)
        got = torch.autograd.grad(changed(x), list(changed.parameters()), g)
        y = changed(x)
        changed.recompute = False
        between = torch.autograd.grad(y, list(changed.parameters()), g)
        for a, b, c in zip(want, got, between, strict=True):
            scale = a.float().abs().max().item()
            torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.05 * scale)
            torch.testing.assert_close(c.float(), a.float(), rtol=0.05, atol=0.05 * scale)
        with pytest.raises(gg.InvalidArgument, match=r"recompute: expected True or False, got 'yes'"):
            changed.recompute = "yes"  # type: ignore[assignment]


# 5. Outputs are contiguous tensors of the replaced module's shape.

def test_outputs_are_contiguous_in_the_replaced_modules_shape():
    """An output width that is not a multiple of 8 (100 columns): every layer returns a contiguous
    tensor of the replaced module's shape (`.view()` works), with and without gradients."""
    torch.manual_seed(0)
    x3 = _x(3, 7, 64)
    layers: list[tuple[nn.Module, tuple[torch.Tensor, ...], tuple[int, ...]]] = [
        (gg.nn.FusedLinear(64, 100), (x3,), (3, 7, 100)),
        (gg.nn.FusedLinear(64, 100, activation="swiglu"), (x3[0],), (7, 100)),
        (gg.nn.FusedMLP(64, 96, 100, activation="gelu"), (x3,), (3, 7, 100)),
        (gg.nn.GroupedLinear(2, 64, 100, activation="silu"), (x3[0], torch.tensor([3, 7], dtype=torch.int32)),
         (7, 100)),
        (gg.nn.BlockScaledLinear(128, 100), (_x(5, 128),), (5, 100)),
    ]
    for layer, args, shape in layers:
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                y = layer(*args)
            assert y.shape == shape and y.is_contiguous(), (type(layer).__name__, y.shape, y.stride())
            assert y.view(-1).numel() == y.numel()
    fused, _ = gg.nn.fuse(_model("llama"), unpaired=True)
    assert isinstance(fused.lm_head, gg.nn.FusedLinear)
    y = fused(x3)
    assert y.shape == (3, 7, 100) and y.is_contiguous()

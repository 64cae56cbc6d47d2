"""Every refusal's suggested fix works when applied: each case makes the mistake, reads the fix the
message gives, applies it (the code it spells is run as written), and the call then passes. Also:
the reference checks operands as the kernel does, a problem too large is refused before any copy,
and reprs are short."""

from __future__ import annotations

import re

import pytest
import torch

import gemmgen as gg
from gemmgen.integrations.ops import call_realigning
from gemmgen.testing.calls import cpu_kernel

pytestmark = pytest.mark.faults
bf = torch.bfloat16


@pytest.fixture(scope="module")
def kernels(recipe_kernels):
    return {name: cpu_kernel(recipe_kernels[name]) for name in ("gemm_bf16", "bias_gelu", "bias_silu_residual")}


def _ab(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gemm_bf16's operands: A row-major, B column-major."""
    return torch.randn(m, k).to(bf), torch.randn(n, k).to(bf).t()


def _refusal(call, *args, **kw) -> str:
    with pytest.raises(gg.InvalidArgument) as e:
        call(*args, **kw)
    return str(e.value)


def _apply(message: str, env: dict) -> dict:
    """Run the Python fix the message spells (`... padded storage: CODE; or ...` or `... (CODE)`)."""
    m = re.search(r"(?:padded storage|pass a copy): (.*?)(?:; or make|$)", message) or \
        re.search(r"\((\w+ = torch\.empty\(.*?\))\)", message)
    assert m, f"no fix to apply in: {message}"
    exec(m.group(1), {"torch": torch}, env)
    return env


def test_a_dtype_mistake_is_fixed_by_the_conversion_it_names(kernels):
    a, b = _ab(64, 64, 64)
    message = _refusal(kernels["gemm_bf16"].prepare, a.float(), b)
    assert "(the recipe declares bf16)" in message and "declare the recipe with" not in message
    fix = re.search(r"convert it with a\.to\((torch\.\w+)\)", message)
    assert fix
    kernels["gemm_bf16"].prepare(a.float().to(eval(fix.group(1), {"torch": torch})), b)


def test_an_out_that_is_not_row_major_is_told_to_pass_a_row_major_one_not_a_copy(kernels):
    a, b = _ab(64, 96, 64)
    out = torch.empty(96, 64, dtype=bf).t()
    message = _refusal(kernels["gemm_bf16"].prepare, a, b, out=out)
    assert ".contiguous()" not in message and "a copy would not land in your tensor" in message
    env = _apply(message, {})
    prepared = kernels["gemm_bf16"].prepare(a, b, out=env["out"])
    assert prepared.outputs[0] is env["out"]


def test_an_alias_names_the_input(kernels):
    a, b = _ab(64, 64, 64)
    message = _refusal(kernels["gemm_bf16"].prepare, a, b, out=a)
    assert "shares memory with input a;" in message and "#0" not in message
    assert "pass a separate output tensor, or omit out= to get a new one" in message
    kernels["gemm_bf16"].prepare(a, b, out=torch.empty(64, 64, dtype=bf))


@pytest.mark.parametrize("which", ["a", "b"])
def test_a_k_that_breaks_tma_alignment_says_so_and_its_padded_copy_passes(kernels, which):
    """K = 4100: contiguous rows of A (or columns of B) are 8200 bytes, not a multiple of 16."""
    a, b = _ab(64, 64, 4100)
    message = _refusal(kernels["gemm_bf16"].prepare, a, b)
    assert message.startswith("a: row stride 4100 must be a multiple of 8 elements")
    assert "with K = 4100, a contiguous a's rows are 8200 bytes" in message and "make K a multiple of 8" in message
    env = _apply(message, {"a": a})
    if which == "b":
        message = _refusal(kernels["gemm_bf16"].prepare, env["a"], b)
        assert message.startswith("b: column stride 4100 must be a multiple of 8")
        env = _apply(message, {**env, "b": b})
    else:
        env["b"] = _apply(_refusal(kernels["gemm_bf16"].prepare, env["a"], b), {"b": b})["b"]
    assert torch.equal(env["a"], a) and torch.equal(env["b"], b)
    kernels["gemm_bf16"].prepare(env["a"], env["b"])


def test_a_k_of_one_no_longer_reads_stride_1_must_be_at_least_1(kernels):
    a, b = _ab(64, 64, 1)
    a = _apply(_refusal(kernels["gemm_bf16"].prepare, a, b), {"a": a})["a"]
    message = _refusal(kernels["gemm_bf16"].prepare, a, b)
    assert "must be >= 1" not in message and "b: column stride 1 must be a multiple of 8" in message
    env = _apply(message, {"b": b})
    assert torch.equal(env["b"], b)
    kernels["gemm_bf16"].prepare(a, env["b"])


def test_an_overlapping_view_is_named_as_such(kernels):
    a, b = _ab(64, 64, 64)
    message = _refusal(kernels["gemm_bf16"].prepare, a[:1].expand(64, 64), b)
    assert "row stride 0 is less than K = 64, so its rows overlap" in message
    kernels["gemm_bf16"].prepare(_apply(message, {"a": a[:1].expand(64, 64)})["a"], b)


def test_a_list_input_is_refused_by_name():
    layer = gg.nn.FusedLinear(64, 32)
    with pytest.raises(gg.InvalidArgument, match=r"input: expected a torch.Tensor of shape \(\.\.\., 64\), got list"):
        layer([[1.0] * 64])


def test_a_layer_dtype_given_as_a_string_is_told_the_torch_dtype():
    with pytest.raises(gg.InvalidArgument, match=r"dtype: expected torch.bfloat16 or torch.float16 .*got 'bf16' "
                                                 r"\(a str\); pass dtype=torch.bfloat16"):
        gg.nn.FusedLinear(64, 32, dtype="bf16")  # type: ignore[arg-type]
    assert gg.nn.FusedLinear(64, 32, dtype=torch.bfloat16).compute_dtype is torch.bfloat16


def test_a_replaced_weight_of_the_wrong_shape_is_reported_in_the_layers_terms():
    layer = gg.nn.FusedLinear(64, 32)
    right = layer.weight
    layer.weight = torch.nn.Parameter(torch.randn(32, 48, dtype=bf))
    with pytest.raises(gg.InvalidArgument, match=r"weight: expected shape \(32, 64\) = \(out_features, "
                                                 r"in_features\), got \(32, 48\)"):
        layer(torch.randn(4, 64, dtype=bf))
    layer.weight = right
    grouped = gg.nn.GroupedLinear(2, 64, 32)
    grouped.weight = torch.nn.Parameter(torch.randn(2, 32, 48, dtype=bf))
    with pytest.raises(gg.InvalidArgument, match=r"weight: expected shape \(2, 32, 64\) = \(num_experts, "
                                                 r"out_features, in_features\)"):
        grouped(torch.randn(4, 64, dtype=bf), torch.tensor([2, 4], dtype=torch.int32))


def test_the_reference_checks_operands_as_the_kernel_does(examples):
    r = examples["bias_silu_residual"]  # B row-major: K x N
    a, b = torch.randn(8, 16).to(bf), torch.randn(16, 24).to(bf)
    bias, residual = torch.randn(24).to(bf), torch.randn(8, 24).to(bf)
    cases = [(dict(bias=bias[:1], residual=residual), r"bias: expected a 1-D tensor of length 24 = N"),
             (dict(bias=bias[:-1], residual=residual), r"bias: expected a 1-D tensor of length 24 = N"),
             (dict(bias=bias, residual=residual[0]),
              r"residual: expected shape \(8, 24\) \(the output's\), got \(24,\)"),
             (dict(bias=bias, residual=residual.float()), r"residual: expected dtype torch.bfloat16 .*"
                                                          r"residual\.to\(torch\.bfloat16\)")]
    for operands, match in cases:
        with pytest.raises(gg.InvalidArgument, match=match):
            r.reference(a, b, **operands)
    d = r.reference(a, b, bias=bias, residual=residual.float().to(torch.bfloat16))
    assert d.shape == (8, 24) and d.abs().sum() > 0
    assert r.reference(a.t().contiguous().t(), b[:, :].t().contiguous().t(), bias=bias, residual=residual).shape \
        == (8, 24)  # any layout: the reference is not the kernel's memory rules


def test_a_problem_too_large_is_refused_before_the_op_copies_anything(kernels, monkeypatch):
    """An expanded A (stride 0, no memory) with M = 2^31: the layout check alone would have the op
    copy 2^31 x 64 bf16 values (256 GiB) to realign it; the size refusal comes first."""
    import gemmgen.integrations.ops as ops

    monkeypatch.setattr(ops, "tma_readable", lambda *a: pytest.fail("copied before the size check"))
    kernel = kernels["gemm_bf16"]
    a = torch.zeros(1, 64, dtype=bf).expand(2**31, 64)
    b = torch.randn(64, 64).to(bf).t()
    with pytest.raises(gg.InvalidArgument, match=r"M = 2147483648: too large for the kernel's 32-bit tile"):
        call_realigning(kernel.recipe, kernel.prepare, a, b, ())


def test_reprs_are_short(compiled, examples):
    k = compiled["gemm_bf16"]
    assert len(k.cubin) > 100_000
    for text in (repr(k), repr(k.generated), repr([k, k])):
        assert len(text) < 400, text[:500]
    assert repr(k).startswith("CompiledKernel('gemm_bf16', ") and "bytes of cubin, from" in repr(k)

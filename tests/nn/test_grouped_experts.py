"""`GroupedExperts` (issue 59: transformers' 3-d experts as gemmgen grouped kernels) against an
fp64 loop over each routed token's experts written here from the definition, with odd and empty
groups, a group of one, expert-parallel sentinels, both gate/up layouts, gradients, the kept
interleaved copy going stale, and bad inputs. CPU: the grouped ops evaluate their recipes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemmgen as gg
from gemmgen.errors import InvalidArgument, ReadOnlyOption
from tests.data.gated import Experts, routing
from tests.data.gated import experts_reference as loop


@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_fp64_loop_with_odd_empty_and_single_groups(bias: bool) -> None:
    torch.manual_seed(0)
    e, hidden, inter = 6, 64, 40
    ref = Experts(e, hidden, inter, bias).bfloat16()
    layer = gg.nn.GroupedExperts.from_experts(ref, "swiglu")
    tokens = 37
    index, weights = routing(tokens, e - 2, 2, 1)  # experts 4 and 5 get nothing
    index[0, 0] = 4  # expert 4: a group of one
    x = torch.randn(tokens, hidden).bfloat16()
    got = layer(x, index, weights)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
    want = loop(ref, x, index, weights)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_interleaved_and_concatenated_layouts_agree_and_sentinels_count_for_nothing() -> None:
    torch.manual_seed(1)
    e, hidden, inter = 4, 32, 16
    ref = Experts(e, hidden, inter).bfloat16()
    concat = gg.nn.GroupedExperts.from_experts(ref, "geglu")
    inter_ref = copy.deepcopy(ref)
    with torch.no_grad():
        w = ref.gate_up_proj
        inter_ref.gate_up_proj.copy_(gg.nn.interleave_pairs(w[:, :inter], w[:, inter:], dim=1))
    interleaved = gg.nn.GroupedExperts.from_experts(inter_ref, "geglu", concatenated=False)
    index, weights = routing(20, e, 2, 2)
    index[3, 1] = e  # expert parallelism's sentinel: another rank's expert
    x = torch.randn(20, hidden).bfloat16()
    got = concat(x, index, weights)
    assert torch.equal(got, interleaved(x, index, weights))
    torch.testing.assert_close(got.double(), loop(ref, x, index, weights, F.gelu), rtol=2e-2, atol=2e-2)


def test_gradients_reach_the_shared_parameters_and_match_fp64() -> None:
    torch.manual_seed(2)
    e, hidden, inter = 4, 32, 24
    ref = Experts(e, hidden, inter, bias=True).bfloat16()
    layer = gg.nn.GroupedExperts.from_experts(ref, "swiglu")
    assert layer.gate_up_proj is ref.gate_up_proj and list(layer.state_dict()) == list(ref.state_dict())
    index, weights = routing(29, e, 2, 3)
    x = torch.randn(29, hidden).bfloat16().requires_grad_()
    layer(x, index, weights).float().square().sum().backward()
    exact = copy.deepcopy(ref).double()
    xd = x.detach().double().requires_grad_()
    loop(exact, xd, index, weights).square().sum().backward()
    for got, want in ((x.grad, xd.grad), (ref.gate_up_proj.grad, exact.gate_up_proj.grad),
                      (ref.down_proj.grad, exact.down_proj.grad), (ref.down_proj_bias.grad, exact.down_proj_bias.grad)):
        assert got is not None and want is not None
        assert (got.double() - want).norm() / want.norm() < 2e-2


def test_the_kept_interleaved_copy_follows_in_place_updates() -> None:
    torch.manual_seed(3)
    ref = Experts(4, 32, 16).bfloat16()
    layer = gg.nn.GroupedExperts.from_experts(ref, "swiglu")
    index, weights = routing(9, 4, 1, 4)
    x = torch.randn(9, 32).bfloat16()
    with torch.no_grad():
        before = layer(x, index, weights)
        ref.gate_up_proj.mul_(2)  # an optimizer step, say: the same tensor, a new version
        after = layer(x, index, weights)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.double(), loop(ref, x, index, weights), rtol=2e-2, atol=2e-2)


def test_dtype_conversions_pickling_and_read_only_options() -> None:
    ref = Experts(4, 32, 16).bfloat16()
    layer = gg.nn.GroupedExperts.from_experts(ref, "swiglu")
    index, weights = routing(5, 4, 2, 5)
    x = torch.randn(5, 32)
    with pytest.warns(gg.GemmgenWarning, match="no kernel computing in torch.float32"):
        got = layer.float()(x, index, weights)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop(layer, x, index, weights), rtol=1e-5, atol=1e-5)
    clone = pickle.loads(pickle.dumps(layer.bfloat16()))
    assert torch.equal(clone(x.bfloat16(), index, weights), layer(x.bfloat16(), index, weights))
    with pytest.raises(ReadOnlyOption, match="activation"):
        layer.activation = "geglu"


def test_bad_inputs_name_the_argument() -> None:
    layer = gg.nn.GroupedExperts.from_experts(Experts(4, 32, 16).bfloat16(), "swiglu")
    x = torch.randn(5, 32).bfloat16()
    index, weights = routing(5, 4, 2, 6)
    with pytest.raises(InvalidArgument, match="hidden_states: expected \\(tokens, 32\\)"):
        layer(x[:, :16], index, weights)
    with pytest.raises(InvalidArgument, match="top_k_index: expected integer expert ids"):
        layer(x, index.float(), weights)
    with pytest.raises(InvalidArgument, match="top_k_weights"):
        layer(x, index, weights[:, :1])
    with pytest.raises(InvalidArgument, match="activation: expected one of"):
        gg.nn.GroupedExperts.from_experts(Experts(4, 32, 16), "silu")
    with pytest.raises(InvalidArgument, match="experts: expected a module with 3-d parameters"):
        gg.nn.GroupedExperts.from_experts(nn.Linear(4, 4), "swiglu")

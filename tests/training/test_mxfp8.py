"""MXFP8 training (issue 57, sm_100a), checked on the CPU as Float8Blockwise is
(tests/training/test_float8_blockwise.py): the quantizer bit-exact against one written here from
the recipe's definition, each GEMM's operands along its own K, signal-to-noise above torchao's
floors. The loss-parity tier is tests/training/test_loss_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

import gemmgen as gg
from gemmgen.ir.microscaling import to_blocked
from gemmgen.training import MXFP8, Gemm
from tests.training.test_float8_blockwise import _awkward, _grads, _mlp_pair, _snr, reference_e4m3


def reference_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values as float64, UE8M0 scale bytes) of x per 32 values of each row, in Python: the
    scale 2^e with e = ceil(log2(amax / 448)) (rounded up: nothing saturates), 2^0 for zeros; each
    value e4m3(fp32(x / 2^e))."""
    rows, cols = x.shape
    blocks = -(-cols // 32)
    exponents = torch.zeros(rows, blocks, dtype=torch.int64)
    xf = x.float()
    for i in range(rows):
        for j in range(blocks):
            amax = xf[i, j * 32:(j + 1) * 32].abs().max().item()
            if amax > 0:
                exponents[i, j] = math.ceil(math.log2(float(torch.tensor(amax / 448.0, dtype=torch.float32))))
    per_value = torch.ldexp(torch.ones(rows, blocks * 32, dtype=torch.float64),
                            exponents.repeat_interleave(32, dim=1))[:, :cols]
    quotient = (xf.double() / per_value).float()
    return reference_e4m3(quotient), (exponents + 127).to(torch.uint8)


def test_the_quantizer_is_bit_exact_against_one_written_from_the_definition():
    x = _awkward(130, 200, seed=5)  # a partial 32-value block at each row's end
    q, scales = MXFP8().quantize(x)
    want_q, want_scales = reference_mx(x)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.double(), want_q)
    assert torch.equal(scales.view(torch.uint8), want_scales)
    assert q.double().abs().max() <= 448  # rounded up: the largest value of a block fits


def test_rounding_up_differs_from_the_ocp_floor():
    """The check above would see the OCP floor rule: a block whose amax is 500 gets 2^1 (500 / 2 =
    250 fits), where the floor rule's 2^0 saturates it to 448."""
    x = torch.zeros(1, 32)
    x[0, 0] = 500.0
    q, scales = MXFP8().quantize(x)
    assert scales.view(torch.uint8).item() == 128 and q[0, 0].float().item() == 256.0  # 250 -> e4m3 256
    floor_q, _ = gg.quantize_mx(x)
    assert floor_q[0, 0].float().item() == 448.0


def test_each_gemm_reads_its_operands_along_its_own_k():
    """wgrad's B is X along the tokens (K-major: X^T quantized per 32 tokens); the weight's two
    copies are each quantized along its own K (no exact transpose under MX)."""
    from gemmgen.nn.low_precision import linear_gemms

    gemms = linear_gemms(MXFP8(), None, False, torch.bfloat16)
    x, w = _awkward(96, 64, 1), _awkward(128, 64, 2)
    b = gemms.operand(x.t(), Gemm.WGRAD, "b")
    want, want_scales = reference_mx(x.t())
    assert b.data.shape == x.shape and b.data.stride(0) == 1
    assert torch.equal(b.data.t().double(), want)
    assert torch.equal(b.scale.view(torch.uint8), to_blocked(want_scales))
    qw = gemms.weight(w)
    assert torch.equal(qw.rows.data.t().double(), reference_mx(w)[0])
    assert torch.equal(qw.columns.data.t().double(), reference_mx(w.t())[0])


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])  # SwiGLU: Llama's MLP, over column pairs
def test_fused_mlp_signal_to_noise_is_above_torchaos_floors(activation):
    """Against the same MLP in fp32: output >= 18 dB, each gradient >= 17 dB (torchao's floors);
    measured 25 dB (GELU) and 23.6-23.9 dB (SwiGLU, whose output is a product of two GEMMs')."""
    low, ref = _mlp_pair(activation, MXFP8())
    x, g = torch.randn(300, 256).bfloat16(), torch.randn(300, 128)
    y, gx, grads = _grads(low, x, g)
    y_ref, gx_ref, grads_ref = _grads(ref, x, g)
    assert _snr(y, y_ref) >= 18 and _snr(gx, gx_ref) >= 17
    for name, got in grads.items():
        assert _snr(got, grads_ref[name if activation == "swiglu" else
                                   name.replace("fc1", "0").replace("fc2", "2")]) >= 17, name


def test_its_kernels_are_sm_100a_ones():
    mlp = gg.nn.FusedMLP(256, 512, 128, precision=MXFP8())
    names = [r.name for r, _ in mlp.launches(300, training=True, arch="sm_100a")
             + mlp.backward_launches(300, arch="sm_100a")]
    assert names == ["linear_gelu_bias_bf16_mxfp8_fprop_train", "linear_none_bias_bf16_mxfp8_fprop",
                     "linear_gelu_bias_bf16_mxfp8_fprop_bwd", "linear_none_bf16_mxfp8_dgrad",
                     "weight_grad_mxfp8_wgrad", "weight_grad_mxfp8_wgrad"]
    with pytest.raises(gg.ConfigError, match="sm_100a"):
        mlp.launches(300, training=True, arch="sm_90a")


def test_a_gated_mlps_kernels_are_over_column_pairs():
    """Llama's MLP under MXFP8: fc1's forward (the microscaled MMA, then silu(gate) * up over the
    accumulator's column pairs, saving the accumulator) and fc2's dgrad (fc1's derived epilogue: the
    saved pairs read, dL/dgate and dL/dup written interleaved) are its own; the other four are the
    GELU MLP's. All are checked against CUTLASS's host code and emulated with the GELU step's
    (tests/data/sm100.py's mxfp8_training_kernels); their NVRTC compiles: docs/design/training.md."""
    mlp = gg.nn.FusedMLP(256, 512, 128, activation="swiglu", bias=False, precision=MXFP8())
    launched = mlp.launches(300, training=True, arch="sm_100a") + mlp.backward_launches(300, arch="sm_100a")
    assert [r.name for r, _ in launched] == [
        "linear_swiglu_bf16_mxfp8_fprop_train", "linear_none_bf16_mxfp8_fprop", "linear_swiglu_bf16_mxfp8_fprop_bwd",
        "linear_none_bf16_mxfp8_dgrad", "weight_grad_mxfp8_wgrad", "weight_grad_mxfp8_wgrad"]
    for recipe, config in (launched[0], launched[2]):
        assert recipe.ir.epilogue.pairs and config.arch is gg.Arch.SM100A

"""The third tier of the low-precision checks: a small model trained for 300 steps under each
precision ends within 0.5% relative loss of the bf16 run (gemmgen/testing/loss_parity.py says how
the model and data are built; docs/training.md shows the curves)."""

from __future__ import annotations

import pytest

from gemmgen.testing.loss_parity import relative_gap, train
from gemmgen.training import Float8Blockwise


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])  # SwiGLU: Llama's MLP, no biases
def test_float8_blockwise_trains_within_half_a_percent_of_bf16(activation):
    baseline = train(None, activation=activation)
    low = train(Float8Blockwise(), activation=activation)
    assert abs(low.curve[0] / baseline.curve[0] - 1) < 0.01  # the same model and batch, quantized
    assert low.curve[-1] < 0.97 * low.curve[0]  # it learned something
    assert abs(relative_gap(low, baseline)) < 0.005

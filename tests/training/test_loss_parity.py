"""The third tier of the low-precision checks: a small model trained for 300 steps under each
precision ends within 0.5% relative loss of the bf16 run (gemmgen/testing/loss_parity.py says how
the model and data are built; docs/design/training.md shows the curves)."""

from __future__ import annotations

import functools

import pytest

from gemmgen.testing.loss_parity import Run, relative_gap, train
from gemmgen.training import MXFP8, Float8Blockwise, Float8Tensorwise, Precision

BATCH = 128  # half of scripts/loss_parity.py's 256: half the CPU, the same 300 steps


@functools.cache
def _bf16(activation: str) -> Run:
    return train(None, activation=activation, batch=BATCH)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])  # SwiGLU: Llama's MLP, no biases
@pytest.mark.parametrize("precision", [
    Float8Blockwise(), Float8Tensorwise(),
    Float8Tensorwise(scaling="delayed"),  # its first step at scale 1, as Transformer Engine's
    MXFP8()], ids=repr)
def test_each_precision_trains_within_half_a_percent_of_bf16(precision: Precision, activation: str):
    baseline = _bf16(activation)
    low = train(precision, activation=activation, batch=BATCH)
    assert abs(low.curve[0] / baseline.curve[0] - 1) < 0.01  # the same model and batch, quantized
    assert low.curve[-1] < 0.97 * low.curve[0]  # it learned something
    assert abs(relative_gap(low, baseline)) < 0.005

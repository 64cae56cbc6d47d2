"""Delayed scaling's state: each tensor's amax history (`AmaxHistory`), and the choices a per-tensor
recipe makes (`Scaling`, `AmaxAlgorithm`)."""

from __future__ import annotations

import enum

import torch

from ..ir.ops import FP8_MAX
from ..types import DType


class Scaling(enum.Enum):
    """How a per-tensor recipe picks each tensor's scale."""

    CURRENT = "current"  # from the tensor's own amax, before quantizing it
    DELAYED = "delayed"  # from the amaxes of earlier steps (`AmaxHistory`)


class AmaxAlgorithm(enum.Enum):
    """Which amax of the history a delayed scale is computed from (Transformer Engine's
    `amax_compute_algo`)."""

    MAX = "max"  # the largest of the history
    MOST_RECENT = "most_recent"  # the last step's


class AmaxHistory:
    """One tensor's amaxes under delayed scaling, as Transformer Engine's DelayedScaling keeps
    them: the scale comes from the amaxes of earlier steps, so a tensor is quantized before its own
    amax is known (values past it saturate), and each quantization records its amax into the
    current step's slot. `advance`, once per optimizer step, takes the history's amax for the next
    steps and opens a new slot. Everything stays on the tensor's device (no sync); the scale of a
    call is a new tensor, so an operand saved for backward keeps the scale it was quantized with.
    Experts' weights (`Float8Tensorwise.experts`) keep one history per expert: amaxes of shape
    (experts,) where a tensor's are (1,)."""

    def __init__(self, length: int, algorithm: AmaxAlgorithm, margin: int) -> None:
        self.length, self.algorithm, self.margin = length, algorithm, margin
        self.amaxes: torch.Tensor | None = None  # (length, *shape), [0] the current step's
        self.amax: torch.Tensor | None = None  # (*shape): what the scales come from; NaN before a first step

    def record(self, t: torch.Tensor, dtype: DType, per: int = 0) -> torch.Tensor:
        """The scale to quantize `t` in `dtype` with (`scale`), after recording t's amax: (1,), or
        with `per` leading dimensions of their own, one per index of them (t.shape[:per])."""
        shape = tuple(t.shape[:per]) or (1,)
        scale = self.scale(dtype, t.device, shape)
        self.add(t.detach().abs().amax(dim=tuple(range(per, t.dim()))) if per else t.detach().abs().amax())
        return scale

    def scale(self, dtype: DType, device: torch.device, shape: tuple[int, ...] = (1,)) -> torch.Tensor:
        """The scale (`shape`: (1,), or an expert's each) a tensor of this history is quantized in
        `dtype` with: from the earlier steps' amax; 1 before the first step ends, as Transformer
        Engine starts (and again where the shape changes)."""
        if self.amaxes is None or self.amaxes.device != device or self.amaxes.shape[1:] != shape:
            self.amaxes = torch.zeros((self.length, *shape), dtype=torch.float32, device=device)
            self.amax = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
        assert self.amax is not None
        return (self.amax * 2.0**self.margin / FP8_MAX[dtype]).nan_to_num(1.0)

    def add(self, amax: torch.Tensor) -> None:
        """Record a tensor's amax (one value, or one per expert; an epilogue's `gg.amax`, or
        torch's) in this step's slot."""
        assert self.amaxes is not None, "scale() first: it places the history on the tensor's device"
        self.amaxes[0] = torch.maximum(self.amaxes[0], amax.detach().float().reshape(self.amaxes.shape[1:]))

    def advance(self) -> None:
        """End a step: the amax of the history (kept as it was where that is 0 or not finite),
        then a new slot for the next step's amaxes."""
        if self.amaxes is None or self.amax is None:
            return
        amax = self.amaxes.amax(0) if self.algorithm is AmaxAlgorithm.MAX else self.amaxes[0].clone()
        self.amax = torch.where((amax > 0) & amax.isfinite(), amax, self.amax)
        self.amaxes = self.amaxes.roll(1, 0)
        self.amaxes[0] = 0.0


__all__ = ["AmaxAlgorithm", "AmaxHistory", "Scaling"]

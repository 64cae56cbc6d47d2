"""Weights for epilogues over column pairs (`gemmgen.pairs`): a gated MLP's gate and up
projections interleaved, so that each pair of accumulator columns holds one gate and one up value.

    w1 = gemmgen.nn.interleave_pairs(gate_proj.weight, up_proj.weight)   # (2F, in): rows g0 u0 g1 u1 ...
    h = swiglu(x, w1.t())                                                # silu(x @ Wg^T) * (x @ Wu^T)
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidArgument


def interleave_pairs(even: torch.Tensor, odd: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """One tensor holding `even`'s index i at 2i and `odd`'s at 2i + 1 along `dim` (rows of an
    out x in weight: dim=0; columns of a K x N B: dim=-1). A copy, made once at load time."""
    if even.shape != odd.shape or even.dtype != odd.dtype or even.device != odd.device:
        raise InvalidArgument(f"even, odd: expected tensors of one shape, dtype and device, got {tuple(even.shape)} "
                              f"{even.dtype} {even.device} and {tuple(odd.shape)} {odd.dtype} {odd.device}")
    if even.dim() == 0 or not -even.dim() <= dim < even.dim():
        raise InvalidArgument(f"dim: {dim} is not a dimension of a {even.dim()}-d tensor")
    d = dim % even.dim()
    return torch.stack((even, odd), dim=d + 1).flatten(d, d + 1)


def contents_key(t: torch.Tensor | None) -> tuple[object, int, int]:
    """What tells a tensor's contents apart without reading them: the tensor object (a view's base:
    a view made anew per call of the same memory is the same contents), its memory and its
    version, which in-place writes (optimizer steps, load_state_dict) advance, and which a view
    shares with its base; -1 for an inference tensor, which has none (never taken as unchanged).
    How a kept interleaved copy knows it is stale."""
    if t is None:
        return None, 0, 0
    return (t if t._base is None else t._base), t.data_ptr(), -1 if t.is_inference() else t._version


def same_contents(kept: tuple[tuple[object, int, int], ...], now: tuple[tuple[object, int, int], ...]) -> bool:
    """Whether tensors keyed `now` (`contents_key`) hold what those keyed `kept` held."""
    return all(a[0] is b[0] and a[1] == b[1] and a[2] == b[2] >= 0 for a, b in zip(kept, now, strict=True))


class GateUpHalf:
    """Gate or up as a half of one Linear's rows (`half` 0: the first out_features rows), as a
    chunked GLU holds them (ModernBERT's `Wi(x).chunk(2, dim=-1)`): its `weight` and `bias` are
    views of the Linear's, so gradients reach the Linear's own parameters."""

    def __init__(self, linear: nn.Linear, half: int) -> None:
        self.linear, self.half = linear, half
        self.in_features, self.out_features = linear.in_features, linear.out_features // 2

    def _rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.narrow(0, self.half * self.out_features, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        w = self._rows(self.linear.weight)
        assert w is not None
        return w

    @property
    def bias(self) -> torch.Tensor | None:
        return self._rows(self.linear.bias)


def split_pairs(x: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(even, odd): the views `interleave_pairs` undoes (every other index along `dim`)."""
    if x.shape[dim] % 2:
        raise InvalidArgument(f"x: {x.shape[dim]} entries along dim {dim}; pairs need an even number")
    index = [slice(None)] * x.dim()
    index[dim] = slice(0, None, 2)
    even = x[tuple(index)]
    index[dim] = slice(1, None, 2)
    return even, x[tuple(index)]

"""Test tensors laid out the way TMA needs them (tests only)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..types import Layout


def strided_matrix(make: Callable[..., torch.Tensor], rows: int, cols: int, dtype: torch.dtype, layout: Layout,
                   lead: tuple[int, ...] = (), pad: int = 0) -> torch.Tensor:
    """A (lead,) rows x cols view in `layout` over storage from `make(*shape)`, its leading dimension
    rounded up to 16 bytes (what TMA needs) plus `pad` elements."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    if layout is Layout.ROW:
        ld = -(-cols // per) * per + pad
        return make(*lead, rows, ld).to(dtype)[..., :cols]
    ld = -(-rows // per) * per + pad
    return make(*lead, cols, ld).to(dtype)[..., :rows].transpose(-1, -2)

"""One launch's problem in CUTLASS's terms: extents, device addresses and element strides.

Conventions follow CUTLASS 3.x: A is (M, K, L), B is (N, K, L), C/D/aux are (M, N, L); strides
are in elements, one per mode. Vectors and scalars carry only an address or a value.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorArg:
    ptr: int
    strides: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True)
class Problem:
    m: int
    n: int
    k: int
    l: int  # noqa: E741 - CUTLASS's name for the batch extent
    a: TensorArg
    b: TensorArg
    d: TensorArg
    operands: dict[str, TensorArg | float] = field(default_factory=dict)  # by operand name (C included)
    aux: dict[str, TensorArg] = field(default_factory=dict)
    device_id: int = 0
    sm_count: int = 132
    max_active_clusters: int = 0

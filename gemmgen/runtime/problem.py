"""One launch's problem in CUTLASS's terms: extents, device addresses and element strides.

Conventions follow CUTLASS 3.x: A is (M, K, L), B is (N, K, L), C/D/aux are (M, N, L); strides
are in elements, one per mode. Vectors and scalars carry only an address or a value.
"""

from __future__ import annotations

from typing import NamedTuple


class TensorArg(NamedTuple):
    """A tensor's address and CUTLASS element strides (a tuple: cheap to build per call)."""

    ptr: int
    strides: tuple[int, int, int] = (0, 0, 0)

    def transposed(self) -> TensorArg:
        """An M x N tensor seen as N x M over the same memory."""
        s = self.strides
        return TensorArg(self.ptr, (s[1], s[0], s[2]))


class Problem(NamedTuple):
    """One launch in the kernel's terms (a tuple: built for every new address set)."""

    m: int
    n: int
    k: int
    l: int  # noqa: E741 - CUTLASS's name for the batch extent
    a: TensorArg
    b: TensorArg
    d: TensorArg
    operands: dict[str, TensorArg | float]  # by operand name (C included)
    aux: dict[str, TensorArg]
    device_id: int = 0
    sm_count: int = 132
    max_active_clusters: int = 0
    d_sink: int = 0  # the module's sink of the collective's D store, where registers write D (`fields.sinks_d`)

    def transposed(self, block_scales: bool = False) -> Problem:
        """The same launch as D^T = B^T A^T, what a swapped kernel computes (RecipeIR.transposed).

        B's (N, K, L) strides are those of A^T as the kernel's (M, K, L) operand, and A's are
        B^T's; every M x N tensor is the transpose of the same memory. Vectors (no strides) and
        scalars are unchanged: only the kernel's name for their dimension changes. With
        `block_scales`, scale_a and scale_b trade names (the kernel's A is B^T) and keep their
        (blocks, K blocks, L) strides: A's M-major scales are the swapped kernel's N-major ones."""
        ops = {k: v.transposed() if isinstance(v, TensorArg) else v for k, v in self.operands.items()}
        if block_scales:
            ops["scale_a"], ops["scale_b"] = self.operands["scale_b"], self.operands["scale_a"]
        return Problem(self.n, self.m, self.k, self.l, self.b, self.a, self.d.transposed(), ops,
                       {k: v.transposed() for k, v in self.aux.items()}, self.device_id, self.sm_count,
                       self.max_active_clusters, self.d_sink)

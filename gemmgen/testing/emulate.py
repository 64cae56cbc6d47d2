"""What a kernel would compute from the Params gemmgen built, evaluated in fp32 on the CPU (tests only).

The oracle (oracle.py) checks that gemmgen's Params equal CUTLASS's for the same problem; this
checks that the problem itself is the caller's and that the kernel's epilogue computes the recipe:
it reads A and B through the tensor maps the Params hold (read back through the RecordingEncoder
or the stub driver that made them), then runs the epilogue the kernel's source declares
(`visitors.EpilogueInterpreter`), whose leaves read C, the aux inputs, vectors and scalars from
the Params fields at their own places, and whose stores write D and the aux outputs through their
tensor maps. A wrong stride, extent, operand role, transposition, visitor or Params position
shows up as a wrong or unwritten (NaN) output element.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import torch

from ..build import CompiledKernel
from ..runtime.arguments import ArgumentBuilder, ParamsLayout
from ..runtime.tma import EncodeArgs, TmaTemplate
from .visitors import EpilogueInterpreter


class MapReader(Protocol):
    """What made the tensor maps, asked what a map holds (RecordingEncoder, stub_driver.StubDriver)."""

    def of(self, desc: bytes) -> EncodeArgs | None: ...


@lru_cache(maxsize=64)
def _interpreter(source: str) -> EpilogueInterpreter:
    return EpilogueInterpreter(source)


class _ParamsBytes:
    """A Params block as the device reads it: fields at their probed offsets, addresses resolved
    to the caller's tensors, tensor maps to what they address (implements visitors.ParamsView)."""

    def __init__(self, layout: ParamsLayout, params: bytes, encoder: MapReader, tensors: list[torch.Tensor],
                 templates: dict[str, TmaTemplate]) -> None:
        self._params = params
        self._encoder = encoder
        self._templates = templates
        self._at = {f.expr: (f, offset) for f, offset, _ in layout.fields}
        self._by_name = {f.name: f.expr for f, _, _ in layout.fields}
        self._by_addr = {t.data_ptr(): t for t in tensors if t.numel()}

    def raw(self, lvalue: str) -> bytes:
        if lvalue not in self._at:
            raise AssertionError(f"the kernel reads {lvalue}, where gemmgen writes no Params field")
        f, offset = self._at[lvalue]
        return self._params[offset:offset + f.size]

    def pointer(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor | None:
        addr = int.from_bytes(self.raw(lvalue), "little")
        if addr == 0:
            return None
        return _as(self._by_addr[addr], dtype).as_strided((length,), (1,))

    def mapped(self, lvalue: str, dtype: torch.dtype) -> torch.Tensor:
        """(L, M or N, K) for A and B, (L, M, N) for C, D and the aux tensors."""
        args = self._encoder.of(self.raw(lvalue))
        name = self._at[lvalue][0].name
        assert args is not None, f"{name}: no tensor map written"
        base = _as(self._by_addr[args.addr], dtype)
        item = base.element_size()
        d0, d1, d2 = args.dims
        view = base.as_strided((d2, d1, d0), (args.strides[1] // item, args.strides[0] // item, 1))
        return view.transpose(1, 2) if self._templates[name].contiguous_first else view

    def mapped_field(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.mapped(self._by_name[name], dtype)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The memory of `t` read as `dtype`, as a kernel with that element type reads it."""
    if t.element_size() != torch.empty((), dtype=dtype).element_size():
        raise AssertionError(f"the kernel reads {t.dtype} memory as {dtype}")
    return t.view(dtype)


def emulate(compiled: CompiledKernel, params: bytes, encoder: MapReader, tensors: list[torch.Tensor]) -> None:
    """Run `compiled` on `params` in fp32; `tensors` are every tensor the call passed or returned."""
    recipe = compiled.generated.kernel_recipe
    builder = ArgumentBuilder(recipe, compiled.config)
    templates = {"mainloop.tma_a": builder.a, "mainloop.tma_b": builder.b, builder.d[0]: builder.d[2],
                 **{field: t for field, _, t in (*builder.loads, *builder.stores)}}
    view = _ParamsBytes(compiled.params_layout, params, encoder, tensors, templates)
    a = view.mapped_field("mainloop.tma_a", recipe.gemm.a.torch)
    b = view.mapped_field("mainloop.tma_b", recipe.gemm.b.torch)
    acc = torch.matmul(a.float(), b.float().transpose(1, 2))
    _interpreter(compiled.generated.source).run(acc, view)

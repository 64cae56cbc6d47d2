"""What a kernel would compute from the Params gemmgen built, evaluated in fp32 on the CPU (tests only).

The oracle (oracle.py) checks that gemmgen's Params equal CUTLASS's for the same problem; this
checks that the problem itself is the caller's: it reads A, B, C and the aux inputs through the
tensor maps the Params hold (read back through the RecordingEncoder or the stub driver that made
them), vectors through their pointers and scalars from their fields, evaluates the kernel-side
recipe, and writes D and the aux outputs through their tensor maps. A wrong stride, extent,
operand role or transposition shows up as a wrong or unwritten (NaN) output element.
"""

from __future__ import annotations

import struct
from typing import Protocol

import torch

from ..build import CompiledKernel
from ..reference import evaluate_epilogue
from ..runtime.arguments import ArgumentBuilder
from ..runtime.tma import EncodeArgs, TmaTemplate
from ..types import OperandKind


class MapReader(Protocol):
    """What made the tensor maps, asked what a map holds (RecordingEncoder, stub_driver.StubDriver)."""

    def of(self, desc: bytes) -> EncodeArgs | None: ...


def emulate(compiled: CompiledKernel, params: bytes, encoder: MapReader, tensors: list[torch.Tensor]) -> None:
    """Run `compiled` on `params` in fp32; `tensors` are every tensor the call passed or returned."""
    recipe = compiled.generated.kernel_recipe
    builder = ArgumentBuilder(recipe, compiled.config)
    at = {f.name: (f, offset) for f, offset, _ in compiled.params_layout.fields}
    by_addr = {t.data_ptr(): t for t in tensors if t.numel()}

    def raw(name: str) -> bytes:
        f, offset = at[name]
        return params[offset:offset + f.size]

    def mapped(name: str, template: TmaTemplate) -> torch.Tensor:
        """The tensor a tensor map addresses: (L, M or N, K) for A and B, (L, M, N) for C/D/aux."""
        args: EncodeArgs | None = encoder.of(raw(name))
        assert args is not None, f"{name}: no tensor map written"
        base = by_addr[args.addr]
        item = base.element_size()
        d0, d1, d2 = args.dims
        view = base.as_strided((d2, d1, d0), (args.strides[1] // item, args.strides[0] // item, 1))
        return view.transpose(1, 2) if template.contiguous_first else view

    a = mapped("mainloop.tma_a", builder.a)
    b = mapped("mainloop.tma_b", builder.b)
    acc = torch.matmul(a.float(), b.float().transpose(1, 2))

    values: dict[str, torch.Tensor | float] = {}
    loads = {name: (field, t) for field, name, t in builder.loads}
    for o in recipe.epilogue.operands:
        if o.kind is OperandKind.SCALAR:
            values[o.name] = struct.unpack("<f", raw(f"epilogue.scalar.{o.name}.value"))[0]
        elif o.kind is OperandKind.MATRIX:
            field, template = loads[o.name]
            values[o.name] = mapped(field, template)
        else:
            ptr = int.from_bytes(raw(f"epilogue.{o.kind.value}.{o.name}.ptr"), "little")
            length = acc.shape[1] if o.kind is OperandKind.COL else acc.shape[2]
            values[o.name] = by_addr[ptr][:length]
    results = evaluate_epilogue(recipe.epilogue, acc, values)
    targets = [builder.d, *builder.stores]
    for (field, _, template), result in zip(targets, results, strict=True):
        mapped(field, template).copy_(result)

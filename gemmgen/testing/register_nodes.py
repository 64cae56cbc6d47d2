"""The register nodes of gemmgen's own headers, evaluated on the CPU as the interpreter of
`visitors` walks a kernel's callbacks (tests only): coordinates.hpp's Coordinate and Random, and
row_blocks.hpp's Sm90RowBlocks and column_blocks.hpp's Sm90ColumnBlocksStore. Each takes the
node's type as the kernel source spells it and reads its Params where the device would
(`ParamsView`)."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..ir.ops import random_uniform
from ..runtime.tma import EncodeArgs
from .cpp_types import CppType, EpilogueSourceError


class ParamsView(Protocol):
    """The kernel's Params as the device would read them, addressed by C++ lvalue (`{p}` is Params)."""

    def raw(self, lvalue: str) -> bytes:
        """The bytes of the field at `lvalue`; raises when gemmgen writes no field there."""
        ...

    def pointer(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor | None:
        """`length` elements of `dtype` at the address the pointer field holds; None for nullptr."""
        ...

    def mapped(self, lvalue: str, dtype: torch.dtype, rows_contiguous: bool) -> torch.Tensor:
        """The (L, rows, columns) tensor of `dtype` the tensor map at `lvalue` addresses, a writable
        view; the map's first dimension is the contiguous one: rows (M) when `rows_contiguous`."""
        ...

    def encoded(self, lvalue: str) -> EncodeArgs:
        """What the tensor map at `lvalue` was encoded from."""
        ...

    def holds(self, addr: int) -> bool:
        """Whether `addr` lies in one of the call's tensors."""
        ...

    def inside(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor:
        """`length` elements of `dtype` at the address the pointer field holds, anywhere inside one of
        the call's tensors (a workspace's regions)."""
        ...

    def group_pointer(self, lvalue: str, dtype: torch.dtype, length: int) -> torch.Tensor | None:
        """A grouped kernel's per-group pointer: `length` elements at the address the current group's
        entry of the pointer array at `lvalue` holds; None for a null array."""
        ...

    def group_matrix(self, pointers: str, strides: str, dtype: torch.dtype, acc: torch.Tensor, column_major: bool
                     ) -> torch.Tensor:
        """A grouped kernel's M x N matrix of the current group (shaped like `acc`, (1, M, N)): its
        address and leading dimension (between rows, or columns when `column_major`) from the
        current group's entries of the arrays at `pointers` and `strides`."""
        ...


def coordinate(t: CppType, acc: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Coordinate<0> / Coordinate<1>: each register's row / column in its batch's (or group's)
    M x N problem, converted to fp32."""
    mode = t.args[0].name if len(t.args) == 1 else None
    if mode not in ("0", "1") or inputs:
        raise EpilogueSourceError(f"coordinate node {t}")
    _, m, n = acc.shape
    index = torch.arange(m if mode == "0" else n, dtype=torch.int64).to(torch.float32)
    return index.reshape(1, m, 1) if mode == "0" else index.reshape(1, 1, n)


def random_numbers(t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView, inputs: tuple[torch.Tensor, ...]
            ) -> torch.Tensor:
    """Random<Transposed, Stream>: each register's `ir.ops.random_uniform` (Transposed: the kernel's
    rows are the recipe's columns), of the seed or the int64 at the seed pointer its Params hold."""
    if len(t.args) != 2 or inputs or t.args[0].name not in ("true", "false") or not t.args[1].name.endswith("u"):
        raise EpilogueSourceError(f"random node {t}")
    transposed, stream = t.args[0].name == "true", int(t.args[1].name.removesuffix("u"))
    at = params.pointer(f"{lvalue}.seed_ptr", torch.int64, 1)
    seed = int(at[0]) if at is not None else int.from_bytes(params.raw(f"{lvalue}.seed"), "little")
    batch, rows, columns = (torch.arange(e).reshape(s) for e, s in zip(acc.shape, ((-1, 1, 1), (1, -1, 1), (1, 1, -1)),
                                                                       strict=True))
    return random_uniform(seed, stream, batch, columns, rows) if transposed else \
        random_uniform(seed, stream, batch, rows, columns)


def row_blocks(t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView, inputs: tuple[torch.Tensor, ...],
               resolve: Callable[[CppType], CppType]) -> torch.Tensor:
    """Sm90RowBlocks<Policy, Block, FragmentSize, TileShape, EpilogueTile> over D's value (and the
    value its statistic is of, if a second input): per row and block of `Block` columns of each
    epilogue subtile (which must hold whole blocks, and the tile whole subtiles: the header's
    static_asserts), the block's statistic of its in-bounds elements gives its factor, which each
    value of the block takes (the values pass on in fp32: the collective converts them to
    ElementD) and which is stored at (row, block) through the Params' pointer and strides, unless
    null. QuantizeBlock<Qmax[, true]>: max |x|, NaN propagated, as epi::Max does, over Qmax, 1 where
    the max is not above 0 (with `true`, rounded up to a power of two: `_power_of_two_at_least`);
    D = v / scale. RmsNormBlock<Block, Eps>: rsqrt(sum of x^2 / count + Eps),
    count the block's columns inside the problem; D = v * rstd. ExpMinusMaxBlock<Scale>: max x, NaN
    propagated, the factor itself; D = exp(Scale * (v - max))."""
    if len(t.args) != 5 or len(inputs) not in (1, 2):
        raise EpilogueSourceError(f"row blocks node {t} with {len(inputs)} inputs")
    policy, block = resolve(t.args[0]), int(t.args[1].name)
    tile_n, subtile_n = (_extent(resolve(a), 1) for a in t.args[3:5])
    if block % 8 or subtile_n % block or tile_n % subtile_n:
        raise EpilogueSourceError(f"{t}: blocks of {block} in epilogue subtiles {subtile_n} wide of tiles {tile_n} "
                                  "wide (the header's static_asserts)")
    value, stat = (x.to(torch.float32).expand(acc.shape) for x in (inputs[0], inputs[-1]))
    l_, m, n = acc.shape
    blocks = -(-n // block)  # subtiles start at multiples of the block: a subtile's blocks are these
    name = policy.name.removeprefix("gemmgen::epi::")
    identity = -math.inf if name == "ExpMinusMaxBlock" else 0.0  # each policy's, for out-of-bounds elements
    padded = stat.new_full((l_, m, blocks * block), identity)
    padded[..., :n] = stat
    grouped = padded.reshape(l_, m, blocks, block)
    if name == "QuantizeBlock" and len(policy.args) in (1, 2):
        amax = grouped.abs().amax(dim=-1)  # NaN propagates
        factor = _rounded(torch.where(amax > 0, amax / _bits_f32(policy.args[0]), 1.0), policy.args[1:])
    elif name == "RmsNormBlock" and len(policy.args) == 2 and int(policy.args[0].name) == block:
        counts = (n - torch.arange(0, n, block)).clamp(max=block)  # a partial last block's columns
        factor = ((grouped * grouped).sum(dim=-1) / counts + _bits_f32(policy.args[1])).rsqrt()
    elif name == "ExpMinusMaxBlock" and len(policy.args) == 1:
        factor = grouped.amax(dim=-1)  # NaN propagates
    else:
        raise EpilogueSourceError(f"row blocks policy {policy} for blocks of {block}")
    sm, sn, sl = (struct.unpack("<q", params.raw(f"cute::get<{i}>({lvalue}.dFactor)"))[0] for i in range(3))
    ptr = params.pointer(f"{lvalue}.ptr_factor", torch.float32,
                         (l_ - 1) * sl + (m - 1) * sm + (blocks - 1) * sn + 1) if l_ and m and blocks else None
    if ptr is not None:
        ptr.as_strided((l_, m, blocks), (sl, sm, sn)).copy_(factor)
    spread = factor.repeat_interleave(block, dim=-1)[..., :n]  # each value's block's factor
    if name == "QuantizeBlock":  # a division, as the device divides (x * (1 / s) can round otherwise)
        return value / spread
    if name == "ExpMinusMaxBlock":
        return torch.exp(_bits_f32(policy.args[0]) * (value - spread))
    return value * spread


def column_blocks(t: CppType, lvalue: str, acc: torch.Tensor, params: ParamsView, inputs: tuple[torch.Tensor, ...],
                  element: torch.dtype, tile_m: int) -> torch.Tensor:
    """Sm90ColumnBlocksStore<QmaxBits, Block, ElementQ, TileShape, EpilogueTile[, true]>: its input
    passes on. Per column and block of `Block` rows (a tile starts at a multiple of the block: the
    header's static_asserts), the block's scale is QuantizeBlock's (max |x| of its values inside the
    problem, NaN propagated, over Qmax; 1 where that is not above 0; with `true` rounded up to a
    power of two), and each value / scale, converted to
    ElementQ saturating (cvt.rn.satfinite), is stored at (n, m) through ptr_q and dQ (M's stride
    1), the scale at (n, m / Block) through ptr_scale and dScale unless that is null."""
    if len(t.args) not in (5, 6) or len(inputs) != 1:
        raise EpilogueSourceError(f"column blocks node {t} with {len(inputs)} inputs")
    qmax, block = _bits_f32(t.args[0]), int(t.args[1].name)
    if block % 16 or tile_m % block:
        raise EpilogueSourceError(f"{t}: blocks of {block} rows in tiles of {tile_m} (the header's static_asserts)")
    x = inputs[0].to(torch.float32).expand(acc.shape)
    l_, m, n = acc.shape
    blocks = -(-m // block)
    padded = x.new_zeros((l_, blocks * block, n))
    padded[:, :m] = x
    amax = padded.reshape(l_, blocks, block, n).abs().amax(dim=2)  # (L, blocks, N); NaN propagates
    scale = _rounded(torch.where(amax > 0, amax / qmax, 1.0), t.args[5:])
    q = x / scale.repeat_interleave(block, dim=1)[:, :m]  # a division, as the device divides
    limit = torch.finfo(element).max
    sn, sl = (struct.unpack("<q", params.raw(f"cute::get<{i}>({lvalue}.dQ)"))[0] for i in (0, 2))
    if not (l_ and m and n):
        return inputs[0]
    copy = params.pointer(f"{lvalue}.ptr_q", element, (l_ - 1) * sl + (n - 1) * sn + m)
    if copy is None:
        raise AssertionError(f"{lvalue}.ptr_q: null, and the node stores its copy through it")
    copy.as_strided((l_, n, m), (sl, sn, 1)).copy_(q.clamp(-limit, limit).transpose(1, 2).to(element))
    fn, fm, fl = (struct.unpack("<q", params.raw(f"cute::get<{i}>({lvalue}.dScale)"))[0] for i in range(3))
    scales = params.pointer(f"{lvalue}.ptr_scale", torch.float32, (l_ - 1) * fl + (n - 1) * fn + (blocks - 1) * fm + 1)
    if scales is not None:
        scales.as_strided((l_, n, blocks), (fl, fn, fm)).copy_(scale.transpose(1, 2))
    return inputs[0]


def _rounded(scale: torch.Tensor, power_of_two: Sequence[CppType]) -> torch.Tensor:
    """A quantize policy's scales, rounded up to a power of two where its last template argument is
    `true` (epilogue.hpp's power_of_two_at_least): 2 ** ceil(log2 s) in float64, where every fp32
    scale and its logarithm are exact enough that ceil cannot round across a power (an independent
    route to ops.quantize_blocks' frexp), and 1 for 0 and infinity, as the header has it."""
    if not power_of_two:
        return scale
    if len(power_of_two) != 1 or power_of_two[0].name not in ("true", "false"):
        raise EpilogueSourceError(f"quantize policy's rounding {power_of_two}")
    if power_of_two[0].name == "false":
        return scale
    s = scale.double()
    up = torch.exp2(torch.ceil(torch.log2(s)))
    return torch.where((s > 0) & torch.isfinite(s), up, 1.0).float()


def _bits_f32(t: CppType) -> float:
    """A policy's fp32 constant, spelled as its bits (`0x43e00000u`)."""
    if not t.name.endswith("u"):
        raise EpilogueSourceError(f"constant {t} is not fp32 bits")
    return struct.unpack("<f", struct.pack("<I", int(t.name.removesuffix("u"), 16)))[0]


def _extent(shape: CppType, mode: int) -> int:
    """One mode of a static shape, `Shape<_128, _128, _64>` or `Shape<_128, _64>`."""
    if shape.name.removeprefix("cute::") != "Shape" or mode >= len(shape.args):
        raise EpilogueSourceError(f"shape {shape}")
    return int(shape.args[mode].name.removeprefix("cute::").removeprefix("_"))

"""The arguments CUTLASS 4.2 passes to cuTensorMapEncodeTiled for each tensor of a kernel.

A port of what CuTe's make_tma_copy derives for the smem layouts CUTLASS's sm90 and sm100 builders
pick (ss_smem_selector / sm100_smem_selector; the epilogue's smem swizzle atoms), restricted to the
layouts gemmgen emits. Checked call by call against CUTLASS's own host code by the oracle tests.

sm100 differs in three ways: A and B are typed as their elements (sm90 loads raw words); each
CTA of a pair loads half of A's rows and half of B's (the 2-SM MMA reads both halves); and the
epilogue tile is sm100's (`codegen.sm100.geometry.epilogue_tile`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from ..codegen import sm100
from ..codegen.sm90.geometry import epilogue_tile, swizzle_span
from ..config import Arch, KernelConfig
from ..ir import RecipeIR
from ..ir.microscaling import BLOCK_COLUMNS, BLOCK_ROWS
from ..types import DType, Layout


class TmaDataType(enum.IntEnum):  # CUtensorMapDataType
    UINT8 = 0
    UINT16 = 1
    UINT32 = 2
    FLOAT16 = 6
    FLOAT32 = 7
    BFLOAT16 = 9
    U4X16_ALIGN8B = 13  # packed 4-bit elements, 16 per 8 bytes (NVFP4's A and B: dims count elements)


class Swizzle(enum.IntEnum):  # CUtensorMapSwizzle
    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3


L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
OOB_FILL_NONE = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (zeros)
INTERLEAVE_NONE = 0


class EncodeArgs(NamedTuple):
    """Everything cuTensorMapEncodeTiled takes besides the output map (a tuple: built on every
    call with new addresses, where a frozen dataclass costs microseconds)."""

    dtype: int
    rank: int
    addr: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]  # bytes, rank - 1 entries (dim 0 is contiguous)
    box: tuple[int, ...]
    elem_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2: int
    oob: int

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "rank": self.rank, "addr": self.addr, "dims": list(self.dims),
                "strides": list(self.strides), "box": list(self.box), "elem_strides": list(self.elem_strides),
                "interleave": self.interleave, "swizzle": self.swizzle, "l2": self.l2, "oob": self.oob}


def _storage_type(dtype: DType) -> TmaDataType:
    """How CUTLASS types the data of C/D/aux tensors (and of sm100's A and B: packed fp4 as
    to_CUtensorMapDataType<float_e2m1_t> has it, since the block-scaled collective loads kind::mxf4nvf4's
    operands as their own elements)."""
    return {DType.BF16: TmaDataType.BFLOAT16, DType.F16: TmaDataType.FLOAT16, DType.F32: TmaDataType.FLOAT32,
            DType.E4M3: TmaDataType.UINT8, DType.E5M2: TmaDataType.UINT8,
            DType.E2M1: TmaDataType.U4X16_ALIGN8B}[dtype]


def _mainloop_type(dtype: DType, arch: Arch) -> TmaDataType:
    """sm90's mainloop loads A/B as raw unsigned words of the element's width (TmaInternalElementA/B);
    sm100's as the elements (fp8 as bytes)."""
    if arch is Arch.SM100A:
        return _storage_type(dtype)
    return {8: TmaDataType.UINT8, 16: TmaDataType.UINT16, 32: TmaDataType.UINT32}[dtype.bits]


def _swizzle_atom(extent: int, bits: int) -> tuple[Swizzle, int]:
    """ss_smem_selector: the widest swizzle whose atom width (in elements) divides `extent`, and
    that width (16 bytes' worth without a swizzle)."""
    span = swizzle_span(extent, bits)
    swizzle = {128: Swizzle.B128, 64: Swizzle.B64, 32: Swizzle.B32, 0: Swizzle.NONE}[span]
    return swizzle, (span * 8 // bits) if span else 128 // bits


def _split_multicast(box: list[int], multicast: int) -> list[int]:
    """make_tma_copy_desc: divide the box among multicast CTAs, from the last dim backwards."""
    for i in range(len(box) - 1, -1, -1):
        if multicast <= 1:
            break
        new = -(-multicast // box[i])
        box[i] = -(-box[i] // multicast)
        multicast = new
    return box


@dataclass(frozen=True)
class TmaTemplate:
    """What is fixed per kernel and tensor role; a call adds the address, extents and strides."""

    dtype: int
    bits: int  # per element: strides are given in elements and encoded in bytes
    box: tuple[int, int, int]
    swizzle: int
    contiguous_first: bool  # TMA dim 0 is M/N, not K (MN-major operand); M, not N (column-major C/D/aux)

    def operand(self, addr: int, mn: int, k: int, l: int, strides: tuple[int, int, int]) -> EncodeArgs:  # noqa: E741
        """A (M x K) or B (N x K); `strides` are CUTLASS's (MN, K, L) element strides."""
        if self.contiguous_first:
            return self._args(addr, (mn, k, l), strides[1], strides[2])
        return self._args(addr, (k, mn, l), strides[0], strides[2])

    def matrix(self, addr: int, m: int, n: int, l: int, strides: tuple[int, int, int]) -> EncodeArgs:  # noqa: E741
        """C, D or an aux tensor, M x N per batch; `strides` are CUTLASS's (M, N, L) element strides."""
        if self.contiguous_first:
            return self._args(addr, (m, n, l), strides[1], strides[2])
        return self._args(addr, (n, m, l), strides[0], strides[2])

    def sink(self, addr: int) -> EncodeArgs:
        """One element at `addr` under this template's box (`codegen.fields.sinks_d`): the box at
        the origin writes that element, every other lies outside the map (strides of 16 bytes, the
        least TMA takes)."""
        return self._args(addr, (1, 1, 1), 128 // self.bits, 128 // self.bits)

    def _args(self, addr: int, dims: tuple[int, int, int], s1: int, s2: int) -> EncodeArgs:
        return EncodeArgs(self.dtype, 3, addr, dims, (s1 * self.bits // 8, s2 * self.bits // 8), self.box, (1, 1, 1),
                          INTERLEAVE_NONE, self.swizzle, L2_PROMOTION_128B, OOB_FILL_NONE)


def mainloop_template(recipe: RecipeIR, config: KernelConfig, which: str) -> TmaTemplate:
    """The TMA of A (which="a") or B (which="b"), as CUTLASS's builder for the config's arch sets it
    up: one CTA's part of the tile (a pair's CTA holds half of A's rows and half of B's), split
    among the CTAs it is multicast to."""
    g = recipe.gemm
    dtype = g.a if which == "a" else g.b
    tile_mn = config.tile[0] if which == "a" else config.tile[1]
    tile_k = config.tile[2]
    # A row-major and B column-major are K-major ("T" and "N" in TN).
    k_major = (g.layout_a is Layout.ROW) if which == "a" else (g.layout_b is Layout.COL)
    if config.arch is Arch.SM100A:
        tile_mn //= sm100.geometry.mma_ctas(config)
        multicast = sm100.geometry.multicast(config)[0 if which == "a" else 1]
    else:
        multicast = config.cluster[1] if which == "a" else config.cluster[0]
    if k_major:
        swizzle, width = _swizzle_atom(tile_k, dtype.bits)
        box = [min(width, tile_k), tile_mn, 1]
    else:
        swizzle, width = _swizzle_atom(tile_mn, dtype.bits)
        box = [min(width, tile_mn), tile_k, 1]
    return TmaTemplate(int(_mainloop_type(dtype, config.arch)), dtype.bits,
                       tuple(_split_multicast(box, multicast)), int(swizzle), not k_major)  # type: ignore[arg-type]


def block_scale_template(scales_per_tile: int) -> TmaTemplate:
    """The TMA of M/N-major block scales (the blockwise main loop's tma_load_sfa/sfb): fp32 over
    (blocks, K blocks, L), one box of the tile's scales per K step, no swizzle."""
    return TmaTemplate(int(TmaDataType.FLOAT32), 32, (scales_per_tile, 1, 1), int(Swizzle.NONE), True)


@dataclass(frozen=True)
class ScaleBlockTemplate:
    """The TMA of a microscaled operand's scales (the block-scaled main loop's tma_load_sfa/sfb),
    over their blocked order (`ir.microscaling`): 16-bit words, modes (the 256 words of a block,
    row blocks, K blocks, L), one box of the tile's row blocks and K blocks per K tile, no swizzle.
    `order` is the modes after the words as CuTe's TMA lays them out: those the box spans more than
    one of first, then the rest, each group in mode order."""

    box: tuple[int, int, int, int]  # per mode, in mode order
    order: tuple[int, int, int]

    def encode(self, addr: int, row_blocks: int, k_blocks: int, l: int) -> EncodeArgs:  # noqa: E741
        block = BLOCK_ROWS * BLOCK_COLUMNS
        dims = (row_blocks, k_blocks, l)
        strides = (k_blocks * block, block, row_blocks * k_blocks * block)
        return EncodeArgs(int(TmaDataType.UINT16), 4, addr, (block // 2, *(dims[i] for i in self.order)),
                          tuple(strides[i] for i in self.order), (self.box[0], *(self.box[1 + i] for i in self.order)),
                          (1, 1, 1, 1), INTERLEAVE_NONE, int(Swizzle.NONE), L2_PROMOTION_128B, OOB_FILL_NONE)


def scale_block_template(config: KernelConfig, recipe: RecipeIR, which: str) -> ScaleBlockTemplate:
    """The tile's row blocks of A's scales (which="a": its CTA's 128 rows) or B's (the MMA's N,
    rounded up to whole blocks) and its K tile's K blocks, split as make_tma_atom_{A,B}_sm100 splits
    them: A's among the CTAs it is multicast to, B's also between the CTAs of a pair."""
    fmt = recipe.gemm.microscaling
    assert fmt is not None
    multicast_a, multicast_b = sm100.geometry.multicast(config)
    if which == "a":
        blocks, split = -(-config.cta_tile[0] // BLOCK_ROWS), multicast_a
    else:
        blocks, split = -(-config.tile[1] // BLOCK_ROWS), multicast_b * sm100.geometry.mma_ctas(config)
    k_blocks = -(-config.tile[2] // (fmt.vector * BLOCK_COLUMNS))
    box = _split_multicast([BLOCK_ROWS * BLOCK_COLUMNS // 2, blocks, k_blocks, 1], split)
    order = sorted(range(3), key=lambda i: box[1 + i] == 1)  # stable: mode order within each group
    return ScaleBlockTemplate(tuple(box), tuple(order))  # type: ignore[arg-type]


def epilogue_template(recipe: RecipeIR, config: KernelConfig, dtype: DType) -> TmaTemplate:
    """The TMA of C, D or an aux tensor, tiled by the epilogue tile, in D's layout
    (sm90_get_epilogue_smem_swizzle_layout_atom: the swizzle spans the contiguous extent)."""
    em, en = (sm100.geometry.epilogue_copy_tile if config.arch is Arch.SM100A else epilogue_tile)(config, recipe)
    if recipe.gemm.layout_d is Layout.ROW:
        swizzle, width = _swizzle_atom(en, dtype.bits)  # a box spans one swizzle atom's width at most
        return TmaTemplate(int(_storage_type(dtype)), dtype.bits, (min(width, en), em, 1), int(swizzle), False)
    swizzle, width = _swizzle_atom(em, dtype.bits)
    return TmaTemplate(int(_storage_type(dtype)), dtype.bits, (min(width, em), en, 1), int(swizzle), True)

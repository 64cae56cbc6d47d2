"""A stand-in for cuTensorMapEncodeTiled that records its arguments (for tests and host-cost benchmarks).

By default it also applies the driver's documented requirements (cuda.h, CUDA 13.0), so that a CPU
test fails where the driver would answer CUDA_ERROR_INVALID_VALUE on the GPU.
"""

from __future__ import annotations

from ..codegen.sm90 import SM90_SMEM_CAPACITY
from ..runtime.tma import EncodeArgs, Swizzle, TmaDataType

_BITS = {TmaDataType.UINT8: 8, TmaDataType.UINT16: 16, TmaDataType.UINT32: 32, TmaDataType.FLOAT16: 16,
         TmaDataType.FLOAT32: 32, TmaDataType.BFLOAT16: 16, TmaDataType.U4X16_ALIGN8B: 4}
_SWIZZLE_SPAN = {Swizzle.B32: 32, Swizzle.B64: 64, Swizzle.B128: 128}


class TensorMapRejected(AssertionError):
    """Arguments cuTensorMapEncodeTiled would refuse."""


def encode_violations(args: EncodeArgs) -> list[str]:
    """What cuTensorMapEncodeTiled's documented requirements say against `args` (the subset for the
    non-interleaved data types gemmgen uses, 16U4_ALIGN8B's packed fp4 among them); empty when the
    driver accepts them."""
    out = []
    if args.dtype not in _BITS:
        return [f"data type {args.dtype} is not one gemmgen encodes"]
    bits = _BITS[TmaDataType(args.dtype)]
    if not 1 <= args.rank <= 5 or not len(args.dims) == len(args.box) == len(args.elem_strides) == args.rank \
            or len(args.strides) != args.rank - 1:
        out.append(f"rank {args.rank} with dims {args.dims}, strides {args.strides}, box {args.box}")
    if args.addr % 16:
        out.append(f"global address {args.addr:#x} is not 16-byte aligned")
    if not all(0 < d <= 2**32 for d in args.dims):
        out.append(f"global dims {args.dims} must be in [1, 2^32]")
    if not all(s % 16 == 0 and 0 <= s < 2**40 for s in args.strides):
        out.append(f"global strides {args.strides} (bytes) must be multiples of 16 below 2^40")
    if not all(0 < b <= 256 for b in args.box):
        out.append(f"box {args.box} must be in [1, 256]")
    if bits == 4 and args.dims and args.dims[0] % 2:
        out.append(f"global dim 0 = {args.dims[0]} of packed 4-bit elements must be a multiple of 2")
    inner = args.box[0] * bits // 8 if args.box else 0
    if inner % 16:
        out.append(f"box inner dimension {inner} bytes is not a multiple of 16")
    if args.swizzle in _SWIZZLE_SPAN and inner > _SWIZZLE_SPAN[Swizzle(args.swizzle)]:
        out.append(f"box inner dimension {inner} bytes exceeds the {_SWIZZLE_SPAN[Swizzle(args.swizzle)]}-byte swizzle")
    if not all(0 < e <= 8 for e in args.elem_strides):
        out.append(f"element strides {args.elem_strides} must be in [1, 8]")
    return out


def launch_violations(grid: tuple[int, int, int], block: int, cluster: tuple[int, int, int], smem: int) -> list[str]:
    """What cuLaunchKernelEx would refuse on an sm_90 device for this launch; empty when none."""
    out = []
    if not (0 < grid[0] < 2**31 and 0 < grid[1] <= 65535 and 0 < grid[2] <= 65535):
        out.append(f"grid {grid} is outside [1, 2^31) x [1, 65535] x [1, 65535]")
    if any(g % c for g, c in zip(grid, cluster, strict=True)):
        out.append(f"grid {grid} is not a multiple of the cluster {cluster}")
    if cluster[0] * cluster[1] * cluster[2] > 8:
        out.append(f"cluster {cluster} has more than 8 blocks (the portable limit)")
    if not 0 < block <= 1024:
        out.append(f"block of {block} threads")
    if smem > SM90_SMEM_CAPACITY:
        out.append(f"{smem} bytes of dynamic shared memory, more than sm_90's {SM90_SMEM_CAPACITY}")
    return out


class RecordingEncoder:
    """Returns a 128-byte map whose bytes name the call; `calls[i]` holds call i+1's arguments.

    `strict` (the default) raises TensorMapRejected for arguments the driver would refuse; host-cost
    benchmarks turn it off to time gemmgen's work alone.
    """

    def __init__(self, strict: bool = True) -> None:
        self.calls: list[EncodeArgs] = []
        self.strict = strict

    def __call__(self, args: EncodeArgs) -> bytes:
        if self.strict:
            wrong = encode_violations(args)
            if wrong:
                raise TensorMapRejected(f"cuTensorMapEncodeTiled would refuse {args}: {'; '.join(wrong)}")
        self.calls.append(args)
        return bytes([len(self.calls) & 0xFF]) * 128

    def of(self, desc: bytes) -> EncodeArgs | None:
        return self.calls[desc[0] - 1] if desc[0] else None

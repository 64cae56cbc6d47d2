"""The GPUs `gemmgen advise` models: SMs, memory bandwidth and MMA rates, each figure with its
source. The time model (`analysis`) is a roofline whose compute roof is calibrated so that it gives
the anchor's throughput at the anchor's shape; no figure here was measured by gemmgen (no GPU has
run it yet), so every prediction is labelled a model."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Arch
from ..errors import InvalidArgument


@dataclass(frozen=True)
class Anchor:
    """A measured GEMM throughput the model is calibrated on: `tflops` at (m, n, k), and where the
    figure comes from."""

    tflops: float
    shape: tuple[int, int, int]
    source: str


@dataclass(frozen=True, eq=False)  # one object per GPU (GPUS): compared and hashed by identity
class Gpu:
    """A GPU's figures for the model, each with its source (`anchors`: the calibration)."""

    name: str
    arch: Arch
    sm_count: int
    bandwidth_tb_s: float  # HBM, the spec sheet's
    spec_tflops: dict[str, float]  # dense MMA rate by operand kind ("bf16", "fp8"), the spec sheet's
    anchors: dict[str, Anchor]  # by operand kind
    bandwidth_source: str

    def anchor(self, kind: str) -> Anchor:
        """The calibration anchor for "bf16" or "fp8" operands."""
        return self.anchors[kind]


_H_ANCHORS = {
    "bf16": Anchor(795.0, (8192, 8192, 8192), "cuBLAS bf16, about 795 TFLOP/s at 8192^3 on H100/H200 "
                   "(../shared/FINDINGS.md section 5, published)"),
    "fp8": Anchor(1453.0, (8192, 8192, 8192), "torch._scaled_mm fp8, about 1453 TFLOP/s on an H200 "
                  "(../shared/FINDINGS.md section 5, published)"),
}

#: The GPUs by the name `--gpu` takes: H100 and H200 SXM (sm_90a, 132 SMs), B200 (sm_100a, 148).
GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM", Arch.SM90A, 132, 3.35, {"bf16": 989.4, "fp8": 1978.9}, _H_ANCHORS,
                "NVIDIA H100 SXM spec sheet: 3.35 TB/s HBM3"),
    "h200": Gpu("H200 SXM", Arch.SM90A, 132, 4.8, {"bf16": 989.4, "fp8": 1978.9}, _H_ANCHORS,
                "NVIDIA H200 SXM spec sheet: 4.8 TB/s HBM3e"),
    "b200": Gpu("B200", Arch.SM100A, 148, 8.0, {"bf16": 2250.0, "fp8": 4500.0}, {
        "bf16": Anchor(1360.0, (8192, 8192, 8192), "B200 bf16 at 1.36-1.51 PFLOP/s published, the low end "
                       "(../shared/research/perf_tooling.md section 3)"),
        "fp8": Anchor(2720.0, (8192, 8192, 8192), "no published fp8 anchor: the bf16 anchor's share of the spec "
                      "rate (1360 / 2250) times the fp8 spec rate (4500): an assumption"),
    }, "NVIDIA B200 spec sheet: 8 TB/s HBM3e"),
}


def gpu(name: str) -> Gpu:
    """The GPU named (h100, h200, b200; any case)."""
    found = GPUS.get(str(name).lower().replace(" ", "").replace("-", "").removesuffix("sxm"))
    if found is None:
        raise InvalidArgument(f"gpu: {name!r} is not one gemmgen models; give one of {', '.join(GPUS)}")
    return found

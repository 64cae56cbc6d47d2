"""Each GEMM of a rank's training step: the kernel gemmgen launches and why, its tiles and waves,
and a roofline time; the advice rules over them (`rules`), per layer and per step.

The time model: a GEMM gemmgen runs takes max(FLOPs / (roof x efficiency), minimum bytes /
bandwidth), where efficiency is the launch's wave model (`tuning.heuristic.wave_model`: useful
tile area x wave or stream-K balance) and the roof is calibrated so that the model gives the GPU's
anchor throughput at the anchor's shape (`gpus`). A GEMM torch runs is put at the anchor's
throughput whatever its shape (no tile model of cuBLAS). A model, not a measurement."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import KernelConfig
from ..nn import linear_recipe
from ..nn.plan import Pass, PlannedGemm
from ..tuning import choose_launch
from ..tuning.heuristic import Waves, wave_model
from .gpus import Gpu


@dataclass(frozen=True)
class Timed:
    """A modelled time (`timed`, `analyze`): the kernel's waves (None where torch runs it), FLOPs,
    minimum bytes, and the compute and memory roofs' times."""

    waves: Waves | None
    flops: int
    bytes: int
    compute_us: float
    memory_us: float

    @property
    def predicted_us(self) -> float:
        return max(self.compute_us, self.memory_us)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_us >= self.memory_us else "memory"


@dataclass(frozen=True)
class GemmAnalysis(Timed):
    """One GEMM of the step (`gemm`), `repeats` times (once per model layer that has it), timed."""

    gemm: PlannedGemm
    repeats: int
    kind: str  # "bf16" or "fp8": which roof
    config: KernelConfig | None  # None: torch runs it
    why: str

    @property
    def engine(self) -> str:
        return "torch" if self.config is None else "gemmgen"

    @property
    def last_wave_use(self) -> float | None:
        """The share of the last wave's SMs that have a tile (persistent kernels)."""
        if self.waves is None:
            return None
        w = self.waves.waves
        return 1.0 if w == int(w) else w - int(w)


def min_bytes(m: int, n: int, k: int, groups: int, split_k: bool, a_bits: int, d_bits: int) -> int:
    """The minimum traffic: A, B and D once (B per group, or D per group where the groups split K);
    A and B of `a_bits` (fp4 packs two to a byte), D of `d_bits`."""
    a, b, d = m * k, k * n, m * n
    if groups > 1:
        if split_k:
            d *= groups
        else:
            b *= groups
    return ((a + b) * a_bits + d * d_bits) // 8


def _kind(g: PlannedGemm) -> str:
    return "bf16" if g.recipe is None or g.recipe.ir.gemm.a.bits == 16 else "fp8"


def analyze(g: PlannedGemm, repeats: int, gpu: Gpu) -> GemmAnalysis:
    """`g` on `gpu` as gemmgen's launch policy picks its kernel (no device: the heuristic, or the
    recipe's config)."""
    kind = _kind(g)
    split_k = g.pass_ is Pass.WGRAD
    if g.recipe is None:
        flops, size = 2 * g.m * g.n * g.k, min_bytes(g.m, g.n, g.k, g.groups, split_k, 16, 16)
        return GemmAnalysis(None, flops, size, flops / (gpu.anchor(kind).tflops * 1e6),
                            size / (gpu.bandwidth_tb_s * 1e6), g, repeats, kind, None,
                            "torch computes it (torch.matmul / torch._grouped_mm)")
    launch = choose_launch(g.recipe, g.m, g.n, g.k, g.groups, sm_count=gpu.sm_count, arch=gpu.arch)
    ir = g.recipe.ir.gemm
    t = timed(launch.config, g.m, g.n, g.k, g.groups, split_k, ir.a.bits, ir.d.bits, gpu)
    return GemmAnalysis(t.waves, t.flops, t.bytes, t.compute_us, t.memory_us, g, repeats, kind, launch.config,
                        launch.why)


def timed(cfg: KernelConfig, m: int, n: int, k: int, groups: int, split_k: bool, a_bits: int, d_bits: int,
          gpu: Gpu, batch: int = 1) -> Timed:
    """The time model of `cfg`'s kernel on (m, n, k) over `groups` (rows split evenly over them, or K
    where `split_k`) or `batch` whole problems, A of `a_bits` and D of `d_bits`, on `gpu`."""
    kind = "bf16" if a_bits == 16 else "fp8"
    flops = 2 * m * n * k * batch
    size = min_bytes(m, n, k, groups, split_k, a_bits, d_bits) * batch
    waves = wave_model(cfg, m, n, k, batch, gpu.sm_count) if batch > 1 else _waves(cfg, m, n, k, groups, split_k, gpu)
    compute_us = flops / (roof_tflops(gpu, kind) * 1e6 * waves.efficiency)
    return Timed(waves, flops, size, compute_us, size / (gpu.bandwidth_tb_s * 1e6))


def waves_of(cfg: KernelConfig, g: PlannedGemm, gpu: Gpu) -> Waves:
    """The wave model of `cfg` on `g` (see `_waves`; a weight gradient's groups split K)."""
    return _waves(cfg, g.m, g.n, g.k, g.groups, g.pass_ is Pass.WGRAD, gpu)


def _waves(cfg: KernelConfig, m: int, n: int, k: int, groups: int, split_k: bool, gpu: Gpu) -> Waves:
    """The wave model over `groups`: the rows split evenly over them, or where `split_k` (a
    K-grouped GEMM) K, each group then a whole M x N of tiles."""
    if groups == 1:
        return wave_model(cfg, m, n, k, 1, gpu.sm_count)
    if split_k:
        return wave_model(cfg, m, n, -(-k // groups), groups, gpu.sm_count)
    return wave_model(cfg, -(-m // groups), n, k, groups, gpu.sm_count)


@functools.cache
def roof_tflops(gpu: Gpu, kind: str) -> float:
    """The compute roof: the anchor's throughput over the efficiency the wave model gives the
    kernel gemmgen launches for a plain bf16 linear layer at the anchor's shape, so that the model
    reproduces the anchor there."""
    anchor = gpu.anchor(kind)
    m, n, k = anchor.shape
    recipe = linear_recipe(None, False, torch.bfloat16)
    launch = choose_launch(recipe, m, n, k, sm_count=gpu.sm_count, arch=gpu.arch)
    return anchor.tflops / wave_model(launch.config, m, n, k, 1, gpu.sm_count).efficiency

"""What a model's gemmgen layers launch: the (recipe, config) pairs to build ahead of time."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .. import tuning
from ..codegen.quantize import QuantizeSpec
from ..config import Arch, KernelConfig
from ..dsl import Recipe
from ..errors import InvalidArgument
from ..types import DType
from .base import launch_arch
from .block_scaled import BlockScaledGroupedLinear, QuantizedLinear
from .experts import GroupedExperts
from .grouped import GroupedLinear
from .linear import FusedLinear
from .mlp import FusedMLP


def model_launches(model: nn.Module, tokens: Iterable[int], training_tokens: Iterable[int] = (),
                   sm_count: int | None = None, device: tuning.Device | None = None,
                   arch: Arch | str | None = None) -> list[tuple[Recipe, KernelConfig]]:
    """(recipe, config) of every kernel the gemmgen layers of `model` launch (each once): forward
    for inputs of each of `tokens` rows, and a training step (forward with gradients wanted: the
    kernels that also store the pre-activation or the accumulator; and the backward's own kernels,
    derived or accumulating weight gradients) for each of `training_tokens`; both of a grouped layer's
    heuristic kernels (for few rows per expert, and for many) whatever the tokens (and with
    `training_tokens` its derived backward kernel's), as its rows are the tokens routed to it, which
    the model's top-k decides. What to build ahead of time, e.g.
    `gg.warmup(model_launches(model, (1, 16, 4096), training_tokens=(4096,)))`.

    The kernels are `arch`'s (default: the current CUDA device's, sm_90a without one, as
    `gemmgen.warmup` has it; `"sm_100a"` for B200s), chosen for `sm_count` SMs (default: the arch's
    reference GPU's, 132 or 148). The heuristic's choices; with `device`
    (`gemmgen.tuning.Device.current()` where the model will run), the runtime's: an autotune result
    registered for that device replaces the heuristic's pick where it applies, and a grouped layer
    adds every winner registered for its sizes."""
    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    target = launch_arch(arch)
    mlps = [m for m in model.modules() if isinstance(m, FusedMLP)]
    inside = {id(layer) for mlp in mlps for layer in (mlp.fc1, mlp.fc2)}  # launched as the MLP launches them
    layers = [m for m in model.modules()
              if isinstance(m, FusedLinear | QuantizedLinear) and id(m) not in inside]
    tokens, training_tokens = tuple(tokens), tuple(training_tokens)
    found = [m.launches(t, sm_count=sm_count, device=device, arch=target) for m in layers for t in tokens]
    found += [m.launches(t, training=True, sm_count=sm_count, device=device, arch=target)
              for m in layers for t in training_tokens]
    found += [k for m in layers if isinstance(m, FusedLinear) for t in training_tokens
              for k in m.backward_launches(t, sm_count=sm_count, device=device, arch=target)]
    found += [k for m in mlps for t in tokens for k in m.launches(t, sm_count=sm_count, device=device, arch=target)]
    found += [k for m in mlps for t in training_tokens
              for k in (*m.launches(t, training=True, sm_count=sm_count, device=device, arch=target),
                        *m.backward_launches(t, sm_count=sm_count, device=device, arch=target))]
    grouped: list = [m for m in model.modules() if isinstance(m, GroupedLinear | BlockScaledGroupedLinear)]
    grouped += [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.projections()]
    found += [m.launches(rows, device=device, arch=target) for m in grouped for rows in (None, m.num_experts)]
    found += [k for m in grouped if training_tokens for rows in (None, m.num_experts)
              for k in m.backward_launches(rows, device=device, arch=target)]
    if device is not None:
        found += [(m.recipe, c) for m in grouped
                  for c in tuning.tuned_configs(m.recipe.ir, device, m.out_features, m.in_features, m.num_experts)
                  if c.arch is target]
    return list(dict.fromkeys(found))


def model_quantize_specs(model: nn.Module, arch: Arch | str | None = None) -> list[QuantizeSpec]:
    """The quantize kernels (`codegen.quantize`: cast-transpose, amax) a training step of `model`'s
    low-precision FusedLinear and FusedMLP layers launches on `arch` (default as `model_launches`),
    each once: what `gemmgen.warmup(..., quantize=)` and `build_bundle(..., quantize=)` build beside
    the GEMMs, e.g. for a GEMMGEN_JIT=0 deployment. Activations in f16 where a layer computes in
    f16, else bf16 (autocast's, with fp32 master weights)."""
    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    target = launch_arch(arch)
    found: list[QuantizeSpec] = []
    for m in model.modules():
        precision = m.precision if isinstance(m, FusedLinear | FusedMLP) else None
        if precision is not None:
            layer = m.fc1 if isinstance(m, FusedMLP) else m
            source = DType.F16 if layer.compute_dtype == torch.float16 else DType.BF16
            found += precision.quantize_specs(source, target)
    return list(dict.fromkeys(found))

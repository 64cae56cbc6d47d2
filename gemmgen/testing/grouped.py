"""Grouped (MoE) test recipes, inputs and CPU kernels, shared by the grouped tests of every layer."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compile import CompiledKernel
from ..dsl import ColVector, Recipe, RowVector, pairs, silu
from ..ir.reference import group_bounds, reference
from ..nn import interleave_pairs
from ..runtime.grouped import GroupedKernel
from ..runtime.quantize import quantize_blockwise, quantize_mx
from ..types import ColMajor, Microscaling, bf16, f32
from .emulate import emulate_grouped
from .recording import RecordingEncoder

#: examples/recipes.py's moe_up: an MoE expert layer with a per-expert bias, SiLU, then each token's
#: routing weight.
MOE: dict[str, Any] = dict(epilogue=lambda acc, bias, weight: silu(acc + bias) * weight,
                           operands={"bias": RowVector(bf16), "weight": ColVector(f32)})


def moe_recipe(**kw: Any) -> Recipe:
    """moe_up, with any of its declaration replaced."""
    args = {**MOE, **kw}
    return Recipe("moe_up", args.pop("epilogue"), grouped=True, **args)


def _swiglu_experts(acc: Any, bias: Any, weight: Any) -> Any:
    gate, up = pairs(acc + bias)
    return silu(gate) * up * weight


def moe_swiglu_recipe() -> Recipe:
    """examples/recipes.py's moe_swiglu, the grouped tests' kernel over column pairs: SwiGLU (each
    expert's gate and up rows interleaved, `gemmgen.nn.interleave_pairs`) after a per-expert bias,
    times each token's routing weight; D has N/2 columns."""
    return Recipe("moe_swiglu", _swiglu_experts, grouped=True,
                  operands={"bias": RowVector(bf16), "weight": ColVector(f32)})


def cpu_grouped_kernel(kernel: CompiledKernel, sm_count: int = 132, clusters: int = 0) -> Any:
    """The kernel with the driver replaced: recording tensor maps, the given hardware. (Typed Any:
    tests read the optional fields of its prepared calls, and its recording encoder, directly.)"""
    return GroupedKernel(kernel, encoder=RecordingEncoder(), hardware=lambda i: (sm_count, clusters),
                         require_cuda=False)


def params_field(compiled: CompiledKernel, params: bytes) -> Callable[[str], int]:
    """A Params field's value by name, as the oracle prints it (sign-extended to 64 bits)."""
    layout = {f.name: (offset, f) for f, offset, _ in compiled.params_layout.fields}

    def field(name: str) -> int:
        offset, f = layout[name]
        return int.from_bytes(params[offset:offset + f.size], "little", signed=f.kind in ("i32", "i64")) \
            & (2**64 - 1)

    return field


def grouped_inputs(rows: int = 37, k: int = 64, n: int = 48, groups: int = 4,
                   offsets: Sequence[int] = (5, 5, 20, 30)) -> tuple[torch.Tensor, ...]:
    """moe_up's: bf16 tokens and expert weights, offsets, each expert's bias, each token's routing weight."""
    a = torch.randn(rows, k).bfloat16()
    b = torch.randn(groups, n, k).bfloat16().transpose(1, 2)  # per group K x N, stored N x K (K-major)
    return a, b, torch.tensor(offsets, dtype=torch.int32), torch.randn(groups, n).bfloat16(), torch.rand(rows)


def emulated_moe(kernel: CompiledKernel, shape: tuple[int, int, int, int], offsets: Sequence[int],
                 sm_count: int = 132) -> tuple[torch.Tensor, torch.Tensor]:
    """(D as the emulated setup kernel and GEMM write it, the fp32 reference) for one call of a
    moe_up kernel on (rows, K, N, groups) with A's rows 8 apart from K (A's and B's strides
    differ) and D pre-filled with NaN."""
    enc = RecordingEncoder()
    k = GroupedKernel(kernel, encoder=enc, hardware=lambda i: (sm_count, 0), require_cuda=False)
    rows, depth, n, groups = shape
    _, b, offs, bias, weight = grouped_inputs(rows, depth, n, groups, offsets)
    a = torch.randn(rows, depth + 8).bfloat16()[:, :depth]
    out = torch.full((rows, n), float("nan")).bfloat16()
    p = k.prepare(a, b, offs, bias=bias, weight=weight, out=out)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(kernel, p.setup, p.params, enc, [a, b, offs, bias, weight, out, p.buffer])
    want = moe_recipe().reference(a, b, offs, bias=bias, weight=weight).float()
    assert want.nan_to_num().abs().sum() > 0
    return out.float(), want


def emulated_block_moe(kernel: CompiledKernel, shape: tuple[int, int, int, int], offsets: Sequence[int],
                       sm_count: int = 132) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor],
                                                     torch.Tensor, torch.Tensor]:
    """`emulated_moe` for a moe_fp8_block kernel (`block_grouped_inputs`): (D as emulated, the fp32
    reference, the operands, the unquantized tokens and weights)."""
    rows, k, n, groups = shape
    a, b, offs, ops, x, w = block_grouped_inputs(rows, k, n, groups, offsets)
    return (*_emulated_call(kernel, a, b, offs, ops, sm_count), ops, x, w)


def _emulated_call(kernel: CompiledKernel, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                   ops: dict[str, torch.Tensor], sm_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(D as the emulated setup kernel and GEMM write it, pre-filled with NaN; the fp32 reference,
    non-zero) for one call of a grouped kernel."""
    enc = RecordingEncoder()
    grouped = GroupedKernel(kernel, encoder=enc, hardware=lambda i: (sm_count, 0), require_cuda=False)
    out = torch.full((a.shape[0], b.shape[-1]), float("nan")).bfloat16()
    p = grouped.prepare(a, b, offsets, **ops, out=out)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(kernel, p.setup, p.params, enc, [a, b, offsets, *ops.values(), out, p.buffer])
    (want,) = reference(kernel.recipe, a, b, ops, offsets)
    assert want.float().nan_to_num().abs().sum() > 0
    return out.float(), want.float()


def fp8_grouped_inputs(rows: int = 37, k: int = 128, n: int = 48, groups: int = 4,
                       offsets: Sequence[int] = (5, 5, 20, 30)
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """moe_fp8's: e4m3 tokens and expert weights, each token's scale, each expert's channel scales and bias."""
    a = torch.randn(rows, k).to(torch.float8_e4m3fn)
    b = torch.randn(groups, n, k).to(torch.float8_e4m3fn).transpose(1, 2)
    return (a, b, torch.tensor(offsets, dtype=torch.int32),
            {"scale_a": torch.rand(rows) + 0.5, "scale_b": torch.rand(groups, n) + 0.5,
             "bias": torch.randn(groups, n).bfloat16()})


def unfused_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
    """The MoE layer in plain torch, one group at a time (float64)."""
    out = []
    for g, (start, end) in enumerate(group_bounds(offsets.tolist(), a.shape[0])):
        acc = a[start:end].double() @ b[g].double()
        out.append(torch.nn.functional.silu(acc + bias[g].double()) * weight[start:end, None].double())
    return torch.cat(out)


def assert_gradients(mine: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Each gradient within 1% of the fp64 unfused layer's, relative to its norm: the op recomputes
    the accumulator in bf16 (as the unfused bf16 layer would have saved it) and returns bf16
    gradients for bf16 inputs, so each element carries bf16 rounding (about 0.3% here)."""
    for name, m, r in zip(("a", "b", "bias", "weight"), mine, ref, strict=True):
        assert m.grad is not None and r.grad is not None and r.grad.norm() > 0, name
        error = (m.grad.double().cpu() - r.grad).norm() / r.grad.norm()
        assert error < 1e-2, (name, float(error))


def experts_loop(linears: Sequence[torch.nn.Linear], x: torch.Tensor, offsets: torch.Tensor,
                 activation: str | None) -> torch.Tensor:
    """The experts as a model without gemmgen runs them: each expert's nn.Linear (in float64) on its
    own rows, then the activation."""
    act: Callable[[torch.Tensor], torch.Tensor] = {
        None: lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[activation]
    out = []
    for e, (start, end) in enumerate(group_bounds(offsets.tolist(), x.shape[0])):
        out.append(act(linears[e].double()(x[start:end].double())))
    return torch.cat(out)


def gated_experts(num_experts: int, in_features: int, out_features: int, bias: bool,
                  device: torch.device | str | None = None
                  ) -> tuple[list[torch.nn.Linear], list[torch.nn.Linear], list[torch.nn.Linear]]:
    """Gated experts as a model holds them: each expert's gate and up Linears (float64 on the CPU,
    holding bf16 values), and what a gated GroupedLinear is made from (`from_linears`): per expert
    one bf16 Linear of 2 x out_features rows, gate and up interleaved, on `device`."""
    gates = [torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64) for _ in range(num_experts)]
    ups = [torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64) for _ in range(num_experts)]
    fc1s = []
    with torch.no_grad():
        for layer in (*gates, *ups):
            for p in layer.parameters():
                p.copy_(p.bfloat16())
        for gate, up in zip(gates, ups, strict=True):
            fc1 = torch.nn.Linear(in_features, 2 * out_features, bias=bias, dtype=torch.bfloat16, device=device)
            fc1.weight.copy_(interleave_pairs(gate.weight, up.weight))
            if bias:
                fc1.bias.copy_(interleave_pairs(gate.bias, up.bias))
            fc1s.append(fc1)
    return gates, ups, fc1s


def gated_experts_loop(gates: Sequence[torch.nn.Linear], ups: Sequence[torch.nn.Linear], x: torch.Tensor,
                       offsets: torch.Tensor, activation: str) -> torch.Tensor:
    """Gated experts as a model without gemmgen runs them: act(gate(x)) * up(x) on each expert's
    own rows, in float64 (SwiGLU: SiLU; GEGLU: erf GELU)."""
    assert activation in ("swiglu", "geglu"), activation
    act: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu if activation == "swiglu" else \
        torch.nn.functional.gelu
    x = x.double()
    return torch.cat([act(gates[e](x[start:end])) * ups[e](x[start:end])
                      for e, (start, end) in enumerate(group_bounds(offsets.tolist(), x.shape[0]))])


def block_grouped_inputs(rows: int = 37, k: int = 304, n: int = 136, groups: int = 4,
                         offsets: Sequence[int] = (5, 5, 20, 30), gen: torch.Generator | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor,
                                    torch.Tensor]:
    """moe_fp8_block's: tokens and expert weights quantized as DeepSeek-V3 does (per token and 128 of
    K; per 128 x 128 block), scales K-major and unpadded as grouped kernels read them, and routing
    weights. Also the unquantized tokens and weights (float32)."""
    gen = gen or generator()
    x = torch.randn(rows, k, generator=gen) * (torch.rand(rows, 1, generator=gen) * 4 + 0.1)
    w = torch.randn(groups, n, k, generator=gen) * (torch.rand(groups, 1, 1, generator=gen) + 0.1)
    a, scale_a = quantize_blockwise(x, (1, 128), compact=True)
    b, scale_b = quantize_blockwise(w.mT, (128, 128), scale_layout=ColMajor, compact=True)
    ops = {"scale_a": scale_a, "scale_b": scale_b, "weight": torch.rand(rows, generator=gen) + 0.5}
    return a, b, torch.tensor(offsets, dtype=torch.int32), ops, x, w


def moe_mx_recipe(fmt: Microscaling) -> Recipe:
    """moe_up over microscaled tokens and experts (MXFP8: e4m3, NVFP4: packed fp4)."""
    element = fmt.elements[0]
    return Recipe(f"moe_{fmt.value}", MOE["epilogue"], grouped=True, a=element, b=element, block_scale=fmt,
                  operands=MOE["operands"])


def mx_grouped_inputs(fmt: Microscaling, rows: int = 37, k: int = 256, n: int = 136, groups: int = 4,
                      offsets: Sequence[int] = (5, 5, 20, 30), gen: torch.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """moe_mx_recipe(fmt)'s: tokens quantized per row (their scales in the grouped blocked order,
    `quantize_mx(..., offsets=)`), each expert's weight (N x K, passed as K x N) in the blocked
    order per expert, each expert's bias and each token's routing weight."""
    gen = gen or generator()
    offs = torch.tensor(offsets, dtype=torch.int32)
    x = torch.randn(rows, k, generator=gen) * (torch.rand(rows, 1, generator=gen) * 4 + 0.1)
    w = torch.randn(groups, n, k, generator=gen) * 0.1
    a, scale_a = quantize_mx(x, fmt, offsets=offs)
    wq, scale_b = quantize_mx(w, fmt)
    return a, wq.transpose(1, 2), offs, {"scale_a": scale_a, "scale_b": scale_b,
                                         "bias": torch.randn(groups, n, generator=gen).bfloat16(),
                                         "weight": torch.rand(rows, generator=gen) + 0.5}


def emulated_mx_moe(kernel: CompiledKernel, shape: tuple[int, int, int, int], offsets: Sequence[int],
                    sm_count: int = 132) -> tuple[torch.Tensor, torch.Tensor]:
    """`emulated_moe` for a moe_mx_recipe kernel (`mx_grouped_inputs`)."""
    rows, k, n, groups = shape
    fmt = kernel.recipe.gemm.microscaling
    assert fmt is not None
    a, b, offs, ops = mx_grouped_inputs(fmt, rows, k, n, groups, offsets)
    return _emulated_call(kernel, a, b, offs, ops, sm_count)


def generator() -> torch.Generator:
    """A generator of fresh inputs each run (its seed printed, to rerun a failure)."""
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)



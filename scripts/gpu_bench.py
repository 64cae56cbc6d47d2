"""Speed check on the GPU: gemmgen's fused kernels against cuBLAS through torch, side by side in
one process, on the same inputs. bias + GELU (bf16) against:

- `torch.matmul` + bias + GELU (three kernels: what an unfused model runs),
- `torch.addmm` (bias in cuBLAS's epilogue) + GELU,
- `torch._addmm_activation(use_gelu=True)` (cuBLASLt's fused bias + GELU epilogue, where torch
  routes it there; its GELU is the tanh approximation, gemmgen's recipe the erf one),
- `torch.matmul` alone (no epilogue: the GEMM's own cost).

The fp8 rowwise-scaled GEMM with a bias (`scaled_mm_fp8`, e4m3 in, bf16 out) against
`torch._scaled_mm` with the same rowwise scales, with its bias argument (one cuBLASLt call, where
torch supports rowwise scales with a bias) and without it, plus a separate bias add.

The fp8 GEMM with DeepSeek-V3's block scales (`fp8_block_scaled`: one scale per token and 128 of K,
one per 128 x 128 block of the weight) against `torch._scaled_mm` with the same block scales
(cuBLAS's block scaling, where this torch has it), B's scales in either layout.

The residual stream with its per-row statistics (`residual_norm_stats`: D = A @ B + residual, each
row's sum of squares and amax in fp32) against `torch.matmul` + the residual add + the two row
reductions in torch, and `torch.matmul` alone.

The grouped (MoE) expert GEMM with a per-expert bias, SiLU and each token's routing weight
(`moe_up`) against `torch._grouped_mm` (torch's grouped GEMM, with the same offsets) followed by the
same epilogue in torch, and `torch._grouped_mm` alone, under each of its GPU-tested configs (the
swapped one for groups of few rows among them; `*` marks the op's pick), prefill and decode shapes.

The grouped fp8 experts with DeepSeek-V3's block scales and the routing weight (`moe_fp8_block`)
against the same layer in bf16 (`torch._grouped_mm` on the dequantized values, what fp8 replaces)
and `torch._scaled_grouped_mm` with rowwise scales (no torch op takes block scales in a grouped
GEMM: a coarser recipe of similar cost); "vs bf16" divides the first by gemmgen's time.

The gated experts (`moe_swiglu`: SwiGLU over each expert's interleaved gate and up columns, half as
many out, with the bias and routing weight) against `torch._grouped_mm` followed by the same
epilogue in torch (the slices, SiLU and products), and `torch._grouped_mm` alone, at Mixtral's
sizes (prefill and decode; never swapped).

Buffers rotate through more than L2; each number is the median over CUDA-graph replays timed with
CUDA events (device time only). "vs best" divides the fastest torch way to compute the same
layer (the first three) by gemmgen's time. Each shape runs under the config the runtime picks for
it; where that is a stream-K kernel, another row runs the same tile under the persistent scheduler,
and where it is a swapped kernel (small M), another runs the best unswapped config.

The training-step table (`--training`): an MLP block of 4096 tokens, 4096 -> 14336 -> 4096 (bf16),
forward and backward, in torch eager, torch.compile and gemmgen's FusedMLP (its accumulator saved,
and recomputed), each step timed whole with CUDA events: with GELU and biases, and Llama's SwiGLU
MLP without biases (gemmgen: fc1 over column pairs, its backward fused into fc2's dgrad GEMM). Then
the same MLP in bf16 and in Float8Blockwise; and an experts layer's step (Mixtral's gate and up
projections, SwiGLU, tokens spread evenly): `torch._grouped_mm` with its autograd, gemmgen's
GroupedLinear in bf16 and in Float8Blockwise (its weight gradient K-grouped, no token padded).

    python scripts/gpu_bench.py [--reps N] [--training]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
L2_BYTES = 60 << 20  # H100/H200 L2 is 50 MB


def _unfused(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(torch.matmul(a, b) + bias)


def _addmm_gelu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(torch.addmm(bias, a, b))


def _cublaslt_gelu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch._addmm_activation(bias, a, b, use_gelu=True)


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


BASELINES = {"matmul+bias+gelu": _unfused, "addmm+gelu": _addmm_gelu, "cuBLASLt bias+gelu": _cublaslt_gelu,
             "matmul alone": _matmul}
SAME_LAYER = ("matmul+bias+gelu", "addmm+gelu", "cuBLASLt bias+gelu")


def _scaled_mm_bias(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a[:, None], scale_b[None, :], bias=bias, out_dtype=torch.bfloat16)


def _scaled_mm_then_bias(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                         bias: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a[:, None], scale_b[None, :], out_dtype=torch.bfloat16) + bias


FP8_BASELINES = {"_scaled_mm(bias=)": _scaled_mm_bias, "_scaled_mm + bias": _scaled_mm_then_bias}

_K_MAJOR: dict[int, torch.Tensor] = {}  # scale_b copies with K contiguous, made on the eager warm-up call


def _scaled_mm_blockwise(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
                         ) -> torch.Tensor:
    """torch._scaled_mm with 1x128 scales of A and 128x128 of B, as gemmgen's kernel reads them."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)


def _scaled_mm_blockwise_k_major(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
                                 ) -> torch.Tensor:
    """The same with B's scales K-major (torch may want either layout; it refuses the other)."""
    k_major = _K_MAJOR.get(scale_b.data_ptr())
    if k_major is None:
        k_major = _K_MAJOR[scale_b.data_ptr()] = scale_b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a, k_major, out_dtype=torch.bfloat16)


BLOCK_BASELINES = {"_scaled_mm blockwise": _scaled_mm_blockwise, "_scaled_mm blockwise (B scales K-major)":
                   _scaled_mm_blockwise_k_major}


def _matmul_then_stats(a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor) -> tuple:
    h = torch.matmul(a, b) + residual
    hf = h.float()
    return h, (hf * hf).sum(-1), hf.abs().amax(-1)


def _matmul_residual(a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


STATS_BASELINES = {"matmul+add+row stats": _matmul_then_stats, "matmul alone": _matmul_residual}


def _stats_table(recipe, shapes, reps: int) -> None:
    """`_table` for a recipe with row reductions: every output checked (a sum within the bound of its
    summation order), then timed with its three outputs given."""
    from gemmgen.ir.reference import evaluate_epilogue
    from gemmgen.testing.tensors import assert_output_close
    from gemmgen.tuning import device_ms
    from tests.data.gpu_matrix import bench_configs

    names = list(STATS_BASELINES)
    print(f"| M x N x K | config | gemmgen ms | {' ms | '.join(names)} ms | gemmgen TFLOP/s | vs unfused |")
    print("|---" * (5 + len(names)) + "|")
    for m, n, k in shapes:
        sets = []
        for _ in range(max(2, -(-L2_BYTES // ((m * k + k * n + 2 * m * n) * 2)) + 1)):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            outs = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(m, device="cuda"),
                    torch.empty(m, device="cuda"))
            sets.append((a, b, residual, outs))
        theirs = {name: _timed(fn, sets, reps) for name, fn in STATS_BASELINES.items()}
        for config in bench_configs(recipe, m, n, k):
            kernel = recipe.compile(config)
            a, b, residual, _ = sets[0]
            got = kernel(a, b, residual)
            acc = torch.matmul(a.float(), b.float())
            wants = evaluate_epilogue(recipe.ir.epilogue, acc, {"residual": residual})
            scales = evaluate_epilogue(recipe.ir.epilogue, acc, {"residual": residual}, magnitudes=True)
            for o, g, w, mag in zip(recipe.outputs, got, wants, scales, strict=True):
                assert_output_close(o, g.float(), w.float(), mag, (m, n), 1.6e-2,
                                    0.0 if o.reduce else 1.6e-2 * float(w.float().abs().max()), f"{o.name} {m}x{n}x{k}")
            ours = device_ms([functools.partial(kernel, a, b, residual, out=outs) for a, b, residual, outs in sets],
                             reps)
            unfused = theirs[names[0]]
            vs = f"{unfused / ours:.2f}x" if unfused is not None else "n/a"
            print(f"| {m}x{n}x{k} | {config.name} | {ours:.3f} | {' | '.join(map(_ms, theirs.values()))} | "
                  f"{2 * m * n * k / ours / 1e9:.0f} | {vs} |", flush=True)
        del sets
        torch.cuda.empty_cache()


def _moe_up(acc: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """moe_up's epilogue in torch (bias and weight broadcast to acc's rows)."""
    return F.silu(acc + bias) * weight


def _moe_swiglu(acc: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """moe_swiglu's: SwiGLU over the biased accumulator's interleaved gate and up columns."""
    h = acc + bias
    return F.silu(h[..., 0::2]) * h[..., 1::2] * weight


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor,
                weight: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets)


def _grouped_baselines(epilogue) -> dict:
    """torch's grouped GEMM followed by the recipe's epilogue in torch ops (the unfused layer), and
    the GEMM alone."""
    def unfused(a, b, offsets, bias, weight, group):
        return epilogue(torch._grouped_mm(a, b, offs=offsets), bias[group], weight[:, None])
    return {"_grouped_mm + epilogue": unfused, "_grouped_mm": _grouped_mm}


def _grouped_sets(groups: int, rows: int, n: int, k: int, out_columns: int) -> list[tuple]:
    """Tokens spread evenly over the experts; (a, b, offsets, bias, weight, each row's expert, out)."""
    per_set = (rows * k + groups * k * n + rows * out_columns) * 2
    sets = []
    for _ in range(max(2, -(-L2_BYTES // per_set) + 1)):
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        offsets = torch.linspace(rows / groups, rows, groups, device="cuda").round().int()
        bias = torch.randn(groups, n, device="cuda", dtype=torch.bfloat16)
        weight = torch.rand(rows, device="cuda")
        group = torch.searchsorted(offsets, torch.arange(rows, device="cuda", dtype=torch.int32), right=True)
        sets.append((a, b, offsets, bias, weight, group,
                     torch.empty(rows, out_columns, device="cuda", dtype=torch.bfloat16)))
    return sets


def _grouped_table(recipe, epilogue, shapes, reps: int) -> None:
    """`_table` for a grouped recipe of moe_up's operands (`epilogue` its math in torch): each kernel
    checked against a per-group fp32 evaluation first; `*` marks the config the op picks for the
    shape (`tuning.grouped_choice`)."""
    from gemmgen.codegen import is_valid
    from gemmgen.tuning import device_ms
    from gemmgen.tuning.heuristic import grouped_choice
    from tests.data.gpu_matrix import GROUPED_CONFIGS

    baselines = _grouped_baselines(epilogue)
    names = list(baselines)
    print(f"| G x rows x N x K | config | gemmgen ms | {' ms | '.join(names)} ms | gemmgen TFLOP/s | vs unfused |")
    print("|---" * (5 + len(names)) + "|")
    for groups, rows, n, k in shapes:
        sets = _grouped_sets(groups, rows, n, k, recipe.ir.outputs[0].columns.extent(n))
        theirs = {name: _timed(fn, sets, reps) for name, fn in baselines.items()}
        unfused = theirs[names[0]]
        for config in [c for c in GROUPED_CONFIGS if is_valid(c, recipe.ir)]:
            kernel = recipe.compile(config)
            a, b, offsets, bias, weight, group, _ = sets[0]
            assert rows % groups == 0  # equal groups: checked below as one batched GEMM
            got = kernel(a, b, offsets, bias=bias, weight=weight).float()
            acc = torch.bmm(a.float().reshape(groups, rows // groups, k), b.float()).reshape(rows, n)
            want = epilogue(acc, bias.float()[group], weight[:, None])
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
            ours = device_ms([functools.partial(kernel, a, b, offsets, bias=bias, weight=weight, out=out)
                              for a, b, offsets, bias, weight, _, out in sets], reps)
            vs = f"{unfused / ours:.2f}x" if unfused else "n/a"
            chosen = "*" if config == grouped_choice(recipe.ir, rows, groups).config else ""
            print(f"| {groups}x{rows}x{n}x{k} | {config.name}{chosen} | {ours:.3f} | "
                  f"{' | '.join(map(_ms, theirs.values()))} | {2 * rows * n * k / ours / 1e9:.0f} | {vs} |", flush=True)
        del sets
        torch.cuda.empty_cache()


def _block_grouped_sets(groups: int, rows: int, n: int, k: int) -> list[tuple]:
    """moe_fp8_block's inputs (tokens spread evenly, quantized as grouped kernels read them), each
    set with the same layer dequantized to bf16 and rowwise-scaled fp8 inputs for torch's baselines:
    (a, b, offsets, scale_a, scale_b, weight, a16, b16, row scales of a, of b, out)."""
    from gemmgen.runtime.quantize import quantize_blockwise

    per_set = rows * k + groups * k * n + rows * n * 2
    sets = []
    for _ in range(max(2, -(-L2_BYTES // per_set) + 1)):
        a, scale_a = quantize_blockwise(torch.randn(rows, k, device="cuda"), (1, 128), compact=True)
        b, scale_b = quantize_blockwise(torch.randn(groups, n, k, device="cuda").mT, (128, 128), scale_layout="col",
                                        compact=True)
        offsets = torch.linspace(rows / groups, rows, groups, device="cuda").round().int()
        weight = torch.rand(rows, device="cuda")
        a16 = (a.float() * scale_a.repeat_interleave(128, 1)[:, :k]).bfloat16()
        b16 = (b.float() * scale_b.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :k, :n]).bfloat16()
        rows_a, rows_b = torch.rand(rows, device="cuda") + 0.5, torch.rand(groups, n, device="cuda") + 0.5
        sets.append((a, b, offsets, scale_a, scale_b, weight, a16, b16, rows_a, rows_b,
                     torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)))
    return sets


def _bf16_grouped_mm(a, b, offsets, scale_a, scale_b, weight, a16, b16, rows_a, rows_b) -> torch.Tensor:
    return torch._grouped_mm(a16, b16, offs=offsets) * weight[:, None]


def _scaled_grouped_mm_rowwise(a, b, offsets, scale_a, scale_b, weight, a16, b16, rows_a, rows_b) -> torch.Tensor:
    return torch._scaled_grouped_mm(a, b, rows_a, rows_b, offs=offsets, out_dtype=torch.bfloat16) * weight[:, None]


#: No torch op takes block scales in a grouped GEMM: the layer in bf16 (what fp8 replaces), and
#: torch's fp8 grouped GEMM with coarser rowwise scales (a different recipe of similar cost).
BLOCK_GROUPED_BASELINES = {"bf16 _grouped_mm * weight": _bf16_grouped_mm,
                           "_scaled_grouped_mm rowwise * weight": _scaled_grouped_mm_rowwise}


def _block_grouped_table(recipe, shapes, reps: int) -> None:
    """moe_fp8_block under its GPU-matrix configs, each checked against the dequantized layer first;
    `*` marks the op's pick."""
    from gemmgen.tuning import device_ms
    from gemmgen.tuning.heuristic import grouped_choice
    from tests.data.gpu_matrix import BLOCK_GROUPED_CONFIGS

    names = list(BLOCK_GROUPED_BASELINES)
    print(f"| G x rows x N x K | config | gemmgen ms | {' ms | '.join(names)} ms | gemmgen TFLOP/s | vs bf16 |")
    print("|---" * (5 + len(names)) + "|")
    for groups, rows, n, k in shapes:
        sets = _block_grouped_sets(groups, rows, n, k)
        theirs = {name: _timed(fn, sets, reps) for name, fn in BLOCK_GROUPED_BASELINES.items()}
        bf16 = theirs[names[0]]
        for config in BLOCK_GROUPED_CONFIGS:
            kernel = recipe.compile(config)
            a, b, offsets, scale_a, scale_b, weight, a16, b16, *_ = sets[0]
            got = kernel(a, b, offsets, scale_a, scale_b, weight).float()
            want = torch.bmm(a16.float().reshape(groups, rows // groups, k), b16.float()).reshape(rows, n) * \
                weight[:, None]
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
            ours = device_ms([functools.partial(kernel, *inputs[:6], out=out) for *inputs, out in sets], reps)
            vs = f"{bf16 / ours:.2f}x" if bf16 else "n/a"
            chosen = "*" if config == grouped_choice(recipe.ir, rows, groups).config else ""
            print(f"| {groups}x{rows}x{n}x{k} | {config.name}{chosen} | {ours:.3f} | "
                  f"{' | '.join(map(_ms, theirs.values()))} | {2 * rows * n * k / ours / 1e9:.0f} | {vs} |", flush=True)
        del sets
        torch.cuda.empty_cache()


def _training_models(activation: str, shape: tuple[int, int, int, int]) -> tuple[Any, dict[bool, Any], Any]:
    """(eager model, gemmgen's FusedMLP of the same weights with its accumulator saved (False) and
    recomputed (True), the eager model's parameter gradients as the FusedMLP's parameters lay
    them out). "gelu": Linear -> GELU -> Linear with biases; "swiglu": Llama's MLP (no biases),
    whose gate and up projections become one fc1 with their rows interleaved."""
    import copy

    from torch import nn

    import gemmgen as gg

    _, n_in, hidden, n_out = shape
    eager: nn.Module
    if activation == "gelu":
        eager = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, n_out)).to("cuda", torch.bfloat16)
        first, second = eager[0], eager[2]
        assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)

        def as_fused(grads: list[torch.Tensor]) -> list[torch.Tensor]:
            return grads
    else:
        from tests.data.gated import LlamaMLP

        llama = eager = LlamaMLP(n_in, hidden, n_out).to("cuda", torch.bfloat16)
        first, second = llama.fc1(), llama.down
        as_fused = llama.fused_order
    fused = {recompute: gg.nn.FusedMLP.from_linears(copy.deepcopy(first), activation, copy.deepcopy(second),
                                                     recompute=recompute) for recompute in (False, True)}
    return eager, fused, as_fused


def _training_table(activation: str, shape: tuple[int, int, int, int], reps: int) -> None:
    """One MLP block's training step (forward + backward, gradients of the input and every
    parameter): torch eager, torch.compile (inductor) of the same model, and gemmgen's FusedMLP
    with its accumulator saved and recomputed; median of `reps` CUDA-event timings of whole steps,
    inputs rotated through more than L2, each gemmgen model's gradients checked first."""
    import copy

    tokens, n_in, hidden, n_out = shape
    torch.manual_seed(0)
    eager, fused, as_fused = _training_models(activation, shape)
    compiled = torch.compile(copy.deepcopy(eager))
    per_set = tokens * (n_in + n_out) * 2
    sets = [(torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16).requires_grad_(),
             torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16))
            for _ in range(max(2, -(-L2_BYTES // per_set)))]

    def step(model: Any, x: torch.Tensor, g: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)  # as a training loop does: no accumulation into earlier steps
        x.grad = None
        model(x).backward(g)

    x, g = sets[0]
    want_x, *want_params = torch.autograd.grad(eager(x), [x, *eager.parameters()], g)
    for model in fused.values():  # each gemmgen model's gradients against eager's, before timing it
        got = [*torch.autograd.grad(model(x), [x, *model.parameters()], g)]
        for a, b in zip(got, [want_x, *as_fused(want_params)], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * float(b.abs().max()))

    def timed(model: Any) -> float:
        for x, g in sets[:2]:
            step(model, x, g)  # warm-up (and inductor's compile)
        times = []
        for i in range(reps):
            x, g = sets[i % len(sets)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(model, x, g)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    t_eager, t_compiled = timed(eager), timed(compiled)
    t_saved, t_recompute = timed(fused[False]), timed(fused[True])
    print(f"{activation} | {tokens},{n_in},{hidden},{n_out} | {t_eager:.3f} | {t_compiled:.3f} | {t_saved:.3f} | "
          f"{t_recompute:.3f} | {t_eager / t_saved:.2f} | {t_compiled / t_saved:.2f}", flush=True)


def _low_precision_row(activation: str, shape: tuple[int, int, int, int], reps: int) -> None:
    """One MLP block's training step in bf16 and in Float8Blockwise (the same weights), median of
    `reps` CUDA-event timings of whole steps, inputs rotated through more than L2; each model's
    gradients against the fp32 MLP's first (signal-to-noise >= 20 dB, torchao's floor at LLM shapes)."""
    import copy

    import gemmgen as gg

    tokens, n_in, hidden, n_out = shape
    torch.manual_seed(0)
    gated = activation == "swiglu"
    bf16 = gg.nn.FusedMLP(n_in, hidden, n_out, activation, bias=not gated, device="cuda")
    low = gg.nn.FusedMLP(n_in, hidden, n_out, activation, bias=not gated, device="cuda",
                         precision=gg.training.Float8Blockwise())
    low.load_state_dict(bf16.state_dict())
    exact = copy.deepcopy(bf16).float()  # fp32: its reference math (gemmgen says so once)
    sets = [(torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16).requires_grad_(),
             torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16))
            for _ in range(max(2, -(-L2_BYTES // (tokens * (n_in + n_out) * 2))))]
    x, g = sets[0]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        want = torch.autograd.grad(exact(x.float()), [x, *exact.parameters()], g.float())
    for model in (bf16, low):
        got = torch.autograd.grad(model(x), [x, *model.parameters()], g)
        for a, b in zip(got, want, strict=True):
            snr = float(20 * torch.log10(b.double().norm() / (a.double() - b.double()).norm()))
            assert snr >= 20, (activation, snr)

    def timed(model: Any) -> float:
        times = []
        for i in range(reps + 2):
            x, g = sets[i % len(sets)]
            model.zero_grad(set_to_none=True)
            x.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(x).backward(g)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times[2:])[reps // 2]  # the first two warm up

    t_bf16, t_low = timed(bf16), timed(low)
    print(f"{activation} | {tokens},{n_in},{hidden},{n_out} | {t_bf16:.3f} | {t_low:.3f} | {t_bf16 / t_low:.2f}",
          flush=True)


def _experts_training_row(shape: tuple[int, int, int, int], reps: int) -> None:
    """One experts layer's training step (forward + backward: dx and dW), SwiGLU without biases:
    `torch._grouped_mm` and its autograd, gemmgen's GroupedLinear in bf16, Float8Blockwise and
    Float8Tensorwise (the same bf16 weights); median of `reps` CUDA-event timings of whole steps,
    inputs rotated through more than L2; each way's output and gradients against the experts in
    fp32 first (>= 20 dB: a wrong fast step is no result)."""
    import gemmgen as gg

    rows, experts, n_in, n_out = shape
    torch.manual_seed(0)
    bf16 = gg.nn.GroupedLinear(experts, n_in, n_out, bias=False, activation="swiglu", device="cuda")
    low, tensorwise = (gg.nn.GroupedLinear(experts, n_in, n_out, bias=False, activation="swiglu", device="cuda",
                                           precision=p)
                       for p in (gg.training.Float8Blockwise(), gg.training.Float8Tensorwise()))
    low.load_state_dict(bf16.state_dict())
    tensorwise.load_state_dict(bf16.state_dict())
    weight = bf16.weight.detach().clone().requires_grad_()  # torch's: (E, 2 x out, in), gate and up interleaved

    def grouped_mm(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        acc = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
        return F.silu(acc[:, 0::2]) * acc[:, 1::2]

    offsets = (torch.arange(1, experts + 1, device="cuda") * (rows // experts)).int()
    sets = [(torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16).requires_grad_(),
             torch.randn(rows, n_out, device="cuda", dtype=torch.bfloat16))
            for _ in range(max(2, -(-L2_BYTES // (rows * (n_in + n_out) * 2))))]
    x, g = sets[0]
    w32 = bf16.weight.detach().float().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    pieces, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        acc = x32[start:end] @ w32[e].t()
        pieces.append(F.silu(acc[:, 0::2]) * acc[:, 1::2])
        start = end
    y32 = torch.cat(pieces)
    want = [*torch.autograd.grad(y32, [x32, w32], g.float()), y32.detach()]
    ways: dict[str, tuple[Any, torch.Tensor]] = {"_grouped_mm": (grouped_mm, weight), "bf16": (bf16, bf16.weight),
                                                "Float8Blockwise": (low, low.weight),
                                                "Float8Tensorwise": (tensorwise, tensorwise.weight)}
    for name, (layer, w) in ways.items():
        y = layer(x, offsets)
        got = [*torch.autograd.grad(y, [x, w], g), y.detach()]
        for a, b in zip(got, want, strict=True):
            snr = float(20 * torch.log10(b.double().norm() / (a.double() - b.double()).norm()))
            assert snr >= 20, (name, snr)

    def timed(layer: Any, w: torch.Tensor) -> float:
        times = []
        for i in range(reps + 2):
            x, g = sets[i % len(sets)]
            w.grad, x.grad = None, None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            layer(x, offsets).backward(g)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times[2:])[reps // 2]  # the first two warm up

    t = {name: timed(layer, w) for name, (layer, w) in ways.items()}
    print(f"{rows},{experts},{n_in},{n_out} | {t['_grouped_mm']:.3f} | {t['bf16']:.3f} | {t['Float8Blockwise']:.3f} | "
          f"{t['Float8Tensorwise']:.3f} | {t['_grouped_mm'] / t['Float8Blockwise']:.2f} | "
          f"{t['bf16'] / t['Float8Blockwise']:.2f} | {t['bf16'] / t['Float8Tensorwise']:.2f}", flush=True)


def _timed(fn, sets, reps: int) -> float | None:
    """device_ms of `fn` over the buffer sets (each ends with its output); None where torch refuses."""
    from gemmgen.tuning import device_ms

    try:
        return device_ms([functools.partial(fn, *inputs) for *inputs, _ in sets], reps)
    except RuntimeError as refused:
        print(f"# {fn.__name__}: {str(refused).splitlines()[0]}")
        return None


def _check(recipe, kernel, inputs) -> None:
    """One launch against the recipe's semantics before timing (a fast wrong kernel is no result),
    evaluated on the GPU in fp32: the CPU would take seconds per shape here."""
    from gemmgen.ir.reference import accumulate, evaluate_epilogue

    a, b, *ops = inputs
    got = kernel(a, b, *ops).float()
    by_name = dict(zip([o.name for o in recipe.operands], ops, strict=True))
    want = evaluate_epilogue(recipe.ir.epilogue, accumulate(recipe.ir.gemm, a, b, by_name), by_name,
                             round_outputs=False)[0]
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))


def _bf16_sets(m: int, n: int, k: int) -> list[tuple]:
    per_set = (m * k + k * n + m * n) * 2
    sets = []
    for _ in range(max(2, -(-L2_BYTES // per_set) + 1)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        sets.append((a, b, bias, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)))
    return sets


def _fp8_sets(m: int, n: int, k: int) -> list[tuple]:
    per_set = m * k + k * n + m * n * 2
    sets = []
    for _ in range(max(2, -(-L2_BYTES // per_set) + 1)):
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        scale_a, scale_b = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        sets.append((a, b, scale_a, scale_b, bias, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)))
    return sets


def _block_scaled_sets(m: int, n: int, k: int) -> list[tuple]:
    from gemmgen.runtime.quantize import quantize_blockwise

    per_set = m * k + k * n + m * n * 2
    sets = []
    for _ in range(max(2, -(-L2_BYTES // per_set) + 1)):
        a, scale_a = quantize_blockwise(torch.randn(m, k, device="cuda"), (1, 128), scale_layout="col")
        b, scale_b = quantize_blockwise(torch.randn(n, k, device="cuda").t(), (128, 128), scale_layout="row")
        sets.append((a, b, scale_a, scale_b, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)))
    return sets


def _table(recipe, shapes, make_sets, baselines: dict, same_layer: tuple, reps: int) -> None:
    from gemmgen.tuning import device_ms
    from tests.data.gpu_matrix import bench_configs

    print(f"| M x N x K | config | gemmgen ms | {' ms | '.join(baselines)} ms | gemmgen TFLOP/s | vs best |")
    print("|---" * (5 + len(baselines)) + "|")
    for m, n, k in shapes:
        sets = make_sets(m, n, k)
        theirs = {name: _timed(fn, sets, reps) for name, fn in baselines.items()}
        known = [t for name, t in theirs.items() if name in same_layer and t is not None]
        flops = 2 * m * n * k
        for config in bench_configs(recipe, m, n, k):
            kernel = recipe.compile(config)
            _check(recipe, kernel, sets[0][:-1])
            ours = device_ms([functools.partial(kernel, *inputs, out=out) for *inputs, out in sets], reps)
            vs = f"{min(known) / ours:.2f}x" if known else "n/a"
            print(f"| {m}x{n}x{k} | {config.name} | {ours:.3f} | {' | '.join(map(_ms, theirs.values()))} | "
                  f"{flops / ours / 1e9:.0f} | {vs} |", flush=True)
        del sets
        torch.cuda.empty_cache()


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--training", action="store_true", help="only the training-step table (an MLP block, "
                   "GELU and SwiGLU, forward + backward: eager, torch.compile, FusedMLP)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing measured")
        return 0
    sys.path.insert(0, str(ROOT))
    from gemmgen.aot import load_recipes
    from tests.data.gpu_matrix import (
        BENCH_SHAPES,
        FP8_BENCH_SHAPES,
        GATED_BENCH_SHAPES,
        GROUPED_BENCH_SHAPES,
        STATS_BENCH_SHAPES,
    )

    if args.training:
        from tests.data.gpu_matrix import TRAINING_BENCH_MLP

        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; MLP training step (bf16), "
              f"median of {args.reps} steps timed with CUDA events, inputs rotated")
        print("activation | tokens,in,hidden,out | eager ms | compile ms | gemmgen ms | gemmgen recompute ms | "
              "eager/gemmgen | compile/gemmgen")
        for activation in ("gelu", "swiglu"):
            _training_table(activation, TRAINING_BENCH_MLP, args.reps)
        print("# Low precision: the same FusedMLP in bf16 and in Float8Blockwise (bf16 master weights), gradients "
              "of each checked against the fp32 MLP (>= 20 dB) first")
        print("activation | tokens,in,hidden,out | bf16 ms | Float8Blockwise ms | bf16/fp8")
        for activation in ("gelu", "swiglu"):
            _low_precision_row(activation, TRAINING_BENCH_MLP, args.reps)
        from tests.data.gpu_matrix import TRAINING_BENCH_EXPERTS

        print("# Experts (SwiGLU, no biases, tokens spread evenly): torch._grouped_mm with its autograd, gemmgen's "
              "GroupedLinear in bf16, Float8Blockwise and Float8Tensorwise; each checked against the fp32 experts "
              "(>= 20 dB) first")
        print("rows,experts,in,out | _grouped_mm ms | bf16 ms | Float8Blockwise ms | Float8Tensorwise ms | "
              "_grouped_mm/blockwise | bf16/blockwise | bf16/tensorwise")
        _experts_training_row(TRAINING_BENCH_EXPERTS, args.reps)
        return 0
    recipes = load_recipes(ROOT / "examples" / "recipes.py")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; median of {args.reps} CUDA-graph "
          "replays timed with CUDA events, buffers rotated; each kernel checked against its reference first")
    print("# bias_gelu (bf16)")
    _table(recipes["bias_gelu"], BENCH_SHAPES, _bf16_sets, BASELINES, SAME_LAYER, args.reps)
    print("# scaled_mm_fp8 (e4m3 x e4m3 -> bf16, rowwise scales, bias)")
    _table(recipes["scaled_mm_fp8"], FP8_BENCH_SHAPES, _fp8_sets, FP8_BASELINES, tuple(FP8_BASELINES), args.reps)
    print("# fp8_block_scaled (e4m3 x e4m3 -> bf16, DeepSeek-V3 block scales: 1x128 of A, 128x128 of B)")
    _table(recipes["fp8_block_scaled"], FP8_BENCH_SHAPES, _block_scaled_sets, BLOCK_BASELINES, tuple(BLOCK_BASELINES),
           args.reps)
    print("# residual_norm_stats (bf16: residual add, each row's sum of squares and amax in fp32)")
    _stats_table(recipes["residual_norm_stats"], STATS_BENCH_SHAPES, args.reps)
    print("# moe_up (grouped bf16: per-expert bias, SiLU, routing weight; tokens spread evenly)")
    _grouped_table(recipes["moe_up"], _moe_up, GROUPED_BENCH_SHAPES, args.reps)
    print("# moe_fp8_block (grouped e4m3 -> bf16, DeepSeek-V3 block scales, routing weight; tokens spread evenly)")
    _block_grouped_table(recipes["moe_fp8_block"], GROUPED_BENCH_SHAPES, args.reps)
    print("# moe_swiglu (gated experts: SwiGLU over interleaved gate and up columns, N/2 out; tokens spread evenly)")
    _grouped_table(recipes["moe_swiglu"], _moe_swiglu, GATED_BENCH_SHAPES, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Coverage kernels for the tests: every epilogue functor, a second matrix input (Sm90AuxLoad),
constants on either side of an op, a cast, a compile-time scalar, fp8 (e4m3) D, a batched recipe,
vectors and a scalar per batch, MN-major A and B multicast across a 2x2 cluster, a swapped kernel
(D^T = B^T A^T), an amax, reductions over M, signed max and min reductions, the stream-K scheduler,
where() with comparisons, random numbers (a dropout and stochastic rounding), and a softmax's
numerator per block of a row (gg.exp_minus_max)."""

import gemmgen as gg


def _every_op(acc, c, r2, bias, scale, k):
    x = k * acc + c  # compile-time scalar and the source matrix C
    y = gg.clamp(gg.leaky_relu(x, 0.2), -4.0, 4.0)  # leaky_relu, max/min with constants
    z = gg.cast(gg.abs(y) / (1.0 + gg.exp(-y)), gg.bf16)  # abs, div, const-left add, exp, neg, cast
    w = gg.tanh(z) - gg.sigmoid(r2) * (2.0 - bias)  # tanh, sigmoid, second matrix (AuxLoad), const-left sub
    return gg.max(gg.min(w, scale), gg.relu(-w) + gg.gelu_tanh(w))  # min/max of values, relu, gelu_tanh


every_op = gg.Recipe(
    "every_op",
    _every_op,
    d=gg.e4m3,
    layout_a=gg.ColMajor,
    layout_b=gg.RowMajor,
    batched=True,
    operands={"c": gg.Matrix(gg.bf16), "r2": gg.Matrix(gg.f16), "bias": gg.RowVector(gg.f32),
              "scale": gg.ColVector(gg.bf16), "k": gg.Scalar(value=0.5)},
    config=gg.KernelConfig(tile=(64, 128, 64), cluster=(2, 2, 1), schedule=gg.Schedule.PINGPONG, stages=4),
)


# Swapped: the kernel computes D^T = B^T A^T, so its A is B^T (MN-major here, B being row-major),
# the row vector becomes a column vector and vice versa, and C, the aux load and the aux store are
# column-major. A shared value makes the epilogue a graph; batched, multicast across a 2x1 cluster;
# D's amax per batch. The bias and alpha are per batch (a bias per head, a scale per expert): a
# column vector with a batch stride in the kernel, and a scalar read through its pointer; r2 is
# one matrix for every batch (read into registers, column-major in the kernel). A dropout of the
# activation (gg.rand's stream 0) and the pre-activation saved stochastically rounded to bf16 (stream
# 1): the swapped kernel's random numbers must be the recipe's, its rows being the recipe's columns.
def _swapped(acc, bias, scale, alpha, c, r2, seed):
    pre = acc * scale * alpha + bias
    d = gg.where(gg.rand(seed) < 0.125, 0.0, gg.silu(pre) * (8.0 / 7.0)) + c * r2
    return {"d": d, "pre": gg.stochastic_round(pre, seed), "amax_d": gg.amax(d)}


swapped = gg.Recipe(
    "swapped",
    _swapped,
    layout_b=gg.RowMajor,
    batched=True,
    operands={"bias": gg.RowVector(gg.bf16, per_batch=True), "scale": gg.ColVector(gg.f32),
              "alpha": gg.Scalar(per_batch=True), "c": gg.Matrix(gg.bf16), "r2": gg.Matrix(gg.f16, per_batch=False),
              "seed": gg.Seed()},
    aux={"pre": gg.bf16, "amax_d": gg.f32},
    config=gg.KernelConfig(tile=(128, 32, 64), cluster=(2, 1, 1), swap_ab=True),
)


# The swapped kernel the heuristic picks for a decode step (pingpong, tile N = 16), on the example
# with f32 D (column-major in the kernel), an f16 C, runtime scalars, and MN-major A and B.
linear_combination_swapped = gg.Recipe(
    "linear_combination_swapped",
    lambda acc, alpha, beta, c: alpha * acc + beta * c,
    a=gg.f16, b=gg.f16, d=gg.f32,
    layout_a=gg.ColMajor, layout_b=gg.RowMajor,
    operands={"alpha": gg.Scalar(), "beta": gg.Scalar(), "c": gg.Matrix(gg.f16)},
    config=gg.KernelConfig(tile=(64, 16, 64), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG, swap_ab=True),
)


# Reductions over M, one value per column of D (a bias gradient's sum over tokens, a per-channel
# amax), which a swapped kernel computes as reductions over its N, next to an amax over M and N;
# batched (a vector per batch; the sum over every batch's rows too, as a bias shared by the batches
# has its gradient: a batch stride of 0), pingpong, a column vector (a row vector in the kernel), and
# D the value rounded to e4m3 (a quantize-dequantize: a cast to fp8 inside the epilogue) stored as f16.
def _column_stats(acc, row_scale):
    y = acc * row_scale
    return {"d": gg.cast(y, gg.e4m3), "col_sum": gg.sum(y, dim=0, over_batch=True), "col_amax": gg.amax(y, dim=0),
            "amax": gg.amax(y)}


column_stats = gg.Recipe(
    "column_stats",
    _column_stats,
    d=gg.f16,
    batched=True,
    operands={"row_scale": gg.ColVector(gg.f32)},
    aux={"col_sum": gg.f32, "col_amax": gg.f32, "amax": gg.f32},
    config=gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.PINGPONG, swap_ab=True),
)


# Each row's largest and smallest value and its log-sum-exp (an LM head's max logit and the
# log-normalizer of its softmax, a per-token range): signed max and min reductions over N, whose
# identities (-inf, +inf) the runtime writes into the Params, and an online log-sum-exp, whose state
# is a pair (lse.hpp); and each batch's signed max and min over M and N (atomic combines: CUTLASS's
# max, gemmgen's AtomicMinimum), which start from -inf and +inf; each row's target logit (a gather
# through the column's coordinate, coordinates.hpp: with the log-sum-exp, a cross-entropy); batched,
# a bias and a target per batch and a position bias shared by every batch, D in bf16. Under CUTLASS's
# stream-K scheduler across a 2x1 cluster (the suite's compiled stream-K kernel on sm_90a, its
# scheduler's workspace after the reductions'): a split tile's epilogue, and so each reduction, runs
# once, on its last peer.
def _row_extrema(acc, bias, position, target):
    y = acc + bias + position
    return {"d": y, "row_max": gg.reduce_max(y, dim=1), "row_min": gg.reduce_min(y, dim=1),
            "lse": gg.logsumexp(y, dim=1), "max": gg.reduce_max(y), "min": gg.reduce_min(y),
            "target_logit": gg.gather(y, target)}


row_extrema = gg.Recipe(
    "row_extrema",
    _row_extrema,
    batched=True,
    operands={"bias": gg.RowVector(gg.bf16, per_batch=True), "position": gg.Matrix(gg.bf16, per_batch=False),
              "target": gg.ColVector(gg.i32, per_batch=True)},
    aux={"row_max": gg.f32, "row_min": gg.f32, "lse": gg.f32, "max": gg.f32, "min": gg.f32, "target_logit": gg.f32},
    config=gg.KernelConfig(tile=(128, 128, 64), cluster=(2, 1, 1), tile_scheduler=gg.TileScheduler.STREAM_K),
)


# fp8 with DeepSeek-V3 block scales in a swapped kernel (what decode-sized M gets, and what a
# reduction over M needs): the kernel's A is the weight, whose 128 x 128 scales it reads with
# cp.async, and its B the tokens, whose per-token scales it loads with TMA; e4m3 x e5m2, batched,
# a bias and each column's sum.
def _block_scaled_swapped(acc, bias):
    y = acc + bias
    return {"d": y, "col_sum": gg.sum(y, dim=0)}


block_scaled_swapped = gg.Recipe(
    "block_scaled_swapped",
    _block_scaled_swapped,
    a=gg.e4m3, b=gg.e5m2, d=gg.bf16,
    batched=True,
    block_scale=gg.DEEPSEEK_BLOCK_SCALE,
    operands={"bias": gg.RowVector(gg.bf16)},
    aux={"col_sum": gg.f32},
    config=gg.KernelConfig(tile=(128, 64, 128), swap_ab=True),
)


# CUTLASS's stream-K scheduler (per problem: data-parallel, split-K or stream-K, the fp32 partial
# sums of split tiles reduced in a fixed order in the workspace), batched, across a 2x1 cluster,
# with each row's sum (its workspace comes first, then the scheduler's). Checked without NVRTC (its
# arguments, data flow and types); row_extrema is the stream-K kernel the suite compiles.
def _stream_k(acc, bias):
    y = gg.silu(acc + bias)
    return {"d": y, "row_sum": gg.sum(y, dim=1)}


stream_k = gg.Recipe(
    "stream_k",
    _stream_k,
    batched=True,
    operands={"bias": gg.RowVector(gg.bf16)},
    aux={"row_sum": gg.f32},
    config=gg.KernelConfig(tile=(128, 128, 64), cluster=(2, 1, 1), tile_scheduler=gg.TileScheduler.STREAM_K),
)


# where() and comparisons, with values and with constants on either branch (gemmgen::epi::Select,
# SelectConstX / Y / XY), erf, sin and cos. Each where() is continuous where its condition flips, so
# the emulation's and the reference's accumulators, which differ in their last bits, agree at ties;
# the step function's conditions (never true on finite inputs) leave it at 0 (its functor's both
# sides are checked on the host, tests/ir/test_ops.py). Then a dropout (gg.rand's stream 0) and a
# value stochastically rounded to bf16 (stream 1), under the swapped pingpong kernel the heuristic
# picks for a decode step (tile N = 16): the swapped kernel's random numbers must be the recipe's, its
# rows being the recipe's columns. (The suite compiles this kernel: its functors, random numbers and
# config are compiled nowhere else.)
def _select_ops(acc, bias, seed):
    a = gg.where(acc > bias, gg.erf(acc - bias), gg.sin(acc - bias) * gg.cos(acc))
    b = gg.where(acc <= 0.5, 0.5, acc)
    c = gg.where(gg.ge(acc, -1.0), acc, -1.0)
    e = gg.where(gg.lt(acc, -1e30) + gg.eq(acc, 3e38) + gg.ne(acc, acc), 1.0, 0.0)
    return {"d": gg.where(gg.rand(seed) < 0.125, 0.0, a + b * c - e), "rounded": gg.stochastic_round(a, seed)}


select_ops = gg.Recipe("select_ops", _select_ops, operands={"bias": gg.RowVector(gg.bf16), "seed": gg.Seed()},
                       aux={"rounded": gg.bf16},
                       config=gg.KernelConfig(tile=(64, 16, 64), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG,
                                              swap_ab=True))


# A derived backward (Recipe.backward): the epilogue of the GEMM whose accumulator is dL/dD for the
# forward D = gelu(acc + bias): D = dL/dacc = g * gelu'(saved_acc + bias) (erf and exp), the saved
# accumulator read as C, and the bias gradient as a sum over M (so a swapped kernel); its B is the
# next layer's weight, row-major.
bias_gelu_bwd = gg.Recipe("bias_gelu", lambda acc, bias: gg.gelu(acc + bias),
                          operands={"bias": gg.RowVector(gg.bf16)}).backward().kernel


# Column pairs (gg.pairs, gg.interleave; gemmgen/include/gemmgen/pairs.hpp): GEGLU of the pairs with
# a per-row scale and an N/2-column residual (PairLoad) as D (PairStore, no D of the collective's),
# SwiGLU of the same pairs in fp32 (a second PairStore), a rotary rotation of the pairs by an N/2-column angle
# cosine and a scalar sine put back to full width (a TMA aux store), a pair with a constant odd
# side, the row sums of D's squares (each pair's value counted once: PairSumMask) and max |D|.
def _pair_ops(acc, residual, scale, cos, sin):
    gate, up = gg.pairs(acc)
    h = gg.gelu(gate) * up * scale + residual
    rot = gg.interleave(gate * cos - up * sin, gate * sin + up * cos)
    return {"d": h, "h32": gg.silu(gate) * up, "rot": rot, "gate_only": gg.interleave(gate, 0.0),
            "sum_sq": gg.sum(h * h, dim=1), "amax_h": gg.amax(h)}


pair_ops = gg.Recipe(
    "pair_ops",
    _pair_ops,
    operands={"residual": gg.Matrix(gg.bf16), "scale": gg.ColVector(gg.f32), "cos": gg.Matrix(gg.bf16),
              "sin": gg.Scalar()},
    aux={"h32": gg.f32, "rot": gg.bf16, "gate_only": gg.bf16, "sum_sq": gg.f32, "amax_h": gg.f32},
)


# The derived backward of a gated recipe on the next layer's dgrad GEMM (Recipe.backward): its
# accumulator is dL/dh (F columns), it reads the forward's saved accumulator of 2F columns as its
# pairs' halves (DoubleLoad) and writes dL/dacc, gate's and up's gradients interleaved, at 2F
# (DoubleStore, no D of the collective's).
def _swiglu(acc):
    gate, up = gg.pairs(acc)
    return gg.silu(gate) * up


swiglu_bwd = gg.Recipe("swiglu", _swiglu).backward().kernel


# A softmax's numerator per block of 128 columns (gg.exp_minus_max: the row blocks' max policy), with
# each block's max: bf16 D under the row blocks' 128-column epilogue tile
def _block_softmax(acc, bias):
    p, top = gg.exp_minus_max(acc + bias, block=128, scale=0.125)
    return {"d": p, "max": top}


block_softmax = gg.Recipe("block_softmax", _block_softmax, operands={"bias": gg.RowVector(gg.bf16)},
                          aux={"max": gg.f32})


# Low-precision training (gemmgen.training.Float8Blockwise, made as gemmgen/nn/low_precision.py makes
# them): the weight gradient dW = dY^T X with both operands quantized per row and 128 tokens (DeepGEMM's
# "1D1D": CUTLASS's blockwise main loop at granularity (1, 1, 128), both operands' scales loaded by
# cp.async), added in fp32 to main_grad, read as C (D written over it: beta = 1); fc1's forward saving
# its accumulator (bf16) beside gelu(acc + bias); and fc2's dgrad GEMM (dY per token and 128 features,
# W2's 128 x 128 blocks transposed) carrying fc1's derived epilogue: gelu' of the saved accumulator and
# bias, and the bias gradient as a sum over M.
def _float8_training():
    from gemmgen.training import Float8Blockwise, Gemm

    precision = Float8Blockwise()
    wgrad = gg.Recipe("weight_grad_accumulate", lambda acc, main_grad: acc + main_grad, d=gg.f32,
                      operands={"main_grad": gg.Matrix(gg.f32)})
    fc1 = gg.Recipe("fc1", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    backward = precision.backward(fc1)
    return precision.recipe(wgrad, Gemm.WGRAD), backward.forward, backward.kernel


weight_grad_accumulate_fp8block_wgrad, fc1_fp8block_fprop_train, fc1_fp8block_fprop_bwd = _float8_training()


# Llama's gated MLP in Float8Blockwise: fc1 over column pairs (SwiGLU) from e4m3 operands with
# DeepSeek-V3's block scales, saving its 2F-column accumulator, and fc2's dgrad GEMM carrying its
# derived epilogue (the saved accumulator read as pairs' halves, dL/dgate and dL/dup interleaved).
def _float8_gated():
    from gemmgen.training import Float8Blockwise

    backward = Float8Blockwise().backward(gg.Recipe("swiglu_fc1", _swiglu))
    return backward.forward, backward.kernel


swiglu_fc1_fp8block_fprop_train, swiglu_fc1_fp8block_fprop_bwd = _float8_gated()


# Float8Tensorwise (one scale per tensor, Transformer Engine's HYBRID format): fc2's dgrad GEMM over e5m2
# dY and e4m3 W2 (CUTLASS's fp8 main loop, mixed formats), each operand's fp32 scale read from a device
# tensor at launch (gg.Scalar(tensor=True): the scalar broadcast through its pointer) and multiplied into
# the accumulator before fc1's derived epilogue (gelu' of the saved accumulator and bias, the bias sum).
def _float8_tensorwise():
    from gemmgen.training import Float8Tensorwise

    fc1 = gg.Recipe("fc1", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    return Float8Tensorwise().backward(fc1).kernel


fc1_fp8tensor_fprop_bwd = _float8_tensorwise()


# A Float8Blockwise FusedMLP's fc1 forward and fc2 dgrad as nn launches them, each writing its D as the
# next GEMMs read it (Precision.quantizing_backward): rounded to bf16, then quantized per token and 128
# columns (gg.quantize: the next fprop's or dgrad's A) and stored transposed, quantized per column and
# 128 tokens (gg.quantize_columns: the wgrad GEMM's operand, K-major), each with its scales. The forward
# keeps its accumulator for the backward; the backward also sums fc1's bias gradient over M.
def _float8_quantizing():
    from gemmgen.training import Float8Blockwise

    fc1 = gg.Recipe("fc1", lambda acc, bias: gg.gelu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    backward = Float8Blockwise().quantizing_backward(fc1)
    assert backward is not None
    return backward.forward, backward.kernel


fc1_fp8block_fprop_train_q, fc1_fp8block_fprop_bwd_q = _float8_quantizing()

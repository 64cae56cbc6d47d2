"""The example recipes: `gemmgen build examples/recipes.py` compiles each and prints the kernel report.

Every module-level gemmgen.Recipe is a kernel. Together they cover both schedules, all four
A/B layouts, fp8 inputs, every operand kind, an aux output, an amax, per-row reductions, a grouped
(MoE) GEMM, and both epilogue shapes (tree and graph).
"""

import gemmgen as gg

# D = A @ B (bf16, A row-major, B column-major: "TN")
gemm_bf16 = gg.Recipe("gemm_bf16", a=gg.bf16, b=gg.bf16)

# D = gelu(A @ B + bias)
bias_gelu = gg.Recipe(
    "bias_gelu",
    lambda acc, bias: gg.gelu(acc + bias),
    operands={"bias": gg.RowVector(gg.bf16)},
    config=gg.KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1)),
)

# D = silu(A @ B + bias) + residual, B row-major ("NN")
bias_silu_residual = gg.Recipe(
    "bias_silu_residual",
    lambda acc, bias, residual: gg.silu(acc + bias) + residual,
    layout_b=gg.RowMajor,
    operands={"bias": gg.RowVector(gg.bf16), "residual": gg.Matrix(gg.bf16)},
)

# D = alpha * (A @ B) + beta * C, fp16 in, fp32 out, A column-major ("TT" in BLAS terms)
linear_combination = gg.Recipe(
    "linear_combination",
    lambda acc, alpha, beta, c: alpha * acc + beta * c,
    a=gg.f16, b=gg.f16, d=gg.f32,
    layout_a=gg.ColMajor, layout_b=gg.RowMajor,
    operands={"alpha": gg.Scalar(), "beta": gg.Scalar(), "c": gg.Matrix(gg.f16)},
)

# D = gelu_tanh(A @ B + bias), also storing the pre-activation for the backward pass, and D's
# amax, max |D| (the scale an fp8 copy of D needs) (pingpong)
def _bias_gelu_aux(acc, bias):
    pre_act = acc + bias
    d = gg.gelu_tanh(pre_act)
    return {"d": d, "pre_act": pre_act, "amax_d": gg.amax(d)}


bias_gelu_aux = gg.Recipe(
    "bias_gelu_aux",
    _bias_gelu_aux,
    layout_a=gg.ColMajor,
    operands={"bias": gg.RowVector(gg.bf16)},
    aux={"pre_act": gg.bf16, "amax_d": gg.f32},
    config=gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.PINGPONG),
)


# D = x * sigmoid(1.702 x), x = scale * (A @ B) + bias: a shared value, so a graph epilogue
def _quick_gelu(acc, scale, bias):
    x = scale * acc + bias
    return x * gg.sigmoid(1.702 * x)


quick_gelu_scaled = gg.Recipe(
    "quick_gelu_scaled",
    _quick_gelu,
    a=gg.f16, b=gg.f16,
    operands={"scale": gg.ColVector(gg.f32), "bias": gg.RowVector(gg.f16)},
)


# D = (A @ B) * scale_a[m] * scale_b[n] + bias: fp8 (e4m3) in, bf16 out, one scale per token (row
# of A) and per output channel (row of the N x K weight), as torch._scaled_mm's rowwise scaling
scaled_mm_fp8 = gg.Recipe(
    "scaled_mm_fp8",
    lambda acc, scale_a, scale_b, bias: acc * scale_a * scale_b + bias,
    a=gg.e4m3, b=gg.e4m3, d=gg.bf16,
    operands={"scale_a": gg.ColVector(gg.f32), "scale_b": gg.RowVector(gg.f32), "bias": gg.RowVector(gg.bf16)},
)


# DeepSeek-V3's fp8 linear layer: e4m3 A and B with block scales, one fp32 scale per token and 128
# values of K (scale_a, M-major) and one per 128 x 128 block of the weight (scale_b); the main loop
# adds each K block's product times its two scales into the fp32 accumulator; bf16 out
fp8_block_scaled = gg.Recipe(
    "fp8_block_scaled",
    a=gg.e4m3, b=gg.e4m3, d=gg.bf16,
    block_scale=gg.DEEPSEEK_BLOCK_SCALE,
)


# An MXFP8 linear layer (B200, sm_100a): e4m3 A and B with one UE8M0 exponent per 32 values of K of
# each token and of each weight row (gg.quantize_mx), applied by the block-scaled MMA itself; bf16 out
mxfp8_linear = gg.Recipe(
    "mxfp8_linear",
    lambda acc, bias: acc + bias,
    a=gg.e4m3, b=gg.e4m3, d=gg.bf16,
    block_scale=gg.MXFP8,
    operands={"bias": gg.RowVector(gg.bf16)},
)


# An NVFP4 linear layer (B200, sm_100a): packed fp4 A and B with one e4m3 scale per 16 values of K
# (gg.quantize_mx(x, gg.NVFP4, tensor_scale=...)), applied by the block-scaled MMA; the per-tensor
# scales' product comes in as alpha; bf16 out
nvfp4_linear = gg.Recipe(
    "nvfp4_linear",
    lambda acc, alpha, bias: acc * alpha + bias,
    a=gg.e2m1, b=gg.e2m1, d=gg.bf16,
    block_scale=gg.NVFP4,
    operands={"alpha": gg.Scalar(), "bias": gg.RowVector(gg.bf16)},
)


# An activation quantized for the next fp8 layer: D = gelu(A @ B + bias) in e4m3, one fp32 scale per
# token and 128 columns (DeepSeek-V3's 1 x 128 activation blocks), which the kernel reduces in its
# epilogue; D and the scales are the next block-scaled GEMM's A and scale_a as they are
def _gelu_quantized(acc, bias):
    q, scale = gg.quantize(gg.gelu(acc + bias), block=128)
    return {"d": q, "scale": scale}


fp8_quantized = gg.Recipe(
    "fp8_quantized",
    _gelu_quantized,
    d=gg.e4m3,
    operands={"bias": gg.RowVector(gg.bf16)},
    aux={"scale": gg.f32},
)


# A query (or key) projection with Qwen3's QK-norm in its epilogue: an RMSNorm over each head of 128
# columns, times the norm's weight (one per column: the head's weight repeated over the heads); each
# head's statistic is reduced in the epilogue, and its 1 / rms kept for the backward
def _qk_norm(acc, weight):
    y, rstd = gg.rms_norm(acc, block=128, eps=1e-6, weight=weight)
    return {"d": y, "rstd": rstd}


qk_norm = gg.Recipe(
    "qk_norm",
    _qk_norm,
    operands={"weight": gg.RowVector(gg.bf16)},
    aux={"rstd": gg.f32},
)


# D = A @ B + residual (a residual stream after an output projection), with each row's sum of
# squares (what the RMSNorm that follows needs) and each row's amax (a per-token fp8 scale): fp32
# reductions over N, summed in a fixed order (the same result every run)
def _residual_norm_stats(acc, residual):
    h = acc + residual
    return {"d": h, "sum_sq": gg.sum(h * h, dim=1), "amax_row": gg.amax(h, dim=1)}


residual_norm_stats = gg.Recipe(
    "residual_norm_stats",
    _residual_norm_stats,
    operands={"residual": gg.Matrix(gg.bf16)},
    aux={"sum_sq": gg.f32, "amax_row": gg.f32},
)


# fp8 training's two scales of an activation in one pass: D = A @ B + bias, each row's max |D| (a
# per-token scale, for the next forward GEMM) and each column's (a per-channel scale, for the
# weight gradient, which reads D transposed); reductions over N and over M in one kernel (sm_90a)
def _row_col_amax(acc, bias):
    y = acc + bias
    return {"d": y, "amax_rows": gg.amax(y, dim=1), "amax_cols": gg.amax(y, dim=0)}


row_col_amax = gg.Recipe(
    "row_col_amax",
    _row_col_amax,
    operands={"bias": gg.RowVector(gg.bf16)},
    aux={"amax_rows": gg.f32, "amax_cols": gg.f32},
)


# A gated MLP's up projection (SwiGLU: Llama, Qwen, DeepSeek) in one GEMM: B's columns interleave
# the gate's and the up projection's (gemmgen.nn.interleave_pairs), each pair of accumulator
# columns gives one column of D = silu(gate) * up, half as wide as B
def _swiglu(acc):
    gate, up = gg.pairs(acc)
    return gg.silu(gate) * up


swiglu = gg.Recipe("swiglu", _swiglu)


# A mixture-of-experts layer's expert GEMMs in one grouped kernel: the tokens (rows of A) sorted by
# expert, one (N x K) weight per expert (B is G x K x N), `offsets` where each expert's tokens end;
# D = silu(A_g @ B_g + bias_g) * routing weight of the token
moe_up = gg.Recipe(
    "moe_up",
    lambda acc, bias, weight: gg.silu(acc + bias) * weight,
    grouped=True,
    operands={"bias": gg.RowVector(gg.bf16), "weight": gg.ColVector(gg.f32)},
)


# Gated experts (Mixtral, DeepSeek, Qwen MoE up projections) in one grouped kernel over column
# pairs: each expert's gate and up rows interleaved (B is G x K x 2F), D = silu(gate) * up of the
# biased accumulator, times the token's routing weight: F columns per token
def _moe_swiglu(acc, bias, weight):
    gate, up = gg.pairs(acc + bias)
    return gg.silu(gate) * up * weight


moe_swiglu = gg.Recipe(
    "moe_swiglu",
    _moe_swiglu,
    grouped=True,
    operands={"bias": gg.RowVector(gg.bf16), "weight": gg.ColVector(gg.f32)},
)


# DeepSeek-V3's fp8 experts in one grouped kernel: e4m3 tokens sorted by expert, each with one fp32
# scale per 128 values of K (scale_a: rows x K/128), e4m3 expert weights with one scale per 128 x 128
# block (scale_b: G x K/128 x N/128), both K-major; D = (A_g @ B_g, block-scaled) * routing weight,
# as the experts' down projection ends
moe_fp8_block = gg.Recipe(
    "moe_fp8_block",
    lambda acc, weight: acc * weight,
    a=gg.e4m3, b=gg.e4m3, d=gg.bf16,
    grouped=True,
    block_scale=gg.DEEPSEEK_BLOCK_SCALE,
    operands={"weight": gg.ColVector(gg.f32)},
)


# NVFP4 experts (B200, sm_100a) in one grouped kernel: packed fp4 tokens sorted by expert and fp4
# expert weights, each with one e4m3 scale per 16 values of K (the tokens' each group's rows from a
# block of their own: gg.quantize_mx(x, gg.NVFP4, offsets=offsets)); D = silu(acc * scale + bias_g)
# * routing weight, `scale` each token's fp32 tensor scale times its expert's
moe_nvfp4 = gg.Recipe(
    "moe_nvfp4",
    lambda acc, scale, bias, weight: gg.silu(acc * scale + bias) * weight,
    a=gg.e2m1, b=gg.e2m1, d=gg.bf16,
    grouped=True,
    block_scale=gg.NVFP4,
    operands={"scale": gg.ColVector(gg.f32), "bias": gg.RowVector(gg.bf16), "weight": gg.ColVector(gg.f32)},
)

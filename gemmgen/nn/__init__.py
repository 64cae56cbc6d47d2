"""Drop-in modules: `FusedLinear` (one fused gemmgen kernel per forward), `FusedMLP` (two
layers whose backward fuses the first one's activation derivative into the second's dgrad GEMM), `GroupedLinear` (a
mixture-of-experts layer's expert Linears as one grouped kernel), `GroupedExperts` (transformers' 3-d experts
modules as two grouped kernels), `BlockScaledLinear` and
`BlockScaledGroupedLinear` (an fp8 inference Linear, and fp8 experts, with DeepSeek-V3's block
scales), `MXFP8Linear` and `NVFP4Linear` (MXFP8 and NVFP4 inference Linears for B200s) and
`fuse(model)`.

    layer = gemmgen.nn.FusedLinear(4096, 14336, activation="silu", dtype=torch.bfloat16)
    mlp = gemmgen.nn.FusedMLP(4096, 14336, 4096, activation="gelu")  # backward fused at the boundary
    experts = gemmgen.nn.GroupedLinear(8, 4096, 14336, activation="silu")   # experts(x, offsets)
    fp8 = gemmgen.nn.BlockScaledLinear.from_linear(linear)                  # e4m3, 128 x 128 blocks
    fp8_experts = gemmgen.nn.BlockScaledGroupedLinear.from_linears(experts)  # experts(x, offsets)
    mx = gemmgen.nn.MXFP8Linear.from_linear(linear)             # sm_100a: e4m3, a UE8M0 exponent per 32
    nv = gemmgen.nn.NVFP4Linear.from_linear(linear)             # sm_100a: fp4, an e4m3 scale per 16
    w1 = gemmgen.nn.interleave_pairs(w_gate, w_up)  # B's columns for an epilogue over column pairs
    model, report = gemmgen.nn.fuse(model)   # Linear + activation pairs -> FusedLinear
    model, report = gemmgen.nn.fuse(model, mlp=True)   # and MLPs -> FusedMLP, experts -> GroupedExperts
    gemmgen.warmup(gemmgen.nn.model_launches(model, tokens=(1, 16, 4096)))   # build ahead of time
"""

from .base import ACTIVATIONS
from .block_scaled import (
    BlockScaledGroupedLinear,
    BlockScaledLinear,
    block_scaled_grouped_recipe,
    block_scaled_linear_recipe,
)
from .experts import GroupedExperts
from .fuse import activation_of, fuse
from .grads import weight_grad_recipe
from .grouped import GroupedLinear, grouped_linear_recipe
from .launches import model_launches, model_quantize_specs
from .linear import FusedLinear, linear_recipe
from .microscaled import MXFP8Linear, NVFP4Linear, mxfp8_linear_recipe, nvfp4_linear_recipe
from .mlp import FusedMLP, MLPSecondLayer
from .mlp_kernels import mlp_backward
from .pairs import interleave_pairs, split_pairs

__all__ = ["ACTIVATIONS", "BlockScaledGroupedLinear", "BlockScaledLinear", "FusedLinear", "FusedMLP", "GroupedExperts",
           "GroupedLinear",
           "MLPSecondLayer", "MXFP8Linear", "NVFP4Linear", "activation_of", "block_scaled_grouped_recipe",
           "block_scaled_linear_recipe", "fuse", "grouped_linear_recipe", "interleave_pairs", "linear_recipe",
           "mlp_backward", "model_launches", "model_quantize_specs", "mxfp8_linear_recipe", "nvfp4_linear_recipe",
           "split_pairs", "weight_grad_recipe"]

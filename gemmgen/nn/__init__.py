"""Drop-in modules: `FusedLinear` (one fused gemmgen kernel per forward) and `fuse(model)`.

    layer = gemmgen.nn.FusedLinear(4096, 14336, activation="silu", dtype=torch.bfloat16)
    model, report = gemmgen.nn.fuse(model)   # Linear + activation pairs -> FusedLinear
    gemmgen.warmup(gemmgen.nn.model_launches(model, tokens=(1, 16, 4096)))   # build ahead of time
"""

from .fuse import activation_of, fuse
from .linear import ACTIVATIONS, FusedLinear, linear_recipe, model_launches

__all__ = ["ACTIVATIONS", "FusedLinear", "activation_of", "fuse", "linear_recipe", "model_launches"]

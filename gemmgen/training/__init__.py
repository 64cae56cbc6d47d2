"""Low-precision training: the precision objects that `gemmgen.nn`'s layers and `fuse` take
(`precision=`), each one recipe's every choice (docs/training.md#low-precision-training).

    mlp = gemmgen.nn.FusedMLP(4096, 14336, 4096, precision=gemmgen.training.Float8Blockwise())
"""

from .history import AmaxAlgorithm, AmaxHistory, Scaling
from .precision import MXFP8, Float8Blockwise, Gemm, Operand, Precision, QuantizedWeight, as_precision
from .tensorwise import Float8Tensorwise

__all__ = ["MXFP8", "AmaxAlgorithm", "AmaxHistory", "Float8Blockwise", "Float8Tensorwise", "Gemm", "Operand",
           "Precision", "QuantizedWeight", "Scaling", "as_precision"]

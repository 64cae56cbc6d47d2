"""What an epilogue returns, checked and turned into the IR's outputs: D, then each aux output in
its declaration order (an M x N value, a reduction, the factors of D's row blocks)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from ..errors import RecipeError
from ..ir import BlockOp, ColumnBlocks, GemmSpec, Output, Reduction, RowBlocks
from ..ir.ops import FP8_MAX
from ..types import DType
from .blocks import BLOCK_EXAMPLES, COLUMN_BLOCKS_EXAMPLE, BlockOutput, ColumnBlockOutput
from .values import Reduced, Trace, Value


def traced_outputs(trace: Trace, result: Any, gemm: GemmSpec, aux: Mapping[str, DType]) -> list[Output]:
    """The outputs of an epilogue's `result` (D's value, or a dict {'d': ..., '<aux>': ...})."""
    values = dict(result) if isinstance(result, Mapping) else {"d": result}
    if "d" not in values:
        raise RecipeError("epilogue: the returned dict has no 'd' entry; D must always be written")
    extra = [k for k in values if k != "d" and k not in aux]
    if extra:
        raise RecipeError(f"epilogue returned output {extra[0]!r} that is not declared; declare it with "
                          f"aux={{{extra[0]!r}: gg.{_declared_dtype(values[extra[0]])}}}")
    never = [k for k in aux if k not in values]
    if never:
        raise RecipeError(f"aux output {never[0]!r} is declared but never written; return it from the "
                          f"epilogue as {{'d': ..., {never[0]!r}: ...}}")
    _check_row_blocks(values, gemm, aux)
    copy_dtype = _check_column_blocks(values, gemm, aux)
    outs = []
    for name in ["d", *aux]:
        v = values[name]
        dtype = gemm.d if name == "d" else aux[name]
        reduce, dim, over_batch, blocks, columns = None, None, False, None, None
        if isinstance(v, ColumnBlockOutput):
            columns = ColumnBlocks(v.block, copy_dtype, v.power_of_two)  # type: ignore[arg-type]
            reduce = Reduction.COLUMN_BLOCK_SCALE if v.factor else None
            v = v.value
        elif isinstance(v, BlockOutput):
            blocks = RowBlocks(v.op, v.block, v.stat._index, v.constant, v.power_of_two)
            reduce, dim = (Reduction.BLOCK_SCALE, 1) if v.factor else (None, None)
            v = v.value
        if isinstance(v, Reduced):
            if name == "d":
                raise RecipeError(f"output 'd': D is the M x N result; return gg.{v.reduce.value}(...) under an "
                                  f"aux name, e.g. {{'d': y, 'r': gg.{v.reduce.value}(y, ...)}} with "
                                  "aux={'r': gg.f32}")
            if dtype is not DType.F32:
                raise RecipeError(f"aux output {name!r}: a reduction ({v!r}) is fp32; declare aux={{{name!r}: gg.f32}}")
            if v.over_batch and not gemm.batched:
                raise RecipeError(f"aux output {name!r}: over_batch=True reduces over a batched GEMM's "
                                  "batches, and this recipe is not batched; declare batched=True, or drop "
                                  "over_batch=True")
            v, reduce, dim, over_batch = v.value, v.reduce, v.dim, v.over_batch
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            raise RecipeError(f"output {name!r} is a constant; an output must depend on the accumulator or an operand")
        if not isinstance(v, Value) or v._trace is not trace:
            raise RecipeError(f"output {name!r}: expected a traced value, got {type(v).__name__}")
        outs.append(Output(name, v._index, dtype, reduce, dim, over_batch=over_batch, blocks=blocks,
                           column_blocks=columns))
    return outs


def _check_column_blocks(values: Mapping[str, Any], gemm: GemmSpec, aux: Mapping[str, DType]) -> DType | None:
    """gg.quantize_columns's copy is an fp8 aux output and its scales an fp32 one, both from one call
    (one per recipe), in a recipe that is neither grouped nor batched; the copy's fp8 type."""
    returned = {k: v for k, v in values.items() if isinstance(v, ColumnBlockOutput)}
    if not returned:
        return None
    fix = COLUMN_BLOCKS_EXAMPLE
    first = next(iter(returned.values()))
    for name, v in returned.items():
        if name == "d":
            raise RecipeError(f"output 'd': gg.quantize_columns's values are a transposed copy, an aux output; {fix}")
        if v.call is not first.call:
            raise RecipeError(f"output {name!r}: one gg.quantize_columns call per recipe; {fix}")
        if v.factor and aux[name] is not DType.F32:
            raise RecipeError(f"aux output {name!r}: gg.quantize_columns's scales are fp32; declare "
                              f"aux={{{name!r}: gg.f32}}")
        if not v.factor and aux[name] not in FP8_MAX:
            raise RecipeError(f"aux output {name!r}: gg.quantize_columns stores its copy in an fp8 type, and "
                              f"{name!r} is declared {aux[name].value}; declare aux={{{name!r}: gg.e4m3}} (or gg.e5m2)")
    if len(returned) < 2:
        raise RecipeError(f"output {next(iter(returned))!r}: return both of gg.quantize_columns's values, the copy "
                          f"and its scales; {fix}")
    if gemm.grouped or gemm.batched:
        raise RecipeError(f"gg.quantize_columns: a {'grouped' if gemm.grouped else 'batched'} recipe's tokens are "
                          "not one K; quantize columns in a plain GEMM's epilogue")
    return next(aux[k] for k, v in returned.items() if not v.factor)


def _declared_dtype(value: Any) -> str:
    """The dtype to suggest for an undeclared output, one the declaration then accepts: fp32 for a
    reduction and a block's factors (nothing else is allowed there), bf16 for an M x N value."""
    fp32 = isinstance(value, Reduced) or (isinstance(value, BlockOutput) and value.factor)
    return "f32" if fp32 else "bf16"


def _check_row_blocks(values: Mapping[str, Any], gemm: GemmSpec, aux: Mapping[str, DType]) -> None:
    """gg.quantize's, gg.rms_norm's and gg.exp_minus_max's values are D (in an fp8 type for
    gg.quantize) and their factors an fp32 aux output (gg.quantize's required), both from one call."""
    returned = {k: v for k, v in values.items() if isinstance(v, BlockOutput) and not isinstance(v, ColumnBlockOutput)}
    if not returned:
        return
    first = next(iter(returned.values()))
    fix = BLOCK_EXAMPLES[first.op]
    what = f"gg.{first.op.value}"
    for name, v in returned.items():
        if v.factor == (name == "d"):
            part = f"the factors ({what}'s second value) are an aux output" if v.factor else \
                f"the values ({what}'s first value) are D"
            raise RecipeError(f"output {name!r}: {part}; {fix}")
        if v.call is not first.call:
            raise RecipeError(f"output {name!r}: D's row blocks come from one {what} call; "
                              f"return both of its values, {fix}")
        if v.factor and aux[name] is not DType.F32:
            raise RecipeError(f"aux output {name!r}: {what}'s factors are fp32; declare aux={{{name!r}: gg.f32}}")
    if "d" not in returned:
        raise RecipeError(f"output {next(iter(returned))!r}: {what}'s factors come with its values as D; {fix}")
    if first.op is BlockOp.QUANTIZE:
        if gemm.d not in FP8_MAX:
            raise RecipeError(f"output 'd': gg.quantize stores D in an fp8 type, and D is {gemm.d.value}; declare "
                              "d=gg.e4m3 (or gg.e5m2)")
        if len(returned) < 2:
            raise RecipeError(f"output 'd': return both of gg.quantize's values, the scales too (D is of no use "
                              f"without them); {fix}")

"""Per-tensor fp8 training (`Float8Tensorwise`, Transformer Engine's Float8CurrentScaling and
DelayedScaling); what delayed scaling keeps per tensor is `history.AmaxHistory`."""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..codegen.quantize import AmaxSpec, CastTransposeSpec, QuantizeSpec
from ..config import Arch
from ..dsl import Recipe, amax, cast
from ..dsl.backward import declarations, replay
from ..dsl.operands import OperandDecl, Scalar
from ..errors import InvalidArgument
from ..ir import EpilogueIR
from ..ir.ops import fp8_scale, round_to
from ..runtime.cast_transpose import cast_transposable, cast_transpose, tensor_amax
from ..runtime.quantize import k_grouped_copy
from ..types import DType, Layout
from .history import AmaxAlgorithm, AmaxHistory, Scaling
from .precision import Gemm, Operand, Precision, QuantizedWeight


def _prescaled(ir: EpilogueIR) -> Callable[..., Any]:
    """`ir`'s epilogue over the accumulator times scale_a times scale_b: a per-tensor scaled GEMM's
    accumulator dequantized before anything else reads it (the saved accumulator included)."""
    inner = replay(ir)

    def epilogue(acc: Any, scale_a: Any, scale_b: Any, **operands: Any) -> Any:
        return inner(acc * scale_a * scale_b, **operands)

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in ("scale_a", "scale_b")]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY) for o in ir.operands]
    epilogue.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return epilogue


@dataclass(frozen=True, repr=False)
class Float8Tensorwise(Precision):
    """Per-tensor fp8 (Transformer Engine's Float8CurrentScaling and DelayedScaling, format
    HYBRID): X and W in e4m3, gradients in e5m2, one fp32 scale per tensor, so a tensor's
    transposed copy is the same values transposed. `scaling="current"` takes each tensor's scale
    from its own amax (one more reduction before quantizing); "delayed" from its amax history
    (`AmaxHistory`: `amax_history_len` steps, `amax_compute_algo` "max" or "most_recent", the
    scale `margin` powers of two below the range's top), advanced once per optimizer step. The
    kernels read both operands' scales from device tensors (`gg.Scalar(tensor=True)`) and multiply
    the accumulator by them before the epilogue; no block scales, no fp32 promotion beyond the main
    loop's own."""

    scaling: str = "current"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    suffix: ClassVar[str] = "fp8tensor"
    grouped: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("scaling", self.scaling, Scaling)
        _choice("amax_compute_algo", self.amax_compute_algo, AmaxAlgorithm)
        for name, least in (("amax_history_len", 1), ("margin", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"{name}: expected an int >= {least}, got {value!r}")

    @property
    def delayed(self) -> bool:
        return Scaling(self.scaling) is Scaling.DELAYED

    def block_scale(self, gemm: Gemm) -> None:
        return None

    def dtypes(self, gemm: Gemm) -> tuple[DType, DType]:
        """fprop reads X and W in e4m3; dgrad and wgrad read the gradient (their A) in e5m2."""
        return (DType.E4M3 if gemm is Gemm.FPROP else DType.E5M2), DType.E4M3

    def epilogue(self, ir: EpilogueIR) -> tuple[Callable[..., Any], dict[str, OperandDecl]]:
        return _prescaled(ir), {"scale_a": Scalar(tensor=True), "scale_b": Scalar(tensor=True),
                                **declarations(ir.operands)}

    def quantizing(self, recipe: Recipe, gemm: Gemm, name: str) -> Recipe | None:
        """D rounded to its type with its amax (`d_amax`: max |D| over the tensor, NaNs skipped).
        Delayed scaling: D divided by its tensor's delayed scale (the operand `scale_d`, from the
        tensor's amax history) and stored in the fp8 type the next GEMMs read it in (e4m3 for an
        activation, e5m2 for a gradient), the amax for the history. Current scaling: the scale
        needs the whole tensor's amax before the first value is stored, so D stays 16-bit and
        `quantized` quantizes it from the kernel's amax (one read of D fewer than torch's amax
        and quantize). Either way bit for bit `quantize` of the rounded D, whose weight-gradient
        copy is the same values transposed. None under `save_original_input` and over column
        pairs: the layer quantizes with torch."""
        ir = recipe.ir.epilogue
        if self.save_original_input or ir.pairs:
            return None
        fn, operands = self.epilogue(ir)
        rounded_to, delayed = recipe.ir.gemm.d, self.delayed

        def epilogue(acc: Any, **values: Any) -> dict[str, Any]:
            scale_d = values.pop("scale_d", None)
            out = fn(acc, **values)
            d = cast(out.pop("d"), rounded_to)
            return {"d": d / scale_d if delayed else d, "d_amax": amax(d), **out}

        signature = inspect.signature(fn)
        params = [*signature.parameters.values(),
                  *([inspect.Parameter("scale_d", inspect.Parameter.KEYWORD_ONLY)] if delayed else [])]
        epilogue.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        a, b = self.dtypes(gemm)
        aux = {"d_amax": DType.F32, **{o.name: o.dtype for o in recipe.outputs[1:]}}
        return Recipe(name, epilogue, a=a, b=b, d=a if delayed else rounded_to, layout_a=Layout.ROW,
                      layout_b=Layout.COL, aux=aux,
                      operands={**operands, **({"scale_d": Scalar(tensor=True)} if delayed else {})})

    def quantizing_operands(self, gemm: Gemm, history: AmaxHistory | None, device: torch.device
                            ) -> dict[str, torch.Tensor]:
        return {"scale_d": history.scale(self.dtypes(gemm)[0], device)} if history is not None else {}

    def quantized(self, outs: dict[str, torch.Tensor], gemm: Gemm, operands: dict[str, torch.Tensor],
                  history: AmaxHistory | None) -> tuple[Operand, Operand | torch.Tensor]:
        if history is not None:  # delayed: D came quantized, its amax goes into the history
            history.add(outs["d_amax"])
            d, scale = outs["d"], operands["scale_d"]
        else:  # current: D quantized here, its scale from the kernel's amax
            out = self._cast_transpose(outs["d"], self.dtypes(gemm)[0], outs["d_amax"])
            if out is not None:  # both copies in one pass: the transposed one is already K-major
                q, q_t, scale = out
                return Operand(q, scale), Operand(q_t.t(), scale) if gemm is Gemm.FPROP else Operand(q_t, scale)
            d, scale = self.quantize(outs["d"], self.dtypes(gemm)[0], amax=outs["d_amax"])
        if gemm is Gemm.FPROP:  # the next wgrad's B: K x N, K-major (a column-major view)
            return Operand(d, scale), Operand(d.t().contiguous().t(), scale)
        return Operand(d, scale), Operand(d.t().contiguous(), scale)  # this layer's wgrad A

    def quantize_specs(self, source: DType, arch: Arch) -> tuple[QuantizeSpec, ...]:
        """Current scaling: the amax kernel and the per-tensor casts to e4m3 (X, h) and e5m2 (the
        gradients); delayed scaling quantizes with torch ops."""
        if self.delayed:
            return ()
        return (AmaxSpec(source, arch), *(CastTransposeSpec(source, dtype, arch=arch, per_tensor=True)
                                          for dtype in (DType.E4M3, DType.E5M2)))

    def operands(self, t: torch.Tensor, rows: tuple[Gemm, str, Recipe], columns: tuple[Gemm, str, Recipe],
                 history: AmaxHistory | None = None) -> tuple[Operand, Operand]:
        """Current scaling on the GPU: t's amax by the amax kernel, then both copies over its one
        scale in one pass (the cast-transpose kernel, per tensor), the same bits as `quantize`
        twice; delayed scaling, and where the kernels cannot run (`_cast_transpose`), `quantize`
        twice."""
        dtype = self.dtypes(rows[0])[rows[1] == "b"]
        if history is None and dtype is self.dtypes(columns[0])[columns[1] == "b"]:
            out = self._cast_transpose(t, dtype, None)
            if out is not None:
                q, q_t, scale = out
                return (Operand(q, scale) if rows[1] == "a" else Operand(q.t(), scale),
                        Operand(q_t, scale) if columns[1] == "a" else Operand(q_t.t(), scale))
        return super().operands(t, rows, columns, history)

    @staticmethod
    def _cast_transpose(t: torch.Tensor, dtype: DType, amax: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q, q_t, scale): t and t transposed in fp8 `dtype` over one scale from `amax` (t's own by
        the amax kernel where None) on the GPU; None on the CPU, in a traced call, for rows the
        kernels cannot read 16 bytes at a time, or a kernel GEMMGEN_JIT keeps from compiling now."""
        if torch.compiler.is_compiling() or not cast_transposable(t):
            return None
        amax = tensor_amax(t) if amax is None else amax.float()
        out = None if amax is None else cast_transpose(t, dtype, amax=amax)
        if out is None:
            return None
        assert out.q is not None and out.q_t is not None and out.scale is not None
        return out.q, out.q_t, out.scale

    def history(self) -> AmaxHistory | None:
        if not self.delayed:
            return None
        return AmaxHistory(self.amax_history_len, AmaxAlgorithm(self.amax_compute_algo), self.margin)

    def quantize(self, t: torch.Tensor, dtype: DType, history: AmaxHistory | None = None, per: int = 0,
                 amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale): `t` in fp8 `dtype` with t's shape, and its fp32 scale (1,) (a value is
        stored as value / scale, saturating): the recipe's one quantizer. Current scaling: the
        scale is t's amax (or the given one, an epilogue's) over dtype's largest value (1 for zeros
        or a NaN); delayed: `history`'s. `per` leading dimensions are tensors of their own
        (experts: 1), a scale each (t.shape[:per])."""
        if history is not None:
            scale = history.record(t, dtype, per)
        else:
            if amax is None:
                detached = t.detach().abs()
                amax = detached.amax(dim=tuple(range(per, t.dim()))) if per else detached.amax().reshape(1)
            amax = amax.float().reshape(t.shape[:per] or (1,))
            scale = fp8_scale(amax, dtype)
        q = t.new_empty(t.shape, dtype=dtype.torch)
        spread = scale.reshape(*scale.shape, *[1] * (t.dim() - per)) if per else scale  # over each one's values
        q.copy_(round_to(t.detach().float() / spread, dtype))
        return q, scale

    def operand(self, t: torch.Tensor, gemm: Gemm, which: str, recipe: Recipe,
                history: AmaxHistory | None = None) -> Operand:
        q, scale = self.quantize(t.contiguous(), self.dtypes(gemm)[which == "b"], history)
        return Operand(q, scale) if which == "a" else Operand(q.t(), scale)

    def weight(self, w: torch.Tensor, fprop: Recipe, dgrad: Recipe,
               history: AmaxHistory | None = None) -> QuantizedWeight:
        q, scale = self.quantize(w, DType.E4M3, history)  # (out, in): one scale, so both copies are exact
        return QuantizedWeight(self.weight_version(w), Operand(q.t(), scale), Operand(q.t().contiguous().t(), scale))

    def experts(self, w: torch.Tensor, history: AmaxHistory | None = None) -> QuantizedWeight:
        """The experts' weights (E x out x in) in e4m3, a scale per expert (E,) (each expert's
        weight a tensor, as Transformer Engine's GroupedLinear holds them), which the grouped
        kernels read at the group: both copies exact."""
        q, scale = self.quantize(w.detach(), DType.E4M3, history, per=1)
        return QuantizedWeight(self.weight_version(w), Operand(q.mT, scale), Operand(q.mT.contiguous().mT, scale))

    def tokens(self, t: torch.Tensor, gemm: Gemm, groups: int, history: AmaxHistory | None = None) -> Operand:
        """`t` (tokens x C) as `gemm`'s A (x in e4m3 for fprop, dL/dacc in e5m2 for dgrad), its one
        scale for each of `groups`."""
        q, scale = self.quantize(t.contiguous(), self.dtypes(gemm)[0], history)
        return Operand(q, scale.expand(groups))

    def along_tokens(self, t: torch.Tensor, offsets: torch.Tensor, which: str,
                     history: AmaxHistory | None = None) -> Operand:
        """`t` (tokens x C) as the K-grouped weight gradient's A (dL/dacc, e5m2: which="a") or B
        (x, e4m3): the same values as its `tokens` copy (one scale), tokens-contiguous, each
        expert's aligned (`gg.k_grouped_copy`)."""
        q, scale = self.quantize(t.contiguous(), self.dtypes(Gemm.WGRAD)[which == "b"], history)
        return Operand(k_grouped_copy(q, offsets), scale.expand(offsets.numel()))


def _choice(name: str, value: object, choices: type[enum.Enum]) -> None:
    allowed = [c.value for c in choices]
    if value not in allowed:
        raise InvalidArgument(f"{name}: expected one of {allowed}, got {value!r}")


__all__ = ["Float8Tensorwise"]

"""`Recipe`: a GEMM declaration plus an epilogue traced from a plain Python function.

    bias_gelu = gg.Recipe("bias_gelu", lambda acc, bias: gg.gelu(acc + bias),
                          a=gg.bf16, b=gg.bf16, operands={"bias": gg.RowVector(gg.bf16)})

The epilogue function is called once with symbolic values (`values.Value`); `ir.normalize` turns
the recorded graph into the IR. Nothing is parsed from source. Mistakes raise RecipeError here, at
declaration, naming the operand or op and the fix.

`recipe.backward()` derives the recipes a training step runs (`Backward`, `ir.autodiff`): the
forward saving what the backward reads, and the backward GEMM's epilogue (docs/design/training.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..codegen import fitting_default, render_kernel, validate
from ..compile import CompiledKernel, KernelCache, build_kernel
from ..config import DEFAULT_ARCH, Arch, KernelConfig
from ..errors import RecipeError
from ..ir import (
    BLOCK_SCALE_OPERANDS,
    EpilogueIR,
    GemmSpec,
    Node,
    Op,
    Operand,
    Output,
    RecipeIR,
    normalize,
)
from ..ir.autodiff import GRAD_PREFIX, RECOMPUTED_D, SAVED_ACC, NotDifferentiable, derive
from ..types import DType, Grouping, Layout, Microscaling, OperandKind, as_dtype, as_layout
from .backward import OperandGradient, declarations, operand_gradients, replay
from .checks import check_grouped_epilogue, check_k_grouped, check_reductions, grouping_of
from .operands import OperandDecl, check_operand
from .outputs import traced_outputs
from .summary import summary
from .values import OUTPUT_DTYPES, SeedValue, Trace, Value, tracing

if TYPE_CHECKING:  # the runtime and the reference import torch: loaded when first used
    import torch

    from ..runtime.base import KernelBase

_AB_16BIT = (DType.BF16, DType.F16)
_AB_FP8 = (DType.E4M3, DType.E5M2)


def _check_gemm(a: Any, b: Any, d: Any, layout_a: Any, layout_b: Any, batched: bool, grouped: Any,
                block_scale: Any = None, layout_d: Any = Layout.ROW) -> GemmSpec:
    da, db = as_dtype(a, "a (dtype of A)"), as_dtype(b, "b (dtype of B)")
    la, lb = as_layout(layout_a, "layout_a"), as_layout(layout_b, "layout_b")
    ld = as_layout(layout_d, "layout_d")
    for what, dt in (("a", da), ("b", db)):
        if dt not in _AB_16BIT + _AB_FP8 + (DType.E2M1,):
            raise RecipeError(f"{what}: A and B may be bf16, f16, e4m3, e5m2 or e2m1 (NVFP4), not {dt.value}")
    grouping = grouping_of(grouped)
    if DType.E2M1 in (da, db) and grouping is not Grouping.K:
        return _check_fp4(da, db, d, la, lb, ld, batched, grouping is not None, block_scale)
    fp8 = da in _AB_FP8
    if fp8 != (db in _AB_FP8) or (not fp8 and da is not db):
        raise RecipeError(f"a/b: mixed input types ({da.value} x {db.value}) are not supported; give A and B the "
                          "same 16-bit dtype, or make both fp8 (e4m3 and e5m2 may be mixed)")
    if grouping is Grouping.K:
        if batched:
            raise RecipeError("grouped/batched: a grouped GEMM's groups take the place of the batch; declare one "
                              "of them")
        return check_k_grouped(da, db, d, la, lb, ld, fp8, block_scale)
    if fp8 and (la, lb) != (Layout.ROW, Layout.COL):
        raise RecipeError(f"layout_a/layout_b: fp8 WGMMA reads A and B K-major only, so an fp8 GEMM needs "
                          f"layout_a=RowMajor and layout_b=ColMajor (got {la.value}/{lb.value}); store the "
                          "operand transposed (e.g. the weight as N x K, passed as its .t())")
    # an fp8 D is asked for, not a default: it needs a scale in the epilogue to be useful
    dd = as_dtype(d if d is not None else (DType.BF16 if fp8 else da), "d (dtype of D)")
    if dd not in OUTPUT_DTYPES:
        raise RecipeError(f"d: D may be bf16, f16, f32, e4m3 or e5m2, not {dd.value}")
    if not isinstance(batched, bool):
        raise RecipeError(f"batched: expected True or False, got {batched!r}")
    if grouping is not None and batched:
        raise RecipeError("grouped/batched: a grouped GEMM's groups take the place of the batch; declare one of them")
    grouped = grouping is not None
    if grouped and la is not Layout.ROW:
        raise RecipeError("layout_a: a grouped GEMM's A holds each group's rows one after another (T x K), so "
                          f"it must be RowMajor, not {la.value}")
    if grouped and ld is not Layout.ROW:
        raise RecipeError("layout_d: a grouped GEMM's D holds each group's rows one after another (T x N), so it "
                          "is RowMajor; drop layout_d=ColMajor")
    if isinstance(block_scale, Microscaling):
        return GemmSpec(da, db, dd, la, lb, batched, layout_d=ld, grouped=grouped,
                        microscaling=_check_microscaling(block_scale, fp8))
    scale = _check_block_scale(block_scale, fp8, grouped)
    return GemmSpec(da, db, dd, la, lb, batched, layout_d=ld, grouped=grouped, block_scale=scale)


def _check_fp4(da: DType, db: DType, d: Any, la: Layout, lb: Layout, ld: Layout, batched: bool, grouped: bool,
               block_scale: Any) -> GemmSpec:
    """fp4 (e2m1) A and B: NVFP4, both K-major (the MMA's kind::mxf4nvf4 reads packed fp4 K-major
    only), with a 16-bit or fp32 D."""
    if da is not db:
        raise RecipeError(f"a/b: fp4 A takes fp4 B ({da.value} x {db.value}); declare a=gg.e2m1 and b=gg.e2m1")
    if block_scale is not Microscaling.NVFP4:
        raise RecipeError(f"block_scale: fp4 (e2m1) A and B are scaled per 16 values of K; declare "
                          f"block_scale=gg.NVFP4, got {block_scale!r}")
    if (la, lb) != (Layout.ROW, Layout.COL):
        raise RecipeError(f"layout_a/layout_b: the MMA reads packed fp4 K-major only, so an NVFP4 GEMM needs "
                          f"layout_a=RowMajor and layout_b=ColMajor (got {la.value}/{lb.value}); store the "
                          "operand transposed (the weight as N x K/2 bytes, passed as its .t())")
    dd = as_dtype(d if d is not None else DType.BF16, "d (dtype of D)")
    if dd not in (DType.BF16, DType.F16, DType.F32):
        raise RecipeError(f"d: an NVFP4 GEMM's D may be bf16, f16 or f32, not {dd.value}")
    if not isinstance(batched, bool) or not isinstance(grouped, bool):
        raise RecipeError(f"batched/grouped: expected True or False, got {batched!r}/{grouped!r}")
    if grouped and batched:
        raise RecipeError("grouped/batched: a grouped GEMM's groups take the place of the batch; declare one of them")
    if grouped and ld is not Layout.ROW:
        raise RecipeError("layout_d: a grouped GEMM's D holds each group's rows one after another (T x N), so it "
                          "is RowMajor; drop layout_d=ColMajor")
    return GemmSpec(da, db, dd, la, lb, batched, layout_d=ld, grouped=grouped, microscaling=Microscaling.NVFP4)


#: DeepSeek-V3's fp8 block scaling: activations per row and 128 K, weights per 128 x 128 block.
DEEPSEEK_BLOCK_SCALE = (1, 128, 128)


def _check_microscaling(value: Microscaling, fp8: bool) -> Microscaling:
    """`block_scale=gg.MXFP8`: fp8 A and B whose scales the sm_100a MMA applies itself."""
    if value is Microscaling.NVFP4:
        raise RecipeError("block_scale: gg.NVFP4 scales fp4 A and B; declare a=gg.e2m1 and b=gg.e2m1 "
                          "(fp8 takes gg.MXFP8)")
    if not fp8:
        raise RecipeError(f"block_scale: {value!r} scales fp8 A and B (e4m3/e5m2); declare a=gg.e4m3 and b=gg.e4m3 "
                          "(bf16/f16 need no scales)")
    return value


def _check_block_scale(value: Any, fp8: bool, grouped: bool) -> tuple[int, int, int] | None:
    """`block_scale=(M, N, K)`: powers of two, M and N up to 128 (they must divide the tile), K a
    multiple of 128 (the main loop rescales once per K tile, and an fp8 K tile is 128)."""
    if value is None:
        return None
    if not (isinstance(value, tuple | list) and len(value) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        raise RecipeError(f"block_scale: expected (M, N, K) granularity ints such as {DEEPSEEK_BLOCK_SCALE}, or "
                          f"gg.MXFP8, got {value!r}")
    m, n, k = value
    for what, x in (("M", m), ("N", n)):
        if x < 1 or x > 128 or x & (x - 1):
            raise RecipeError(f"block_scale: {what} granularity {x} must be a power of two from 1 to 128 (it "
                              "must divide the kernel's tile)")
    if k != 128:
        raise RecipeError(f"block_scale: K granularity {k} must be 128 (CUTLASS's blockwise main loop rescales "
                          "once per K tile, and an fp8 K tile is 128)")
    if not fp8:
        raise RecipeError("block_scale: block scaling is for fp8 A and B (e4m3/e5m2); bf16/f16 need no scales")
    if grouped and m != 1:
        raise RecipeError(f"block_scale: M granularity {m} in a grouped GEMM: its groups start at any row of A, so "
                          "its activations' scales must be per row (M granularity 1, as DeepSeek-V3's "
                          "(1, 128, 128)); quantize the tokens per row and 128 values of K")
    return (m, n, k)


class Recipe:
    """A fused GEMM: D = epilogue(A @ B, operands...), plus optional auxiliary outputs.

    Args:
        name: a C identifier naming the kernel.
        epilogue: `f(acc, **operands)` returning D's value, or a dict `{"d": ..., "<aux>": ...}`.
            Defaults to `lambda acc: acc`.
        a, b, d: element types of A, B and D (D defaults to A's type, and to bf16 for fp8 A and B).
        layout_a, layout_b: gg.RowMajor or gg.ColMajor (A is M x K, B is K x N).
        layout_d: gg.RowMajor (the default) or gg.ColMajor: the memory order of D and of every
            M x N tensor of the epilogue (C, matrix operands, aux outputs), as cuBLAS's column-major
            D; not with column pairs or grouped.
        batched: whether tensors carry a leading batch dimension L.
        grouped: a grouped (MoE) GEMM: A is T x K with the rows of G groups one after another, B is
            G x K x N, and the kernel takes `offsets` (int32, G): where each group's rows end.
            Row vectors are per group (G x N); column vectors and matrices are per row of A.
            `grouped=gg.Grouping.K`: the groups split K instead (the experts' weight gradient): A is
            M x T (the `.t()` of a tokens-major T x M tensor: layout_a=gg.ColMajor), B is T x N
            (layout_b=gg.RowMajor), offsets say where each group's tokens end, and D is G x M x N
            with D_g = A_g @ B_g; a matrix operand (C) is G x M x N too. bf16 or f16 A and B.
        operands: name -> gg.Scalar / gg.RowVector / gg.ColVector / gg.Matrix declaration.
        aux: name -> dtype of each auxiliary output: an M x N tensor, or gg.f32 for a reduction
            (`gg.amax(x)`, `gg.amax(x, dim)`, `gg.sum(x, dim)`, `gg.reduce_max(x, dim)`,
            `gg.reduce_min(x, dim)`).
        block_scale: (M, N, K) granularity of fp8 block scaling, e.g. (1, 128, 128) as DeepSeek-V3
            (gg.DEEPSEEK_BLOCK_SCALE): the call then takes `scale_a`, fp32 (ceil(M/M_g), ceil(K/128)),
            and `scale_b`, fp32 (ceil(K/128), ceil(N/N_g)), first among its operands, and
            acc = sum over K blocks of (A_kb @ B_kb) * scale_a * scale_b. Grouped: M_g is 1,
            `scale_a` is (T, ceil(K/128)) and `scale_b` (G, ceil(K/128), ceil(N/N_g)), both K-major.
            Or gg.MXFP8 (sm_100a): the MMA scales A and B itself by UE8M0 exponents, one per 32
            values of K of each row of A and each column of B: the call takes `scale_a` and
            `scale_b` (torch.float8_e8m0fnu) in the MMA's blocked order (gg.to_blocked_scales).
            Or gg.NVFP4 (sm_100a) with a=gg.e2m1 and b=gg.e2m1: packed fp4 A (M x K/2 bytes,
            torch.float4_e2m1fn_x2) and B (K/2 x N, column-major), scaled by the MMA with one
            unsigned e4m3 (torch.float8_e4m3fn) per 16 values of K, in the same blocked order.
        config: the default KernelConfig for this recipe.
    """

    def __init__(self, name: str, epilogue: Callable[..., Any] | None = None, *, a: Any = DType.BF16,
                 b: Any = DType.BF16, d: Any = None, layout_a: Any = Layout.ROW, layout_b: Any = Layout.COL,
                 batched: bool = False, grouped: bool | Grouping | str = False,
                 operands: Mapping[str, OperandDecl] | None = None,
                 aux: Mapping[str, Any] | None = None, block_scale: Any = None,
                 config: KernelConfig | None = None, layout_d: Any = Layout.ROW) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise RecipeError(f"name: expected a C identifier such as 'bias_gelu', got {name!r}")
        self.name = name
        self.gemm = _check_gemm(a, b, d, layout_a, layout_b, batched, grouped, block_scale, layout_d)
        self._fn = epilogue if epilogue is not None else (lambda acc: acc)
        self._decls = dict(operands or {})
        if self.gemm.scaled:
            taken = sorted({o.name for o in BLOCK_SCALE_OPERANDS} & set(self._decls))
            if taken:
                raise RecipeError(f"operand {taken[0]!r}: a block-scaled recipe's call takes scale_a and scale_b "
                                  "for its main loop; give the epilogue operand another name")
        self._aux = {k: as_dtype(v, f"aux output {k!r} dtype") for k, v in (aux or {}).items()}
        for k, v in self._aux.items():
            if not k.isidentifier() or k == "d":
                raise RecipeError(f"aux output {k!r}: names must be Python identifiers other than 'd'")
            if v not in OUTPUT_DTYPES:
                raise RecipeError(f"aux output {k!r}: may be bf16, f16, f32, e4m3 or e5m2, not {v.value}")
        self.ir = RecipeIR(name, self.gemm, self._trace())
        check_reductions(self.ir.epilogue)
        if self.gemm.grouped:
            check_grouped_epilogue(self.ir.epilogue, self.gemm.k_grouped)
        if self.ir.epilogue.row_blocks is not None and self.gemm.layout_d is Layout.COL:
            raise RecipeError("layout_d: the blocks of gg.quantize, gg.rms_norm and gg.exp_minus_max are columns of a "
                              "row of a row-major D; declare the recipe with layout_d=RowMajor (the default)")
        if self.ir.epilogue.pairs and self.gemm.layout_d is Layout.COL:
            raise RecipeError("layout_d: column pairs (gg.pairs) read and write row-major tensors from the "
                              "registers; declare the recipe with layout_d=RowMajor (the default)")
        if config is not None:
            validate(config, self.ir)
        self.config = config

    # ---- tracing

    def _trace(self) -> EpilogueIR:
        checked = {k: check_operand(k, v, self.gemm.batched, self.gemm.grouped) for k, v in self._decls.items()}
        params = self._epilogue_params()
        missing = [p for p in params[1:] if p not in checked]
        if missing:
            raise RecipeError(f"epilogue parameter {missing[0]!r} has no declaration; add it to operands=, e.g. "
                              f"operands={{{missing[0]!r}: gg.RowVector(gg.bf16)}}")
        unused = [k for k in checked if k not in params[1:]]
        if unused:
            raise RecipeError(f"operand {unused[0]!r} is declared but is not a parameter of the epilogue; "
                              "add it to the function's parameters or remove the declaration")
        trace = Trace()
        acc = trace.add(Node(Op.ACC))
        args: dict[str, Value | SeedValue] = {}
        for k, v in checked.items():
            if isinstance(v, float):
                args[k] = trace.add(Node(Op.CONST, attr=v))
            elif v.kind is OperandKind.SEED:  # what gg.rand draws from, not a value
                args[k] = SeedValue(trace, k)
            else:
                args[k] = trace.add(Node(Op.INPUT, name=k, dtype=v.dtype))
        with tracing(trace):
            result = self._fn(acc, **{p: args[p] for p in params[1:]})
        outputs = traced_outputs(trace, result, self.gemm, self._aux)
        operands = tuple(v for v in checked.values() if isinstance(v, Operand))
        ir = normalize(trace.nodes, outputs, operands)
        for o in ir.outputs:
            if ir.nodes[o.node].op is Op.CONST:
                raise RecipeError(f"output {o.name!r} is a constant; an output must depend on the accumulator "
                                  "or an operand")
        used = {o.name for o in ir.operands}
        for decl in operands:
            if decl.name not in used:
                raise RecipeError(f"operand {decl.name!r} is declared but no output depends on it; "
                                  "use it or remove it")
        return ir

    def _epilogue_params(self) -> list[str]:
        try:
            sig = inspect.signature(self._fn)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"epilogue: expected a Python function f(acc, ...), got {self._fn!r}") from e
        params = list(sig.parameters.values())
        if not params or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise RecipeError("epilogue: expected a function with named parameters f(acc, op1, op2, ...), "
                              "the first being the accumulator")
        return [p.name for p in params]

    # ---- what other layers read

    @property
    def key(self) -> str:
        return self.ir.key

    @property
    def operands(self) -> tuple[Operand, ...]:
        """What a call takes after A and B, in order (`RecipeIR.operands`)."""
        return self.ir.operands

    @property
    def outputs(self) -> tuple[Output, ...]:
        return self.ir.epilogue.outputs

    def reference(self, a: torch.Tensor, b: torch.Tensor, *args: Any, **operands: Any) -> Any:
        """The fused op in fp32 on the CPU. Returns D, or (D, aux...) when the recipe has aux outputs.
        A grouped recipe takes `reference(a, b, offsets, **operands)`, or in the masked layout
        `reference(a3, b, masked_m, **operands)` (a3: groups x max_m x K). The operands are checked
        as the kernel checks them (dtypes, shapes), in any layout."""
        from ..ir.reference import reference

        offsets = None
        if self.gemm.grouped:
            if len(args) != 1:
                raise RecipeError("reference: a grouped recipe takes (a, b, offsets, **operands), offsets an int "
                                  "tensor of G entries: where each group's rows of A end")
            offsets = args[0]
        elif args:
            raise RecipeError("reference: operands are passed by name, e.g. reference(a, b, bias=bias)")

        names = {o.name for o in self.operands}
        unknown = set(operands) - names
        if unknown:
            raise RecipeError(f"reference: unknown operand(s) {sorted(unknown)}; this recipe takes {sorted(names)}")
        if names - set(operands):
            raise RecipeError(f"reference: missing operand(s) {sorted(names - set(operands))}")
        from ..runtime.value_checks import check_values

        check_values(self.ir, a, b, operands, offsets)  # the kernel's rules: no silent broadcast
        outs = reference(self.ir, a, b, operands, offsets)
        return outs[0] if len(outs) == 1 else outs

    def backward(self, *, a: Any = None, b: Any = None, layout_a: Any = None, layout_b: Any = None,
                 d: Any = None, saved: Any = None, wrt: Sequence[str] | None = None,
                 grad_outputs: Sequence[str] = ("d",), recompute: bool = False, recompute_d: bool = False,
                 block_scale: Any = None) -> Backward:
        """The recipes a training step runs for this one (`dsl.backward`, docs/design/training.md): the
        forward, saving its accumulator where the backward needs it, and the backward GEMM's
        epilogue, derived from this recipe's IR: its D is dL/dacc, its aux outputs the operands'
        gradients (`Backward.gradients`).

        Args:
            a, b, layout_a, layout_b: the backward GEMM's A and B, whose product is dL/dD (dL/dY
                and the next layer's weight, K x N with N this recipe's N: row-major for a weight
                stored out x in). Default: this recipe's A type (bf16 for fp8), both row-major.
            block_scale: the backward GEMM's block scales, for fp8 a and b (its A's along K:
                dL/dY's per row; its B's: the next layer's weight's), as `Recipe(block_scale=)`.
            d: the type of dL/dacc (default: as a). saved: the type the forward saves its
                accumulator in, or with `recompute` the type of dL/dD (default: as d).
            wrt: the operands whose gradients to compute (default: all of the epilogue's but seeds).
            grad_outputs: the outputs a gradient flows into: D, and M x N aux outputs, each then
                read from the operand `grad_<name>`.
            recompute: the backward kernel is this recipe's own GEMM again, reading dL/dD as the
                operand `grad_d`, instead of a GEMM whose product is dL/dD reading the saved
                accumulator: one more GEMM, nothing kept from the forward. Always so for a
                grouped GEMM (its forward writes D only), and for an epilogue over column pairs
                (`gemmgen.pairs`) that does more with the accumulator than take its pairs (its
                backward kernel reads the saved accumulator, 2N columns, as pairs' halves only).
            recompute_d: also write the forward's D (aux `fwd_d`), for a next layer's weight
                gradient, instead of keeping it from the forward.
        """
        return _derive_backward(self, a=a, b=b, layout_a=layout_a, layout_b=layout_b, d=d, saved=saved, wrt=wrt,
                               grad_outputs=grad_outputs, recompute=recompute, recompute_d=recompute_d,
                               block_scale=block_scale)

    def default_config(self, arch: Arch = DEFAULT_ARCH) -> KernelConfig:
        """The recipe's own `config=` (when it targets `arch`), else gemmgen's default for its math
        on `arch` (`codegen.fitting_default`: 128 x 128 tiles, narrower where the epilogue's shared
        memory leaves the main loop one stage)."""
        if self.config is not None and self.config.arch is arch:
            return self.config
        return fitting_default(self.ir, arch)

    def source(self, config: KernelConfig | None = None) -> str:
        """The generated CUTLASS C++ for this recipe under `config`."""
        return render_kernel(self.ir, config or self.default_config()).source

    def compile(self, config: KernelConfig | None = None, *, cache: KernelCache | None = None) -> KernelBase:
        """The kernel as a callable on torch tensors (a gemmgen.Kernel, or a GroupedKernel for a grouped
        recipe); compiles or loads from cache. Without `config`: the recipe's default config for the
        current CUDA device's arch (sm_90a where torch sees no GPU): the recipe's own `config=`, else
        gemmgen's default, not necessarily what a call of a given shape launches through the op (the
        launch policy picks per shape: `gemmgen.tuning.choose_launch(recipe, m, n, k).config`)."""
        from ..runtime.driver import current_arch
        from ..runtime.kernel import kernel_for_compiled

        return kernel_for_compiled(self.build(config or self.default_config(current_arch()), cache=cache))

    def build(self, config: KernelConfig | None = None, *, cache: KernelCache | None = None) -> CompiledKernel:
        """Compile (or load from a bundle or the cache) the kernel for `config`; without it, the
        recipe's default config (as `compile`), not the config a call of some shape launches
        (`gemmgen.tuning.choose_launch(recipe, m, n, k).config` names that one)."""
        return build_kernel(self.ir, config or self.default_config(), cache=cache)

    def __repr__(self) -> str:
        return summary(self.name, self.gemm, self.operands, self.outputs, self.config)


@dataclass(frozen=True)
class Backward:
    """What `Recipe.backward()` derives (see the module docstring).

    `forward`: the recipe to run in the forward pass (the recipe itself when the backward reads
    nothing of it but its operands; else it also writes aux `saved_acc`). `kernel`: the backward
    GEMM's recipe: its accumulator is dL/dD, its D is dL/dacc, its aux outputs the fused operand
    gradients (`gradients`), and `fwd_d` (the forward's D, recomputed) when asked for.
    `recompute` (always so for a grouped GEMM, whose forward writes D only): the kernel is the
    forward's GEMM again (its A, B and operands), reading dL/dD as the operand `grad_d`: one more
    GEMM, and no M x N tensor kept from the forward. `rest`: the epilogue of the gradients the
    kernel cannot compute (`Derivative.rest`)."""

    forward: Recipe
    kernel: Recipe
    gradients: tuple[OperandGradient, ...]
    recompute: bool = False
    rest: EpilogueIR | None = None

    @property
    def saves_accumulator(self) -> bool:
        return any(o.name == SAVED_ACC for o in self.kernel.operands)

    def rest_gradients(self, acc: torch.Tensor, operands: Mapping[str, torch.Tensor | float],
                       offsets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The gradients the kernel does not compute, with torch in fp32, each in its operand's
        shape: `acc` is the kernel's accumulator, materialized (dL/dD; with `recompute`, the
        forward's A @ B), `operands` the kernel's (saved_acc or grad_d included); a grouped
        recipe's `offsets` as its forward took them."""
        import torch

        from ..ir.reference import evaluate_epilogue, group_bounds

        wanted = [g for g in self.gradients if g.reason and g.output is not None]
        if self.rest is None or not wanted:
            return {}
        rest = self.rest
        kinds = {o.name: o.kind for o in rest.operands}

        def evaluate(g: torch.Tensor, ops: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
            values = evaluate_epilogue(rest, g.float(), ops, round_outputs=False)
            return {o.name: v for o, v in zip(rest.outputs, values, strict=True)}

        if offsets is None:
            by_name = evaluate(acc, dict(operands))
            return {g.operand: by_name[g.output].sum(g.sum_dims) if g.sum_dims else by_name[g.output]  # type: ignore[index]
                    for g in wanted}
        # grouped: each group's rows with its own row vectors; a row vector's gradient per group
        out = {g.operand: torch.zeros_like(torch.as_tensor(operands[g.operand], dtype=torch.float32))
               for g in wanted}
        for i, (start, end) in enumerate(group_bounds(offsets.tolist(), acc.shape[0])):
            ops = {k: v if not isinstance(v, torch.Tensor) or kinds.get(k) is OperandKind.SCALAR else
                   v[i] if kinds.get(k) is OperandKind.ROW else v[start:end] for k, v in operands.items()}
            by_name = evaluate(acc[start:end], ops)
            for g in wanted:
                kind, value = kinds.get(g.operand), by_name[g.output]  # type: ignore[index]
                if kind is OperandKind.ROW:
                    out[g.operand][i] += value
                elif kind is OperandKind.SCALAR:
                    out[g.operand] += value
                else:
                    out[g.operand][start:end] = value
        return out

    def describe(self) -> str:
        """One line per output of the backward kernel, and per gradient it does not compute."""
        g = self.kernel.ir.gemm
        lines = [f"{self.kernel.name}: {g.a.value} x {g.b.value} -> {g.d.value}, reads "
                 f"{', '.join(o.name for o in self.kernel.operands) or 'only its accumulator'}",
                 "  d: dL/dacc (" + ("the accumulator is the forward's, recomputed; dL/dD is grad_d)" if self.recompute
                                 else "the accumulator is dL/dD)")]
        for grad in self.gradients:
            if grad.reason:
                lines.append(f"  {grad.operand}: not in the kernel, computed with torch ({grad.reason})")
            else:
                rest = f", then summed over dims {list(grad.sum_dims)}" if grad.sum_dims else ""
                out = next(o for o in self.kernel.outputs if o.name == grad.output)
                how = "M x N" if out.reduce is None else "sum over " + {None: "M and N", 0: "M", 1: "N"}[out.dim]
                lines.append(f"  {grad.output}: dL/d{grad.operand} ({how}{rest})")
        if any(o.name == RECOMPUTED_D for o in self.kernel.outputs):
            lines.append(f"  {RECOMPUTED_D}: the forward's D, recomputed")
        if self.saves_accumulator:
            lines.append(f"  {SAVED_ACC}: written by {self.forward.name} in the forward")
        return "\n".join(lines)


def _derive_backward(recipe: Recipe, *, a: Any = None, b: Any = None, layout_a: Any = None, layout_b: Any = None,
                    d: Any = None, saved: Any = None, wrt: Sequence[str] | None = None,
                    grad_outputs: Sequence[str] = ("d",), recompute: bool = False,
                    recompute_d: bool = False, block_scale: Any = None, _pairs_checked: bool = False) -> Backward:
    """`Recipe.backward`'s body (its docstring says what the arguments mean)."""
    gemm = recipe.ir.gemm
    where = f"{recipe.name}.backward()"
    if not isinstance(recompute, bool) or not isinstance(recompute_d, bool):
        raise RecipeError(f"{where}: recompute and recompute_d are True or False")
    if recipe.ir.epilogue.row_blocks is not None or recipe.ir.epilogue.column_blocks is not None:
        raise RecipeError(f"{where}: D is computed per block of its rows (gg.quantize, gg.rms_norm, "
                          "gg.exp_minus_max) or a copy per block of its columns (gg.quantize_columns), which "
                          "gemmgen does not differentiate; differentiate the recipe without them, and apply them "
                          "in the forward only")
    d_only = ""
    if gemm.grouped:
        d_only = "a grouped GEMM writes D only"
        if recompute_d:
            raise RecipeError(f"{where}: recompute_d=True asks a grouped GEMM for an aux output, and it writes D "
                              "only; keep the forward's D instead")
        recompute = True  # its forward cannot write the accumulator either
    if recipe.ir.epilogue.pairs and not recompute and not _pairs_checked:
        # the GEMM whose product is dL/dD (N/2 columns) reads the saved accumulator at twice its own
        # width, as its pairs' halves: where the epilogue does more with it (a bias before the
        # pairs), the backward kernel is this recipe's GEMM again
        try:
            return _derive_backward(recipe, a=a, b=b, layout_a=layout_a, layout_b=layout_b, d=d, saved=saved,
                                    wrt=wrt, grad_outputs=grad_outputs, recompute=False, recompute_d=recompute_d,
                                    block_scale=block_scale, _pairs_checked=True)
        except RecipeError:
            recompute = True
    given = [k for k, v in (("a", a), ("b", b), ("layout_a", layout_a), ("layout_b", layout_b),
                            ("block_scale", block_scale)) if v is not None]
    if recompute and given:
        raise RecipeError(f"{where}: {given[0]}= describes the next layer's GEMM, but with recompute=True (always "
                          "for a grouped GEMM or one over column pairs) the backward kernel is this recipe's own GEMM "
                          "again; leave it out")
    grad_default = gemm.a if gemm.a.bits == 16 else DType.BF16
    grad_dtype = as_dtype(d if d is not None else grad_default, "d (dtype of dL/dacc)")
    read_dtype = as_dtype(saved if saved is not None else grad_dtype,
                          "saved (dtype of the saved accumulator, or with recompute of dL/dD)")
    names = {o.name for o in recipe.ir.epilogue.operands if o.kind is not OperandKind.SEED}  # seeds: no gradient
    outputs = {o.name: o for o in recipe.outputs}
    reserved = {SAVED_ACC, RECOMPUTED_D, *(GRAD_PREFIX + n for n in grad_outputs)}
    taken = sorted((names | set(outputs)) & reserved)
    if taken:
        raise RecipeError(f"{where}: {taken[0]!r} names what the backward reads or writes; rename that operand or "
                          "aux output")
    wrt = tuple(sorted(names) if wrt is None else wrt)
    unknown = sorted(set(wrt) - names)
    if unknown:
        raise RecipeError(f"{recipe.name}.backward(wrt=...): {unknown[0]!r} is not an operand of the epilogue; "
                          f"choose from {sorted(names)}")
    for name in grad_outputs:
        out = outputs.get(name)
        if out is None or out.reduce is not None:
            matrices = [o.name for o in recipe.outputs if o.reduce is None]
            raise RecipeError(f"{recipe.name}.backward(grad_outputs=...): {name!r} is not an M x N output of the "
                              f"recipe; a gradient flows into {matrices}")
    try:
        derived = derive(recipe.ir.epilogue, grad_dtype=grad_dtype, read_dtype=read_dtype, wrt=wrt,
                         grad_outputs=tuple(grad_outputs), recompute=recompute, recompute_d=recompute_d,
                         d_only=d_only, batched=gemm.batched)
    except NotDifferentiable:
        raise RecipeError(f"{where}: D does not depend differentiably on the accumulator (it reads it only "
                          "through comparisons, or not at all), so there is no backward GEMM to fuse") from None

    if recompute:
        ab: dict[str, Any] = {"a": gemm.a, "b": gemm.b, "layout_a": gemm.layout_a, "layout_b": gemm.layout_b,
                              "block_scale": gemm.declared_block_scale}
    else:
        dtype_a = as_dtype(a if a is not None else grad_default, "a (dtype of the backward GEMM's A: dL/dY)")
        ab = {"a": dtype_a, "b": as_dtype(b if b is not None else dtype_a, "b (dtype of the backward GEMM's B)"),
              "layout_a": as_layout(layout_a if layout_a is not None else Layout.ROW, "layout_a"),
              "layout_b": as_layout(layout_b if layout_b is not None else Layout.ROW, "layout_b"),
              "block_scale": block_scale}
    name = f"{recipe.name}_bwd{'_recompute' if recompute else ''}"
    kernel = Recipe(name, replay(derived.epilogue), d=grad_dtype, batched=gemm.batched, layout_d=gemm.layout_d,
                    grouped=gemm.grouped, operands=declarations(derived.epilogue.operands),
                    aux={o.name: o.dtype for o in derived.epilogue.outputs[1:]}, **ab)
    forward = _with_saved_acc(recipe, read_dtype) if derived.reads_saved_acc else recipe
    return Backward(forward, kernel, operand_gradients(recipe.ir, derived), recompute, derived.rest)


def _with_saved_acc(recipe: Recipe, dtype: DType) -> Recipe:
    """The recipe, also writing its accumulator as aux output `saved_acc` of `dtype`."""
    ir = recipe.ir.epilogue
    acc = next(i for i, n in enumerate(ir.nodes) if n.op is Op.ACC)
    saved = EpilogueIR(ir.nodes, (*ir.outputs, Output(SAVED_ACC, acc, dtype)), ir.operands)
    g = recipe.ir.gemm
    aux = {o.name: o.dtype for o in saved.outputs[1:]}
    return Recipe(recipe.name + "_train", replay(saved), a=g.a, b=g.b, d=g.d, layout_a=g.layout_a,
                  layout_b=g.layout_b, layout_d=g.layout_d, batched=g.batched, operands=declarations(ir.operands),
                  aux=aux, block_scale=g.declared_block_scale, config=recipe.config)

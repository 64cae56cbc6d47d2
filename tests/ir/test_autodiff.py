"""Derived backward epilogues (`Recipe.backward`, `ir.autodiff`) against torch.autograd.

The derived epilogue and the forward are evaluated in float64 by `_evaluate` (the op table's
formulas on float64 tensors), so that the forward values the backward recomputes are bit for bit
those autograd differentiates and a comparison or a cast decides the same way in both; the
gradients then agree up to the rules' constants, which are fp32 as in the kernel. torch.autograd
differentiates the forward as a user writes it in torch: a min or max against a constant is
torch.clamp (its bound inclusive), one of two values torch.minimum / torch.maximum (a tie splits
the gradient).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

import gemmgen as gg
from gemmgen.ir import EpilogueIR, Op, Reduction
from gemmgen.ir.autodiff import SAVED_ACC
from gemmgen.testing.random_recipes import random_recipe

#: The derivatives' constants are fp32 (as the kernel holds them), autograd's float64: a few of
#: them in a rule, each within 2^-24 of its value.
_RTOL = 1e-6
def _shape(o: gg.ir.Operand, m: int, n: int, lead: tuple[int, ...]) -> tuple[int, ...]:
    """An operand's shape: one per batch (`per_batch`) with the batch first; a matrix's always."""
    own = {gg.OperandKind.ROW: (n,), gg.OperandKind.COL: (m,), gg.OperandKind.SCALAR: (),
           gg.OperandKind.MATRIX: (m, n)}[o.kind]
    return (*lead, *own) if o.per_batch else own


def _broadcast(t: torch.Tensor, o: gg.ir.Operand) -> torch.Tensor:
    """Against (L, M, N): a row vector's values along N, a column vector's along M, a batch first."""
    batch = t.shape[:1] if o.per_batch and o.kind is not gg.OperandKind.MATRIX else ()
    if o.kind is gg.OperandKind.ROW:
        return t.reshape(*batch, 1, -1)
    if o.kind is gg.OperandKind.COL:
        return t.reshape(*batch, -1, 1)
    return t.reshape(*batch, 1, 1) if batch else t


def _evaluate(ir: EpilogueIR, acc: torch.Tensor, operands: dict[str, torch.Tensor], as_torch: bool = False
              ) -> dict[str, torch.Tensor]:
    """Every output of `ir` in float64, unrounded; with `as_torch`, min/max against a constant as
    torch.clamp, and operands expanded to D's shape first: a cast rounds each element's gradient,
    as the kernel does (torch, casting a vector before it broadcasts, rounds the summed one)."""
    values: list[torch.Tensor] = []
    for node in ir.nodes:
        if node.op is Op.ACC:
            v = acc
        elif node.op is Op.CONST:
            v = torch.tensor(node.attr, dtype=torch.float64)
        elif node.op is Op.INPUT:
            assert node.name is not None
            operand = ir.operand(node.name)
            v = _broadcast(operands[node.name], operand)
            # every value per element of D, as the kernel computes it (see `cast`'s rule); over column
            # pairs a vector or scalar stays broadcast (it meets values of either width)
            if as_torch and (not ir.pairs or operand.kind in (gg.OperandKind.MATRIX, gg.OperandKind.ROW)):
                v = v.expand(*acc.shape[:-1], operand.columns.extent(acc.shape[-1]))
        else:
            args = [values[a] for a in node.args]
            consts = [ir.nodes[a].op is Op.CONST for a in node.args]
            if as_torch and node.op in (Op.MIN, Op.MAX) and any(consts):
                x, c = (args[1], ir.nodes[node.args[0]].attr) if consts[0] else (args[0], ir.nodes[node.args[1]].attr)
                v = x.clamp(max=c) if node.op is Op.MIN else x.clamp(min=c)
            else:
                v = node.op.apply(tuple(args), node.attr, node.dtype)
        values.append(v.double())
    out = {}
    for o in ir.outputs:
        v = values[o.node].expand(*acc.shape[:-1], o.columns.extent(acc.shape[-1]))
        if o.reduce is not None and o.reduce is not Reduction.SUM:
            continue  # a forward's statistics: no gradient flows from them
        if o.reduce is not None:  # over the batches too with over_batch (a shared operand's gradient)
            v = v.sum(dim=((-3,) if o.over_batch else ()) + ((-2, -1) if o.dim is None else (o.dim - 2,)))
        out[o.name] = v
    return out


def _random(shape: tuple[int, ...], dtype: gg.DType, rng: torch.Generator) -> torch.Tensor:
    """Values exactly representable in `dtype`, as the kernel would read them."""
    return (torch.randn(shape, generator=rng, dtype=torch.float64) * 1.5).to(dtype.torch).double()


def _check_backward(recipe: gg.Recipe, backward: gg.Backward, m: int, n: int, rng: torch.Generator,
                    grad_outputs: tuple[str, ...] = ("d",), what: str = "", wrt: list[str] | None = None) -> int:
    """Every gradient `backward` gives (in its kernel, in its rest, or zero) equals torch.autograd's
    of `recipe`'s forward at fresh random inputs. Returns how many non-zero operand gradients it
    compared."""
    fwd = recipe.ir.epilogue
    lead = (2,) if recipe.ir.gemm.batched else ()
    saved_dtype = next((o.dtype for o in backward.kernel.operands if o.name == SAVED_ACC), gg.bf16)
    acc = _random((*lead, m, n), saved_dtype, rng).requires_grad_()
    ops = {o.name: _random(_shape(o, m, o.columns.extent(n), lead), o.dtype, rng).requires_grad_()
           for o in fwd.operands}
    outs = _evaluate(fwd, acc, ops, as_torch=True)
    grads = {name: torch.randn(outs[name].shape, generator=rng, dtype=torch.float64) for name in grad_outputs}
    grads = {k: v.to(gg.bf16.torch).double() for k, v in grads.items()}  # as the operands hold them
    loss = torch.stack([(outs[k] * g).sum() for k, g in grads.items()]).sum()
    want = torch.autograd.grad(loss, [acc, *ops.values()], allow_unused=True)
    want_acc, want_ops = want[0], dict(zip(ops, want[1:], strict=True))

    inputs = {k: v.detach() for k, v in ops.items()}
    inputs.update({f"grad_{k}": g for k, g in grads.items() if k != "d" or backward.recompute})
    if not backward.recompute:
        inputs[SAVED_ACC] = acc.detach()
    kernel_acc = acc.detach() if backward.recompute else grads["d"]  # the backward GEMM's product
    got = _evaluate(backward.kernel.ir.epilogue, kernel_acc, inputs)

    # The derived epilogue's constants are fp32 (as the kernel holds them; gelu's derivative has
    # 1/sqrt(2) and 1/sqrt(2 pi) to 2^-24), which moves a gradient by about 2^-24 of its terms'
    # magnitude, g's times O(1): near a derivative's zero (gelu's, at x = -0.7518) that is more
    # than _RTOL of the result, so each comparison also allows 2^-20 of the incoming gradient.
    g_scale = max((g.abs().max().item() for g in grads.values() if g.numel()), default=0.0)

    def close(x: torch.Tensor, y: torch.Tensor | None, name: str) -> None:
        y = torch.zeros_like(x) if y is None else y
        assert x.shape == y.shape, (what, name, x.shape, y.shape)
        scale = y.abs().max().item() if y.numel() else 0.0
        atol = _RTOL * scale + 2**-20 * g_scale + 1e-300
        assert torch.allclose(x, y, rtol=_RTOL, atol=atol, equal_nan=True), \
            f"{what} {name}: max error {(x - y).abs().max().item():.3g}, scale {scale:.3g}\n{recipe.ir.epilogue}"

    close(got["d"], want_acc, "dL/dacc")
    rest = _rest_gradients(backward, kernel_acc, inputs) if backward.rest is not None else {}
    compared = 0
    seen = set()
    for grad in backward.gradients:
        seen.add(grad.operand)
        compared += grad.output is not None
        if grad.output is None:  # nothing reaches it
            close(torch.zeros_like(ops[grad.operand]), want_ops[grad.operand], f"zero {grad.operand}")
        elif grad.reason:
            close(rest[grad.operand], want_ops[grad.operand], f"rest {grad.operand}")
        else:
            value = got[grad.output]
            close(value.sum(grad.sum_dims) if grad.sum_dims else value, want_ops[grad.operand], grad.output)
    assert seen == set(ops if wrt is None else wrt), (what, seen, wrt)
    if any(o.name == "fwd_d" for o in backward.kernel.outputs):
        close(got["fwd_d"], outs["d"].detach(), "fwd_d")
    return compared


def _rest_gradients(backward: gg.Backward, acc: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
    """`Backward.rest` in float64 (what `Backward.rest_gradients` computes in fp32)."""
    assert backward.rest is not None
    values = _evaluate(backward.rest, acc, inputs)
    return {g.operand: values[g.output].sum(g.sum_dims) if g.sum_dims else values[g.output]
            for g in backward.gradients if g.reason and g.output is not None}


def test_the_derived_backward_is_autograd_of_the_forward_on_random_recipes():
    """At least 200 random recipes (every op, operand kind and dtype, casts, aux outputs, batched):
    dL/dacc and every operand's gradient equal torch.autograd's, with random choices of the
    operands asked for, aux outputs receiving a gradient, the accumulator saved or recomputed,
    and D recomputed."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    checked = draws = operand_gradients = 0
    while checked < 200:
        draws += 1
        assert draws < 2000, f"seed {seed}: only {checked} of {draws} random recipes had a backward"
        try:
            recipe = random_recipe(rng, draws)
        except gg.RecipeError:
            continue
        names = [o.name for o in recipe.ir.epilogue.operands]
        wrt = None if rng.random() < 0.7 else rng.sample(names, rng.randint(0, len(names)))
        aux = [o.name for o in recipe.outputs[1:] if o.reduce is None]
        grad_outputs = ("d", *[a for a in aux if rng.random() < 0.5])
        try:
            backward = recipe.backward(wrt=wrt, grad_outputs=grad_outputs, recompute=rng.random() < 0.3,
                                       recompute_d=rng.random() < 0.3)
        except gg.RecipeError as e:
            assert "does not depend differentiably" in str(e), e
            continue
        m, n = rng.randint(1, 9), rng.randint(1, 9)
        operand_gradients += _check_backward(recipe, backward, m, n, gen, grad_outputs, f"seed {seed} recipe {draws}",
                                             wrt)
        checked += 1
    assert operand_gradients >= 25, f"seed {seed}: only {operand_gradients} operand gradients compared"


def _unary(fn, **kw) -> gg.Recipe:
    return gg.Recipe("u", lambda acc: fn(acc), **kw)


#: Each op against the torch function a user would write, at random points and the special ones
#: (0, ties with a bound): torch's own autograd, not the op table's formula.
_UNARY = [
    (gg.relu, torch.relu), (gg.gelu, F.gelu), (lambda x: gg.gelu_tanh(x), lambda x: F.gelu(x, approximate="tanh")),
    (gg.silu, F.silu), (gg.sigmoid, torch.sigmoid), (gg.tanh, torch.tanh), (gg.exp, torch.exp),
    (gg.erf, torch.erf), (gg.sin, torch.sin), (gg.cos, torch.cos), (gg.abs, torch.abs), (lambda x: -x, torch.neg),
    (lambda x: gg.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
    (lambda x: gg.clamp(x, -1.0, 1.0), lambda x: x.clamp(-1.0, 1.0)),
    (lambda x: gg.max(x, 0.5), lambda x: x.clamp(min=0.5)), (lambda x: gg.min(x, 0.5), lambda x: x.clamp(max=0.5)),
    (lambda x: gg.cast(x, gg.bf16), lambda x: x.to(torch.bfloat16).double()),
    (lambda x: gg.cast(x, gg.e4m3) * 1.0, lambda x: x.clamp(-448, 448).to(torch.float8_e4m3fn).double()),
    (lambda x: gg.where(x > 0.25, x * x, 3.0 * x), lambda x: torch.where(x > 0.25, x * x, 3.0 * x)),
    (lambda x: x / (1.5 + gg.abs(x)), lambda x: x / (1.5 + x.abs())),
]


@pytest.mark.parametrize("index", range(len(_UNARY)))
def test_each_op_has_torchs_derivative_at_every_point(index):
    ours, theirs = _UNARY[index]
    backward = _unary(ours).backward(d=gg.f32, saved=gg.f32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 0.25, 448.0, 600.0, -600.0, 3.0], dtype=torch.float64)
    x = torch.cat([special, torch.randn(200, dtype=torch.float64) * 3]).reshape(2, -1)
    g = torch.randn(x.shape, dtype=torch.float64)
    ref = x.clone().requires_grad_()
    theirs(ref).backward(g)  # in float64, as `_evaluate`: the rules' fp32 constants are the difference
    ops = {SAVED_ACC: x} if backward.saves_accumulator else {}
    got = _evaluate(backward.kernel.ir.epilogue, g, ops)["d"]
    assert ref.grad is not None
    torch.testing.assert_close(got, ref.grad, rtol=_RTOL, atol=_RTOL * ref.grad.abs().max().item())


@pytest.mark.parametrize(("ours", "theirs"), [(gg.min, torch.minimum), (gg.max, torch.maximum)])
def test_min_and_max_of_two_values_split_a_tie_as_torch_does(ours, theirs):
    recipe = gg.Recipe("mm", lambda acc, y: ours(acc, y), d=gg.f32, operands={"y": gg.Matrix(gg.f32)})
    backward = recipe.backward(d=gg.f32, saved=gg.f32)
    x = torch.tensor([[1.0, 2.0, 3.0, -1.0]])
    y = torch.tensor([[1.0, 1.0, 4.0, -1.0]])  # ties at 0 and 3
    g = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    theirs(xr, yr).backward(g)
    got = _evaluate(backward.kernel.ir.epilogue, g.double(), {SAVED_ACC: x.double(), "y": y.double()})
    torch.testing.assert_close(got["d"].float(), xr.grad)
    torch.testing.assert_close(got["grad_y"].float(), yr.grad)


def test_every_op_of_the_table_has_a_rule():
    missing = [op for op in Op if not op.is_leaf and op.derivative is None]
    assert missing == []


def test_every_example_has_a_backward(examples):
    """Each example recipe's backward, saving or recomputing its accumulator, checked against
    autograd (a grouped one's recomputes, and leaves its operands' gradients to torch; one over
    column pairs recomputes); one with row blocks has none (tests/runtime/test_row_blocks.py)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for name, recipe in examples.items():
        if recipe.ir.epilogue.row_blocks is not None:
            continue
        backward = recipe.backward()
        recomputes = recipe.ir.gemm.grouped
        assert backward.kernel.name == f"{recipe.name}_bwd" + ("_recompute" if recomputes else "")
        if recipe.ir.gemm.grouped:
            assert backward.recompute and backward.forward is recipe
            assert all(g.reason for g in backward.gradients), name
            continue
        for recompute in (False, True):
            backward = recipe.backward(recompute=recompute)
            n = 6 if recipe.ir.epilogue.pairs else 5  # whole pairs
            _check_backward(recipe, backward, 7, n, gen, what=f"{name} recompute={recompute}")
            reads = backward.saves_accumulator
            assert (backward.forward is not recipe) == reads and not (recompute and reads), name
            if reads:
                assert backward.forward.outputs[-1].name == SAVED_ACC


def test_bias_gelu_backward_fuses_dgelu_and_the_bias_gradient(examples):
    """What the issue names: d(GELU) from the saved pre-activation and the bias gradient in the
    dgrad GEMM's epilogue, checked through the public fp32 reference: A = dL/dY, B = the next
    layer's weight (row-major), so the accumulator is dL/dD."""
    backward = examples["bias_gelu"].backward()
    kernel = backward.kernel
    assert [o.name for o in kernel.outputs] == ["d", "grad_bias"]
    assert kernel.ir.gemm.layout_b is gg.RowMajor
    # the bias gradient, a sum over M: over the kernel's M on sm_90a, a swapped kernel's N on sm_100a
    assert not kernel.default_config().swap_ab and kernel.default_config(gg.Arch.SM100A).swap_ab
    m, n, k = 33, 24, 40
    dy, w = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
    saved, bias = torch.randn(m, n).bfloat16(), torch.randn(n).bfloat16()
    d, grad_bias = kernel.reference(dy, w, saved_acc=saved, bias=bias)
    pre = (saved.double() + bias.double()).requires_grad_()
    g = dy.double() @ w.double()
    F.gelu(pre).backward(g)
    want = pre.grad
    assert want is not None
    torch.testing.assert_close(d.double(), want, rtol=2**-8, atol=1e-5 * want.abs().max().item())  # bf16 D
    torch.testing.assert_close(grad_bias.double(), want.sum(0), rtol=0, atol=1e-5 * want.abs().sum(0).max().item())


def test_rest_gradients_of_a_grouped_recipe_follow_each_groups_rows(examples):
    """moe_up's operand gradients, which its grouped kernel cannot write: per group's bias row, per
    token's routing weight, from dL/dD and the recomputed accumulator."""
    backward = examples["moe_up"].backward()
    assert backward.recompute  # its accumulator is the kernel's: materialized here
    t, n, groups = 11, 6, 3
    offsets = torch.tensor([4, 4, 9])  # an empty group; rows 9 and 10 belong to none
    acc = torch.randn(t, n).bfloat16().float()
    bias, weight = torch.randn(groups, n).bfloat16().float(), torch.randn(t).float()
    g = torch.randn(t, n)
    grads = backward.rest_gradients(acc, {"grad_d": g, "bias": bias, "weight": weight}, offsets)
    b, w = bias.clone().requires_grad_(), weight.clone().requires_grad_()
    rows = torch.tensor([0] * 4 + [2] * 5)
    y = F.silu(acc[:9] + b[rows]) * w[:9, None]
    y.backward(g[:9])
    assert b.grad is not None and w.grad is not None
    torch.testing.assert_close(grads["bias"], b.grad)
    torch.testing.assert_close(grads["weight"][:9], w.grad[:9])
    assert (grads["weight"][9:] == 0).all()


def test_misuse_names_the_fix(examples):
    bias_gelu = examples["bias_gelu"]
    with pytest.raises(gg.RecipeError, match=r"'scale' is not an operand.*choose from \['bias'\]"):
        bias_gelu.backward(wrt=["scale"])
    with pytest.raises(gg.RecipeError, match=r"'amax_d' is not an M x N output.*\['d', 'pre_act'\]"):
        examples["bias_gelu_aux"].backward(grad_outputs=("d", "amax_d"))
    with pytest.raises(gg.RecipeError, match="does not depend differentiably"):
        gg.Recipe("gt", lambda acc, y: (acc > 0) * y, operands={"y": gg.Matrix(gg.bf16)}).backward()
    with pytest.raises(gg.RecipeError, match=r"'saved_acc' names what the backward reads.*rename"):
        gg.Recipe("s", lambda acc, saved_acc: acc * saved_acc,
                  operands={"saved_acc": gg.Matrix(gg.bf16)}).backward()
    with pytest.raises(gg.RecipeError, match="recompute_d=True asks a grouped GEMM"):
        examples["moe_up"].backward(recompute_d=True)


def test_recompute_runs_the_forwards_gemm_again_reading_the_incoming_gradient(examples):
    recipe = examples["bias_silu_residual"]
    backward = recipe.backward(recompute=True)
    assert backward.forward is recipe  # nothing more is saved
    kernel = backward.kernel
    g = recipe.ir.gemm
    assert (kernel.ir.gemm.a, kernel.ir.gemm.layout_a, kernel.ir.gemm.layout_b) == (g.a, g.layout_a, g.layout_b)
    assert [o.name for o in kernel.operands] == ["bias", "grad_d"]
    assert [o.name for o in kernel.outputs] == ["d", "grad_bias", "grad_residual"]
    with pytest.raises(gg.RecipeError, match=r"layout_b= describes the next layer's GEMM.*leave it out"):
        recipe.backward(recompute=True, layout_b=gg.ColMajor)
    m, n, k = 9, 24, 40
    a, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16().t()
    bias, residual, grad_d = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16(), torch.randn(m, n).bfloat16()
    d_acc, grad_bias, grad_residual = kernel.reference(a, b, bias=bias, grad_d=grad_d)
    acc = (a.double() @ b.double()).requires_grad_()
    (F.silu(acc + bias.double()) + residual.double()).backward(grad_d.double())
    want = acc.grad
    assert want is not None
    torch.testing.assert_close(d_acc.double(), want, rtol=2**-8, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(grad_bias.double(), want.sum(0), rtol=0, atol=1e-5 * want.abs().sum(0).max().item())
    assert torch.equal(grad_residual, grad_d)  # D's gradient, unchanged


def test_describe_says_where_each_gradient_is(examples):
    text = examples["quick_gelu_scaled"].backward().describe()
    assert "grad_bias: dL/dbias (sum over M)" in text
    assert "scale: not in the kernel, computed with torch" in text
    assert "saved_acc: written by quick_gelu_scaled_train" in text


def _pairs_recipes() -> list[gg.Recipe]:
    def gated(act):
        def epilogue(acc, bias, scale, residual):
            gate, up = gg.pairs(acc + bias)
            return act(gate) * up * scale + residual
        return epilogue

    def rotary(acc, cos, sin):
        x, y = gg.pairs(acc)
        return gg.interleave(x * cos - y * sin, x * sin + y * cos)

    operands: dict[str, gg.dsl.OperandDecl] = {"bias": gg.RowVector(gg.bf16), "scale": gg.ColVector(gg.f32),
                                               "residual": gg.Matrix(gg.bf16)}
    return [*(gg.Recipe(f"gated_{act.__name__}", gated(act), operands=operands)
              for act in (gg.silu, gg.gelu, gg.gelu_tanh, gg.relu)),
            gg.Recipe("rotary", rotary, operands={"cos": gg.Matrix(gg.f32), "sin": gg.Matrix(gg.f32)}),
            gg.Recipe("glu_stats", lambda acc: {"d": gg.sigmoid(gg.pairs(acc)[0]) * gg.pairs(acc)[1],
                                                "keep": gg.interleave(gg.pairs(acc)[1], 0.0)},
                      aux={"keep": gg.bf16})]


def test_backward_over_column_pairs_matches_autograd():
    """Gated activations (SwiGLU, GEGLU, ReGLU) with a bias before the pairs, a per-row scale and
    an N/2-column residual after; a rotary rotation; an aux output receiving a gradient. The
    backward reads the saved accumulator (2N columns of its GEMM's N) as its pairs' halves, or
    with a bias before the pairs recomputes (the forward's GEMM again, dL/dD read at N/2 columns);
    either way, saved or recomputed, against autograd; the bias gradient, a sum over M, is left
    to torch (`Backward.rest`)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for recipe in _pairs_recipes():
        outputs = tuple(o.name for o in recipe.outputs if o.reduce is None)
        saving = recipe.backward(grad_outputs=outputs)
        assert saving.recompute == any(o.name == "bias" for o in recipe.ir.epilogue.operands), recipe.name
        for backward in (saving, recipe.backward(grad_outputs=outputs, recompute=True)):
            compared = _check_backward(recipe, backward, 7, 10, gen, grad_outputs=outputs, what=recipe.name)
            assert compared == len(recipe.ir.epilogue.operands), recipe.name
        reasons = {g.operand: g.reason for g in backward.gradients}
        assert "never swapped" in reasons.get("bias", "never swapped"), reasons

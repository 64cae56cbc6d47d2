"""The DSL and IR: tracing, normalization, content keys, and the errors a user meets."""

from __future__ import annotations

import math
import re

import pytest
import torch

import gemmgen as gg
from gemmgen.ir import Op


def _bias_recipe(fn, **kw):
    return gg.Recipe("r", fn, operands={"bias": gg.RowVector(gg.bf16)}, **kw)


def test_trace_records_graph():
    r = _bias_recipe(lambda acc, bias: gg.gelu(acc + bias))
    ops = [n.op for n in r.ir.epilogue.nodes]
    assert ops.count(Op.GELU) == 1 and ops.count(Op.ADD) == 1 and ops.count(Op.ACC) == 1
    assert [o.name for o in r.outputs] == ["d"]
    assert r.operands[0].kind is gg.OperandKind.ROW


def test_same_math_same_key():
    a = _bias_recipe(lambda acc, bias: gg.gelu(acc + bias))
    b = _bias_recipe(lambda acc, bias: gg.gelu(bias + acc))
    c = gg.Recipe("other_name", lambda acc, bias: gg.gelu((bias + acc) * 1.0 * 1.0 + 0.0 * 0.0 + 0.0),
                  operands={"bias": gg.RowVector(gg.bf16)})
    assert a.key == b.key
    assert a.ir.epilogue == b.ir.epilogue
    # constants fold (1.0 * 1.0 -> 1.0) but x * 1.0 is kept: the key is about the math as written
    assert c.key != a.key


def test_common_subexpressions_merge_and_dead_nodes_drop():
    def f(acc, bias):
        x = acc + bias
        y = bias + acc  # same as x
        _dead = gg.exp(acc) * 3.0
        return x * gg.sigmoid(y)

    r = _bias_recipe(f)
    ops = [n.op for n in r.ir.epilogue.nodes]
    assert ops.count(Op.ADD) == 1
    assert Op.EXP not in ops
    g = _bias_recipe(lambda acc, bias: (acc + bias) * gg.sigmoid(acc + bias))
    assert g.key == r.key


def test_constant_folding_in_fp32():
    r = gg.Recipe("r", lambda acc: acc * (gg.exp(0.0) + 2.0) - gg.tanh(0.0))
    consts = [n.attr for n in r.ir.epilogue.nodes if n.op is Op.CONST]
    assert consts == [3.0, 0.0]


def test_constants_past_fp32_range_are_infinities_as_in_torch():
    """A constant rounds to fp32 as torch rounds it (the reference's semantics): past the range
    it is an infinity, not a Python OverflowError at declaration."""
    r = gg.Recipe("r", lambda acc: gg.min(acc * 1e39, 5.0) - 2.0**200)
    consts = [n.attr for n in r.ir.epilogue.nodes if n.op is Op.CONST]
    assert sorted(c for c in consts if c is not None) == [5.0, math.inf] and len(consts) == 2  # one inf node (CSE)
    assert all(torch.tensor(x, dtype=torch.float32).item() == gg.ir.f32(x) for x in (1e39, -1e39, 3.4028235e38, 0.1))


def test_deep_epilogues_normalize_without_recursion_limits():
    """The IR walks its graph with an explicit stack: a 1,500-deep chain (Python's default recursion
    limit is 1,000) normalizes, renders and evaluates."""
    from gemmgen.codegen import render_kernel

    def chain(acc):
        x = acc
        for i in range(1500):
            x = x * (1.0 + i / 4096) + 0.5
        return x

    r = gg.Recipe("deep", chain)
    assert len(r.ir.epilogue.nodes) > 3000
    assert render_kernel(r.ir, r.default_config()).source
    a, b = torch.randn(3, 8), torch.randn(8, 5)
    assert r.reference(a.bfloat16(), b.bfloat16()).shape == (3, 5)


def test_compile_time_scalar_is_a_constant():
    r = gg.Recipe("r", lambda acc, k: acc * k, operands={"k": gg.Scalar(value=0.25)})
    assert r.operands == ()
    assert any(n.op is Op.CONST and n.attr == 0.25 for n in r.ir.epilogue.nodes)


def test_value_used_twice_and_aux():
    r = _bias_recipe(lambda acc, bias: {"d": gg.silu(acc + bias), "pre": acc + bias}, aux={"pre": gg.f32})
    assert [(o.name, o.dtype) for o in r.outputs] == [("d", gg.bf16), ("pre", gg.f32)]


@pytest.mark.parametrize("variant", [
    dict(a=gg.f16, b=gg.f16),
    dict(d=gg.f32),
    dict(layout_a=gg.ColMajor),
    dict(layout_b=gg.RowMajor),
    dict(batched=True),
])
def test_every_gemm_field_changes_the_key(variant):
    base = _bias_recipe(lambda acc, bias: acc + bias)
    assert _bias_recipe(lambda acc, bias: acc + bias, **variant).key != base.key


def test_every_epilogue_field_changes_the_key():
    keys = {
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.RowVector(gg.bf16)}).key,
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.RowVector(gg.f16)}).key,
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.ColVector(gg.bf16)}).key,
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.Matrix(gg.bf16)}).key,
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.Scalar()}).key,
        gg.Recipe("r", lambda acc, y: acc + y, operands={"y": gg.Scalar()}).key,
        gg.Recipe("r", lambda acc, x: acc - x, operands={"x": gg.Scalar()}).key,
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.Scalar(value=1.0)}).key,
        gg.Recipe("r", lambda acc, x: acc + x, operands={"x": gg.Scalar(value=2.0)}).key,
        gg.Recipe("r", lambda acc: gg.leaky_relu(acc, 0.1)).key,
        gg.Recipe("r", lambda acc: gg.leaky_relu(acc, 0.2)).key,
        gg.Recipe("r", lambda acc: gg.cast(acc, gg.bf16)).key,
        gg.Recipe("r", lambda acc: gg.cast(acc, gg.f16)).key,
        gg.Recipe("r", lambda acc: {"d": acc, "t": acc}, aux={"t": gg.bf16}).key,
        gg.Recipe("r", lambda acc: {"d": acc, "t": acc}, aux={"t": gg.f32}).key,
        gg.Recipe("r", lambda acc: {"d": acc, "u": acc}, aux={"u": gg.f32}).key,
    }
    assert len(keys) == 16


# ----------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize("build, match", [
    (lambda: gg.Recipe("r", lambda acc: gg.softplus(acc)), r"gemmgen has no op or name 'softplus'.*gelu"),
    (lambda: gg.Recipe("r", lambda acc: acc.sqrt()), r"no method 'sqrt'"),
    (lambda: gg.Recipe("r", lambda acc: torch.relu(acc)), r"torch\.relu is not traceable.*gemmgen op"),
    (lambda: gg.Recipe("r", lambda acc: acc ** 2), r"operator '\*\*'.*x \* x"),
    (lambda: gg.Recipe("r", lambda acc: acc if acc > 0 else -acc), r"truth test.*gg.where\(cond, x, y\)"),
    (lambda: gg.Recipe("r", lambda acc: gg.where(acc == 0, acc, 1.0)), r"'==' / '!='.*gg.eq\(x, y\)"),
    (lambda: gg.Recipe("r", lambda acc, bias: acc + bias), r"parameter 'bias' has no declaration.*operands="),
    (lambda: gg.Recipe("r", lambda acc: acc, operands={"bias": gg.RowVector(gg.bf16)}),
     r"operand 'bias' is declared but is not a parameter"),
    (lambda: gg.Recipe("r", lambda acc, bias: acc, operands={"bias": gg.RowVector(gg.bf16)}),
     r"operand 'bias' is declared but no output depends on it"),
    (lambda: gg.Recipe("r", lambda acc, bias: acc + bias, operands={"bias": gg.bf16}),  # type: ignore[dict-item]
     r"operand 'bias': expected gg.Scalar\(\), gg.RowVector"),
    (lambda: gg.Recipe("r", lambda acc, s: acc * s, operands={"s": gg.Scalar(dtype=gg.bf16)}),
     r"operand 's': runtime scalars are fp32"),
    (lambda: gg.Recipe("r", lambda acc, s: gg.leaky_relu(acc, s), operands={"s": gg.Scalar()}),
     r"leaky_relu slope: expected a compile-time constant"),
    (lambda: gg.Recipe("r", lambda acc: {"d": acc}, aux={"pre": gg.bf16}), r"aux output 'pre'.*never written"),
    (lambda: gg.Recipe("r", lambda acc: {"d": acc, "pre": acc}), r"output 'pre' that is not declared.*aux="),
    (lambda: gg.Recipe("r", lambda acc: {"pre": acc}, aux={"pre": gg.bf16}), r"no 'd' entry"),
    (lambda: gg.Recipe("r", lambda acc: 3.0), r"output 'd' is a constant"),
    (lambda: gg.Recipe("r", lambda acc: acc * 0.0 + gg.exp(1.0) - acc * 0.0 - acc * 0.0), None),
    (lambda: gg.Recipe("r", lambda acc: acc + torch.ones(3)), r"(not traceable|tensors are passed at call time)"),
    (lambda: gg.Recipe("r", a=gg.e4m3, b=gg.e4m3, layout_b=gg.RowMajor),
     r"fp8 WGMMA reads A and B K-major only.*layout_a=RowMajor and layout_b=ColMajor \(got row/row\)"),
    (lambda: gg.Recipe("r", a=gg.e5m2, b=gg.e4m3, layout_a=gg.ColMajor), r"K-major only.*\(got col/col\)"),
    (lambda: gg.Recipe("r", aux={"q": gg.e4m3}), r"aux output 'q' is declared but never written"),
    (lambda: gg.Recipe("r", a=gg.e4m3, b=gg.bf16), r"mixed input types \(e4m3 x bf16\).*both fp8"),
    (lambda: gg.Recipe("r", a=gg.bf16, b=gg.f16), r"mixed input types \(bf16 x f16\)"),
    (lambda: gg.Recipe("r", a=gg.f32, b=gg.f32), r"a: A and B may be bf16, f16, e4m3, e5m2 or e2m1 \(NVFP4\), not f32"),
    (lambda: gg.Recipe("r", layout_a="diagonal"), r"layout_a: expected gemmgen.RowMajor or gemmgen.ColMajor"),
    (lambda: gg.Recipe("r", d="int8"), r"d \(dtype of D\): expected a gemmgen dtype"),
    (lambda: gg.Recipe("bad name"), r"name: expected a C identifier"),
    (lambda: gg.Recipe("r", lambda acc: gg.cast(acc, gg.e4m3)), None),
    (lambda: gg.Recipe("r", lambda acc: gg.cast(acc, "int8")), r"cast dtype: expected a gemmgen dtype"),
])
def test_mistakes_raise_named_errors(build, match):
    if match is None:  # a valid recipe in this list guards against over-eager errors
        build()
        return
    with pytest.raises(gg.RecipeError, match=match):
        build()


@pytest.mark.parametrize("epilogue, d", [
    (lambda acc: {"d": acc, "extra": gg.amax(acc)}, None),
    (lambda acc: {"d": acc, "extra": gg.sum(acc, dim=1)}, None),
    (lambda acc: {"d": acc, "extra": gg.reduce_min(acc, dim=0)}, None),
    (lambda acc: {"d": acc, "extra": gg.relu(acc)}, None),
    (lambda acc: dict(zip(("d", "extra"), gg.quantize(acc), strict=True)), gg.e4m3),
    (lambda acc: dict(zip(("d", "extra"), gg.rms_norm(acc, 128), strict=True)), None),
])
def test_an_undeclared_outputs_suggested_declaration_works_when_applied(epilogue, d):
    """The fix for an output the recipe does not declare is the declaration it needs: gg.f32 for a
    reduction or a block's factors (a suggested gg.bf16 there was itself refused), as written."""
    kw = {"d": d} if d is not None else {}
    with pytest.raises(gg.RecipeError, match="not declared") as e:
        gg.Recipe("r", epilogue, **kw)
    fix = re.search(r"declare it with aux=(\{.*\})$", str(e.value))
    assert fix, str(e.value)
    r = gg.Recipe("r", epilogue, aux=eval(fix.group(1), {"gg": gg}), **kw)
    assert [o.name for o in r.outputs] == ["d", "extra"]


def test_a_recipes_repr_shows_what_a_user_needs():
    """Name, A x B -> D with layouts, what the call takes, what it returns, and the config."""
    config = gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.PINGPONG)
    r = gg.Recipe("bias_gelu_aux", lambda acc, bias: {"d": gg.gelu(acc + bias), "pre": acc + bias,
                                                       "amax_d": gg.amax(gg.gelu(acc + bias))},
                  operands={"bias": gg.RowVector(gg.bf16)}, aux={"pre": gg.bf16, "amax_d": gg.f32},
                  layout_a=gg.ColMajor, config=config)
    assert repr(r) == ("Recipe('bias_gelu_aux', bf16 col x bf16 col -> bf16 row, operands={bias: RowVector(bf16)}, "
                       "outputs={d: bf16, pre: bf16, amax_d: f32 amax}, config=128x128x64_c1x1x1_pingpong_auto)")
    moe = gg.Recipe("moe", lambda acc, w: {"d": acc * w, "rows": gg.sum(acc, dim=1)},
                    operands={"w": gg.ColVector(gg.f32)}, aux={"rows": gg.f32}, a=gg.e4m3, b=gg.e4m3, batched=True,
                    block_scale=gg.DEEPSEEK_BLOCK_SCALE)
    assert repr(moe) == ("Recipe('moe', batched, e4m3 row x e4m3 col -> bf16 row, block_scale=(1, 128, 128), "
                         "operands={w: ColVector(f32)}, outputs={d: bf16, rows: f32 sum(dim=1)}, "
                         "config=None (per shape))")


def test_fp8_inputs_default_to_bf16_output_and_may_mix():
    r = gg.Recipe("r", a=gg.e4m3, b=gg.e5m2)
    assert (r.gemm.a, r.gemm.b, r.gemm.d) == (gg.e4m3, gg.e5m2, gg.bf16)
    assert gg.Recipe("r", a=gg.e4m3, b=gg.e4m3, d=gg.f32).gemm.d is gg.f32
    assert gg.Recipe("r", a=gg.f16, b=gg.f16).gemm.d is gg.f16  # 16-bit inputs: D defaults to A's type
    assert gg.Recipe("r", d=gg.e5m2).gemm.d is gg.e5m2  # fp8 outputs, from any inputs
    a = torch.randn(5, 32).to(torch.float8_e4m3fn)
    b = torch.randn(9, 32).to(torch.float8_e5m2).t()
    torch.testing.assert_close(r.reference(a, b), (a.float() @ b.float()).bfloat16(), rtol=0, atol=0)


def test_ops_outside_a_trace_are_rejected():
    with pytest.raises(gg.RecipeError, match="inside an epilogue"):
        gg.gelu(1.0)


def test_values_do_not_leak_between_traces():
    leaked = []

    def leak(acc):
        leaked.append(acc)
        return acc

    gg.Recipe("r", leak)
    with pytest.raises(gg.RecipeError, match=r"another .* trace"):
        gg.Recipe("r2", lambda acc: acc + leaked[0])


def test_reference_checks_operand_names():
    r = _bias_recipe(lambda acc, bias: acc + bias)
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    with pytest.raises(gg.RecipeError, match="missing operand"):
        r.reference(a, b)
    with pytest.raises(gg.RecipeError, match="unknown operand"):
        r.reference(a, b, bias=torch.randn(16), beta=1.0)


# ----------------------------------------------------------------------------- reductions


def _reducing(reduced, **kw):
    return gg.Recipe("r", lambda acc: {"d": acc, "r": reduced(acc)}, aux={"r": gg.f32}, **kw)


def test_reductions_record_their_dim_as_torch_numbers_a_matrix():
    """dim 0 is over M (a value per column of D), 1 over N (per row); -2 and -1 name the same."""
    for reduced, kind, dim in ((lambda x: gg.sum(x, dim=0), "sum", 0), (lambda x: gg.sum(x, -2), "sum", 0),
                               (lambda x: gg.sum(x, dim=1), "sum", 1), (lambda x: gg.amax(x, dim=-1), "amax", 1),
                               (lambda x: gg.amax(x), "amax", None)):
        out = _reducing(reduced).outputs[1]
        assert (out.reduce.value, out.dim) == (kind, dim)
    keys = {_reducing(f).key for f in (lambda x: gg.sum(x, 1), lambda x: gg.sum(x, 0), lambda x: gg.amax(x, 0),
                                       lambda x: gg.amax(x, 1), lambda x: gg.amax(x))}
    assert len(keys) == 5
    # an amax over M and N keeps the key it had before reductions took a dim
    assert _reducing(lambda x: gg.amax(x)).ir.canonical()["outputs"][1] == ["r", 0, "f32", "amax"]
    seen: list[gg.dsl.Reduced] = []

    def keep(x: gg.Value) -> gg.dsl.Reduced:
        seen.append(gg.sum(x, 1))
        return seen[-1]

    _reducing(keep)
    assert repr(seen[0]) == "gemmgen.sum(<gemmgen traced value #0>, dim=1)"


@pytest.mark.parametrize("build, match", [
    (lambda: _reducing(lambda x: gg.sum(x)), r"missing 1 required positional argument: 'dim'"),  # type: ignore[call-arg]
    (lambda: _reducing(lambda x: gg.sum(x, dim=None)), r"sum: dim=None; expected 0 \(over M.*1 or -1"),  # type: ignore[arg-type]
    (lambda: _reducing(lambda x: gg.amax(x, dim=2)), r"amax: dim=2; expected 0 .* or None \(over M and N\)"),
    (lambda: _reducing(lambda x: gg.sum(x, dim=True)), r"sum: dim=True"),
    (lambda: gg.Recipe("r", lambda acc: {"d": acc, "r": gg.sum(acc, 1)}, aux={"r": gg.bf16}),
     r"aux output 'r': a reduction \(gemmgen.sum\(.*dim=1\)\) is fp32; declare aux=\{'r': gg.f32\}"),
    (lambda: gg.Recipe("r", lambda acc: gg.sum(acc, 1)), r"output 'd': D is the M x N result; return gg.sum"),
    (lambda: gg.Recipe("r", lambda acc: acc + gg.sum(acc, 1)), r"gg.amax\(...\), gg.sum\(...\) and "
                                                               r"gg.reduce_max/min\(...\) are outputs"),
    (lambda: _reducing(lambda x: gg.reduce_max(x, dim=2)), r"reduce_max: dim=2; expected 0 \(over M.* or None"),
    (lambda: gg.Recipe("r", lambda acc: {"d": acc, "m": gg.reduce_min(acc, 1)}, aux={"m": gg.bf16}),
     r"aux output 'm': a reduction \(gemmgen.reduce_min\(.*dim=1\)\) is fp32"),
    (lambda: gg.Recipe("r", lambda acc: gg.relu(gg.amax(acc, 1))), r"are outputs, not values to compute with"),
    (lambda: gg.Recipe("r", lambda acc: {"d": gg.pairs(acc)[0], "s": gg.sum(gg.pairs(acc)[1], 0)},
                       aux={"s": gg.f32}),
     r"aux output 's': a reduction over M \(dim=0\) of a value of column pairs \(at half columns\) is not "
     r"supported; reduce it over N \(dim=1\), or reduce a full-width value over M"),
    (lambda: gg.Recipe("r", lambda acc: {"d": acc, "s": gg.sum(acc, 1)}, aux={"s": gg.f32}, grouped=True),
     r"a grouped GEMM writes D only \(auxiliary outputs and reductions"),
    (lambda: gg.Recipe("r", lambda acc: {"d": acc, "s": gg.sum(acc, 0), "t": gg.amax(acc, 0), "u": gg.amax(acc)},
                       aux={"s": gg.f32, "t": gg.f32, "u": gg.f32}), None),
])
def test_reduction_mistakes_raise_named_errors(build, match):
    if match is None:
        build()
        return
    with pytest.raises((gg.RecipeError, TypeError), match=match):
        build()

"""Epilogues over adjacent column pairs (gg.pairs, gg.interleave): which values are N/2 wide, what
a recipe may not say and the fix it is told, and what the generated source holds. CPU only; the
compiled kernels' checks are with the other kernels' (oracle, SASS, emulation)."""

from __future__ import annotations

import pytest

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.ir import Columns, Op


def _swiglu(acc):
    gate, up = gg.pairs(acc)
    return gg.silu(gate) * up


def test_widths_follow_the_pairs():
    """A pair's half, and what it meets, is N/2 wide; the accumulator, row vectors and what meets
    them N; a matrix operand takes the width of what it is combined with."""
    def epilogue(acc, bias, residual, skip, scale):
        gate, up = gg.pairs(acc + bias)
        h = gg.silu(gate) * up * scale + residual
        return {"d": h, "pre": acc + skip, "rot": gg.interleave(gate, up * scale)}

    r = gg.Recipe("t", epilogue, operands={"bias": gg.RowVector(gg.bf16), "residual": gg.Matrix(gg.bf16),
                                           "skip": gg.Matrix(gg.bf16), "scale": gg.ColVector(gg.f32)},
                  aux={"pre": gg.bf16, "rot": gg.bf16})
    assert [o.columns for o in r.outputs] == [Columns.HALF, Columns.FULL, Columns.FULL]
    widths = {o.name: o.columns for o in r.ir.epilogue.operands}
    assert widths == {"bias": Columns.FULL, "residual": Columns.HALF, "skip": Columns.FULL, "scale": Columns.FULL}
    assert r.ir.epilogue.source == "skip"  # C is a full-width matrix; the half one is read from registers
    assert [o.shape((3, 5, 8)) for o in r.outputs] == [(3, 5, 4), (3, 5, 8), (3, 5, 8)]


def test_recipes_without_pairs_keep_their_keys():
    """`columns` enters an IR's canonical form only when it is N/2: every other kernel's id stays."""
    r = gg.Recipe("t", lambda acc, c: acc + c, operands={"c": gg.Matrix(gg.bf16)})
    canonical = r.ir.canonical()
    assert canonical["operands"] == [["c", "matrix", "bf16"]] and canonical["outputs"] == [["d", 2, "bf16"]]
    assert gg.Recipe("t", _swiglu).ir.canonical()["outputs"][0][-1] == "half"


@pytest.mark.parametrize("epilogue, operands, match", [
    (lambda acc, bias: _swiglu(acc) + bias, {"bias": gg.RowVector(gg.bf16)},
     r"row vector 'bias' .* apply 'bias' before gg.pairs"),
    (lambda acc: gg.pairs(gg.pairs(acc)[0])[0], {}, r"already a pair's half; pairs of pairs are not supported"),
    (lambda acc: gg.interleave(acc, acc) + 1.0, {}, r"a value of 2N columns .* is used or reduced; write it as an"),
    (lambda acc, s: gg.pairs(s)[0] + s, {"s": gg.Matrix(gg.bf16)}, r"combines values"),
    (lambda acc: gg.interleave(gg.interleave(acc, acc), gg.interleave(acc, acc)), {},
     r"interleave of values of 2N columns"),
    (lambda acc: acc + gg.interleave(1.0, 2.0), {}, r"two values that are the same in every column"),
    (lambda acc: _swiglu(acc) + acc, {}, r"add combines values of the accumulator's width \(N\) and of a pair's half"),
])
def test_misuse_names_the_fix(epilogue, operands, match):
    with pytest.raises(gg.RecipeError, match=match):
        gg.Recipe("t", epilogue, operands=operands)


def test_a_reduction_over_m_of_a_half_is_refused_in_a_recipe_over_pairs():
    """The kernel reduces over M its own N columns, of which a half holds every other one: a
    reduction over M of a full-width value is the kernel's (unswapped), one of a half is refused."""
    with pytest.raises(gg.RecipeError, match=r"a reduction over M \(dim=0\) of a value of column pairs .* reduce it "
                                             r"over N \(dim=1\)"):
        gg.Recipe("t", lambda acc: {"d": _swiglu(acc), "s": gg.sum(_swiglu(acc), dim=0)}, aux={"s": gg.f32})
    ok = gg.Recipe("t", lambda acc: {"d": _swiglu(acc), "s": gg.sum(_swiglu(acc), dim=1)}, aux={"s": gg.f32})
    assert ok.outputs[1].columns is Columns.HALF
    full = gg.Recipe("t", lambda acc: {"d": _swiglu(acc), "s": gg.sum(acc, dim=0)}, aux={"s": gg.f32})
    assert full.outputs[1].columns is Columns.FULL and not full.default_config().swap_ab


def test_the_fix_for_a_row_vector_after_the_pairs_works():
    """Applied as the error says, before the pairs (its values interleaved as B's columns)."""
    r = gg.Recipe("t", lambda acc, bias: _swiglu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    assert r.outputs[0].columns is Columns.HALF


def test_the_source_writes_d_from_the_registers_and_reads_half_tensors_there():
    """D of N/2 columns: the collective's D is void, a PairStore writes it (the callbacks name its
    element); an N/2 operand is a PairLoad; a sum over N of a half counts each pair once."""
    def epilogue(acc, residual, c):
        h = _swiglu(acc) + residual
        return {"d": h, "pre": acc + c, "ss": gg.sum(h * h, dim=1), "h32": h}

    r = gg.Recipe("t", epilogue, operands={"residual": gg.Matrix(gg.bf16), "c": gg.Matrix(gg.bf16)},
                  aux={"pre": gg.bf16, "ss": gg.f32, "h32": gg.f32})
    gen = render_kernel(r.ir, r.default_config())
    src = gen.source
    assert "using ElementD = void;" in src
    assert "gemmgen::epi::WithElementAux<cutlass::bfloat16_t, " in src
    assert src.count("gemmgen::epi::PairStore<") == 2 and src.count("gemmgen::epi::PairLoad<") == 1
    assert "gemmgen::epi::PairSumMask" in src and "Sm90SrcFetch<cutlass::bfloat16_t>" in src  # c is C
    names = {f.name for f in gen.fields}
    assert "epilogue.tma_d" not in names
    assert {"epilogue.pair_store.d.ptr", "epilogue.pair_store.d.stride_m", "epilogue.pair_load.residual.ptr",
            "epilogue.pair_store.h32.stride_l"} <= names
    assert ("UTMASTG",) in gen.required_sass  # pre goes through TMA
    assert ("UTMASTG",) not in render_kernel(gg.Recipe("t", _swiglu).ir, r.default_config()).required_sass


def test_interleave_with_a_constant_builds_the_constant_in():
    r = gg.Recipe("t", lambda acc: gg.interleave(gg.pairs(acc)[0], 0.5))
    assert [n.op for n in r.ir.epilogue.nodes if n.op.pairs] == [Op.PAIR_EVEN, Op.INTERLEAVE]
    assert "gemmgen::epi::InterleaveConst<0x3f000000u, false>::Fn" in r.source()


def test_configs_that_cannot_pair_are_refused_before_codegen():
    r = gg.Recipe("t", _swiglu)
    with pytest.raises(gg.ConfigError, match=r"swap_ab=True: .* column pairs .* use swap_ab=False"):
        r.source(gg.KernelConfig(tile=(128, 64, 64), swap_ab=True))
    with pytest.raises(gg.ConfigError, match=r"swap_ab=True: .* column pairs .* use swap_ab=False"):  # sm_100a's too
        r.source(gg.KernelConfig(tile=(128, 64, 64), schedule=gg.Schedule.ONE_SM, swap_ab=True, arch=gg.Arch.SM100A))
    grouped = gg.Recipe("t", _swiglu, grouped=True)  # gated experts: tests/runtime/test_grouped_pairs.py
    with pytest.raises(gg.ConfigError, match=r"swap_ab=True: .* column pairs .* use swap_ab=False"):
        grouped.source(gg.KernelConfig(tile=(128, 32, 64), swap_ab=True))


def test_small_m_never_swaps_a_recipe_over_pairs():
    from gemmgen.tuning.heuristic import choose

    choice = choose(gg.Recipe("t", _swiglu).ir, 8, 28672, 4096)
    assert not choice.config.swap_ab and "_swapab" not in choice.why


def test_the_backward_of_a_recipe_over_pairs_reads_the_saved_accumulator_as_pairs():
    """On the GEMM whose product is dL/dD (N/2 columns of the forward: the kernel's N), the saved
    accumulator has 2N columns, read as its pairs' halves (DoubleLoad, even and odd), and dL/dacc
    is written at 2N, gate's and up's gradients interleaved (DoubleStore at the root, void D). A
    bias before the pairs would be added to the 2N-column tensor: that backward recomputes."""
    backward = gg.Recipe("t", _swiglu).backward()
    assert not backward.recompute and backward.kernel.name == "t_bwd"
    ir = backward.kernel.ir
    assert [(o.name, o.columns) for o in ir.epilogue.operands] == [("saved_acc", Columns.DOUBLE)]
    assert ir.outputs[0].columns is Columns.DOUBLE
    gen = render_kernel(ir, backward.kernel.default_config())
    assert gen.source.count("gemmgen::epi::DoubleLoad<") == 2 and "using ElementD = void;" in gen.source
    assert "gemmgen::epi::WithElementAux<cutlass::bfloat16_t, " in gen.source
    assert {"epilogue.double_load_even.saved_acc.ptr", "epilogue.double_load_odd.saved_acc.stride_m",
            "epilogue.double_store.d.stride_l"} <= {f.name for f in gen.fields}
    assert gg.Recipe("t", _swiglu).outputs[0].shape((3, 10)) == (3, 5) and ir.outputs[0].shape((3, 5)) == (3, 10)
    biased = gg.Recipe("t", lambda acc, bias: _swiglu(acc + bias), operands={"bias": gg.RowVector(gg.bf16)})
    recomputing = biased.backward()
    assert recomputing.recompute and recomputing.kernel.name == "t_bwd_recompute"
    assert [(o.name, o.columns) for o in recomputing.kernel.ir.epilogue.operands] == [
        ("bias", Columns.FULL), ("grad_d", Columns.HALF)]
    assert "gemmgen::epi::PairLoad<" in recomputing.kernel.source()

"""The op table (`gemmgen.ir.Op`) is the one declaration of each epilogue op: the DSL, the reference,
constant folding, the emitted functors and the emulation's visitors all read it, and the C++
functors it names compute its formulas."""

from __future__ import annotations

import math
import pickle
import re
import shutil
import subprocess

import pytest
import torch

import gemmgen as gg
from gemmgen import DType
from gemmgen.codegen.visitor_types import EPI
from gemmgen.compile.toolchain import gemmgen_include_dir
from gemmgen.ir import Op, Param, f32_bits
from gemmgen.ir.ops import random_uniform
from gemmgen.testing.functors import _PAIR_FUNCTORS, scalar_function

EPILOGUE_HPP = gemmgen_include_dir() / "gemmgen" / "epilogue.hpp"
PAIR_FUNCTORS_HPP = gemmgen_include_dir() / "gemmgen" / "pair_functors.hpp"
#: the headers' structs that are no op's: the identity (D's own conversion node), the adaptors, and
#: the pair functors' constant form and a sum's mask (codegen.evt places them).
HELPERS = {"Identity", "WithRhs", "WithLhs", "Map", "SelectConstX", "SelectConstY", "SelectConstXY",
           "InterleaveConst", "Fn", "PairSumMask"}


def _functors_in_header() -> set[str]:
    return {name for header in (EPILOGUE_HPP, PAIR_FUNCTORS_HPP)
            for name in re.findall(r"^\s*struct (\w+)", header.read_text(), re.M)}


def test_each_op_is_one_complete_row():
    keys = [op.key for op in Op]
    assert len(set(keys)) == len(keys)
    for op in Op:
        assert Op.by_key(op.key) is op  # looked up by the stable key that IR keys hold
        assert pickle.loads(pickle.dumps(op)) is op  # compile workers receive IRs by pickle
        if op.is_leaf:
            assert op.formula is None and op.functor is None and op.dsl is None
        else:
            assert op.formula is not None and op.functor is not None, op
            assert op.dsl is not None or op.symbol is not None, f"{op}: the DSL has no spelling of it"
            assert op.commutative <= (op.arity == 2)
            assert op.arity <= 3


def test_every_functor_the_table_names_is_in_epilogue_hpp_and_no_other():
    structs = _functors_in_header()
    named = {op.functor for op in Op if op.functor}
    assert named <= structs, named - structs
    assert structs - HELPERS == named - HELPERS, "a functor in epilogue.hpp that no op names (or the reverse)"


def test_the_dsl_spells_every_op_and_lists_it():
    """Each row's DSL function is gemmgen's, records that op, and is in gemmgen.OPS, as is each operator."""
    for op in Op:
        if op.symbol:
            assert op.symbol in gg.OPS
        if op.dsl is None:
            continue
        assert op.dsl in gg.OPS
        fn = getattr(gg, op.dsl)
        assert fn is getattr(gg.dsl, op.dsl)
        extra = {Param.SLOPE: (0.2,), Param.DTYPE: (gg.bf16,)}.get(op.param, ())
        if op.pairs:  # gg.pairs gives both halves; gg.interleave takes two
            recipe = gg.Recipe("t", lambda acc: gg.interleave(*gg.pairs(acc)))
        elif op is Op.STOCHASTIC_ROUND:  # its second input is a seed's numbers
            recipe = gg.Recipe("t", _binary_epilogue(fn), operands={"s": gg.Seed()})
        elif op.arity == 3:
            recipe = gg.Recipe("t", _ternary_epilogue(fn), operands={"s": gg.Scalar()})
        elif op.arity == 2:
            recipe = gg.Recipe("t", _binary_epilogue(fn), operands={"s": gg.Scalar()})
        else:
            recipe = gg.Recipe("t", _unary_epilogue(fn, extra))
        assert op in [n.op for n in recipe.ir.epilogue.nodes], op


def _ternary_epilogue(fn):
    return lambda acc, s: fn(acc, s, acc * s)


def _binary_epilogue(fn):
    return lambda acc, s: fn(acc, s)


def _unary_epilogue(fn, extra):
    return lambda acc: fn(acc, *extra)


def test_the_visitors_evaluate_each_functor_by_the_tables_formula():
    """What the emulation runs for a functor named in a kernel's source is its row's formula."""
    x = torch.linspace(-4, 4, 17)
    for op in Op:
        if op.functor is None or op.param is not Param.NONE or op.pairs:  # pairs: the next test
            continue
        args = (x, x.flip(0), x * 0.5)[:op.arity]
        got = scalar_function(op.functor)(*args)
        torch.testing.assert_close(got, op.apply(args), rtol=0, atol=0, equal_nan=True)


def test_constants_fold_by_the_formula():
    recipe = gg.Recipe("t", lambda acc: acc + gg.gelu_tanh(0.7) * gg.leaky_relu(-3.0, 0.1))
    const = next(n.attr for n in recipe.ir.epilogue.nodes if n.op is Op.CONST)
    t = torch.tensor
    want = Op.GELU_TANH.apply((t(0.7),)) * Op.LEAKY_RELU.apply((t(-3.0),), gg.ir.f32(0.1))
    assert const == float(want.float())


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the epilogue functors on the host")
def test_cpp_functors_compute_the_tables_formulas(tmp_path):
    """Every functor epilogue.hpp defines for an op, run on the host, against the row's formula in
    fp32, within a few units in the last place of the inputs' magnitude: libm's and torch's expf,
    tanhf and erff differ there by an ulp, and GELU's 1 + erf(x) cancels that ulp for large negative
    x (-5.5 gives -1.6e-7 from glibc, -0.0 from torch). A cast's functor is the identity: its
    rounding is the compute node's output conversion, which the emulation and the GPU tests check."""
    # 1 + 2^-23: the lowest mantissa bit set (a stochastic rounding's carry at u's top)
    xs = [-30.0, -5.5, -1.0, -0.3, -1e-3, 0.0, 1e-3, 0.25, 0.7, 1.0, 1.0 + 2**-23, 2.5, 7.0, 30.0, float("nan")]
    ys = [0.5, -2.0, 3.0]
    slope = gg.ir.f32(0.2)
    lines, cases = [], []
    for op in Op:
        if op.functor is None or op.param is Param.DTYPE or op.pairs:  # pairs: test_cpp_pair_functors...
            continue
        functor = f"{EPI}::{op.functor}<{f32_bits(slope)}u>" if op.param is Param.SLOPE else f"{EPI}::{op.functor}"
        for x in xs:
            for y in [*ys, x] if op.arity >= 2 else [0.0]:  # y = x: the comparisons' ties
                args = (x, y, -7.0)[:op.arity]
                lines.append(f"  p({functor}{{}}({', '.join(map(_cpp, args))}));")
                cases.append((op, args))
    for x in xs:  # a constant operand on either side; where's constant branches
        lines.append(f"  p({EPI}::WithLhs<{EPI}::Sub, {f32_bits(2.0)}u>{{}}({_cpp(x)}));")
        cases.append((Op.SUB, (2.0, x)))
        lines.append(f"  p({EPI}::WithRhs<{EPI}::Div, {f32_bits(3.0)}u>{{}}({_cpp(x)}));")
        cases.append((Op.DIV, (x, 3.0)))
        lines.append(f"  p({EPI}::SelectConstX<{f32_bits(2.0)}u>{{}}({_cpp(x)}, -1.0f));")
        cases.append((Op.WHERE, (x, 2.0, -1.0)))
        lines.append(f"  p({EPI}::SelectConstY<{f32_bits(2.0)}u>{{}}({_cpp(x)}, -1.0f));")
        cases.append((Op.WHERE, (x, -1.0, 2.0)))
        lines.append(f"  p({EPI}::SelectConstXY<{f32_bits(2.0)}u, {f32_bits(-3.0)}u>{{}}({_cpp(x)}));")
        cases.append((Op.WHERE, (x, 2.0, -3.0)))
    out = host_program(tmp_path, "#include <limits>\n#include <gemmgen/epilogue.hpp>\n"
                        'static void p(float r) { std::printf("%.9g\\n", r); }\n'
                        "int main() {\n" + "\n".join(lines) + "\n}\n").split()
    assert len(out) == len(cases) > 100
    for (op, args), got in zip(cases, out, strict=True):
        want = op.apply(tuple(torch.tensor(a) for a in args), slope).float()
        ulps = 2**-22 * max([1.0, *(abs(a) for a in args if a == a)])
        torch.testing.assert_close(torch.tensor(float(got)), want, rtol=2e-6, atol=ulps, equal_nan=True,
                                   msg=_prefix(f"{op.functor}{args}"))


def test_the_visitors_evaluate_each_pair_functor_by_the_tables_formula():
    """The emulation holds a pair's half in both columns of its pair: what it runs for a pair
    functor is the row's formula with each result column doubled (the even one kept for
    Interleave's input halves), and PairSumMask keeps each pair's value once."""
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    doubled = {Op.PAIR_EVEN: (x,), Op.PAIR_ODD: (x,)}
    for op, args in doubled.items():
        got = _PAIR_FUNCTORS[op.functor](*args)  # type: ignore[index]
        torch.testing.assert_close(got, op.apply(args).repeat_interleave(2, dim=-1), rtol=0, atol=0)
    # Interleave reads each input's pair from its even (a half's) or odd column: halves held doubled
    even, odd = x[:, 0::2].repeat_interleave(2, -1), y[:, 1::2].repeat_interleave(2, -1)
    got = _PAIR_FUNCTORS["Interleave"](even, odd)
    torch.testing.assert_close(got, Op.INTERLEAVE.apply((x[:, 0::2], y[:, 1::2])), rtol=0, atol=0)
    masked = _PAIR_FUNCTORS["PairSumMask"](even)
    assert torch.equal(masked.sum(-1), x[:, 0::2].sum(-1)) and torch.equal(masked[:, 1::2], torch.zeros(3, 4))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the pair functors on the host")
def test_cpp_pair_functors_compute_the_tables_formulas(tmp_path):
    """pair_functors.hpp's fragment functors on the host, on fragments of 8 (four pairs), against
    the formulas with a half held in both columns of its pair (as the emulation holds it)."""
    x = [float(v) for v in torch.randn(8)]
    y = [float(v) for v in torch.randn(8)]
    calls = {"PairEven": "PairEven<A>{}(x)", "PairOdd": "PairOdd<A>{}(x)", "Interleave": "Interleave<A>{}(x, y)",
             "PairSumMask": "PairSumMask<A>{}(x)",
             "ConstEven": f"InterleaveConst<{f32_bits(2.5)}u, true>::Fn<A>{{}}(y)",
             "ConstOdd": f"InterleaveConst<{f32_bits(-1.5)}u, false>::Fn<A>{{}}(x)"}
    rows = host_program(
        tmp_path,
        "#include <gemmgen/pair_functors.hpp>\nusing namespace gemmgen::epi;\n"
        "using A = cutlass::Array<float, 8, true>;\n"
        "static void p(A const& a) {\n"
        "  for (int i = 0; i < 8; ++i) std::printf(\"%.9g \", a[i]);\n  std::printf(\"\\n\");\n}\n"
        "int main() {\n  A x, y;\n" + "".join(f"  x[{i}] = {x[i]!r}f; y[{i}] = {y[i]!r}f;\n" for i in range(8))
        + "".join(f"  p({c});\n" for c in calls.values()) + "}\n").splitlines()
    got = {name: torch.tensor([float(v) for v in row.split()]) for name, row in zip(calls, rows, strict=True)}
    tx, ty = torch.tensor(x), torch.tensor(y)
    torch.testing.assert_close(got["PairEven"], Op.PAIR_EVEN.apply((tx,)).repeat_interleave(2), rtol=0, atol=0)
    torch.testing.assert_close(got["PairOdd"], Op.PAIR_ODD.apply((tx,)).repeat_interleave(2), rtol=0, atol=0)
    torch.testing.assert_close(got["Interleave"], Op.INTERLEAVE.apply((tx[0::2], ty[1::2])), rtol=0, atol=0)
    torch.testing.assert_close(got["PairSumMask"], Op.INTERLEAVE.apply((tx[0::2], torch.zeros(4))), rtol=0, atol=0)
    torch.testing.assert_close(got["ConstEven"], Op.INTERLEAVE.apply((torch.full((4,), 2.5), ty[1::2])), rtol=0,
                               atol=0)
    torch.testing.assert_close(got["ConstOdd"], Op.INTERLEAVE.apply((tx[0::2], torch.full((4,), -1.5))), rtol=0,
                               atol=0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the random numbers' hash on the host")
def test_cpp_random_numbers_are_the_references(tmp_path):
    """epilogue.hpp's random_stream and random_uniform (what coordinates.hpp's Random draws) on the
    host give ir.ops.random_uniform's numbers bit for bit: seeds with both halves set, streams,
    batches, rows and columns up to 2^24."""
    gen = torch.Generator().manual_seed(5)
    cases = [(int(torch.randint(0, 2**62, (), generator=gen)) * 2 + 1, s, b, r, c)
             for s in (0, 1, 65535) for b in (0, 1, 7) for r, c in ((0, 0), (1, 0), (0, 1), (4095, 2**24 - 1))]
    body = "".join(f"  p(random_uniform(random_stream({seed}ull, {s}u, {b}u), {r}u, {c}u));\n"
                   for seed, s, b, r, c in cases)
    out = host_program(tmp_path, "#include <gemmgen/epilogue.hpp>\nusing namespace gemmgen::epi;\n"
                        'static void p(float r) { std::printf("%.9g\\n", r); }\n'
                        "int main() {\n" + body + "}\n").split()
    t = torch.tensor
    want = torch.stack([random_uniform(seed, s, t(b), t(r), t(c)) for seed, s, b, r, c in cases])
    assert torch.equal(torch.tensor([float(v) for v in out]), want) and len(set(want.tolist())) == len(cases)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the epilogue functors on the host")
def test_cpp_power_of_two_rounding_is_the_quantizers(tmp_path):
    """epilogue.hpp's power_of_two_at_least (what QuantizeBlock<Qmax, true> rounds each scale with)
    on the host, bit for bit against ir.ops.quantize_blocks' power-of-two scales: every fp32 scale
    it can see, from 0 and subnormals (one bit, two bits, the largest) through 2^-126, powers of
    two and their neighbours, to the largest finite (which rounds to infinity) and infinity."""
    from gemmgen.ir.ops import quantize_blocks

    tiny = 2.0**-149
    s = torch.tensor([0.0, tiny, 2 * tiny, 3 * tiny, 2.0**-127, 2.0**-126 - tiny, 2.0**-126, 2.0**-126 + 2.0**-149 * 2,
                      0.75, 1.0, 1.0 + 2.0**-23, 1.5, 2.0 - 2.0**-23, 448.0, 2.0**127, 1.5 * 2.0**127,
                      float(torch.finfo(torch.float32).max), math.inf], dtype=torch.float32)
    mantissas = torch.randint(1, 2**20, (200,), generator=torch.Generator().manual_seed(7)).double()  # times 448 exact
    s = torch.cat([s, (mantissas * 2.0 ** torch.randint(-165, 105, (200,), generator=torch.Generator().manual_seed(8))
                       .double()).float()])
    body = "".join(f"  p(power_of_two_at_least(__uint_as_float({b}u)));\n" for b in s.view(torch.int32).tolist())
    out = host_program(tmp_path, "#include <gemmgen/epilogue.hpp>\nusing namespace gemmgen::epi;\n"
                       'static void p(float r) { std::printf("%a\\n", r); }\n'
                       "int main() {\n" + body + "}\n").split()
    got = torch.tensor([float.fromhex(v) for v in out], dtype=torch.float32)
    # quantize_blocks' scale of a one-value block holding s * 448 is s (where that is exact) rounded
    _, want = quantize_blocks((s.double() * 448).float()[:, None, None], (1, 1), DType.E4M3, power_of_two=True)
    exact = (s.double() * 448).float().double() / 448 == s.double()
    assert exact.sum() > 180 and got.shape == s.shape
    assert torch.equal(got[exact], want.flatten()[exact]), \
        [(a, b, c) for a, b, c in zip(s, got, want.flatten(), strict=True) if a != c]
    mantissa, exponent = s.frexp()  # the rest (the largest finite, whose s * 448 overflows): frexp's rule
    assert torch.equal(got, torch.ones_like(s).ldexp(exponent - (mantissa == 0.5).int()))
    assert (got[0], got[16], got[17]) == (1.0, math.inf, 1.0)  # 0, the largest finite, infinity


def host_program(tmp_path, source: str) -> str:
    """The output of `source` (which includes gemmgen headers) built with g++ on host stand-ins for
    the two CUTLASS headers the functor headers include (macros, bit casts and a plain Array)."""
    stub = tmp_path / "stub" / "cutlass"
    stub.mkdir(parents=True)
    (stub / "cutlass.h").write_text(
        "#pragma once\n#include <cstdint>\n#include <cstring>\n#include <cmath>\n#define CUTLASS_DEVICE inline\n"
        "#define CUTLASS_PRAGMA_UNROLL\n"
        "inline float __uint_as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }\n"
        "inline uint32_t __float_as_uint(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }\n")
    (stub / "array.h").write_text(
        "#pragma once\nnamespace cutlass { template <class T, int N, bool R = true> struct Array {\n"
        "  T v[N]; T& operator[](int i) { return v[i]; } T const& operator[](int i) const { return v[i]; }\n"
        "  void fill(T x) { for (T& e : v) e = x; } }; }\n")
    prog, exe = tmp_path / "program.cpp", tmp_path / "program"
    prog.write_text("#include <cstdio>\n#include <cutlass/cutlass.h>\n" + source)
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{tmp_path / 'stub'}", f"-I{gemmgen_include_dir()}",
                    "-o", str(exe), str(prog)], check=True, capture_output=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def _prefix(where: str):
    return lambda message: f"{where}: {message}"


def _cpp(x: float) -> str:
    return "std::numeric_limits<float>::quiet_NaN()" if x != x else f"{x}f"


def test_comparisons_and_where_trace_fold_and_mean_what_torch_means():
    """`<` `<=` `>` `>=` are traced (`==` stays Python's); where() picks a side without touching the
    other (NaN and inf there stay out), a constant condition folds to its side, NaN counts as true."""
    recipe = gg.Recipe("t", lambda acc, s: gg.where(acc > s, gg.erf(acc), gg.sin(acc) / gg.cos(acc))
                       + gg.where(gg.ne(acc, acc), -1.0, gg.where(acc <= 0.0, 0.5, acc)),
                       operands={"s": gg.Scalar()})
    keys = [n.op.key for n in recipe.ir.epilogue.nodes]
    for key in ("gt", "le", "ne", "where", "erf", "sin", "cos"):
        assert key in keys
    acc = torch.tensor([[-2.0, 0.0, 1.5707964, 3.0], [float("nan"), 0.25, -0.0, 1e30]])
    s = torch.tensor(0.5)
    want = torch.where(acc > s, torch.erf(acc), torch.sin(acc) / torch.cos(acc)) + \
        torch.where(acc != acc, torch.tensor(-1.0), torch.where(acc <= 0, torch.tensor(0.5), acc))
    from gemmgen.ir.reference import evaluate_epilogue

    got, = evaluate_epilogue(recipe.ir.epilogue, acc, {"s": s}, round_outputs=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    folded = gg.Recipe("t", lambda acc: gg.where(gg.lt(1.0, 2.0), acc, gg.exp(acc)) +
                       gg.where(float("nan"), acc, 0.0))
    assert [n.op.key for n in folded.ir.epilogue.nodes] == ["acc", "add"]  # both conditions folded away
    with pytest.raises(gg.RecipeError, match=r"gg.eq\(x, y\)"):
        gg.Recipe("t", lambda acc: acc == 0.0)
    with pytest.raises(gg.RecipeError, match=r"gg.where\(cond, x, y\)"):
        gg.Recipe("t", lambda acc: acc if acc > 0 else -acc)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the epilogue functors on the host")
def test_sin_and_cos_are_within_an_ulp_over_the_whole_float_range(tmp_path):
    """gemmgen::epi::Sin/Cos reduce their argument in registers (trig.hpp) rather than CUDA's slow
    path in local memory; against float64 torch on random bit patterns of every exponent and on
    the floats nearest k pi/2 (the hardest reductions), each result is within one fp32 ulp."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 2**31 - 2**23, (40000,), generator=gen, dtype=torch.int64)  # finite, both signs below
    xs = bits.to(torch.int32).view(torch.float32)
    xs = torch.cat([xs, -xs[:20000]])
    k = torch.cat([torch.arange(1, 5000, dtype=torch.float64), torch.randint(1, 2**40, (5000,), generator=gen)
                   .double()])
    near = (k * torch.pi / 2).float()
    xs = torch.cat([xs, near, torch.nextafter(near, torch.tensor(float("inf"))),
                    torch.tensor([0.0, -0.0, 1e-40, 3.4028235e38, -3.4028235e38, 105615.0, 105616.0,
                                  4.2166e8, 4.2168e8])])
    (tmp_path / "in.txt").write_text("\n".join(str(int(b) & 0xFFFFFFFF) for b in xs.view(torch.int32).tolist()))
    stub = tmp_path / "stub" / "cutlass"
    stub.mkdir(parents=True)
    (stub / "cutlass.h").write_text(
        "#pragma once\n#include <cstdint>\n#include <cstring>\n#include <cmath>\n#define CUTLASS_DEVICE inline\n"
        "inline uint32_t __float_as_uint(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }\n")
    prog = tmp_path / "t.cpp"
    trig = "gemmgen::epi::trig::sin_or_cos"
    prog.write_text("#include <cstdio>\n#include <cutlass/cutlass.h>\n#include <gemmgen/trig.hpp>\n"
                    "int main() {\n  unsigned b;\n  while (std::scanf(\"%u\", &b) == 1) {\n"
                    f"    float x, s, c;\n    std::memcpy(&x, &b, 4);\n    s = {trig}(x, false), c = {trig}(x, true);\n"
                    "    unsigned sb, cb;\n    std::memcpy(&sb, &s, 4), std::memcpy(&cb, &c, 4);\n"
                    "    std::printf(\"%u %u\\n\", sb, cb);\n  }\n}\n")
    exe = tmp_path / "t"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{tmp_path / 'stub'}", f"-I{gemmgen_include_dir()}", "-o",
                    str(exe), str(prog)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], input=(tmp_path / "in.txt").read_text(), check=True, capture_output=True,
                         text=True).stdout.split()
    got = torch.tensor([int(v) for v in out], dtype=torch.int64).to(torch.int32).view(torch.float32).view(-1, 2)
    for column, fn in ((0, torch.sin), (1, torch.cos)):
        want = fn(xs.double())
        ulp = (torch.nextafter(want.float().abs(), torch.tensor(float("inf"))) - want.float().abs()).double()
        err = (got[:, column].double() - want).abs() / ulp
        worst = int(err.argmax())
        assert float(err.max()) <= 1.0, f"{fn.__name__}({float(xs[worst])!r}): {float(got[worst, column])!r}, " \
                                        f"want {float(want[worst])!r} ({float(err.max()):.2f} ulp)"
        assert torch.equal(got[:, column].signbit()[want != 0], want.signbit()[want != 0])

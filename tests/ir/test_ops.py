"""The op table (`gemmgen.ir.Op`) is the one declaration of each epilogue op: the DSL, the reference,
constant folding, the emitted functors and the emulation's visitors all read it, and the C++
functors it names compute its formulas."""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen.evt import EPI
from gemmgen.compile.toolchain import gemmgen_include_dir
from gemmgen.ir import Op, Param, f32_bits
from gemmgen.testing.visitors import scalar_function

EPILOGUE_HPP = gemmgen_include_dir() / "gemmgen" / "epilogue.hpp"
#: epilogue.hpp's structs that are no op's: the identity (D's own conversion node) and the adaptors.
HELPERS = {"Identity", "WithRhs", "WithLhs", "Map"}


def _functors_in_header() -> set[str]:
    return set(re.findall(r"^struct (\w+)", EPILOGUE_HPP.read_text(), re.M))


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
        recipe = gg.Recipe("t", _binary_epilogue(fn), operands={"s": gg.Scalar()}) if op.arity == 2 else \
            gg.Recipe("t", _unary_epilogue(fn, extra))
        assert op in [n.op for n in recipe.ir.epilogue.nodes], op


def _binary_epilogue(fn):
    return lambda acc, s: fn(acc, s)


def _unary_epilogue(fn, extra):
    return lambda acc: fn(acc, *extra)


def test_the_visitors_evaluate_each_functor_by_the_tables_formula():
    """What the emulation runs for a functor named in a kernel's source is its row's formula."""
    x = torch.linspace(-4, 4, 17)
    for op in Op:
        if op.functor is None or op.param is not Param.NONE:
            continue
        got = scalar_function(op.functor)(*([x, x.flip(0)] if op.arity == 2 else [x]))
        torch.testing.assert_close(got, op.apply((x, x.flip(0))[:op.arity]), rtol=0, atol=0, equal_nan=True)


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
    xs = [-30.0, -5.5, -1.0, -0.3, -1e-3, 0.0, 1e-3, 0.25, 0.7, 1.0, 2.5, 7.0, 30.0, float("nan")]
    ys = [0.5, -2.0, 3.0]
    slope = gg.ir.f32(0.2)
    lines, cases = [], []
    for op in Op:
        if op.functor is None or op.param is Param.DTYPE:
            continue
        functor = f"{EPI}::{op.functor}<{f32_bits(slope)}u>" if op.param is Param.SLOPE else f"{EPI}::{op.functor}"
        for x in xs:
            for y in ys if op.arity == 2 else (0.0,):
                call = f"{_cpp(x)}, {_cpp(y)}" if op.arity == 2 else _cpp(x)
                lines.append(f"  p({functor}{{}}({call}));")
                cases.append((op, x, y))
    for x in xs:  # a constant operand on either side
        lines.append(f"  p({EPI}::WithLhs<{EPI}::Sub, {f32_bits(2.0)}u>{{}}({_cpp(x)}));")
        cases.append((Op.SUB, 2.0, x))
        lines.append(f"  p({EPI}::WithRhs<{EPI}::Div, {f32_bits(3.0)}u>{{}}({_cpp(x)}));")
        cases.append((Op.DIV, x, 3.0))
    # Host stand-ins for the two CUTLASS headers epilogue.hpp includes (only macros and a declaration).
    stub = tmp_path / "stub" / "cutlass"
    stub.mkdir(parents=True)
    (stub / "cutlass.h").write_text(
        "#pragma once\n#include <cstdint>\n#include <cstring>\n#include <cmath>\n#define CUTLASS_DEVICE inline\n"
        "#define CUTLASS_PRAGMA_UNROLL\n"
        "inline float __uint_as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }\n")
    (stub / "array.h").write_text(
        "#pragma once\nnamespace cutlass { template <class T, int N, bool R> struct Array; }\n")
    prog = tmp_path / "f.cpp"
    prog.write_text("#include <cstdio>\n#include <limits>\n#include <cutlass/cutlass.h>\n"
                    "#include <gemmgen/epilogue.hpp>\n"
                    'static void p(float r) { std::printf("%.9g\\n", r); }\n'
                    "int main() {\n" + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "f"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{tmp_path / 'stub'}", f"-I{gemmgen_include_dir()}",
                    "-o", str(exe), str(prog)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert len(out) == len(cases) > 100
    for (op, x, y), got in zip(cases, out, strict=True):
        args = (torch.tensor(x), torch.tensor(y))[:op.arity]
        want = op.apply(args, slope).float()
        ulps = 2**-22 * max(1.0, abs(x), abs(y))
        torch.testing.assert_close(torch.tensor(float(got)), want, rtol=2e-6, atol=ulps, equal_nan=True,
                                   msg=_prefix(f"{op.functor}({x}, {y})"))


def _prefix(where: str):
    return lambda message: f"{where}: {message}"


def _cpp(x: float) -> str:
    return "std::numeric_limits<float>::quiet_NaN()" if x != x else f"{x}f"

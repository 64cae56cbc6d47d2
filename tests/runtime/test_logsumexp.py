"""gg.logsumexp (issue 32 item 5, the reduction): log(sum(exp(x))) over N (a row's, as a
cross-entropy's log-normalizer) or over M, in CUTLASS's vector reductions with a pair state
{max, sum of exp(x - max)} (gemmgen/include/gemmgen/lse.hpp; over M on sm_90a in gemmgen's
row_reduction.hpp). Its combine on the host against
torch.logsumexp, the reference against torch, the emulated kernels (sm90 either way round, sm100
swapped for a reduction over M), and mistakes that must fail."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Callable

import pytest
import torch

import gemmgen as gg
from gemmgen.compile.toolchain import gemmgen_include_dir
from gemmgen.runtime import arguments
from gemmgen.testing.calls import EMULATED_CONFIGS, emulated_shapes
from gemmgen.testing.checks import assert_computes, source_replaced, uncompiled, uncompiled_kernel

#: A cross-entropy's pieces over the vocabulary (N): each row's log-normalizer and max logit,
#: batched, a bias per column; and each column's log-sum-exp over the tokens (M) of a scaled value.
RECIPES = {
    "rows": gg.Recipe("lse_rows", lambda acc, bias: {"d": acc + bias, "lse": gg.logsumexp(acc + bias, dim=1),
                                                     "top": gg.reduce_max(acc + bias, dim=1)},
                      batched=True, operands={"bias": gg.RowVector(gg.bf16)}, aux={"lse": gg.f32, "top": gg.f32}),
    "columns": gg.Recipe("lse_columns", lambda acc: {"d": acc, "lse": gg.logsumexp(acc * 4.0, dim=0)},
                         aux={"lse": gg.f32}),
    "over_batch": gg.Recipe("lse_over_batch", lambda acc: {"d": acc, "lse": gg.logsumexp(acc, dim=1, over_batch=True)},
                            batched=True, aux={"lse": gg.f32}),
}
SM100 = gg.Arch.SM100A

_STUB_NUMERIC = """#pragma once
#include <limits>
namespace cutlass {
enum class FloatRoundStyle { round_to_nearest };
template <class T, class S, FloatRoundStyle R = FloatRoundStyle::round_to_nearest> struct NumericConverter;
namespace platform { using std::numeric_limits; }
}
"""


def _prefixed(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


def _cpp(v: float) -> str:
    return "NAN" if v != v else "INFINITY" if v == float("inf") else "-INFINITY" if v == -float("inf") else f"{v!r}f"


def _folded(values: list[float], rng: random.Random) -> str:
    """C++ folding `values`' states (and identities) with lse_combine in a random tree order, as
    lanes, warps and tiles combine their partial states in some fixed order of their own."""
    items = ["LseState(0)"] * rng.randint(1, 3) + [f"C{{}}({_cpp(v)})" for v in values]
    rng.shuffle(items)
    while len(items) > 1:
        i = rng.randrange(len(items) - 1)
        items[i:i + 2] = [f"LseCombine<LseState>{{}}({items[i]}, {items[i + 1]})"]
    return f"NumericConverter<float, LseState>{{}}({items[0]})"


def test_the_combine_is_torchs_logsumexp_in_any_order(tmp_path):
    """lse.hpp on the host (g++, CUTLASS's macros stubbed): states folded in random tree orders
    against torch.logsumexp, on fresh values, values whose exp overflows fp32, +inf, only -inf,
    NaN, and nothing (the identity alone: -inf)."""
    stub = tmp_path / "stub" / "cutlass"
    stub.mkdir(parents=True)
    (stub / "cutlass.h").write_text("#pragma once\n#include <cmath>\n#define CUTLASS_HOST_DEVICE inline\n"
                                    "#define CUTLASS_PRAGMA_UNROLL\n")
    (stub / "array.h").write_text("#pragma once\nnamespace cutlass { template <class T, int N> struct Array {\n"
                                  "  T v[N]; T& operator[](int i) { return v[i]; }\n"
                                  "  T const& operator[](int i) const { return v[i]; } }; }\n")
    (stub / "numeric_conversion.h").write_text(_STUB_NUMERIC)
    rng = random.Random(0)
    inf, nan = float("inf"), float("nan")
    cases = [[float(v) for v in torch.randn(n) * 3] for n in (1, 2, 7, 33)]
    cases += [[float(v) for v in torch.randn(9) * 30 + 1000], [float(v) for v in torch.randn(5) - 200],
              [1.0, inf, -3.0], [-inf, -inf], [2.0, nan, 1.0], [-inf, nan], []]
    rows = [_folded(c, rng) for c in cases for _ in range(3)]
    prog = tmp_path / "lse.cpp"
    prog.write_text("#include <cstdio>\n#include <cmath>\n#include <gemmgen/lse.hpp>\nusing namespace gemmgen::epi;\n"
                    "using namespace cutlass;\nusing C = NumericConverter<LseState, float>;\nint main() {\n"
                    + "".join(f'  std::printf("%.9g\\n", {r});\n' for r in rows) + "}\n")
    exe = tmp_path / "lse"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{tmp_path / 'stub'}", f"-I{gemmgen_include_dir()}", "-o",
                    str(exe), str(prog)], check=True, capture_output=True)
    got = [float(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    for k, case in enumerate(cases):
        want = torch.tensor(case, dtype=torch.float64).logsumexp(dim=0)
        for j in range(3):
            torch.testing.assert_close(torch.tensor(got[3 * k + j], dtype=torch.float64), want, rtol=2e-6, atol=0,
                                       equal_nan=True, msg=_prefixed(f"{case} folded, order {j}"))


def test_the_reference_is_torchs_logsumexp():
    """Fresh inputs, large enough that exp(x) overflows fp32 in places: the recipe's reference
    against torch's own logsumexp of the epilogue's value (per row, per column, over the batches)."""
    a, b = (torch.randn(3, 33, 40) * 6).bfloat16(), (torch.randn(3, 40, 70) * 6).bfloat16()
    bias = torch.randn(70).bfloat16()
    acc = a.float() @ b.float()
    assert (acc.exp() == float("inf")).any(), "some exp must overflow, or the test shows nothing"
    y = acc + bias.float()
    _, lse, top = RECIPES["rows"].reference(a, b, bias=bias)
    torch.testing.assert_close(lse, torch.logsumexp(y, dim=-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(top, y.amax(dim=-1), rtol=0, atol=0)
    assert lse.isfinite().all() and (lse >= top).all() and (lse <= top + torch.log(torch.tensor(70.0))).all()
    _, columns = RECIPES["columns"].reference(a[0], b[0])
    torch.testing.assert_close(columns, torch.logsumexp(4.0 * acc[0], dim=0), rtol=1e-6, atol=0)
    _, over = RECIPES["over_batch"].reference(a, b)
    torch.testing.assert_close(over, torch.logsumexp(acc, dim=(0, 2)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", RECIPES)
def test_emulated_kernels_compute_the_logsumexp(name):
    recipe = RECIPES[name]
    configs = [c for c in EMULATED_CONFIGS if gg.codegen.is_valid(c, recipe.ir)]
    assert {c.arch for c in configs} == {gg.Arch.SM90A, SM100}
    # sm_100a kernels reduce over their N only (over M: swapped); sm_90a ones over either
    assert all(c.swap_ab == (name == "columns") for c in configs if c.arch is SM100)
    assert {c.swap_ab for c in configs if c.arch is gg.Arch.SM90A} == {False, True}
    for config in configs:
        ck = uncompiled(recipe, config)
        assert "gemmgen::epi::LseState" in ck.generated.source
        for shape in emulated_shapes(recipe):
            assert_computes(ck, shape, f"{name} {config.name}")


@pytest.mark.parametrize("mistake", ["identity", "partials of 4 bytes", "state of fp32"])
def test_mistakes_fail_the_check(mistake, monkeypatch):
    """A wrong starting state in the Params, a workspace sized for fp32 partials, or the reduction
    declared in fp32 each fail the emulated call (the unchanged kernel passes)."""
    recipe, config, shape = RECIPES["rows"], EMULATED_CONFIGS[0], (130, 200, 24, 2)
    assert_computes(uncompiled(recipe, config), shape, "unchanged")
    ck = uncompiled(recipe, config)
    if mistake == "identity":
        real = arguments.ArgumentBuilder.shape_values

        def values(self, p):
            v, grid = real(self, p)
            v["epilogue.col_reduction.lse.identity_sum"] = 1.0
            return v, grid
        monkeypatch.setattr(arguments.ArgumentBuilder, "shape_values", values)
    elif mistake == "partials of 4 bytes":
        init = arguments.ArgumentBuilder.__init__

        def four(self, *args):
            init(self, *args)
            self.partial_bytes = dict.fromkeys(self.partial_bytes, 4)
        monkeypatch.setattr(arguments.ArgumentBuilder, "__init__", four)
    else:
        ck = uncompiled(recipe, config, source_replaced("float, gemmgen::epi::LseState,", "float, float,"))
    with pytest.raises(AssertionError):
        assert_computes(ck, shape, mistake)


def test_empty_problems_give_minus_inf_as_torch():
    """Nothing to reduce over (N = 0) gives -inf, as torch.logsumexp over an empty dim; K = 0 the
    log-sum-exp of the epilogue of a zero accumulator."""
    k = uncompiled_kernel(RECIPES["rows"])
    bias = torch.randn(0).bfloat16()
    prep = k.prepare(torch.randn(2, 5, 8).bfloat16(), torch.randn(2, 8, 0).bfloat16(), bias=bias)
    assert prep.params is None
    torch.testing.assert_close(prep.outputs[1], torch.logsumexp(torch.zeros(2, 5, 0), dim=-1))
    bias = torch.randn(6).bfloat16()
    prep = k.prepare(torch.randn(2, 5, 0).bfloat16(), torch.randn(2, 0, 6).bfloat16(), bias=bias)
    torch.testing.assert_close(prep.outputs[1], torch.logsumexp(bias.float().expand(2, 5, 6), dim=-1))


def test_misuse_is_refused_naming_the_fix():
    with pytest.raises(gg.RecipeError, match=r"logsumexp: dim=None; expected 0 \(over M"):
        gg.Recipe("t", lambda acc: {"d": acc, "l": gg.logsumexp(acc, dim=None)}, aux={"l": gg.f32})  # type: ignore[arg-type]
    with pytest.raises(gg.RecipeError, match=r"a reduction .* is fp32; declare aux=\{'l': gg.f32\}"):
        gg.Recipe("t", lambda acc: {"d": acc, "l": gg.logsumexp(acc, dim=1)}, aux={"l": gg.bf16})
    with pytest.raises(gg.RecipeError, match=r"a reduction over M \(dim=0\) of a value of column pairs"):
        gg.Recipe("t", lambda acc: {"d": gg.pairs(acc)[0], "l": gg.logsumexp(gg.pairs(acc)[1], dim=0)},
                  aux={"l": gg.f32})

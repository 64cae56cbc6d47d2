"""Each maximal elementwise region of an epilogue is one compute node over a generated straight-line
functor (codegen.evt._fuse_regions). The functors, built with g++ on the host, compute the IR
reference's values bit for bit up to libm's last-place differences, on random and special inputs
(NaN, infinities, signed zeros, denormals); and the regions leave the visitor tree only the nodes
that are not elementwise."""

from __future__ import annotations

import random
import shutil
import struct

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen.evt import build_epilogue
from gemmgen.ir.reference import error_scale, evaluate_epilogue
from tests.ir.test_ops import host_program

#: Values every input takes somewhere: NaN, both infinities and zeros, denormals, the largest and
#: smallest normal floats, and ordinary ones.
SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -1e-45, 1.1754944e-38, 3.4028235e38,
           -3.4028235e38, 1.0, -1.0, 0.5, 2.5, -7.0, 30.0, -30.0, 1e-3, 1e30]


def _expression(rng: random.Random, leaves: list[gg.Value]) -> gg.Value:
    """A random graph of every elementwise op over `leaves`: constants on either side, values
    used twice, where() over comparisons, clamp, leaky_relu."""
    pool = list(leaves)
    const = lambda: round(rng.choice((-1, 1)) * rng.uniform(0.25, 3), 3)  # noqa: E731
    unary = [lambda x: -x, gg.abs, gg.tanh, gg.sigmoid, gg.relu, gg.gelu, gg.gelu_tanh, gg.silu, gg.erf,
             gg.sin, gg.cos, lambda x: gg.exp(gg.tanh(x)), lambda x: gg.leaky_relu(x, rng.choice([0.01, 0.2])),
             lambda x: gg.clamp(x, -1.5, 2.0), lambda x: x - const(), lambda x: const() - x, lambda x: const() / x]
    binary = [lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y, lambda x, y: x / y, gg.min, gg.max,
              lambda x, y: gg.where(x > y, x, y * 0.5), lambda x, y: gg.where(gg.le(x, y), const(), y),
              lambda x, y: gg.where(gg.ne(x, y), x, const()), lambda x, y: gg.eq(x, y) + gg.ge(x, y) - gg.lt(y, x)]
    unused = list(leaves[1:])

    def pick() -> gg.Value:
        return unused.pop(rng.randrange(len(unused))) if unused and rng.random() < 0.5 else rng.choice(pool)

    for _ in range(rng.randint(2, 9)):  # a chain from the accumulator, each step reading the last
        if rng.random() < 0.4:
            pool.append(rng.choice(unary)(pool[-1] if len(pool) > len(leaves) else leaves[0]))
        else:
            pool.append(rng.choice(binary)(pool[-1] if len(pool) > len(leaves) else leaves[0], pick()))
    while unused:  # every operand read
        pool.append(rng.choice(binary)(pool[-1], unused.pop()))
    return pool[-1]


def _recipe(seed: int) -> gg.Recipe:
    rng = random.Random(seed)
    operands: dict[str, gg.Scalar | gg.RowVector | gg.ColVector | gg.Matrix | gg.Seed] = {
        "s": gg.Scalar(), "r": gg.RowVector(gg.bf16), "c": gg.ColVector(gg.f32), "m": gg.Matrix(gg.f16)}

    def epilogue(acc, s, r, c, m):
        return _expression(rng, [acc, s, r, c, m, acc * s])

    return gg.Recipe(f"region{seed}", epilogue, operands=operands)


def _bits(x: float) -> str:
    return f"{struct.unpack('<I', struct.pack('<f', x))[0]}u"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the region functors on the host")
def test_region_functors_compute_the_reference_on_special_values(tmp_path):
    """40 random single-region epilogues over every elementwise op, each on all pairs of special
    values for the accumulator and one operand and random values for the others: the functor
    (g++, host stand-ins for CUTLASS's macros) against the IR reference (`evaluate_epilogue` in
    fp32), NaN where NaN, equal where the reference is infinite, else within 2^-20 of the size
    of the reference's rounding error (`error_scale`: libm's and torch's last places differ)."""
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor(SPECIAL)
    acc = grid.repeat_interleave(len(SPECIAL)).reshape(-1, 1)  # every (acc, m) pair of special values
    m = grid.repeat(len(SPECIAL)).reshape(-1, 1)
    rows = acc.shape[0]
    cases: list[tuple[gg.Recipe, torch.Tensor, torch.Tensor]] = []
    program: list[str] = []
    for seed in range(40):
        recipe = _recipe(seed)
        code = build_epilogue(recipe.ir)
        if len(code.functors) != 1:  # a graph the IR reduced to one op, or a cast: no region to test
            continue
        name, functor = code.functors[0].name, code.functors[0].source
        params = functor.split("operator()(")[1].split(")")[0].replace("float ", "").split(", ")
        values = {"acc": acc, "in_s": torch.full((rows, 1), float(torch.randn((), generator=gen))),
                  "in_r": torch.randn((1, 1), generator=gen).bfloat16().float().expand(rows, 1),
                  "in_c": torch.randn((rows, 1), generator=gen), "in_m": m.half().float()}
        assert set(params) <= set(values), params
        operands: dict[str, torch.Tensor | float] = {"s": values["in_s"][0, 0], "r": values["in_r"][0],
                                                     "c": values["in_c"], "m": values["in_m"]}
        want = evaluate_epilogue(recipe.ir.epilogue, acc, operands, round_outputs=False)[0].expand(rows, 1)
        scale = error_scale(recipe.ir.epilogue, acc, operands).expand(rows, 1)
        k = len(cases)
        program.append(f"namespace r{k} {{\n{functor}\n}}")
        arrays = "".join(f"  static uint32_t const {p}[] = {{{', '.join(_bits(float(v)) for v in values[p][:, 0])}}};\n"
                         for p in params)
        call = f"r{k}::{name}{{}}({', '.join(f'f({p}[i])' for p in params)})"
        program.append(f"void run{k}() {{\n{arrays}  for (int i = 0; i < {rows}; ++i) p({call});\n}}")
        cases.append((recipe, want[:, 0], scale[:, 0]))
    assert len(cases) >= 25, f"only {len(cases)} of 40 random epilogues were one region"
    source = ("#include <gemmgen/epilogue.hpp>\n"
              "static float f(uint32_t b) { return __uint_as_float(b); }\n"
              'static void p(float r) { std::printf("%u\\n", __float_as_uint(r)); }\n'
              + "\n".join(program) + "\nint main() {\n" + "".join(f"  run{k}();\n" for k in range(len(cases))) + "}\n")
    out = torch.tensor([int(v) for v in host_program(tmp_path, source).split()], dtype=torch.int64)
    got = out.to(torch.int32).view(torch.float32).reshape(len(cases), rows)
    for (recipe, want, scale), g in zip(cases, got, strict=True):
        nan = want.isnan() & g.isnan()
        equal = g == want
        close = (g - want).abs() <= 2**-20 * scale.abs() + 1e-38
        ok = nan | equal | (close & want.isfinite() & g.isfinite())
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise AssertionError(f"{recipe.name}: {int((~ok).sum())} of {rows} values differ; first: acc "
                                 f"{float(acc[i, 0])!r}, m {float(m[i, 0])!r}: functor {float(g[i])!r}, "
                                 f"reference {float(want[i])!r}\n{build_epilogue(recipe.ir).functors[0].source}")

"""The epilogue each generated kernel declares computes its recipe: the visitor types in the C++
source, run by `gemmgen.testing.visitors` on the Params the runtime builds, against the recipe's
reference. No NVRTC: these kernels are rendered, not compiled, so every recipe and config is cheap
(tests/runtime/test_runtime.py runs the compiled kernels the same way, on their probed Params layout)."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import time
from collections.abc import Callable

import pytest
import torch

import gemmgen as gg
from gemmgen.codegen import render_kernel
from gemmgen.testing.calls import EMULATED, TOLERANCE, args_with_nonzero_reference, dense, emulated_shapes, padded
from gemmgen.testing.checks import assert_computes, emulated_call, uncompiled
from gemmgen.testing.cpp_types import CppType, parse_type
from gemmgen.testing.random_recipes import random_recipe
from gemmgen.testing.visitors import EpilogueInterpreter
from gemmgen.tuning.heuristic import SWAP_MAX_M, candidate_configs


def _prefixed(where: str) -> Callable[[str], str]:
    """assert_close's message, saying which output of which call differs."""
    return lambda message: f"{where}: {message}"


def _configs(recipe: gg.Recipe, pingpong: bool = True) -> list[gg.KernelConfig]:
    """The recipe's default, a pingpong kernel and the first valid swapped kernel."""
    ir = recipe.ir
    out = [recipe.default_config()]
    if pingpong:
        out.append(gg.KernelConfig(tile=(64, 128, 64), schedule=gg.Schedule.PINGPONG))
    out += [c for c in candidate_configs(ir, SWAP_MAX_M) if c.swap_ab and gg.codegen.is_valid(c, ir)][:1]
    return [c for c in dict.fromkeys(out) if gg.codegen.is_valid(c, ir)]


def test_every_recipe_under_plain_and_swapped_kernels(examples, extra):
    """Every example and coverage recipe, under its default config, a pingpong and a swapped kernel
    (the epilogue of D^T, rows and columns exchanged), over the emulation shapes."""
    count = 0
    for recipe in [*dense(examples).values(), *extra.values()]:  # grouped: tests/runtime/test_grouped_kernel.py
        for config in _configs(recipe):
            ck = uncompiled(recipe, config)
            for shape in emulated_shapes(recipe):
                assert_computes(ck, shape, f"{recipe.name} {config.name}")
            count += 1
    assert count >= 20


# ---- random epilogues

@pytest.mark.parametrize("dtype, scale, limit", [(gg.e4m3, 40.0, 448.0), (gg.e5m2, 4000.0, 57344.0)])
def test_fp8_outputs_saturate_as_the_kernel_converts(dtype, scale, limit):
    """An fp8 D past its range: the emulated kernel (CUTLASS's saturating conversion, as
    visitors.py models it) and the reference (reference.round_to) both give the largest finite
    value (torch's own cast to e5m2 gives inf), every other element within a unit in the last
    place; the amax sees the values before rounding."""
    from tests.data.gpu_matrix import fp8_out_recipe

    recipe = fp8_out_recipe(dtype)
    tol = TOLERANCE[dtype.torch]
    for config in _configs(recipe):
        a = padded(37, 96, torch.float8_e4m3fn, True, ())
        b = padded(96, 53, torch.float8_e4m3fn, False, ())
        want = recipe.reference(a, b, scale=scale)
        assert float(want[1]) > limit and (want[0].float().abs() == limit).any()
        (d, amax), _, _ = emulated_call(uncompiled(recipe, config), (37, 53, 96, 1), (a, b, {"scale": scale}, want))
        assert d.float().abs().max() == limit, config.name
        torch.testing.assert_close(d.float(), want[0].float(), rtol=tol, atol=tol)
        torch.testing.assert_close(amax, want[1], rtol=1e-5, atol=0)


def test_random_epilogues_compute_their_recipes():
    """60 random recipes (a new seed each run, printed on failure; GEMMGEN_TEST_SEED replays one),
    each under a plain and a swapped kernel: trees and graphs, aux outputs of shared and of leaf
    values, every op."""
    seed = int(os.environ.get("GEMMGEN_TEST_SEED") or time.time_ns() % 2**32)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layouts, swapped, made = set(), 0, 0
    while made < 60:
        try:
            recipe = random_recipe(rng, made)
        except gg.RecipeError:  # e.g. an output that folded to a constant
            continue
        shape = rng.choice(EMULATED)
        m, n, k, batch = shape
        try:
            drawn = args_with_nonzero_reference(recipe, m, n, k, (batch,) if recipe.ir.gemm.batched else ())
        except AssertionError:  # an output that is zero here for any input, as relu(-abs(x)): checks nothing
            continue
        made += 1
        for config in _configs(recipe, pingpong=False):
            ck = uncompiled(recipe, config)
            layouts.add(ck.generated.epilogue.layout)
            swapped += config.swap_ab
            assert_computes(ck, shape, f"seed {seed}: {recipe.name} {config.name}", drawn)
    assert layouts == {"tree", "dag"}, f"seed {seed}: only {layouts} epilogues drawn"
    assert swapped >= 30, f"seed {seed}: {swapped} swapped kernels"


@pytest.mark.nvrtc
def test_random_epilogues_are_valid_kernel_types(type_checks):
    """NVRTC accepts the kernel types of 30 random recipes (under a random candidate config and a
    random swapped one, in one translation unit, types only: tests/data/type_checks.py): each is the
    CUTLASS builders' (as the examples are, in test_codegen.py), gemmgen's model of its epilogue's
    shared storage is exact, and every Params field the runtime writes is a member of the kernel's
    Params of the size it writes."""
    kernels, compiled, seed = type_checks["random"]
    assert len(kernels) >= 30
    try:
        compiled.result()
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e


# ---- the check fails on wrong kernels

def _two_rows(layout: str) -> gg.Recipe:
    """Non-commutative ops over two row vectors of one type, a constant on the left and a matrix:
    one elementwise region, a tree (whose `acc - c` reads no Params, so that exchanging its inputs
    moves no operand), or (`x` read by D's region and by a reduction's) a graph."""
    def tree(acc, u, v, c):
        return (2.0 - (acc - c) * u) / (1.5 + gg.abs(v))

    def dag(acc, u, v, c):
        x = acc * c - u
        return {"d": x / (2.0 - gg.tanh(x * v)), "sum_sq": gg.sum(x * x, dim=1)}

    operands: dict[str, gg.Scalar | gg.RowVector | gg.ColVector | gg.Matrix | gg.Seed] = {
        "u": gg.RowVector(gg.bf16), "v": gg.RowVector(gg.bf16), "c": gg.Matrix(gg.bf16)}
    if layout == "tree":
        return gg.Recipe("two_rows_tree", tree, operands=operands)
    return gg.Recipe("two_rows_dag", dag, operands=operands, aux={"sum_sq": gg.f32})


def _exchange_children(source: str) -> str:
    """A compute node's first two inputs exchanged: the outermost Sm90EVT's children, or the Sub
    node's edges in a graph."""
    lines = source.splitlines()
    trees = [i for i, line in enumerate(lines) if line.startswith("using EVT")]
    dags = [i for i, line in enumerate(lines) if line.startswith("using EpilogueDag = ")]
    for i in [*reversed(trees), *dags]:
        name, _, decl = lines[i].removeprefix("using ").partition(" = ")
        t = parse_type(decl.rstrip(";"))
        if i in trees and len(t.args) >= 3:
            lines[i] = f"using {name} = {CppType(t.name, (t.args[0], t.args[2], t.args[1], *t.args[3:]))};"
        elif i in dags:
            ops = [o.name for o in t.args[2:]]
            k = next(j for j, o in enumerate(ops) if o.startswith("Sub"))
            seqs = list(t.args[1].args)
            seqs[k] = CppType(seqs[k].name, seqs[k].args[::-1])
            edges = CppType(t.args[1].name, tuple(seqs))
            lines[i] = f"using {name} = {CppType(t.name, (t.args[0], edges, *t.args[2:]))};"
        else:
            continue
        return "\n".join(lines)
    raise AssertionError("no compute node of two inputs")


def _exchange_statement_arguments(source: str) -> str:
    """Inside a region's functor, the subtraction's two arguments exchanged."""
    mutated, count = re.subn(r"\bSub\{\}\((\w+), (\w+)\)", r"Sub{}(\2, \1)", source, count=1)
    assert count == 1, "no subtraction in a region's functor"
    return mutated


def _exchange_vector_places(generated):
    """u's Params fields written at v's visitor and v's at u's."""
    expr = {f.name: f.expr for f in generated.fields}
    swap = {"epilogue.row.u.ptr": expr["epilogue.row.v.ptr"], "epilogue.row.v.ptr": expr["epilogue.row.u.ptr"]}
    fields = tuple(dataclasses.replace(f, expr=swap.get(f.name, f.expr)) for f in generated.fields)
    return dataclasses.replace(generated, fields=fields)


_SOURCE_MUTATIONS = {
    "children exchanged": _exchange_children,
    "a statement's arguments exchanged": _exchange_statement_arguments,
    "constant on the other side": lambda s: s.replace("WithLhs<Sub", "WithRhs<Sub"),
    "bf16 vector read as f16": lambda s: s.replace("Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t",
                                                   "Sm90RowBroadcast<0, TileShape, cutlass::half_t", 1),
    "add for sub": lambda s: s.replace("Sub{}(", "Add{}(", 1),
}


@pytest.mark.parametrize("layout", ["tree", "dag"])
@pytest.mark.parametrize("mistake", [*_SOURCE_MUTATIONS, "operands at each other's places"])
def test_a_wrong_kernel_fails_the_check(layout, mistake):
    """The check can fail: one mistake in the generated source, or in where the runtime writes an
    operand's arguments, makes the emulated outputs miss the reference."""
    recipe = _two_rows(layout)
    config = recipe.default_config()
    assert render_kernel(recipe.ir, config).epilogue.layout == layout
    assert_computes(uncompiled(recipe, config), (7, 40, 129, 1), "unchanged")
    if mistake in _SOURCE_MUTATIONS:
        source = render_kernel(recipe.ir, config).source
        mutated = _SOURCE_MUTATIONS[mistake](source)
        assert mutated != source
        ck = uncompiled(recipe, config, lambda g: dataclasses.replace(g, source=mutated))
    else:
        ck = uncompiled(recipe, config, _exchange_vector_places)
    with pytest.raises(AssertionError, match="not close"):
        assert_computes(ck, (7, 40, 129, 1), mistake)


def test_interpreter_reads_the_callbacks_the_collective_gets(examples):
    """The interpreter starts from the CollectiveEpilogue's FusionCallbacks argument, not from a
    declaration it guesses: the example with a graph epilogue is interpreted from EpilogueDag."""
    r = examples["residual_norm_stats"]
    interp = EpilogueInterpreter(render_kernel(r.ir, r.default_config()).source)
    assert interp.callbacks.name == "cutlass::epilogue::fusion::Sm90TopologicalVisitor"
    assert interp.element_d == torch.bfloat16 and interp.element_c == torch.bfloat16

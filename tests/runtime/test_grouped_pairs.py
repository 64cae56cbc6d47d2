"""Grouped (MoE) kernels over adjacent column pairs: gated experts (act(gate) * up per expert) and
their recomputing backward. The register visitors of pairs.hpp take per-group pointers there
(`Element*`, each at its group's first row); this checks the call's arguments, the emulation of
both launches through the Params the runtime builds against the recipe's reference, and that the
check fails when the source or the arguments are wrong. The compiled kernel and CUTLASS's host
code: tests/runtime/test_grouped_oracle.py."""

from __future__ import annotations

import pytest
import torch

import gemmgen as gg
from gemmgen.compile import CompiledKernel
from gemmgen.errors import ConfigError, InvalidArgument
from gemmgen.runtime.grouped import Column, GroupedArguments
from gemmgen.testing.calls import padded
from gemmgen.testing.checks import source_replaced, uncompiled
from gemmgen.testing.emulate import emulate_grouped
from gemmgen.testing.grouped import cpu_grouped_kernel, moe_recipe, moe_swiglu_recipe
from gemmgen.tuning.heuristic import grouped_choice
from gemmgen.types import OperandKind


def _geglu_residual(acc, residual):
    """GEGLU plus a residual of the output's N/2 columns (a PairLoad per group)."""
    gate, up = gg.pairs(acc)
    return gg.gelu(gate) * up + residual


RECIPES = {
    "swiglu": moe_swiglu_recipe(),
    "geglu_residual": gg.Recipe("moe_geglu_residual", _geglu_residual, grouped=True,
                                operands={"residual": gg.Matrix(gg.bf16)}),
    # the forward's GEMM again: reads dL/dD (N/2, grad_d) and writes dL/dacc (N columns, TMA)
    "swiglu_bwd": moe_swiglu_recipe().backward().kernel,
}
SM100 = gg.Arch.SM100A
#: sm_90a's default and a ping-pong kernel; sm_100a's one SM and pair (the pointer-array collective's void D)
CONFIGS = [gg.KernelConfig(), gg.KernelConfig(tile=(64, 128, 64), cluster=(2, 1, 1), schedule=gg.Schedule.PINGPONG),
           gg.KernelConfig(tile=(128, 128, 64), schedule=gg.Schedule.ONE_SM, arch=SM100),
           gg.KernelConfig(tile=(256, 128, 64), cluster=(2, 1, 1), schedule=gg.Schedule.TWO_SM, arch=SM100)]
# (rows, K, N, groups), offsets: an empty group and rows after the last; one row, groups over
# several tiles, K and N tails; the smallest pair
SHAPES = [((37, 64, 48, 4), (5, 5, 20, 30)), ((300, 72, 136, 3), (1, 129, 300)), ((9, 24, 2, 2), (0, 9))]


def _inputs(recipe: gg.Recipe, rows: int, k: int, n: int, groups: int, offsets: tuple[int, ...]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Fresh A (rows 8 past K apart), B per group (K-major), and each operand as a caller gives it:
    row vectors per group with 16-byte aligned rows, column vectors per row, matrices (N/2 columns
    for a pair's half) with padded rows."""
    a = torch.randn(rows, k + 8).bfloat16()[:, :k]
    b = torch.randn(groups, n, k).bfloat16().transpose(1, 2)
    ops: dict[str, torch.Tensor] = {}
    for o in recipe.ir.epilogue.operands:
        if o.kind is OperandKind.ROW:
            ops[o.name] = torch.randn(groups, -(-n // 8) * 8 + 8).to(o.dtype.torch)[:, :n]
        elif o.kind is OperandKind.COL:
            ops[o.name] = (torch.rand(rows) + 0.5).to(o.dtype.torch)
        else:
            ops[o.name] = padded(rows, o.columns.extent(n), o.dtype.torch, True, ())
    return a, b, torch.tensor(offsets, dtype=torch.int32), ops


def _emulated(recipe: gg.Recipe, ck: CompiledKernel, rows: int, k: int, n: int, groups: int,
              offsets: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(D as the emulated launches of `recipe`'s kernel `ck` wrote it, the reference): D
    NaN-filled with padded rows."""
    kernel = cpu_grouped_kernel(ck)
    a, b, offs, ops = _inputs(recipe, rows, k, n, groups, offsets)
    out = padded(rows, recipe.ir.outputs[0].columns.extent(n), recipe.gemm.d.torch, True, (), fill=float("nan"))
    p = kernel.prepare(a, b, offs, out=out, **ops)
    assert p.setup is not None and p.params is not None and p.buffer is not None
    emulate_grouped(ck, p.setup, p.params, kernel._encode, [a, b, offs, *ops.values(), out, p.buffer])
    want = recipe.reference(a, b, offs, **ops).float()
    assert want.nan_to_num().abs().sum() > 0
    return out.float(), want


def test_the_example_is_the_recipe_tested_here(examples):
    assert examples["moe_swiglu"].key == moe_swiglu_recipe().key


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("shape, offsets", SHAPES)
def test_emulated_groups_over_pairs_compute_the_recipe(name, config, shape, offsets):
    """Both launches emulated: the setup kernel's per-group pointers (the PairStore's and PairLoad's
    at each group's first row), then per group the epilogue the source declares; rows in no group
    stay NaN."""
    rows, k, n, groups = shape
    out, want = _emulated(RECIPES[name], uncompiled(RECIPES[name], config), rows, k, n, groups, offsets)
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.parametrize("activation", ["silu", "swiglu"])
@pytest.mark.parametrize("shape, offsets", SHAPES[:2])
def test_the_kernels_grouped_linears_backward_launches_compute_their_recipe(activation, shape, offsets):
    """GroupedLinear's backward kernels (`backward_launches`: the derived recipe under the
    heuristic's picks for many and for few rows per expert, swapped where it swaps), emulated
    against their reference: dL/dD read per group as C (N columns, or N/2 as pairs' halves),
    dL/dacc written at N."""
    from gemmgen.nn import GroupedLinear

    rows, k, n, groups = shape
    layer = GroupedLinear(groups, k, n // 2 if activation == "swiglu" else n, activation=activation, device="meta")
    derived = layer.derived_backward
    assert derived is not None
    every = [(r, c) for rows_ in (None, groups) for r, c in layer.backward_launches(rows_)]
    launches = {c.name: (r, c) for r, c in every if r is derived.kernel}
    assert len(launches) == (1 if activation == "swiglu" else 2), list(launches)  # pairs: never swapped
    # ...then dx's grouped GEMM and dW's K-grouped one (test_k_grouped emulates those)
    assert {r.name for r, _ in every if r is not derived.kernel} == {"grouped_input_grad_bf16",
                                                                      "grouped_weight_grad_bf16"}
    for recipe, config in launches.values():
        out, want = _emulated(recipe, uncompiled(recipe, config), rows, k, n, groups, offsets)
        torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)


@pytest.mark.parametrize("config", CONFIGS[::2], ids=lambda c: c.arch.value)
def test_the_grouped_register_visitors_take_per_group_pointers(config):
    """A grouped kernel names its pair visitors' elements as pointers (pairs.hpp's TensorOf<E*>),
    stores no D of its own when D is N/2 wide, and has no TMA store of D in its Params."""
    g = uncompiled(RECIPES["swiglu"], config).generated
    assert "gemmgen::epi::PairStore<cutlass::bfloat16_t*," in g.source and not g.epilogue.stores_d
    assert {f.name for f in g.fields} >= {"epilogue.pair_store.d.ptr", "epilogue.pair_store.d.stride_m"}
    assert not {f.name for f in g.fields} & {"epilogue.tma_d", "epilogue.ptr_d", "epilogue.stride_d"}
    assert "using ElementD = void;" in g.source
    bwd = uncompiled(RECIPES["swiglu_bwd"], config).generated
    assert "gemmgen::epi::PairLoad<cutlass::bfloat16_t*," in bwd.source and bwd.epilogue.stores_d


@pytest.mark.parametrize("mistake", ["a dense visitor", "even and odd exchanged", "every group at the first's rows",
                                     "the row stride off by one"])
@pytest.mark.parametrize("config", CONFIGS[::2], ids=lambda c: c.arch.value)
def test_a_wrong_grouped_pairing_fails_the_check(mistake, config, monkeypatch):
    """Each mistake fails the emulated call (of sm_90a's kernel and sm_100a's): the source's
    PairStore in the dense form, the pairs' halves exchanged, the PairStore's per-group pointers
    all at D's first row, its row stride wrong."""
    recipe = RECIPES["swiglu"]
    mutate = None
    if mistake == "a dense visitor":
        mutate = source_replaced("PairStore<cutlass::bfloat16_t*,", "PairStore<cutlass::bfloat16_t,")
    elif mistake == "even and odd exchanged":
        mutate = source_replaced("gemmgen::epi::PairEven,", "gemmgen::epi::PairOdd,")
    elif mistake == "every group at the first's rows":
        columns = GroupedArguments.columns
        monkeypatch.setattr(GroupedArguments, "columns", lambda self, call, d: [
            c._replace(per_row=0) if c.field == "epilogue.pair_store.d.ptr" else c for c in columns(self, call, d)])
    else:
        values = GroupedArguments.values

        def off_by_one(self, *args, **kw):
            v = values(self, *args, **kw)
            v["epilogue.pair_store.d.stride_m"] = int(v["epilogue.pair_store.d.stride_m"]) + 1
            return v
        monkeypatch.setattr(GroupedArguments, "values", off_by_one)
    with pytest.raises(Exception) as failed:  # an assertion or the source check: either fails it
        out, want = _emulated(recipe, uncompiled(recipe, config, mutate), 37, 64, 48, 4, (5, 5, 20, 30))
        torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2, equal_nan=True)
    assert isinstance(failed.value, AssertionError | gg.errors.GemmgenError), failed.value


def test_grouped_calls_over_pairs_are_checked_at_n_over_2():
    """D and a pair's-half operand have N/2 columns: a full-width one is refused naming the shape,
    and an odd N is refused with a fix that works."""
    recipe = RECIPES["geglu_residual"]
    kernel = cpu_grouped_kernel(uncompiled(recipe, CONFIGS[0]))
    a, b, offs, ops = _inputs(recipe, 37, 64, 48, 4, (5, 5, 20, 30))
    with pytest.raises(InvalidArgument, match=r"out: expected shape \(37, 24\)"):
        kernel.prepare(a, b, offs, out=torch.empty(37, 48).bfloat16(), **ops)
    with pytest.raises(InvalidArgument, match=r"residual: expected shape \(37, 24\)"):
        kernel.prepare(a, b, offs, residual=torch.empty(37, 48).bfloat16())
    assert kernel.prepare(a, b, offs, **ops).output.shape == (37, 24)
    odd = torch.randn(4, 47, 64).bfloat16().transpose(1, 2)
    with pytest.raises(InvalidArgument, match=r"b: 47 columns; .* pass B with 48 or 46 columns"):
        kernel.prepare(a, odd, offs, **ops)
    fixed = torch.randn(4, 46, 64).bfloat16().transpose(1, 2)
    residual = padded(37, 23, torch.bfloat16, True, ())
    assert kernel.prepare(a, fixed, offs, residual=residual).output.shape == (37, 23)


def test_a_swapped_kernel_is_refused_and_never_chosen():
    """A swapped grouped kernel would take the pairs from a group's rows: refused with the fix, and
    the heuristic keeps the unswapped kernel for groups of few rows (it swaps moe_up's)."""
    recipe = RECIPES["swiglu"]
    with pytest.raises(ConfigError, match=r"swap_ab=True: .* adjacent column pairs .* use swap_ab=False"):
        recipe.build(gg.KernelConfig(tile=(128, 32, 64), swap_ab=True))
    choice = grouped_choice(recipe.ir, 8 * 4, 8)
    assert not choice.config.swap_ab and "column pairs" in choice.why
    assert grouped_choice(moe_recipe().ir, 8 * 4, 8).config.swap_ab


def test_the_pair_store_column_is_each_groups_first_row():
    """The setup kernel's column for the PairStore's pointers: D's address plus the group's first row
    times D's row stride in bytes (N/2 columns, padded to 16 bytes)."""
    recipe = RECIPES["swiglu"]
    kernel = cpu_grouped_kernel(uncompiled(recipe, CONFIGS[0]))
    a, b, offs, ops = _inputs(recipe, 37, 64, 50, 4, (5, 5, 20, 30))
    p = kernel.prepare(a, b, offs, **ops)
    assert p.output.shape == (37, 25) and p.output.stride() == (32, 1)
    plan = next(iter(kernel._plans.values()))
    column = next(c for c in plan.columns if c.field == "epilogue.pair_store.d.ptr")
    assert column == Column("epilogue.pair_store.d.ptr", 0, 32 * 2, 0)


def test_empty_and_zero_k_over_pairs():
    """No rows: nothing to launch, D (0, N/2), as torch; K = 0: each group's epilogue of a zero
    accumulator, N/2 wide, rows after the last group left as they were."""
    recipe = RECIPES["swiglu"]
    kernel = cpu_grouped_kernel(uncompiled(recipe, CONFIGS[0]))
    a, b, offs, ops = _inputs(recipe, 0, 64, 48, 4, (0, 0, 0, 0))
    empty = kernel.prepare(a, b, offs, **ops)
    assert empty.params is None and empty.output.shape == (0, 24)
    a, b, offs, ops = _inputs(recipe, 37, 0, 48, 4, (5, 5, 20, 30))
    out = torch.full((37, 24), float("nan")).bfloat16()
    assert kernel.prepare(a, b, offs, out=out, **ops).params is None
    want = recipe.reference(a, b, offs, **ops).float()
    assert want[:30].abs().sum() > 0
    torch.testing.assert_close(out[:30].float(), want[:30])
    assert out[30:].float().isnan().all()

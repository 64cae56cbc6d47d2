"""What the GPU tests of every arch share: inputs of a recipe (small integers for the exact tier,
fresh random values otherwise; padded leading dimensions), NaN-filled outputs, and the comparison
against the recipe's reference (exact where its math is, else by output dtype), for each kernel
of a list (`check_kernels`)."""

from __future__ import annotations

import torch

import gemmgen as gg
from gemmgen.ir import BlockOp, Op, Reduction
from gemmgen.ir.reference import reference
from gemmgen.runtime.quantize import random_block_scale
from gemmgen.testing.calls import output_tolerance
from gemmgen.testing.tensors import assert_output_close, assert_outputs_close, strided_matrix
from gemmgen.types import Layout, OperandKind

EXACT_OPS = {Op.ACC, Op.INPUT, Op.CONST, Op.ADD, Op.SUB, Op.MUL, Op.NEG, Op.ABS, Op.MIN, Op.MAX, Op.RELU, Op.CAST}


def matrix(rows, cols, dtype, layout, lead, pad_bytes, gen, exact):
    """A (lead,) rows x cols tensor in `layout`, with `pad_bytes` (a multiple of 16) more per
    leading dimension than TMA's 16-byte alignment needs."""
    def values(*shape):
        if exact:
            return torch.randint(-2, 3, shape, device="cuda", generator=gen)
        return torch.randn(*shape, device="cuda", generator=gen)

    if dtype == torch.float4_e2m1fn_x2:  # packed fp4: K (the contiguous dim, K-major) in pairs of codes
        rows, cols = (rows, -(-cols // 2)) if layout is Layout.ROW else (-(-rows // 2), cols)
        return strided_matrix(lambda *shape: _fp4_codes(shape, gen, exact), rows, cols, torch.uint8, layout, lead,
                              pad_bytes).view(dtype)
    return strided_matrix(values, rows, cols, dtype, layout, lead, pad_bytes // dtype.itemsize)


#: fp4 codes of 0, 1, 2, -1 and -2 (e2m1), packed in pairs: the exact tier's small integers
_FP4_SMALL = (0x0, 0x2, 0x4, 0xA, 0xC)


def _fp4_codes(shape, gen, exact):
    """Random bytes of two fp4 codes each: any code, or small integers for the exact tier."""
    if not exact:
        return torch.randint(0, 256, shape, device="cuda", generator=gen, dtype=torch.uint8)
    small = torch.tensor(_FP4_SMALL, device="cuda", dtype=torch.uint8)
    pick = torch.randint(0, len(_FP4_SMALL), (2, *shape), device="cuda", generator=gen)
    return small[pick[0]] | (small[pick[1]] << 4)


def whole_pairs(recipe, n):
    """N made even for an epilogue over column pairs (which needs whole pairs)."""
    return n + n % 2 if recipe.ir.epilogue.pairs else n


def inputs(recipe, m, n, k, gen, exact, pad_bytes=0, batch=3):
    g = recipe.ir.gemm
    n = whole_pairs(recipe, n)
    lead = (batch,) if g.batched else ()
    a = matrix(m, k, g.a.torch, g.layout_a, lead, pad_bytes, gen, exact)
    b = matrix(k, n, g.b.torch, g.layout_b, lead, pad_bytes, gen, exact)
    ops: dict[str, torch.Tensor | float] = {}
    for o in recipe.operands:
        if o.kind.block_scale:  # powers of two keep exact-tier results exact (MXFP8's are already)
            s = random_block_scale(o.kind, g, m, n, k, lead, "cuda")
            if exact and g.microscaling is not gg.MXFP8:
                s = torch.exp2(torch.round(torch.log2(s.float()))).to(s.dtype)
            ops[o.name] = s
        elif o.kind is OperandKind.SCALAR and o.per_batch:
            ops[o.name] = torch.full(lead, 2.0, device="cuda") if exact else torch.randn(lead, generator=gen,
                                                                                         device="cuda")
        elif o.kind is OperandKind.SCALAR:
            ops[o.name] = 2.0 if exact else float(torch.randn((), generator=gen, device="cuda"))
        elif o.kind is OperandKind.SEED:  # read by the kernel at launch
            ops[o.name] = torch.randint(0, 2**62, (1,), generator=gen, device="cuda")
        elif o.kind is OperandKind.MATRIX:  # N/2 columns where it meets column pairs; shared: no batch
            ops[o.name] = matrix(m, o.columns.extent(n), o.dtype.torch, g.layout_d, lead[:o.per_batch], pad_bytes,
                                  gen, exact)
        else:  # one per batch (`per_batch`): each batch's vector 16-byte aligned (rows of a padded matrix)
            length = n if o.kind is OperandKind.ROW else m
            if o.per_batch:
                ops[o.name] = matrix(batch, length, o.dtype.torch, Layout.ROW, (), pad_bytes, gen, exact)
                continue
            ops[o.name] = (torch.randint(-2, 3, (length,), device="cuda", generator=gen) if exact
                           else torch.randn(length, device="cuda", generator=gen)).to(o.dtype.torch)
    return a, b, ops


def nan_outputs(recipe, m, n, batch=3):
    """NaN-filled outputs: M x N with padded rows, or a reduction's fp32 values per batch (an amax
    over M and N the runtime must zero before the kernel max-reduces into it, a vector the kernel
    writes whole)."""
    lead = (batch,) if recipe.ir.gemm.batched else ()
    n = whole_pairs(recipe, n)
    nans = lambda *shape: torch.full(shape, float("nan"), device="cuda")  # noqa: E731
    return tuple(nans(*o.shape((*lead, m, n))) if o.reduce is not None
                 else strided_matrix(nans, m, o.columns.extent(n), o.dtype.torch, recipe.ir.gemm.layout_d, lead)
                 for o in recipe.outputs)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def check_kernels(kernels, gen, m, n, k, exact, pad_bytes=0, prefilled=True):
    """Each (recipe, config, kernel) on fresh inputs against its recipe's reference: into
    NaN-filled outputs (`prefilled`), or into those the kernel allocates."""
    for recipe, _config, kernel in kernels:
        a, b, ops = inputs(recipe, m, n, k, gen, exact, pad_bytes=pad_bytes)
        if prefilled:
            out = nan_outputs(recipe, m, n)
            got = as_tuple(kernel(a, b, out=out if len(out) > 1 else out[0], **ops))
        else:
            got = as_tuple(kernel(a, b, **ops))
        torch.cuda.synchronize()
        compare(recipe, got, a, b, ops, exact)


def compare(recipe, got, a, b, ops, exact):
    """Exact where the recipe's math is (small integers: no rounding anywhere; sums aside, which
    can pass 2^24), else within the output dtype's tolerance (a sum: within the bound of its
    summation order, `assert_output_close`)."""
    want = as_tuple(recipe.reference(a, b, **ops))
    scale = reference(recipe.ir, a, b, ops, magnitudes=True)
    got = tuple(g.cpu() for g in got)
    for o, g, w in zip(recipe.outputs, got, want, strict=True):
        assert not torch.isnan(g.float()).any(), f"{recipe.name}.{o.name}: NaN left in the output"
        assert w.float().abs().max() > 0, "reference must not be all zeros"
    blocks = recipe.ir.epilogue.row_blocks  # an RMSNorm's rsqrtf is within 2 ulp, not exact
    exact_math = all(n.op in EXACT_OPS for n in recipe.ir.epilogue.nodes) and (
        blocks is None or blocks.op is BlockOp.QUANTIZE)
    problem = (a.shape[-2], b.shape[-1])

    def tolerance(o, w):
        tol = output_tolerance(recipe, o)
        return tol, 0.0 if o.reduce is Reduction.SUM else tol * float(w.float().abs().max())

    if not (exact and exact_math):  # a quantized output by its dequantized values
        assert_outputs_close(recipe.outputs, got, want, scale, problem, tolerance, recipe.name)
        return
    for o, g, w, mag in zip(recipe.outputs, got, want, scale, strict=True):
        if o.reduce is Reduction.SUM:
            rtol, atol = tolerance(o, w)
            assert_output_close(o, g.float(), w.float(), mag, problem, rtol, atol, f"{recipe.name}.{o.name}")
        else:
            assert torch.equal(g.float(), w.float()), f"{recipe.name}.{o.name}: not exact"

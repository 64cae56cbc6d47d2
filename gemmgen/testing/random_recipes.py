"""Random recipes, for checks of what gemmgen generates (tests and scripts only)."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

import gemmgen as gg

_DTYPES = (gg.bf16, gg.f16, gg.f32)
_OUT_DTYPES = (*_DTYPES, gg.e4m3, gg.e5m2)  # D and aux outputs may also be fp8 (saturating)


#: The reductions a random recipe's aux output may be, and whether each takes the recipe's `dim`
#: (else it reduces over M and N).
_REDUCTIONS: tuple[tuple[Callable[..., Any], bool], ...] = (
    (gg.amax, False), (gg.amax, True), (gg.sum, True), (gg.reduce_max, True), (gg.reduce_min, True),
    (gg.reduce_max, False), (gg.reduce_min, False), (gg.logsumexp, True))


def random_recipes(rng: random.Random, count: int) -> list[gg.Recipe]:
    """`count` random recipes (`random_recipe`), named random0 ..., drawn again where the DSL refuses a draw."""
    recipes: list[gg.Recipe] = []
    while len(recipes) < count:
        try:
            recipes.append(random_recipe(rng, len(recipes)))
        except gg.RecipeError:
            continue
    return recipes


def random_recipe(rng: random.Random, index: int) -> gg.Recipe:
    """Recipe `random<index>`: random operands (every kind, dtype and both scalar forms; a batched
    recipe's scalars and vectors shared by the batches or one per batch, its matrices one per batch
    or one for every batch), a random graph of every op over them (constants on either side, shared
    values, casts), random aux outputs (some of them reductions: an amax, a max and a min over M and
    N; sums, amaxes, maxes and mins over M or over N, a second one over the other dim), A/B/D types (fp8 A
    and B a third of the time, half of those with block scales of a random granularity) and
    layouts, batched or not. Divisions and exponentials take bounded arguments, so that fp32 stays
    far from overflow. Raises RecipeError for the draws the DSL refuses (an output that folds to a
    constant); draw again."""
    batched = rng.random() < 0.3
    decls: dict[str, object] = {}
    for i in range(rng.randint(0, 4)):
        kind = rng.choice(["scalar", "constant", "row", "col", "matrix"])
        per_batch = batched and rng.random() < 0.5  # a batched recipe's scalars and vectors one per batch,
        # its matrices one for every batch
        decls[f"x{i}"] = {"scalar": lambda p: gg.Scalar(per_batch=p),
                          "constant": lambda p: gg.Scalar(value=rng.uniform(-2, 2)),
                          "row": lambda p: gg.RowVector(rng.choice(_DTYPES), per_batch=p),
                          "col": lambda p: gg.ColVector(rng.choice(_DTYPES), per_batch=p),
                          "matrix": lambda p: gg.Matrix(rng.choice(_DTYPES), per_batch=not p)}[kind](per_batch)
    n_aux = rng.randint(0, 2)
    reduced = {j for j in range(n_aux) if rng.random() < 0.4}  # these are reductions
    dim = rng.choice((0, 1))  # of the recipe's first vector reduction; a second one's is the other
    steps = rng.randint(1, 8)

    def epilogue(acc: gg.Value, **ops: gg.Value) -> gg.Value | dict[str, gg.Value | gg.dsl.Reduced]:
        pool = [acc, *ops.values()]
        unused = list(ops.values())

        def pick() -> gg.Value:
            return unused.pop(rng.randrange(len(unused))) if unused and rng.random() < 0.6 else rng.choice(pool)

        def const() -> float:  # never 0: a division by it stays finite
            return round(rng.choice((-1, 1)) * rng.uniform(0.25, 3), 3)

        unary = [lambda x: -x, gg.abs, gg.tanh, gg.sigmoid, gg.relu, gg.gelu, gg.gelu_tanh, gg.silu,
                 lambda x: gg.exp(gg.tanh(x)), lambda x: gg.leaky_relu(x, rng.choice([0.01, 0.2])),
                 lambda x: gg.cast(x, rng.choice([gg.bf16, gg.f16, gg.e4m3, gg.e5m2])),
                 lambda x: gg.clamp(x, -1.5, 2.0)]
        binary = [lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y, lambda x, y: x / (1.5 + gg.abs(y)),
                  gg.min, gg.max, lambda x, y: x - const(), lambda x, y: const() - x, lambda x, y: const() * x,
                  lambda x, y: x / const() if rng.random() < 0.5 else const() / (1.5 + gg.abs(x))]
        for _ in range(steps + len(unused)):
            v = rng.choice(unary)(pick()) if rng.random() < 0.4 else rng.choice(binary)(pick(), pick())
            pool.append(v)
        while unused:
            pool.append(pool[-1] + unused.pop())
        outs: dict[str, gg.Value | gg.dsl.Reduced] = {"d": pool[-1]}
        for j in range(n_aux):
            v = rng.choice(pool)
            if j in reduced:
                reduce, over_one_dim = rng.choice(_REDUCTIONS)
                outs[f"aux{j}"] = reduce(v, dim if j == 0 else 1 - dim) if over_one_dim else reduce(v)
            else:
                outs[f"aux{j}"] = v
        return outs

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in decls]
    epilogue.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    a = rng.choice([gg.bf16, gg.f16, gg.e4m3])
    b = rng.choice([gg.e4m3, gg.e5m2]) if a is gg.e4m3 else a
    layout_a, layout_b = rng.choice([gg.RowMajor, gg.ColMajor]), rng.choice([gg.RowMajor, gg.ColMajor])
    block_scale = None
    if a is gg.e4m3:  # fp8 WGMMA reads A and B K-major only
        layout_a, layout_b = gg.RowMajor, gg.ColMajor
        if rng.random() < 0.5:  # A's scales loaded with TMA, B's, or neither (both read per element)
            block_scale = rng.choice([(1, 128, 128), (128, 128, 128), (128, 1, 128), (1, 1, 128), (32, 64, 128)])
    return gg.Recipe(f"random{index}", epilogue, a=a, b=b, d=rng.choice(_OUT_DTYPES), layout_a=layout_a,
                     layout_b=layout_b, batched=batched, operands=decls,  # type: ignore[arg-type]
                     block_scale=block_scale,
                     aux={f"aux{j}": gg.f32 if j in reduced else rng.choice(_OUT_DTYPES) for j in range(n_aux)})

"""C++ type spellings every architecture's kernel shares (each arch's `types` module binds them)."""

from __future__ import annotations

from ..ir import RecipeIR


def problem_shape(recipe: RecipeIR) -> str:
    """(M, N, K, L) per launch, or (M, N, K) per group read from device memory."""
    if recipe.gemm.grouped:
        return "cutlass::gemm::GroupProblemShape<Shape<int, int, int>>"
    return "Shape<int, int, int, int>"


def epilogue_strides(recipe: RecipeIR) -> tuple[str, str]:
    """C's and D's stride types as the epilogue's shared-memory atoms are chosen from them: a grouped
    kernel's strides are per-group arrays, whose element is the stride."""
    if recipe.gemm.grouped:
        return "cute::remove_pointer_t<StrideC>", "cute::remove_pointer_t<StrideD>"
    return "StrideC", "StrideD"


def block_scale_decls(scale_config: str) -> list[tuple[str, str]]:
    """The blockwise main loop's scale config (CUTLASS's Sm90/Sm100BlockwiseScaleConfig<...>) and the
    scale layouts it deduces."""
    return [("ScaleConfig", scale_config), ("LayoutSFA", "decltype(ScaleConfig::deduce_layoutSFA())"),
            ("LayoutSFB", "decltype(ScaleConfig::deduce_layoutSFB())")]


def epilogue_tile_type(tile: tuple[int, int] | None) -> str:
    """CUTLASS's EpilogueTileAuto, or the (M, N) tile an arch's geometry spells out (None: Auto)."""
    return "cutlass::epilogue::collective::EpilogueTileAuto" if tile is None else f"Shape<_{tile[0]}, _{tile[1]}>"

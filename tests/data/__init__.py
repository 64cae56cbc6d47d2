"""The repository's files the tests read: the example recipes, the extra-coverage recipes (extra_recipes.py)
and the kernels the GPU check runs (gpu_matrix.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "recipes.py"
EXTRA = ROOT / "tests" / "data" / "extra_recipes.py"

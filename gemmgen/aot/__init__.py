"""Ahead of time and at model load: recipes files, warm-up, bundles (written here, read by
`compile.bundles`)."""

from .bundle import add_bundle, write_bundle
from .recipes_file import load_recipes
from .warmup import build, build_bundle, build_file, pairs_of, unfused_report, warmup, with_tuned_winners

__all__ = ["add_bundle", "build", "build_bundle", "build_file", "load_recipes", "pairs_of", "unfused_report", "warmup",
           "with_tuned_winners", "write_bundle"]

"""Loading the recipes a Python file declares (module-level gemmgen.Recipe objects)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from ..dsl import Recipe
from ..errors import GemmgenError


def load_recipes(path: str | Path) -> dict[str, Recipe]:
    """Import `path` and return its module-level recipes by attribute name, in definition order."""
    path = Path(path).resolve()
    if not path.is_file():
        raise GemmgenError(f"recipes file {str(path)!r} does not exist")
    mod_name = f"_gemmgen_recipes_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module = sys.modules.get(mod_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise GemmgenError(f"cannot import recipes file {str(path)!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
    recipes = {k: v for k, v in vars(module).items() if isinstance(v, Recipe)}
    if not recipes:
        raise GemmgenError(f"{path.name} declares no module-level gemmgen.Recipe")
    names: dict[str, str] = {}
    for attr, r in recipes.items():
        if r.name in names and recipes[names[r.name]] is not r:
            raise GemmgenError(f"{path.name}: recipes {names[r.name]!r} and {attr!r} share the kernel name {r.name!r}")
        names[r.name] = attr
    return {attr: r for attr, r in recipes.items() if names[r.name] == attr}

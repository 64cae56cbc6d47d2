"""Loading the recipes a Python file declares (module-level gemmgen.Recipe objects)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import sys
import traceback
from pathlib import Path

from ..dsl import Recipe
from ..errors import GemmgenError


def load_recipes(path: str | Path) -> dict[str, Recipe]:
    """Import `path` and return its module-level recipes by attribute name, in definition order.

    A file that cannot be read or run is a GemmgenError naming the file, the line and the error
    (a recipe's own GemmgenError keeps its message), not a traceback."""
    path = Path(path).resolve()
    if path.is_dir():
        raise GemmgenError(f"recipes file {str(path)!r} is a directory; name the Python file that declares the "
                           "recipes (e.g. examples/recipes.py)")
    if not path.is_file():
        raise GemmgenError(f"recipes file {str(path)!r} does not exist")
    mod_name = f"_gemmgen_recipes_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module = sys.modules.get(mod_name)
    if module is None:
        loader = importlib.machinery.SourceFileLoader(mod_name, str(path))  # any file name, not only *.py
        spec = importlib.util.spec_from_file_location(mod_name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            loader.exec_module(module)
        except BaseException as e:
            del sys.modules[mod_name]
            if isinstance(e, Exception):
                raise _file_error(path, e) from None
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


def _file_error(path: Path, e: Exception) -> GemmgenError:
    """`e`, raised while running the recipes file, as an error that names the file and line."""
    if isinstance(e, SyntaxError):
        where = f"{path}:{e.lineno}" if e.lineno else str(path)
        return GemmgenError(f"{where}: {e.msg} (the recipes file is not valid Python)")
    if isinstance(e, UnicodeDecodeError):
        return GemmgenError(f"{path}: not a text file ({e.reason}); name the Python file that declares the recipes")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    where = f"{path}:{frames[-1].lineno}" if frames else str(path)
    what = str(e) if isinstance(e, GemmgenError) else f"{type(e).__name__}: {e}"
    return GemmgenError(f"{where}: {what}")

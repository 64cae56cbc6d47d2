"""Problem shapes as users write them: [M, N, K] or [M, N, K, L], and shapes files of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import GemmgenError


def problem_shape(shape: Any, where: str) -> tuple[int, int, int, int]:
    """[M, N, K] or [M, N, K, L] of positive ints, as (M, N, K, L); `where` names it in the error."""
    p = tuple(shape) if isinstance(shape, list | tuple) else ()
    if len(p) not in (3, 4) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in p):
        raise GemmgenError(f"{where}: shape {shape!r}; expected [M, N, K] or [M, N, K, L] of positive integers")
    return (*p, 1) if len(p) == 3 else p


def load_shapes(path: str | Path) -> dict[str, list]:
    """A shapes file: JSON {recipe name: [[M, N, K] or [M, N, K, L], ...]}; keys starting with '_'
    are comments. Every shape is checked here, so a mistake names the file and the entry."""
    p = Path(path)
    if not p.is_file():
        raise GemmgenError(f"shapes file {str(path)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise GemmgenError(f"shapes file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) for k, v in data.items() if not k.startswith("_")):
        raise GemmgenError(f"shapes file {str(path)!r}: expected {{recipe name: [[M, N, K], ...], ...}}")
    for name, problems in data.items():
        for shape in problems if not name.startswith("_") else ():
            problem_shape(shape, f"shapes file {str(path)!r}, {name!r}")
    return data

"""Where one kernel's compile goes, from NVRTC's own trace (`-fdevice-time-trace`): the front end's
and LibNVVM's totals, how many functions NVVM optimised and how long the kernel's own took, and the
trace's event kinds by total time (nested events overlap: a parent's time includes its children's).

    python scripts/compile_trace.py bias_gelu            # an example recipe, its default config
    python scripts/compile_trace.py bias_gelu --keep /tmp/bias_gelu.json

The trace is large (1.6 GB for bias_gelu) and slows ptxas several-fold (its phase is not the plain
compile's): read the front end and NVVM figures, and `--time`'s split from a plain compile.
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gemmgen.aot import load_recipes
from gemmgen.codegen import render_kernel
from gemmgen.compile.nvrtc import compile_cubin
from gemmgen.compile.toolchain import toolchain
from gemmgen.config import DEFAULT_ARCH

ROOT = Path(__file__).resolve().parent.parent
_EVENT = re.compile(rb'\{"args":\{"(?:detail|name)":"((?:[^"\\]|\\.)*)"\},"dur":(\d+),"name":"([^"]*)"')


def events(path: Path) -> Iterator[tuple[str, str, int]]:
    """(name, detail, microseconds) of each complete event, read in chunks (the file is too large to parse)."""
    with path.open("rb") as f:
        rest = b""
        while chunk := f.read(1 << 26):
            rest += chunk
            end = rest.rfind(b"},{")
            if end < 0:
                continue
            for m in _EVENT.finditer(rest, 0, end + 1):
                yield m.group(3).decode(), m.group(1).decode(errors="replace"), int(m.group(2))
            rest = rest[end + 2:]
        for m in _EVENT.finditer(rest):
            yield m.group(3).decode(), m.group(1).decode(errors="replace"), int(m.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="an example recipe's name (examples/recipes.py)")
    parser.add_argument("--keep", type=Path, help="where to keep the trace (default: a temporary file)")
    args = parser.parse_args()
    recipe = load_recipes(ROOT / "examples" / "recipes.py")[args.recipe]
    kernel = render_kernel(recipe.ir, recipe.default_config())
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.keep or Path(tmp) / "trace.json"
        result = compile_cubin(kernel.source, args.recipe, DEFAULT_ARCH.value, toolchain().include_dirs,
                               (f"-fdevice-time-trace={trace}",))
        written = trace if trace.is_file() else Path(f"{trace}.json")  # NVRTC 13.0 appends ".json"
        total: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        kernel_opt = 0
        for name, detail, us in events(written):
            total[name] += us
            count[name] += 1
            if name == "OptFunction" and detail == kernel.entry:
                kernel_opt += us
    p = result.phases
    print(f"{args.recipe} ({kernel.entry}), traced: front end {p['front_end']:.1f} s, NVVM {p['nvvm']:.1f} s")
    print(f"NVVM optimised {count['OptFunction']} functions ({total['OptFunction'] / 1e6:.2f} s), the kernel's "
          f"own {kernel_opt / 1e6:.2f} s")
    print("| event | total s | count |\n|---|---|---|")
    for name, us in total.most_common(14):
        print(f"| {name} | {us / 1e6:.2f} | {count[name]} |")


if __name__ == "__main__":
    main()

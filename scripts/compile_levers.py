"""Compile-time levers, measured side by side in one run: the naive kernel vs gemmgen's vs variants.

    python scripts/compile_levers.py [--all] [KERNEL ...]    (default: gemm_bf16 bias_gelu)

KERNEL names an example recipe (examples/recipes.py, default config). Every variant is compiled
once, one at a time, in this process, with the options gemmgen uses; the table gives NVRTC's
phase split, registers, local bytes and missing SASS markers, so a faster variant that loses a
Hopper feature shows it. `--all` measures only builder vs resolved, for every example.

Variants:
- builder:     the naive instantiation: both collectives named through CUTLASS's CollectiveBuilders.
- resolved:    what gemmgen emits: the collectives spelled out as the builders resolve them.
- tuple_elem:  resolved + direct cute::tuple_element specialisations (one instantiation per lookup
               instead of three through cuda::std; a front-end trace puts much time there).
- fused_epi:   resolved + bias_gelu's add and GELU compute nodes fused into one EVT node.
- ofast_min:   resolved + NVRTC `--Ofast-compile=min`.
- headers:     the includes and an empty kernel: an upper bound for what trimming headers can win.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gemmgen.aot import load_recipes
from gemmgen.codegen import render_kernel
from gemmgen.codegen.sm90 import SASS_MARKERS
from gemmgen.compile.cubin import resource_usage, sass_counts
from gemmgen.compile.nvrtc import compile_cubin
from gemmgen.compile.toolchain import toolchain
from gemmgen.config import DEFAULT_ARCH

ROOT = Path(__file__).resolve().parent.parent

TUPLE_ELEMENT = """#include <gemmgen/nvrtc_prelude.hpp>
#include <cute/container/tuple.hpp>
namespace cute {
template <class T0, class... T> struct tuple_element<0, cute::tuple<T0, T...>, void> { using type = T0; };
template <class T0, class T1, class... T> struct tuple_element<1, cute::tuple<T0, T1, T...>, void> { using type = T1; };
template <class T0, class T1, class T2, class... T>
struct tuple_element<2, cute::tuple<T0, T1, T2, T...>, void> { using type = T2; };
template <class T0, class T1, class T2, class T3, class... T>
struct tuple_element<3, cute::tuple<T0, T1, T2, T3, T...>, void> { using type = T3; };
}  // namespace cute
"""

def tuple_elem(src: str) -> str:
    return src.replace("#include <gemmgen/nvrtc_prelude.hpp>\n", TUPLE_ELEMENT, 1)


def fused_epi(src: str) -> str | None:
    """bias_gelu's add and GELU nodes as one compute node (other kernels: not applicable)."""
    last = "using EVTGelu3 = cutlass::epilogue::fusion::Sm90EVT<Gelu3, EVTAdd2>;\n"
    if last not in src:
        return None
    start, end = src.index("using Add2 ="), src.index(last) + len(last)
    fused = ("struct AddGelu {\n  CUTLASS_DEVICE float operator()(float b, float a) const "
             "{ return gemmgen::epi::Gelu{}(b + a); }\n};\n"
             "using Gelu3 = cutlass::epilogue::fusion::Sm90Compute<gemmgen::epi::Map<AddGelu>::Fn, "
             "cutlass::bfloat16_t, float, cutlass::FloatRoundStyle::round_to_nearest>;\n"
             "using EVTGelu3 = cutlass::epilogue::fusion::Sm90EVT<Gelu3, InBias, Acc>;\n")
    return (src[:start] + fused + src[end:]).replace("thread.op_0.op_0.", "thread.op_0.")


def headers(src: str) -> str:
    return src[:src.index("namespace gemmgen_")] + 'extern "C" __global__ void empty_kernel() {}\n'


def same(src: str) -> str:
    return src


#: variant -> (collectives spelling, source transformation, extra NVRTC options)
VARIANTS: dict[str, tuple[str, Callable[[str], str | None], tuple[str, ...]]] = {
    "builder": ("builder", same, ()),
    "resolved": ("resolved", same, ()),
    "tuple_elem": ("resolved", tuple_elem, ()),
    "fused_epi": ("resolved", fused_epi, ()),
    "ofast_min": ("resolved", same, ("--Ofast-compile=min",)),
    "headers": ("resolved", headers, ()),
}


def main() -> None:
    args = sys.argv[1:]
    every = "--all" in args
    recipes = load_recipes(ROOT / "examples" / "recipes.py")
    names = [a for a in args if a != "--all"] or (list(recipes) if every else ["gemm_bf16", "bias_gelu"])
    variants = {k: v for k, v in VARIANTS.items() if not every or k in ("builder", "resolved")}
    tc = toolchain()
    print(f"# NVRTC {'.'.join(map(str, tc.nvrtc_version))}, {time.strftime('%Y-%m-%d')}, CPU, one compile at a time")
    print("| kernel | variant | wall s | front end s | NVVM s | PTX s | regs | local B | missing SASS markers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        recipe = recipes[name]
        for variant, (spelling, transform, options) in variants.items():
            kernel = render_kernel(recipe.ir, recipe.default_config(), spelling)
            entry = kernel.entry
            text = transform(kernel.source)
            if text is None:
                continue
            result = compile_cubin(text, f"{name}_{variant}", DEFAULT_ARCH.value, tc.include_dirs, options)
            p = result.phases
            regs: int | str = "-"
            local: int | str = "-"
            missing = "-"
            if variant != "headers" and tc.cuobjdump is not None:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "k.cubin"
                    path.write_bytes(result.cubin)
                    res = resource_usage(tc.cuobjdump, path, entry)
                    counts = sass_counts(tc.cuobjdump, path, SASS_MARKERS)
                regs, local = res.registers, res.local_bytes
                missing = " ".join(m for m in SASS_MARKERS if m != "QGMMA" and not counts.get(m)) or "none"
            print(f"| {name} | {variant} | {result.wall_seconds:.1f} | {p['front_end']:.1f} | {p['nvvm']:.1f} | "
                  f"{p['ptx']:.1f} | {regs} | {local} | {missing} |", flush=True)


if __name__ == "__main__":
    main()

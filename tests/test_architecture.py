"""The package's shape: no import cycles (lazy imports included), no module over 600 lines, every
GEMMGEN_* variable read in one module and documented, and the public face unchanged. The layers
themselves (imports only go down) are import-linter's contract in pyproject.toml, run by .ci/run."""

from __future__ import annotations

import ast
import importlib
import json
import re

import grimp
import pytest

from tests.data import ROOT

PACKAGE = ROOT / "gemmgen"
MAX_LINES = 600


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (an import cycle each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the gemmgen modules it imports, anywhere in its body (functions and TYPE_CHECKING
    blocks too), a package's own submodules importing their package's __init__ left out."""
    g = grimp.build_graph("gemmgen", exclude_type_checking_imports=False)
    graph: dict[str, set[str]] = {}
    for m in g.modules:
        graph[m] = {t for t in g.find_modules_directly_imported_by(m)
                    if not m.startswith(t + ".") and t != "gemmgen"}
    return graph


def test_no_import_cycles():
    cycles = _strongly_connected(_import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_a_cycle_would_be_found():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_gemmgen_variables_are_read_in_env_alone_and_each_is_documented():
    from gemmgen import env

    readers = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "env.py" and path.parent == PACKAGE:
            continue
        text = path.read_text()
        if re.search(r"environ(\.get)?\s*[\[(]\s*[\"']GEMMGEN_", text) or re.search(r"getenv\(\s*[\"']GEMMGEN_", text):
            readers.append(str(path.relative_to(ROOT)))
    assert not readers, f"read GEMMGEN_* outside gemmgen/env.py: {readers}"
    mentioned = set(re.findall(r"GEMMGEN_[A-Z_]+", "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))))
    declared = {v.name for v in env.VARIABLES}
    assert mentioned <= declared | {"GEMMGEN_TEST_CACHE_DIR", "GEMMGEN_TEST_SEED"}, mentioned - declared
    table = (ROOT / "docs" / "deployment.md").read_text()
    for v in env.VARIABLES:
        assert re.search(rf"^\| `{v.name}` \| {re.escape(v.default)} \| {re.escape(v.meaning)} \|$", table, re.M), \
            f"docs/deployment.md's table has no row for {v.name} as gemmgen/env.py declares it"


#: Every name a user could import from gemmgen before the packages were laid out as layers
#: (gemmgen 0.1.0, 2026-12-01), and the torch integration's: each still imports from where it did.
PUBLIC = {
    "gemmgen": [
        "DEEPSEEK_BLOCK_SCALE", "OPS", "ColMajor", "ColVector", "CompileError", "ConfigError", "DType",
        "GemmgenError", "InvalidArgument", "KernelConfig", "KernelNotAvailable", "Layout", "LayoutMismatch",
        "Matrix", "NotDeterministic", "OperandKind", "Recipe", "RecipeError", "RowMajor", "RowVector", "Scalar",
        "Schedule", "TileScheduler", "ToolchainError", "Value", "__version__", "abs", "add_bundle", "add_tuning",
        "amax", "autotune", "bf16", "build_bundle", "cast", "clamp", "e2m1", "e4m3", "e5m2", "exp", "f16", "f32",
        "fp16", "fp32", "gelu", "gelu_tanh", "leaky_relu", "max", "maximum", "min", "minimum", "quantize_blockwise",
        "reduce_max", "reduce_min", "relu", "sigmoid", "silu", "sum", "tanh", "warmup", "nn", "op",
        "MXFP8", "NVFP4", "quantize_mx", "nvfp4_tensor_scale", "to_blocked_scales",
        # named in the docs as a recipe's compiled forms
        "CompiledKernel", "Kernel", "GroupedKernel",
    ],
    "gemmgen.errors": ["CompileError", "ConfigError", "GemmgenError", "InvalidArgument", "KernelNotAvailable",
                       "LayoutMismatch", "NotDeterministic", "RecipeError", "ToolchainError", "UnknownOpError"],
    "gemmgen.types": ["ColMajor", "DType", "Layout", "OperandKind", "RowMajor", "as_dtype", "as_layout", "bf16",
                      "e2m1", "e4m3", "e5m2", "f16", "f32", "fp16", "fp32", "Microscaling", "MXFP8", "NVFP4"],
    "gemmgen.nn": ["ACTIVATIONS", "BlockScaledGroupedLinear", "BlockScaledLinear", "FusedLinear", "GroupedExperts",
                   "GroupedLinear",
                   "activation_of", "block_scaled_grouped_recipe", "block_scaled_linear_recipe", "fuse",
                   "grouped_linear_recipe", "linear_recipe", "model_launches", "MXFP8Linear", "mxfp8_linear_recipe",
                   "NVFP4Linear", "nvfp4_linear_recipe"],
    "gemmgen.tuning": ["Device", "TuningTable", "add_tuning", "autotune", "config_for", "entry_key", "bucket",
                       "grouped_bucket", "tuned_config", "tuned_configs", "candidates", "generation", "device_ms"],
    "gemmgen.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_import(module):
    loaded = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(loaded, name)]
    assert not missing, missing
    if hasattr(loaded, "__all__"):
        assert all(hasattr(loaded, name) for name in loaded.__all__), "__all__ names what the module lacks"


def test_the_public_face_lists_its_names_and_only_those():
    """`gemmgen.__all__` names every public name, the lazy torch integration included (op, nn, the
    quantize helpers); `dir(gemmgen)` shows them and not the typing helpers the module imports,
    without importing torch."""
    import subprocess
    import sys

    code = ("import json, sys, types, gemmgen as gg; d = dir(gg); "
            "public = [k for k, v in vars(gg).items() if not k.startswith('_') "
            "and not isinstance(v, types.ModuleType)]; "
            "print(json.dumps({'dir': d, 'all': gg.__all__, 'public': public, 'torch': 'torch' in sys.modules}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert not out["torch"]
    assert "Any" not in out["dir"] and "TYPE_CHECKING" not in out["dir"]
    assert set(out["all"]) <= set(out["dir"]), set(out["all"]) - set(out["dir"])
    assert set(out["public"]) <= set(out["all"]), set(out["public"]) - set(out["all"])
    assert len(out["all"]) == len(set(out["all"]))
    assert {"op", "nn", "bf16", "f16", "f32", "e4m3", "e5m2", "e2m1", "MXFP8", "NVFP4", "quantize_mx", "Recipe",
            "quantize_blockwise", "nvfp4_tensor_scale", "to_blocked_scales", "KernelConfig"} <= set(out["all"])
    assert set(PUBLIC["gemmgen"]) <= set(out["all"])


def test_importing_gemmgen_imports_no_torch():
    """`gemmgen build`, `explain` and `generate` start in a tenth of a second: the torch integration
    loads on first use."""
    import subprocess
    import sys

    code = "import sys, gemmgen, gemmgen.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_only_the_public_face_and_the_integrations_use_lazy_imports_of_torch():
    """Function-level imports are for torch (heavy, optional at import) and nothing else: a lazy
    import of a gemmgen module would hide a layering problem."""
    lazy = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gemmgen")):
                    lazy.append(f"{path.relative_to(ROOT)}:{node.lineno} from {'.' * node.level}{node.module}")
    # torch-importing layers, and the CLI's `advise` (the layers, torch with them: `gemmgen --help` stays light)
    allowed = {"gemmgen/__init__.py", "gemmgen/dsl/recipe.py", "gemmgen/tuning/tuner.py", "gemmgen/cli.py"}
    assert not [x for x in lazy if x.split(":")[0] not in allowed], lazy

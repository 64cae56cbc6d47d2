"""The README and every page of docs/ do what they say.

- A ```python block runs, in order with the page's other python blocks (one namespace per page),
  with the session's compiled kernels as the cache and compiling forbidden (GEMMGEN_JIT=0: a doc
  that needs a kernel no test compiles fails here rather than stalling CI).
- A ```bash block's `gemmgen ...` commands run through the CLI, from a copy of the repository's
  examples, and must exit 0; its other commands name scripts that must exist.
- Every link to a page of docs/ (and an anchor in it) resolves, relative to the page's own folder
  (docs/design/ holds the design pages).
- Blocks in other fences (```text, plain ```) are output, not code.
- docs/api.md is what `python scripts/api_reference.py` writes from the docstrings, and every
  public name has a docstring.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.data import ROOT
from tests.data.session_kernels import keep_compiled_examples

pytestmark = pytest.mark.nvrtc  # the README's example loads a compiled kernel

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/design/ too
API_PAGE = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


@pytest.fixture
def doc_env(compiled, sm100_kernels, session_cache, monkeypatch):
    """The session's kernels as the cache, compiling forbidden, the caches' memo cleared around it."""
    import gemmgen.compile.build

    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(session_cache.root))
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    gemmgen.compile.build.default_cache.cache_clear()
    yield
    gemmgen.compile.build.default_cache.cache_clear()


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_python_blocks_run(page, doc_env):
    scope: dict = {"__name__": f"doc_{page.stem}"}
    for i, block in enumerate(_blocks(page, "python")):
        exec(compile(block, f"{_id(page)} block {i + 1}", "exec"), scope)


def test_the_readme_example_loads_its_kernel_from_the_cache(doc_env):
    scope: dict = {}
    exec(compile(_blocks(ROOT / "README.md", "python")[0], "README.md", "exec"), scope)
    assert scope["built"].report.cached and scope["ref"].shape == (7, 16)


def _commands(page: Path) -> list[list[str]]:
    out = []
    for block in _blocks(page, "bash"):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in (p.strip() for p in line.split("&&")):
                if part:
                    out.append(shlex.split(part))
    return out


def _keep_compiled_shapes(path: Path) -> None:
    """The copy's shapes file cut to the shapes that launch the default config of a recipe the copy
    keeps (the session compiled those): `gemmgen build --shapes` then runs its whole path on the
    session's kernels instead of compiling five more (three minutes of CI); what each shape
    chooses is tests/tuning's to check."""
    import json

    from gemmgen.aot import load_recipes
    from gemmgen.tuning import config_for

    recipes = load_recipes(path.parent / "recipes.py")
    shapes = json.loads(path.read_text())
    kept = {name: [s for s in problems if config_for(recipes[name], *s) == recipes[name].default_config()]
            for name, problems in shapes.items() if name in recipes}
    kept = {name: problems for name, problems in kept.items() if problems}
    assert kept, f"no shape of {path.name} launches a recipe's default config"
    path.write_text(json.dumps(kept))


@pytest.mark.parametrize("page", [p for p in PAGES if _commands(p)], ids=_id)
def test_bash_blocks_run_or_name_what_exists(page, doc_env, tmp_path, monkeypatch, capsys):
    from gemmgen.cli import main

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    keep_compiled_examples(tmp_path / "examples" / "recipes.py")
    _keep_compiled_shapes(tmp_path / "examples" / "llm_shapes.json")
    monkeypatch.chdir(tmp_path)
    for argv in _commands(page):
        while "=" in argv[0]:  # VAR=value before the command
            argv = argv[1:]
        if argv[0] in ("gemmgen", ".venv/bin/gemmgen"):
            assert main(argv[1:]) == 0, f"{_id(page)}: {shlex.join(argv)}\n{capsys.readouterr().err}"
        elif argv[0] in ("bash", "python", ".venv/bin/python", "python3") and argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]) is not None, f"{_id(page)}: no module {argv[2]}"
        elif argv[0] in ("bash", "python", ".venv/bin/python", "python3"):
            script = next(a for a in argv[1:] if not a.startswith("-"))
            assert (ROOT / script).is_file(), f"{_id(page)}: {shlex.join(argv)} names no file"
        else:
            raise AssertionError(f"{_id(page)}: a command the docs test does not know how to check: {argv}")


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_links_to_the_docs_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.is_file(), f"{_id(page)}: {target} names no file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{_id(page)}: {target}: no heading with that anchor"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_stays_under_10_kb():
    assert len((ROOT / "README.md").read_bytes()) <= 10 * 1024


def test_the_user_pages_stay_near_40_kb():
    """The user pages (docs/*.md but the generated api.md) lead with what to do, about 40 KB in all:
    how things work inside, and what was measured, belongs in docs/design/."""
    sizes = {p.name: len(p.read_bytes()) for p in sorted((ROOT / "docs").glob("*.md")) if p != API_PAGE}
    total, limit = sum(sizes.values()), 41 * 1024
    assert total <= limit, (
        f"the user pages hold {total} bytes, over {limit}: "
        + ", ".join(f"{name} {size}" for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]))
        + "; move design material (how it works inside, internals, measurements) to docs/design/ and link to it")


def test_the_faults_table_names_tests_that_exist():
    """docs/design/faults.md names, per fault, the test that shows it: each must be a test function."""
    text = (ROOT / "docs" / "design" / "faults.md").read_text()
    named = re.findall(r"`((?:tests/[\w/]+/)?test_\w+\.py)::(test_\w+)`", text)
    bare = re.findall(r"\| `(test_\w+)` \|$", text, re.M)  # the calls table: test_messages.py's
    assert len(named) + len(bare) >= 40
    for path, name in [*named, *(("test_messages.py", n) for n in bare)]:
        file = ROOT / path if path.startswith("tests/") else ROOT / "tests" / "faults" / path
        assert re.search(rf"^def {name}\(", file.read_text(), re.M), f"docs/design/faults.md names {path}::{name}"


def _api_reference():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_what_the_docstrings_say():
    """docs/api.md is generated: regenerated here, in memory, it must equal the committed page."""
    import difflib

    written = _api_reference().render()
    committed = API_PAGE.read_text() if API_PAGE.is_file() else ""
    if written != committed:
        diff = list(difflib.unified_diff(committed.splitlines(), written.splitlines(), "docs/api.md (committed)",
                                         "docs/api.md (from the docstrings)", lineterm="", n=1))
        shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
        pytest.fail("docs/api.md is stale (a docstring or signature changed, or the page was edited by hand): "
                    f"run `python scripts/api_reference.py` and commit docs/api.md\n{shown}", pytrace=False)


def test_every_public_name_has_a_docstring():
    """Every name of gemmgen's, gemmgen.nn's, gemmgen.training's and gemmgen.advise's `__all__` says
    what it is: a docstring, or for a constant a `#:` comment above it (an enum member: its enum's docstring)."""
    api = _api_reference()
    missing = []
    for module_name in api.MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not api.doc(module, name, getattr(module, name)).strip():
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names without a docstring: {missing}"

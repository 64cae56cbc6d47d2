"""The CLI never shows a traceback for a user mistake: a bad recipes file is named with its line,
numbers are validated by argparse, and every option has help; `--version` and the environment
variables are in the help."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gemmgen import env
from gemmgen.cli import main, parser
from tests.data import EXAMPLES, ROOT

pytestmark = pytest.mark.faults


def _run(args: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return rc, out.err


@pytest.mark.parametrize("content, line, what", [
    ("import gemmgen as gg\nr = gg.Recipe('x', lambda acc: acc\n", 2, "never closed"),
    ("import gemmgen as gg\n\nr = gg.Recipe('x', lambda acc: gg.no_such_op(acc))\n", 3, "no op or name 'no_such_op'"),
    ("import gemmgen as gg\nx = undefined_name\n", 2, "NameError: name 'undefined_name' is not defined"),
    ("# Title\n\nSome *markdown* text.\n", 3, "invalid syntax"),
])
def test_a_broken_recipes_file_is_named_with_its_line(tmp_path, capsys, content, line, what):
    path = tmp_path / "recipes.md"
    path.write_text(content)
    rc, err = _run(["generate", str(path), "--out", str(tmp_path / "out")], capsys)
    assert rc == 2 and f"gemmgen: error: {path}:{line}: " in err and what in err
    assert len(err.strip().splitlines()) == 1


def test_a_directory_or_a_missing_file_says_which(tmp_path, capsys):
    rc, err = _run(["build", str(tmp_path)], capsys)
    assert rc == 2 and "is a directory; name the Python file" in err
    rc, err = _run(["build", str(tmp_path / "none.py")], capsys)
    assert rc == 2 and "does not exist" in err


@pytest.mark.parametrize("args", [["build", str(EXAMPLES), "-j", "0"], ["build", str(EXAMPLES), "-j", "-3"],
                                  ["inspect", str(EXAMPLES), "--jobs", "x"],
                                  ["explain", str(EXAMPLES), "--shape", "8", "4096", "4096", "--sm-count", "0"],
                                  ["explain", str(EXAMPLES), "--shape", "0", "4096", "4096"],
                                  ["tune", str(EXAMPLES), "--shapes", "s.json", "--out", "t.json",
                                   "--candidates", "0"]])
def test_numbers_are_validated_before_anything_runs(capsys, args):
    rc, err = _run(args, capsys)
    assert rc == 2 and ("is not a positive integer" in err or "is not an integer" in err)


def test_explain_with_a_malformed_shape_is_an_error_not_a_crash(capsys):
    rc, err = _run(["explain", str(EXAMPLES), "--shape", "8", "4096"], capsys)
    assert rc == 2 and "expected [M, N, K] or [M, N, K, L]" in err


def test_generate_into_a_file_is_a_named_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, err = _run(["generate", str(EXAMPLES), "--out", str(blocker)], capsys)
    assert rc == 2 and "a file is in the way" in err


def test_version():
    proc = subprocess.run([sys.executable, "-m", "gemmgen.cli", "--version"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("gemmgen 0.") and "sm_90a" in proc.stdout


def _parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_and_every_help_lists_the_environment():
    for p in _parsers(parser()):
        for action in p._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{p.prog}: {action.option_strings or action.dest} has no help"
        text = p.format_help()
        for v in env.VARIABLES:
            assert v.name in text, f"{p.prog} --help does not mention {v.name}"

"""The CLI never shows a traceback for a user mistake: a bad recipes file is named with its line,
numbers are validated by argparse, and every option has help; `--version` and the environment
variables are in the top-level help."""

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


def test_every_option_has_help_and_the_top_level_help_lists_the_environment():
    """`gemmgen --help` lists every environment variable; each command's help points there rather
    than repeating the block (tests/test_cli.py checks the alignment)."""
    for p in _parsers(parser()):
        for action in p._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{p.prog}: {action.option_strings or action.dest} has no help"
    text = parser().format_help()
    for v in env.VARIABLES:
        assert v.name in text, f"gemmgen --help does not mention {v.name}"


def _out_err(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return rc, out.out, out.err


def test_a_repeated_shape_explains_every_shape(capsys):
    """`--shape` twice: each problem is explained (the last one alone was, silently)."""
    rc, out, _ = _out_err(["explain", str(EXAMPLES), "--shape", "16", "4096", "4096", "--shape", "8192", "4096",
                           "4096", "--recipe", "gemm_bf16", "--top", "1"], capsys)
    assert rc == 0
    heads = [line for line in out.splitlines() if not line.startswith(" ")]
    assert len(heads) == 2 and "16x4096x4096" in heads[0] and "8192x4096x4096" in heads[1], out
    assert "bucket 16" in heads[0] and "bucket 8192" in heads[1]


def test_a_closed_pipe_ends_quietly():
    """`gemmgen explain ... | head`: the reader goes away; no BrokenPipeError traceback, the exit
    status of a tool SIGPIPE ended."""
    proc = subprocess.Popen([sys.executable, "-m", "gemmgen.cli", "explain", str(EXAMPLES), "--shape", "4096", "4096",
                             "4096"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before anything is written: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


def test_a_fix_is_spelled_as_the_user_types_it(capsys):
    """On the CLI an arch is `--arch sm_100a`, not the API's `arch=Arch.SM100A`: in an error and in
    the line saying why a recipe is not built."""
    rc, _, err = _out_err(["explain", str(EXAMPLES), "--shape", "64", "4096", "4096", "--recipe", "mxfp8_linear"],
                          capsys)
    assert rc == 2 and "build it with --arch sm_100a" in err and "Arch.SM100A" not in err, err
    rc, out, err = _out_err(["explain", str(EXAMPLES), "--shape", "64", "4096", "4096"], capsys)
    assert rc == 0 and "Arch.SM100A" not in out + err and "--arch sm_100a" in out


def test_a_recipe_name_typo_gets_a_did_you_mean(capsys, tmp_path):
    rc, _, err = _out_err(["explain", str(EXAMPLES), "--shape", "8", "64", "64", "--recipe", "bias_gleu"], capsys)
    assert rc == 2 and "did you mean 'bias_gelu'?" in err, err
    shapes = tmp_path / "shapes.json"
    shapes.write_text('{"bias_gleu": [[8, 4096, 4096]]}')
    rc, _, err = _out_err(["build", str(EXAMPLES), "--shapes", str(shapes)], capsys)
    assert rc == 2 and "did you mean 'bias_gelu'?" in err, err

"""Real faults for the fault-injection suite (tests/faults): a folder this process cannot write to,
a read-only mount, a full file system, and Python run in a child process under them.

The faults are real, not mocked, where the machine allows: as root, file modes do not stop a
write, so the child drops CAP_DAC_OVERRIDE (`setpriv`); a read-only bind mount and a tiny tmpfs
need a private mount namespace (`unshare -m`, root). `why_not(...)` says when one is unavailable,
so a test skips with that reason rather than passing without its fault.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from ..compile import cache as cache_mod

#: capabilities that let root write or read past file modes (dropped for an unprivileged child)
_DAC_CAPS = "-dac_override,-dac_read_search,-fowner"


def why_not(fault: str) -> str | None:
    """None if `fault` ("unwritable", "read_only_mount", "full_disk") can be made here, else why not."""
    root = os.geteuid() == 0
    if fault == "unwritable":
        return None if not root or shutil.which("setpriv") else "root without setpriv cannot be denied a write"
    if not root:
        return f"{fault} needs root (a private mount namespace); run the suite as root or in a container"
    return None if shutil.which("unshare") and shutil.which("mount") else "needs unshare and mount (util-linux)"


def make_unwritable(path: Path) -> None:
    """Take write permission from `path` and everything under it (for an unprivileged child)."""
    for p in [path, *path.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def make_writable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(stat.S_IMODE(p.lstat().st_mode) | stat.S_IWUSR)


def run_python(code: str, *, env: dict[str, str] | None = None, unprivileged: bool = False,
               read_only_mount: Path | None = None, tmpfs: tuple[Path, int] | None = None,
               timeout: float = 120) -> dict:
    """Run `code` in a child Python with this checkout importable; the child prints one JSON object
    (its last stdout line), returned here. `unprivileged`: without the capabilities that bypass file
    modes; `read_only_mount`: that folder bind-mounted read-only; `tmpfs`: (folder, bytes) a tmpfs
    of that size mounted there."""
    root = Path(__file__).resolve().parents[2]
    script = f"import sys\nsys.path.insert(0, {str(root)!r})\n" + textwrap.dedent(code)
    cmd = [sys.executable, "-c", script]
    if unprivileged and os.geteuid() == 0:
        cmd = ["setpriv", f"--bounding-set={_DAC_CAPS}", "--", *cmd]
    mounts = []
    if read_only_mount is not None:
        mounts.append(f"mount --bind {read_only_mount} {read_only_mount} && "
                      f"mount -o remount,bind,ro {read_only_mount}")
    if tmpfs is not None:
        mounts.append(f"mount -t tmpfs -o size={tmpfs[1]} gemmgen-test {tmpfs[0]}")
    if mounts:
        cmd = ["unshare", "-m", "sh", "-c", " && ".join([*mounts, 'exec "$@"']), "sh", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(lines[-1])
    result["stderr"] = proc.stderr
    return result


@contextlib.contextmanager
def no_space_for(name: str, partial: bool = False) -> Iterator[list[str]]:
    """Writes of the cache's files named `name` fail with ENOSPC (after writing half the file with
    `partial`), as on a full disk; yields the names of every file the cache went on to write."""
    real = cache_mod._write
    written: list[str] = []

    def write(path: Path, data: bytes) -> None:
        written.append(path.name)
        if path.name == name:
            if partial:
                path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    with mock.patch.object(cache_mod, "_write", write):
        yield written

"""Autotune results: a JSON table of winning configs, and the tables this process has registered.

Entries are keyed by GPU name, driver version, gemmgen version, recipe key and shape bucket (M
bucket, N, K, L; for a grouped recipe the bucket of its rows per group on average, N, K and the
groups), so a result is only used where it was measured. Tables come from GEMMGEN_TUNING_PATH,
`gemmgen.add_tuning(path)`, and the `tuning.json` a bundle ships (`gemmgen build --tuning FILE`).

A table named `remote:NAME` lives in the remote cache tier (GEMMGEN_REMOTE_CACHE), so one
`gemmgen tune --out remote:NAME` serves every machine of a cluster; a table is small and mutable,
the last writer wins. Read from GEMMGEN_TUNING_PATH, a remote table that cannot be had is a
warning (the heuristic decides meanwhile); named explicitly, an error.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import env
from .._version import __version__
from ..codegen import is_valid
from ..compile import bundles
from ..compile.remote import RemoteTier, remote_tier
from ..config import DEFAULT_ARCH, KernelConfig
from ..errors import GemmgenError, GemmgenWarning, InvalidArgument
from ..ir import RecipeIR
from .heuristic import m_bucket

FORMAT = 1
REMOTE = "remote:"  # prefix of a table kept in the remote cache tier


@dataclass(frozen=True)
class Device:
    """Where timings hold: the GPU's name and the driver version."""

    name: str
    driver: str

    @staticmethod
    def current(index: int | None = None) -> Device:
        import torch
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        ok = err == driver.CUresult.CUDA_SUCCESS
        return Device(torch.cuda.get_device_name(index), f"{version // 1000}.{version % 1000 // 10}" if ok else "?")


def bucket(m: int, n: int, k: int, l: int = 1) -> tuple[int, int, int, int]:  # noqa: E741
    return (m_bucket(max(m, 1)), n, k, l)


def grouped_bucket(rows: int, n: int, k: int, groups: int) -> tuple[int, int, int, int]:
    """A grouped problem's bucket: the rows per group on average, bucketed as M is (all the host
    knows of how the rows split, and what `tuning.grouped_choice` follows), N, K and the groups."""
    return (m_bucket(max(-(-rows // max(groups, 1)), 1)), n, k, groups)


def problem_bucket(recipe: RecipeIR, m: int, n: int, k: int, l: int = 1) -> tuple[int, int, int, int]:  # noqa: E741
    """The bucket tuning results are kept by: `bucket`, or for a grouped recipe (M the rows of A,
    L the groups) `grouped_bucket`."""
    return grouped_bucket(m, n, k, l) if recipe.gemm.grouped else bucket(m, n, k, l)


def entry_key(device: Device, recipe_key: str, shape_bucket: tuple[int, int, int, int]) -> str:
    return "|".join((device.name, device.driver, __version__, recipe_key, "x".join(map(str, shape_bucket))))


def recipe_key_of(key: str) -> str:
    """The recipe key part of an `entry_key`."""
    return key.split("|")[3]


def _config_from_json(raw: Any, where: str) -> KernelConfig:
    try:
        return KernelConfig.from_canonical(raw)
    except (TypeError, ValueError) as e:
        raise GemmgenError(f"{where}: not a kernel config ({raw!r}): {e}") from e


class TuningTable:
    """Autotune results: entry key -> winning config and the timings that chose it."""

    def __init__(self, entries: dict[str, dict] | None = None) -> None:
        self.entries: dict[str, dict] = dict(entries or {})

    def get(self, key: str) -> KernelConfig | None:
        entry = self.entries.get(key)
        return None if entry is None else _config_from_json(entry["config"], f"tuning entry {key!r}")

    def put(self, key: str, config: KernelConfig, timings_us: dict[str, float]) -> None:
        self.entries[key] = {"config": config.canonical(), "name": config.name,
                             "timings_us": {k: round(v, 3) for k, v in timings_us.items()}}

    def configs(self, recipe_key: str) -> list[KernelConfig]:
        """Every winning config recorded for a recipe (on any device): what a bundle must hold."""
        return [c for k in self.entries if recipe_key_of(k) == recipe_key if (c := self.get(k)) is not None]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "entries": self.entries}, indent=1, sort_keys=True)

    @staticmethod
    def load(path: str | Path) -> TuningTable:
        """A table from a JSON file, or from the remote tier (`remote:NAME`)."""
        if isinstance(path, str) and path.startswith(REMOTE):
            data = _remote_get(path)
            if data is None:
                raise GemmgenError(f"tuning table {path}: not in the remote cache {env.remote_cache_url()} (or it "
                                   f"could not be read: see the warning); write it with `gemmgen tune --out {path}`")
            return TuningTable._parse(data.decode(errors="replace"), path)
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise GemmgenError(f"tuning file {path}: cannot be read as JSON ({e}); re-run `gemmgen tune`") from e
        return TuningTable._parse(text, str(path))

    @staticmethod
    def load_or_new(path: str | Path) -> TuningTable:
        """The table at `path` (a file or `remote:NAME`), or an empty one if there is none yet."""
        if isinstance(path, str) and path.startswith(REMOTE):
            data = _remote_get(path)
            return TuningTable() if data is None else TuningTable._parse(data.decode(errors="replace"), path)
        return TuningTable.load(path) if Path(path).is_file() else TuningTable()

    @staticmethod
    def _parse(text: str, where: str) -> TuningTable:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise GemmgenError(f"tuning file {where}: cannot be read as JSON ({e}); re-run `gemmgen tune`") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("entries"), dict):
            raise GemmgenError(f"tuning file {where}: expected {{'format': {FORMAT}, 'entries': {{...}}}}; "
                               "it was written by another gemmgen version: re-run `gemmgen tune`")
        for key, entry in raw["entries"].items():
            _config_from_json(entry.get("config") if isinstance(entry, dict) else None, f"{where}: entry {key!r}")
        return TuningTable(raw["entries"])

    def save(self, path: str | Path) -> None:
        """Written whole to a temporary file and renamed: readers never see a partial table. A
        `remote:NAME` table is one value of the remote tier."""
        if isinstance(path, str) and path.startswith(REMOTE):
            if not _remote_put(path, self.to_json().encode()):
                raise GemmgenError(f"tuning table {path}: could not be stored in the remote cache "
                                   f"{env.remote_cache_url()} (see the warning); save it to a file instead")
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tuning-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)


def _remote_name(path: str) -> str:
    name = path[len(REMOTE):]
    if not name or "/" in name or name.startswith("."):
        raise InvalidArgument(f"tuning table {path!r}: expected remote:NAME with a plain NAME, e.g. remote:h200-prod")
    return f"tuning/{name}"


def _remote_get(path: str) -> bytes | None:
    name = _remote_name(path)
    return _remote_tier_for(path).get_bytes(name)


def _remote_put(path: str, data: bytes) -> bool:
    name = _remote_name(path)
    return _remote_tier_for(path).put_bytes(name, data)


def _remote_tier_for(path: str) -> RemoteTier:
    tier = remote_tier(DEFAULT_ARCH.value)  # tables name their devices: one namespace for every arch
    if tier is None:
        raise InvalidArgument(f"tuning table {path!r}: a remote table needs GEMMGEN_REMOTE_CACHE set (e.g. "
                              "GEMMGEN_REMOTE_CACHE=redis://HOST:6379/0)")
    return tier


def _env_table(path: str) -> TuningTable | None:
    """A GEMMGEN_TUNING_PATH entry: a remote table that cannot be had is a warning, not a failure."""
    if not path.startswith(REMOTE):
        return TuningTable.load(path)
    try:
        return TuningTable.load(path)
    except GemmgenError as e:
        warnings.warn(f"gemmgen: GEMMGEN_TUNING_PATH: {e}; going on without it", GemmgenWarning, stacklevel=4)
        return None


_LOCK = threading.Lock()
_TABLES: list[TuningTable] = []
_ENV_LOADED = False
_FROM_BUNDLES: set[Path] = set()  # the bundles' tuning files registered
_GENERATION = 0  # bumped by every add_tuning: callers that memoise a choice key it with generation()


def generation() -> int:
    """Changes whenever a table is registered: what memoised choices are keyed by."""
    return _GENERATION


def add_tuning(source: str | Path | TuningTable) -> TuningTable:
    """Register autotune results (a file or a table); later registrations take precedence."""
    global _GENERATION
    table = source if isinstance(source, TuningTable) else TuningTable.load(source)
    with _LOCK:
        _TABLES.insert(0, table)
        _GENERATION += 1
    return table


def registered(table: TuningTable) -> bool:
    return any(t is table for t in _TABLES)


def _tables() -> list[TuningTable]:
    """Every registered table, most recent first; GEMMGEN_TUNING_PATH's (read once) after those, and
    the tuning files of the bundles searched (`compile.bundles`) as they are first seen."""
    global _ENV_LOADED
    if not _ENV_LOADED:
        with _LOCK:
            if not _ENV_LOADED:
                _TABLES.extend(t for p in env.tuning_paths() if (t := _env_table(p)) is not None)
                _ENV_LOADED = True
    for bundle in bundles.bundles():
        path = bundle.tuning
        if path is not None and path not in _FROM_BUNDLES:
            _FROM_BUNDLES.add(path)
            add_tuning(path)
    return _TABLES


def _check_device(device: Any) -> None:
    if not isinstance(device, Device):
        raise InvalidArgument(f"device: expected a gemmgen.tuning.Device (gemmgen.tuning.Device.current() on the "
                              f"GPU that will run the kernels), got {device!r}")


def tuned_config(recipe: RecipeIR, device: Device, m: int, n: int, k: int, l: int = 1  # noqa: E741
                 ) -> KernelConfig | None:
    """The registered autotune winner for this problem's bucket on this device, if any."""
    _check_device(device)
    key = entry_key(device, recipe.key, problem_bucket(recipe, m, n, k, l))
    for table in _tables():
        config = table.get(key)
        if config is not None and is_valid(config, recipe):
            return config
    return None


def tuned_configs(recipe: RecipeIR, device: Device, n: int, k: int, l: int = 1) -> list[KernelConfig]:  # noqa: E741
    """Every registered autotune winner for the recipe on `device` at this N, K and L, whatever the
    M bucket: what a layer of these sizes may launch there besides the heuristic's picks (for a
    grouped layer, whose rows per expert only the routing decides)."""
    _check_device(device)
    head = entry_key(device, recipe.key, (0, n, k, l)).rsplit("|", 1)[0]
    found = []
    for table in _tables():
        for key in table.entries:
            where, _, shape = key.rpartition("|")
            if where == head and shape.split("x")[1:] == [str(n), str(k), str(l)]:
                config = table.get(key)
                if config is not None and is_valid(config, recipe):
                    found.append(config)
    return list(dict.fromkeys(found))

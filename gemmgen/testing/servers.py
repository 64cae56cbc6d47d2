"""Real servers for the cluster tests: a `redis-server` of its own on a loopback port in a
temporary folder, started and stopped with bounded waits (never a shared or remote server)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_SECONDS = 10.0


def why_no_redis() -> str | None:
    """None if a redis-server can be started here, else why not (a test skips with it)."""
    if shutil.which("redis-server") is None:
        return "needs redis-server (Debian's redis-server package; .ci/setup installs it)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "needs the redis client package: pip install 'gemmgen[cluster]'"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    process: subprocess.Popen
    port: int
    url: str

    def kill(self) -> None:
        """Stop it the hard way (a server dying mid-run)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=START_SECONDS)

    def client(self) -> Any:  # a redis.Redis (the package is optional)
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=START_SECONDS)


@contextlib.contextmanager
def redis_server(folder: Path, maxmemory: str | None = None) -> Iterator[RedisServer]:
    """A redis-server on 127.0.0.1 with no persistence, its files in `folder`; `maxmemory` (e.g.
    "2mb", with no eviction) makes it refuse writes once full, as a full server does."""
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
            "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
    if maxmemory is not None:
        args += ["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"]
    log = open(folder / "redis.log", "wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    server = RedisServer(process, port, f"redis://127.0.0.1:{port}/0")
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                if server.client().ping():
                    break
            except Exception:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {(folder / 'redis.log').read_text()}") from None
                time.sleep(0.05)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=START_SECONDS)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()

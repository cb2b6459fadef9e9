"""Secrets read from files (a mounted Kubernetes Secret, a file of mode 0600): the Redis
password, the API key."""

from __future__ import annotations

import os
from pathlib import Path


def read_secret_file(path: str | os.PathLike, name: str,
                     error: type[Exception] = ValueError) -> str:
    """The secret in `path`, stripped of surrounding whitespace; `error` naming `name` and the
    file when it cannot be read or is empty."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise error(f"{name}={path}: {exc.strerror or exc}") from exc
    if not secret:
        raise error(f"{name}={path}: the file is empty")
    return secret

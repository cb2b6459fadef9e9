"""Logging set-up, done once per process by its entry point (library code only logs)."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVEL_VARIABLE = "SSSD_LOG_LEVEL"  # overrides every entry point's level (DEBUG, INFO, ...)


def configure_logging(level: int | str = logging.INFO) -> None:
    """Logs to stderr, one line per record, at `level` unless SSSD_LOG_LEVEL says otherwise."""
    chosen = os.environ.get(LEVEL_VARIABLE) or level
    if isinstance(chosen, str):
        chosen = chosen.upper()
    logging.basicConfig(level=chosen, format=FORMAT, stream=sys.stderr)

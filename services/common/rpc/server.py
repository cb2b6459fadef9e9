"""Serving a gRPC server until the process is told to stop."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


def serve_until_signal(server: grpc.Server, health_servicer: Any, grace_s: float,
                       on_stop: Callable[[], None] | None = None) -> None:
    """Blocks until SIGTERM or SIGINT, then: health NOT_SERVING (for watchers and load
    balancers), `on_stop` in a thread of its own (a service's drain), in-flight calls given
    `grace_s` seconds; a second signal cuts the grace period short. Restores the handlers."""
    is_stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if is_stopping.is_set():
            server.stop(0)
            return
        is_stopping.set()
        logger.info("%s: stopping, grace %.1f s",
                                         signal.Signals(signum).name, grace_s)
        health_servicer.enter_graceful_shutdown()
        if on_stop is not None:
            threading.Thread(target=on_stop, daemon=True).start()
        server.stop(grace_s)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.wait_for_termination()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

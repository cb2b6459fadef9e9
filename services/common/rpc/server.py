"""Serving a gRPC server until the process is told to stop."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


# How long a stopping service waits for its daemon threads that are ending.
ENDING_THREADS_S = 1.0


def serve_until_signal(server: grpc.Server, health_servicer: Any, grace_s: float,
                       on_stop: Callable[[], None] | None = None) -> None:
    """Blocks until SIGTERM or SIGINT, then: health NOT_SERVING (for watchers and load
    balancers), `on_stop` in a thread of its own (a service's drain), in-flight calls given
    `grace_s` seconds; a second signal cuts the grace period short. Restores the handlers and
    returns once `on_stop` has finished."""
    is_stopping = threading.Event()
    draining: list[threading.Thread] = []

    def on_signal(signum: int, frame: object) -> None:
        if is_stopping.is_set():
            server.stop(0)
            return
        is_stopping.set()
        logger.info("%s: stopping, grace %.1f s", signal.Signals(signum).name, grace_s)
        health_servicer.enter_graceful_shutdown()
        if on_stop is not None:
            draining.append(threading.Thread(target=on_stop, name="drain", daemon=True))
            draining[0].start()
        server.stop(grace_s)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.wait_for_termination()
        for thread in draining:  # bounded: a stuck drain cannot hang the exit
            thread.join(timeout=grace_s + 60.0)
        _let_ending_threads_end(ENDING_THREADS_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _let_ending_threads_end(timeout_s: float) -> None:
    """Waits up to `timeout_s` for the process's daemon threads to end. gRPC's serving thread
    (a daemon) ends just after the server, and may drop the last reference to the servicers
    as it does: a daemon thread that frees a model's tensors while the interpreter finalizes
    is ended inside C++ (torch gives up the GIL and cannot take it back), which aborts the
    process. Threads that serve for the process's life (the metrics server's) use the time up."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.daemon and thread is not threading.current_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

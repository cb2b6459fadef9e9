"""Where torch's parallel work may run in a serving process: `off_main_thread`.

PyTorch's CPU operations (and the verifier's own kernels) run their parallel regions on
OpenMP's runtime, libgomp, which keeps a team of worker threads for every thread that ever ran
a parallel region, for that thread's life. Between regions the workers spin, and a region starts
in microseconds; but only while libgomp manages no more threads than there are CPUs. Beyond
that it spins a hundred rounds and then sleeps on a futex, and every matrix product of a decode
step waits for its workers to be woken.

A server that loads its model on the main thread and runs the engine on its loop thread owns
two teams, and on a 2-core machine loses the spinning: every product of a step then waits for
its sleeping workers to be woken.
A thread that exits takes its team with it, so the serving processes load and prepare the model
on a short-lived thread, and only the engine's own thread keeps a team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def off_main_thread(work: Callable[[], T], name: str = "model-load") -> T:
    """Runs `work` on a thread of its own that ends when it returns; returns its result or
    raises its exception. The main thread waits (and so runs no parallel region)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]

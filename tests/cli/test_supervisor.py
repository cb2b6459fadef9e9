"""`sssd up`'s supervisor: a child that dies is started again (same port, same arguments) with
a backoff that doubles while it keeps crashing, and its clients reconnect."""

import os
import signal
import subprocess
import sys
import time

import numpy as np

from sssd.cli.processes import start_drafter
from sssd.cli.supervisor import Supervisor
from sssd.common.drafting.proposer import DraftRequest


def test_a_killed_drafter_is_started_again_and_its_client_goes_on(tmp_path, free_port,
                                                                  wait_until):
    from sssd.datastore.build import build_datastore
    from sssd.drafter.client import RemoteDrafter

    datastore = tmp_path / "datastore"
    build_datastore(datastore, [np.arange(100, 160, dtype=np.int32)] * 3, 1000, "fp",
                    shard_tokens=8000)
    port = free_port()
    lines = []
    supervisor = Supervisor(poll_s=0.1, initial_backoff_s=0.2, report=lines.append)
    first = supervisor.add("drafter service",
                           lambda: start_drafter(datastore, 1000, "fp", "127.0.0.1", port))
    supervisor.start()
    client = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=2.0)
    try:
        context = np.arange(100, 120, dtype=np.int32)
        (tree,) = client.propose([DraftRequest("a", context, 8, is_start=True)])
        assert tree.num_nodes > 1
        os.kill(first.pid, signal.SIGKILL)
        assert wait_until(lambda: supervisor.restarts("drafter service") == 1, timeout=30)
        second = supervisor.process("drafter service")
        assert second.pid != first.pid and second.poll() is None
        # The same address serves again; the sequence died with the old process, so it starts
        # over, as the engine does after NOT_FOUND.
        (tree,) = client.propose([DraftRequest("b", context, 8, is_start=True)])
        assert tree.num_nodes > 1
    finally:
        client.close()
        supervisor.stop()
        supervisor.process("drafter service").terminate()
        supervisor.process("drafter service").wait(10)
    assert lines[0].startswith("sssd up: the drafter service exited with -9; starting it again")
    assert lines[1].startswith("sssd up: the drafter service is back (pid ")


def test_a_child_that_keeps_crashing_is_started_with_a_growing_backoff():
    starts = []

    def start():
        starts.append(time.monotonic())
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    lines = []
    supervisor = Supervisor(poll_s=0.02, initial_backoff_s=0.1, max_backoff_s=0.4,
                            report=lines.append)
    supervisor.add("flaky", start)
    supervisor.start()
    deadline = time.monotonic() + 20
    while len(starts) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.stop()
    supervisor.process("flaky").wait(10)
    assert len(starts) >= 5
    gaps = np.diff(starts[:5])  # each includes the child's own short life
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.4 and gaps[3] >= 0.4
    assert gaps[3] < 0.4 + 5.0  # capped, not doubled again (a loose bound: noisy machine)
    assert "exited with 3; starting it again in 0.1 s (restart 1)" in lines[0]
    # stop() ends the supervision: nothing is started after it.
    count = len(starts)
    time.sleep(0.5)
    assert len(starts) == count

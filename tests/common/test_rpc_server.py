"""How a stopping service waits for its daemon threads (services/common/rpc/server.py)."""

import threading
import time

from sssd.common.rpc.server import _let_ending_threads_end


def test_a_stopping_service_waits_for_daemon_threads_that_are_ending_and_not_for_the_others():
    """gRPC's serving thread ends just after the server: it is waited for, so that what it
    frees is freed before the interpreter finalizes. A thread that never ends costs the bound."""
    ending_ran = threading.Event()
    forever = threading.Event()

    def ending():
        time.sleep(0.2)
        ending_ran.set()

    threads = [threading.Thread(target=ending, daemon=True),
               threading.Thread(target=forever.wait, daemon=True)]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    _let_ending_threads_end(1.5)
    waited = time.monotonic() - start
    forever.set()
    assert ending_ran.is_set() and not threads[0].is_alive()
    assert 1.0 < waited < 30.0  # the endless thread used the bound up, then was left

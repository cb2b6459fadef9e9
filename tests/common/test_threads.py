"""off_main_thread: the serving processes' model loading runs on a thread that ends, so that only
the engine's own thread keeps OpenMP workers (threads.py says why)."""

import threading
from types import SimpleNamespace

import pytest

from sssd.common.model.threads import off_main_thread


def test_the_work_runs_on_another_thread_that_has_ended_when_it_returns():
    seen = []

    def work():
        seen.append(threading.current_thread())
        return 42

    assert off_main_thread(work) == 42
    assert seen[0] is not threading.main_thread()
    assert not seen[0].is_alive()


def test_the_works_exception_reaches_the_caller():
    def work():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        off_main_thread(work)


def test_the_single_process_frontend_builds_its_engine_off_the_main_thread(monkeypatch):
    from sssd.verifier.serving import assembly
    from sssd.verifier.serving.frontend import Frontend

    from support.serving import frontend_config

    built = []

    def build_engine_loop(config, loaded, max_requests, publish=None):
        built.append(threading.current_thread())
        raise RuntimeError("built")

    monkeypatch.setattr(assembly, "build_engine_loop", build_engine_loop)
    frontend = Frontend.__new__(Frontend)  # only what load() reads
    frontend.servicer = SimpleNamespace(config=frontend_config(None, max_len=256))
    with pytest.raises(RuntimeError, match="built"):
        frontend.load(loaded=SimpleNamespace())
    assert built[0] is not threading.main_thread()

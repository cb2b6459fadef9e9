"""Fixtures shared by more than one test package."""

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded once per session (from the on-disk cache when warm)."""
    # No skip when the model package is missing: scripts/setup.sh installs it, so its absence is
    # a broken set-up that must fail loudly.
    from sssd.common.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def target_model_fp32():
    """The default model in float32 (a LoadedModel), loaded once per session.

    From the converted-weights cache when warm (about 1-3 s); the first run on a machine pays
    the GGUF conversion (about 15 s) and fills the cache.
    """
    from sssd.common.model_loader import load_causal_lm

    return load_causal_lm(None, "float32")


@pytest.fixture(scope="session")
def wait_until():
    """wait_until(condition, timeout=10.0): polls until condition() is true; False on timeout."""
    import time

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
    """free_port(): a TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    def pick():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick

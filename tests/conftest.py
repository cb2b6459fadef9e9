"""Fixtures shared by more than one test package."""

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded once per session (from the on-disk cache when warm)."""
    # No skip when the model package is missing: scripts/setup.sh installs it, so its absence is
    # a broken set-up that must fail loudly.
    from sssd.common.tokenizer import load_tokenizer

    return load_tokenizer()

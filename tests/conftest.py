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

import pytest


@pytest.fixture(scope="session")
def make_speculator(target_model_fp32):
    """make(draft_layers=0, **SpeculatorConfig fields) -> an in-process Speculator whose draft
    model is the float32 target itself (0) or its first `draft_layers` layers, sharing weights.
    The caller closes it."""
    from sssd.speculator.config import SpeculatorConfig
    from sssd.speculator.service import build_speculator

    def make(draft_layers=0, **fields):
        fields.setdefault("max_len", 1024)
        fields.setdefault("max_sequences", 8)
        config = SpeculatorConfig(draft_layers=draft_layers, dtype="float32", **fields)
        return build_speculator(config, loaded=target_model_fp32)

    return make

"""Which datastore the command-line apps serve when none is named."""

from pathlib import Path

import pytest

from sssd.cli import datastores
from sssd.datastore.build import build_datastore

VOCAB = 100
FINGERPRINT = "f" * 64


def make(directory: Path, fingerprint: str = FINGERPRINT) -> Path:
    build_datastore(directory, [[1, 2, 3, 4]], VOCAB, fingerprint)
    return directory


@pytest.fixture(autouse=True)
def model_tokenizer(monkeypatch):
    """The model's tokenizer is the one of FINGERPRINT (the tests pass tokenizer=None)."""
    monkeypatch.setattr(datastores, "tokenizer_fingerprint", lambda tokenizer: FINGERPRINT)


@pytest.fixture
def self_outputs(tmp_path, monkeypatch):
    root = tmp_path / "self-outputs"
    root.mkdir()
    monkeypatch.setattr(datastores, "SELF_OUTPUTS_DIR", root)
    monkeypatch.setenv("SSSD_DATA_DIR", str(tmp_path / "demo"))
    return root


def test_a_large_self_output_datastore_is_preferred(self_outputs):
    make(self_outputs / "datastore-1200")
    make(self_outputs / "datastore-3000")
    (self_outputs / "datastore-9000").mkdir()  # an interrupted build: no manifest
    assert datastores.pick_datastore(None, tokenizer=None) == self_outputs / "datastore-3000"


def test_a_models_own_directory_and_sharegpt_beside_the_answers_count(self_outputs):
    make(self_outputs / "datastore-1200")
    make(self_outputs / "datastore-1500", fingerprint="e" * 64)  # another model's
    make(self_outputs / "qwen" / "datastore-1400")
    assert datastores.pick_datastore(None, tokenizer=None) == \
        self_outputs / "qwen" / "datastore-1400"
    make(self_outputs / "qwen" / "datastore-1400+sharegpt12000")
    assert datastores.pick_datastore(None, tokenizer=None) == \
        self_outputs / "qwen" / "datastore-1400+sharegpt12000"


def test_a_small_self_output_datastore_gives_way_to_sharegpt(self_outputs, monkeypatch, caplog):
    make(self_outputs / "datastore-56")
    built = []
    monkeypatch.setattr(datastores, "ensure_sharegpt_datastore",
                        lambda root, tokenizer, records: built.append((root, records)) or root)
    with caplog.at_level("INFO"):
        picked = datastores.pick_datastore(None, tokenizer=None, records=500)
    assert built == [(self_outputs.parent / "demo", 500)] and picked == self_outputs.parent / "demo"
    assert "fewer than 1000 conversations" in caplog.text
    # Named explicitly, it is served whatever its size.
    assert datastores.pick_datastore(self_outputs / "datastore-56", None) == \
        self_outputs / "datastore-56"


def test_a_named_directory_without_a_datastore_is_refused(tmp_path):
    with pytest.raises(datastores.NoDatastore, match="no manifest.json"):
        datastores.pick_datastore(tmp_path, None)


def test_a_datastore_of_another_tokenizer_is_never_served(self_outputs, monkeypatch):
    make(self_outputs / "datastore-1200")
    make(self_outputs / "datastore-5000", fingerprint="e" * 64)  # another model's answers
    assert datastores.pick_datastore(None, tokenizer=None) == self_outputs / "datastore-1200"
    with pytest.raises(datastores.NoDatastore, match="built with another tokenizer"):
        datastores.pick_datastore(self_outputs / "datastore-5000", None)

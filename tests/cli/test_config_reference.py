"""The configuration reference in docs/ is what the configuration dataclasses say now."""

from pathlib import Path

from sssd.cli.config_reference import render

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_reference_matches_the_dataclasses():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert "| `--max-batch-size` |" in page  # it is the reference, with a field's row
    assert page == render(), "run: python -m sssd.cli.config_reference > docs/configuration.md"

"""The sources read as the project's style asks: lines of at most 100 columns, no unused imports
or names, imports sorted (ruff, configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is missing: scripts/setup.sh installs it (the dev extra)")
    done = subprocess.run([ruff, "check", "--output-format", "concise", "services", "tests",
                           "bench", "setup.py"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the front pages: current tables generated from the results files ---------------------------


def test_the_results_tables_are_what_the_results_files_give():
    """README.md's table and docs/benchmarks.md's current tables are `bench.report`'s output
    for the files that bench/results/current.toml names: a number cannot drift from its file."""
    from bench import report

    current = report.load_current()
    for page, text in report.pages(current).items():
        assert (REPO / page).read_text() == text, f"{page} is stale: run `python -m bench.report`"


def test_every_current_result_file_exists_and_has_notes():
    from bench import report

    for claim, sources in report.load_current().items():
        for source in sources:
            assert source.path.is_file(), f"{claim}: {source.path} is missing"
            assert source.machine, f"{source.folder}/NOTES.md names no machine"


def test_benchmarks_page_has_no_dated_section():
    """A run's history goes to its results folder's NOTES.md, never to a dated section of the
    page."""
    import re

    text = (REPO / "docs" / "benchmarks.md").read_text()
    dated = re.findall(r"(?m)^#+ .*\b20\d\d-\d\d-\d\d\b.*$", text)
    assert dated == []


def test_readme_results_come_only_from_the_generated_table():
    """Outside its generated block the README quotes no speedup or tokens/s figure."""
    import re

    text = (REPO / "README.md").read_text()
    head, _, rest = text.partition("<!-- headline:begin -->")
    _, _, tail = rest.partition("<!-- headline:end -->")
    figures = re.findall(r"\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? ?tokens/s\b|\b\d+(?:\.\d+)? ?tok/s\b",
                         head + tail)
    assert figures == []
    assert len(text.splitlines()) <= 130


def test_every_results_folder_has_notes_naming_its_machine_and_commit():
    import re

    for folder in sorted((REPO / "bench" / "results").iterdir()):
        if not folder.is_dir():
            continue
        notes = folder / "NOTES.md"
        assert notes.is_file(), f"{folder.name} has no NOTES.md"
        text = notes.read_text()
        assert re.search(r"(?m)^- Machine: \S", text), f"{folder.name}/NOTES.md: no machine"
        assert re.search(r"(?m)^- Commit: \S", text), f"{folder.name}/NOTES.md: no commit"

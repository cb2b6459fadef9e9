"""The Helm chart rendered offline (helm-python-sdk), for the chart's tests and the smoke test
that runs what it renders."""

from pathlib import Path

import pytest

CHART = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "sssd-serve"


@pytest.fixture(scope="session")
def render():
    """render(values) -> the rendered objects (release "demo" in namespace "ai"), as dicts."""
    helm = pytest.importorskip("helm_python")
    yaml = pytest.importorskip("yaml")

    def render(values: dict) -> list[dict]:
        manifests = helm.Chart.load(str(CHART)).render(values, name="demo", namespace="ai")
        return [doc for path, text in sorted(manifests.items())
                if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc]

    return render

"""How scripts/test.sh spreads the suite over pytest-xdist workers (support/workers.py): by
module, every module that starts a local Ray cluster in the one unit "ray"."""

import re
from pathlib import Path

import pytest

pytest.importorskip("xdist")

from support.workers import RAY_MODULES, ModuleScheduling  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# A module starts a local Ray cluster when it imports ray (`import ray` or importorskip("ray")).
USES_RAY = re.compile(r'^(import ray\b|from ray\b|(\w+ = )?pytest\.importorskip\("ray"\))', re.M)


def test_tests_of_a_module_share_a_unit_and_ray_modules_share_one():
    unit = ModuleScheduling._split_scope  # what xdist calls for each node id
    assert unit(None, "tests/drafter/test_service.py::test_a") == "tests/drafter/test_service.py"
    assert unit(None, "tests/drafter/test_service.py::Class::test_b[x::y]") == \
        "tests/drafter/test_service.py"
    assert unit(None, "tests/e2e/test_up.py::test_a") == "ray"
    assert unit(None, "tests/e2e/test_chart_smoke.py::test_b[p]") == "ray"


def test_every_module_that_starts_ray_is_in_the_ray_unit():
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
               if USES_RAY.search(path.read_text())}
    assert modules == set(RAY_MODULES)  # a listed module that is gone fails too

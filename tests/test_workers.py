"""How scripts/test.sh spreads the suite over pytest-xdist workers (support/workers.py): by
module, every module that starts a local Ray cluster in the one group "ray"."""

import re
from pathlib import Path

import pytest

pytest.importorskip("xdist")

from support.workers import SHARED_WORKER, ModuleScheduling, unit_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# A module starts a local Ray cluster when it imports ray (`import ray` or importorskip("ray")).
USES_RAY = re.compile(r'^(import ray\b|from ray\b|(\w+ = )?pytest\.importorskip\("ray"\))', re.M)


def test_tests_of_a_module_share_a_unit_and_ray_modules_share_one():
    assert unit_of("tests/drafter/test_service.py::test_a") == "tests/drafter/test_service.py"
    assert unit_of("tests/drafter/test_service.py::Class::test_b[x::y]") == \
        "tests/drafter/test_service.py"
    assert unit_of("tests/e2e/test_up.py::test_a") == "ray"
    assert unit_of("tests/e2e/test_chart_smoke.py::test_b[p]") == "ray"


def test_every_module_that_starts_ray_is_in_the_ray_group():
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
               if USES_RAY.search(path.read_text())}
    assert modules == set(SHARED_WORKER["ray"])  # a listed module that is gone fails too


def test_the_scheduler_splits_by_unit():
    split = ModuleScheduling._split_scope  # xdist's scope of a node id
    assert split(None, "tests/e2e/test_ray_serving.py::test_x") == "ray"
    assert split(None, "tests/common/test_tls.py::test_y") == "tests/common/test_tls.py"

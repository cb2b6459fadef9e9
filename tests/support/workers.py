"""How scripts/test.sh spreads the suite over pytest-xdist workers: whole modules, never single
tests, so a module-scoped service or cluster starts once; the modules that start a local Ray
cluster all on one worker, one after another, since a second cluster beside the first on this
machine doubles its memory and shares its session files under /tmp/ray.

xdist's own `--dist loadgroup` cannot be used for this: it tags a test's node id with its group,
and on pytest 9.2 the node id is derived and no longer takes the tag, so every test became its
own unit (both workers then started Ray clusters at once). This scheduler reads the unit from
the node id, which it sees whole in the controller.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

RAY_MODULES = ("tests/e2e/test_up.py", "tests/e2e/test_ray_serving.py",
               "tests/e2e/test_ray_own_prefill.py", "tests/e2e/test_chart_smoke.py")


class ModuleScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (units with the most tests first) with a test's module as its
    unit, and the Ray modules as the one unit "ray"."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "ray" if module in RAY_MODULES else module

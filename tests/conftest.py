"""The test suite's shared fixtures, by topic, in tests/support/ (the package `support`, so test
modules may also import its helpers); a domain's own fixtures are in its directory's conftest.

A test that uses a fixture loading the model (weights or tokenizer) is marked `model`: the fast
tier is `pytest -m "not model"`.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

# `support` is imported from its directory, not by putting tests/ on sys.path, where the test
# packages (tests/vllm above all) would shadow the real packages of the same names.
_SUPPORT = Path(__file__).resolve().parent / "support"
_spec = importlib.util.spec_from_file_location("support", _SUPPORT / "__init__.py",
                                               submodule_search_locations=[str(_SUPPORT)])
sys.modules["support"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sys.modules["support"])

pytest_plugins = ("support.model", "support.processes", "support.pki", "support.fakes",
                  "support.chart", "support.indexing")

# Fixtures that load the model (weights or tokenizer); a test using any of them is marked
# `model` automatically. Tests that load it another way (a subprocess) carry the mark.
MODEL_FIXTURES = {"tokenizer", "target_model_fp32", "target_model_bf16", "mt_bench_prompts",
                  "greedy_references", "warm_datastore", "engine_factory", "make_speculator",
                  "qwen_coder_05b"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (scripts/test.sh), whole modules go to a worker and the modules that
    start a local Ray cluster share one: support/workers.py."""
    from support.workers import ModuleScheduling

    return ModuleScheduling(config, log)

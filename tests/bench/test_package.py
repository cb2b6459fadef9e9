"""bench/ is a package: every program imports as `bench.<name>` without editing the import
path, and the flags most programs take come from one module."""

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROGRAMS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_imports_as_a_module_of_the_package(name):
    module = importlib.import_module(f"bench.{name}")
    assert Path(module.__file__).resolve() == BENCH / f"{name}.py"


def test_no_program_edits_the_import_path():
    edits = [f"{p.name}:{node.lineno}" for p in BENCH.glob("*.py")
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert edits == []


def test_shared_flags_are_declared_in_one_module():
    """--datastore and --max-tokens: declared by bench.flags, not by each program."""
    declared = []
    for path in BENCH.glob("*.py"):
        if path.name == "flags.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                    and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value in ("--datastore", "--max-tokens", "--dtype"):
                declared.append(f"{path.name}:{node.lineno} {node.args[0].value}")
    assert declared == []

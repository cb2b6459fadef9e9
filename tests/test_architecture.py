"""The package arrows and interfaces the layout promises (docs/architecture.md): no import
cycle, what each package may import, the one drafting interface known only by its protocol, the
one registry, the one error table, ports and flags defined once."""

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[1] / "services"


def loaded_modules(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `statement`."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def imported_names(package: Path) -> set[str]:
    """Every module name the package's sources import (statically, lazy imports included)."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def module_name(path: Path) -> str:
    """The import name of a source file: services/<a>/<b>.py is sssd.<a>.<b>."""
    parts = ["sssd", *path.relative_to(SERVICES).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """sssd module -> the sssd modules it imports, read from the sources (function-level
    imports included; `from package import module` counts as the module)."""
    paths = {module_name(path): path for path in SERVICES.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    module = f"{node.module}.{alias.name}"
                    targets.add(module if module in paths else node.module)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_tree_is_the_source_tree():
    """An editable install: every sssd module is imported from services/, where it is edited
    (the compiled modules included, which scripts/build_core.sh puts there)."""
    code = ("import json, sssd, sssd._core, sssd._kernels, sssd.v1.generate_pb2, "
            "sssd.verifier.engine.engine; "
            "print(json.dumps([sssd.__file__, sssd._core.__file__, sssd._kernels.__file__, "
            "sssd.v1.generate_pb2.__file__, sssd.verifier.engine.engine.__file__]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    for path in json.loads(done.stdout):
        assert Path(path).resolve().is_relative_to(SERVICES), path


def test_there_is_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "sssd.verifier.engine.engine" in graph  # it read the sources
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The proposers behind the protocol; the engine and the serving loop must not name them.
CONCRETE_PROPOSERS = {"LocalDrafter", "RemoteDrafter", "ReplicatedDrafter", "SourceRouter",
                      "SpeculatorProposer"}
PROPOSER_MODULES = ("sssd.drafter", "sssd.speculator.client", "sssd.common.drafting.router")


def test_the_engine_and_the_serving_loop_know_proposers_by_their_protocol_only():
    for package in (SERVICES / "verifier" / "engine", SERVICES / "verifier" / "serving"):
        imported = {n for n in imported_names(package) if n.startswith(PROPOSER_MODULES)}
        assert not imported, f"{package} imports {imported}"
        for path in package.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id in ("isinstance", "getattr", "hasattr"):
                    named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                    strings = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
                    assert not named & CONCRETE_PROPOSERS, f"{path}:{node.lineno}"
                    assert not strings & {"hindsight_drafts", "sources", "proposers",
                                          "summary"}, f"{path}:{node.lineno}"


def test_the_speculator_client_loads_no_torch():
    modules = loaded_modules("import sssd.speculator.client")
    assert "sssd.speculator.client" in modules and "torch" not in modules
    assert "sssd.speculator.speculator" not in modules


def test_the_indexer_and_the_verifier_share_only_the_conversation_package():
    graph = import_graph()
    verifier = {m for m in graph if m.startswith("sssd.verifier")}
    indexer = {m for m in graph if m.startswith("sssd.indexer")}
    assert not {t for m in verifier for t in graph[m] if t.startswith("sssd.indexer")}
    assert not {t for m in indexer for t in graph[m] if t.startswith("sssd.verifier")}
    # What connects them: the record of a conversation, published by one, indexed by the other.
    assert "sssd.common.conversations.record" in graph["sssd.indexer.consumer"]
    assert "sssd.common.conversations.record" in graph["sssd.verifier.serving.publish"]


def test_the_engine_loads_neither_grpc_nor_the_cpp_core():
    assert "sssd._core" not in loaded_modules("import sssd.verifier.engine")
    modules = loaded_modules("import sssd.verifier.engine.engine; "
                             "from sssd.verifier.engine import Engine")
    assert "torch" in modules  # it did load the engine
    assert not {m for m in modules if m == "grpc" or m.startswith("grpc.")}
    assert "sssd._core" not in modules
    assert not {m for m in modules if m.startswith("ray")}


def test_the_drafting_interface_and_the_datastore_reader_are_light():
    modules = loaded_modules("import sssd.common.drafting.proposer, sssd.datastore.shard, "
                             "sssd.datastore.manifest, sssd.datastore.build")
    assert "grpc" not in modules and "sssd._core" not in modules and "torch" not in modules


def test_serving_configuration_loads_no_model_stack():
    modules = loaded_modules("import sssd.verifier.serving.config, sssd.client, "
                             "sssd.common.config.flags")
    assert "torch" not in modules and "transformers" not in modules


def test_lower_packages_do_not_import_higher_ones():
    higher = {"common": ("sssd.datastore", "sssd.drafter", "sssd.verifier", "sssd.indexer",
                         "sssd.cli", "sssd.client", "sssd.speculator"),
              # The speculator is a service of its own: it shares only sssd.common.
              "speculator": ("sssd.datastore", "sssd.drafter", "sssd.verifier", "sssd.indexer",
                             "sssd.cli", "sssd.client"),
              "datastore": ("sssd.drafter", "sssd.verifier", "sssd.indexer", "sssd.cli"),
              "drafter": ("sssd.verifier", "sssd.indexer", "sssd.cli"),
              "client": ("sssd.verifier", "sssd.drafter", "sssd.indexer", "sssd.cli")}
    for package, forbidden in higher.items():
        wrong = {n for n in imported_names(SERVICES / package) if n.startswith(forbidden)}
        assert not wrong, f"services/{package} imports {wrong}"
    engine = imported_names(SERVICES / "verifier" / "engine")
    assert not {n for n in engine if n.startswith(("sssd.verifier.serving", "sssd.drafter",
                                                   "grpc", "ray"))}


def test_drafters_implement_the_proposer_protocol(tmp_path):
    from sssd.common.drafting.proposer import DraftRequest, Proposer
    from sssd.drafter.client import RemoteDrafter
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    with LocalDrafter(DrafterConfig(vocab_size=100)) as drafter:
        assert isinstance(drafter, Proposer)
        drafter.propose([DraftRequest("s", [1, 2, 3, 1, 2], 8, is_start=True)])
        (root,) = drafter.propose([DraftRequest("s", [3], 1)])  # budget 1: appends only
        assert root.num_nodes == 1
        (tree,) = drafter.propose([DraftRequest("s", [], 8)])
        assert tree.root_token == 3 and tree.token_ids[1] == 1  # "3" was followed by "1"
        assert drafter.end(["s", "unknown"]) == 1
    remote = RemoteDrafter("127.0.0.1:1", timeout_s=0.1)
    assert isinstance(remote, Proposer)
    remote.close()
    from sssd.speculator.client import RemoteSpeculator, SpeculatorProposer

    ssd = SpeculatorProposer(RemoteSpeculator("127.0.0.1:1", timeout_s=0.1))
    assert isinstance(ssd, Proposer)
    ssd.close()


def test_a_drafter_used_before_start_is_refused():
    from sssd.common.drafting.proposer import DraftRequest
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    drafter = LocalDrafter(DrafterConfig(vocab_size=100))
    with pytest.raises(RuntimeError, match="start"):
        drafter.propose([DraftRequest("s", [1], 4, is_start=True)])


def test_every_engine_mode_has_a_proposer_in_the_registry():
    from sssd.verifier.engine.config import MODES
    from sssd.verifier.proposers import PROPOSERS, register_proposer

    assert set(PROPOSERS) == set(MODES)
    with pytest.raises(ValueError, match="already"):
        register_proposer("sssd", PROPOSERS["sssd"])


def test_every_error_kind_has_one_grpc_status():
    from sssd.verifier.serving.errors import ErrorKind
    from sssd.verifier.serving.frontend import STATUS_OF_KIND

    assert set(STATUS_OF_KIND) == set(ErrorKind)


def test_default_ports_are_distinct_and_the_configs_use_them():
    from sssd.common.rpc import ports
    from sssd.drafter.config import DrafterConfig
    from sssd.verifier.serving.config import FrontendConfig

    values = [v for k, v in vars(ports).items() if k.endswith("_PORT")]
    assert len(values) == len(set(values))
    assert DrafterConfig().port == ports.DRAFTER_PORT != FrontendConfig().port
    from sssd.speculator.config import SpeculatorConfig

    assert SpeculatorConfig().port == ports.SPECULATOR_PORT


def test_flags_come_from_the_config_fields():
    from sssd.common.config.flags import add_flags, from_args
    from sssd.verifier.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig, defaults={"budget_policy": "measured"})
    config = from_args(EngineConfig, parser.parse_args(["--max-batch-size", "3",
                                                       "--datastore", "x"]))
    assert (config.max_batch_size, config.datastore_dir, config.budget_policy) == \
        (3, "x", "measured")
    help_text = " ".join(parser.format_help().split())
    assert "the most sequences running at once (each holds KV blocks while it runs: memory " \
        "bounds them too) (default 64)" in help_text
    with pytest.raises(SystemExit):  # choices from the field
        parser.parse_args(["--mode", "fast"])
    with pytest.raises(ValueError, match="max_batch_size"):  # the config's own check
        from_args(EngineConfig, parser.parse_args(["--max-batch-size", "0"]))


# --- sizes and maps ------------------------------------------------------------------------------

GENERATED = ("services/v1/",)  # scripts/gen_proto.sh writes it
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def project_sources() -> list[Path]:
    root = SERVICES.parent
    return [p for p in sorted(SERVICES.rglob("*.py"))
            if not str(p.relative_to(root)).startswith(GENERATED)]


def test_no_source_file_is_over_500_lines():
    """A module of one idea stays small; a longer one is a sign that it does several jobs."""
    root = SERVICES.parent
    long = [f"{p.relative_to(root)}: {n}" for p in project_sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long += [f"{p.relative_to(root)}: {n}" for p in sorted(SERVICES.rglob("*.cc"))
             if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_no_function_is_over_80_lines():
    root = SERVICES.parent
    long = []
    for path in project_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines}")
    assert long == []


def test_every_package_map_names_each_of_its_modules():
    """A package whose docstring maps its files (`    name.py   what it is`) names all of them,
    and names no file that is not there."""
    import re

    for init in sorted(SERVICES.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        listed = set()
        for line in doc.splitlines():
            match = re.match(r"^\s{4}(\S+)\s\s", line)
            if match:
                listed.update(re.findall(r"[\w./]+(?:\.py|/)", match.group(1)))
        if not listed:
            continue
        present = {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"} | \
            {f"{p.name}/" for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
        assert listed == present, f"{init.relative_to(SERVICES.parent)}: map lists " \
            f"{sorted(listed - present)} that are not there, omits {sorted(present - listed)}"

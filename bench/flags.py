"""The command-line flags that most benchmarks take, declared once: the same name, type, default
convention and help text everywhere. Each `add_*` takes the program's own default where
programs differ (a replay reads 80 prompts, a serving run 16)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.prompt_sets import SETS

DTYPES = ("bfloat16", "float32")


def add_model(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument("--model", default=default,
                        help="a GGUF file, a model directory or a name of `sssd-models list` "
                        f"(default: {default or 'SmolLM2-135M-Instruct'}); datastores must be "
                        "built with its tokenizer")


def add_dtype(parser: argparse.ArgumentParser, default: str = "bfloat16") -> None:
    parser.add_argument("--dtype", default=default, choices=DTYPES,
                        help=f"the model's dtype ({default})")


def add_device(parser: argparse.ArgumentParser) -> None:
    from sssd.common.model.device import check_device

    parser.add_argument("--device", default="cpu", type=check_device,
                        help="where the model runs: cpu (default), cuda, cuda:N, auto")


def add_datastore(parser: argparse.ArgumentParser, help: str, required: bool = False,
                  repeat: bool = False, type: type = Path) -> None:
    """--datastore DIR (or, with `repeat`, a list of them); `type` str where the value goes on
    to a subprocess's JSON or a config field that takes a string."""
    if repeat:
        parser.add_argument("--datastore", action="append", type=type, default=[], help=help)
    else:
        parser.add_argument("--datastore", type=type, default=None, required=required,
                            help=help)


def add_prompts(parser: argparse.ArgumentParser, default: int, per_set: bool = False) -> None:
    parser.add_argument("--prompts", type=int, default=default,
                        help=f"prompts{' per set' if per_set else ''}, at most ({default})")


def add_max_tokens(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=default,
                        help=f"new tokens per answer ({default})")


def add_set(parser: argparse.ArgumentParser, default: str = "mt_bench",
            choices: tuple[str, ...] = SETS) -> None:
    parser.add_argument("--set", default=default, choices=choices,
                        help=f"prompt set: {', '.join(choices)} (default {default})")


def add_sets(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--sets", default=default,
                        help=f"comma-separated prompt sets of {', '.join(SETS)} (default "
                        f"{default})")


def add_batch_sizes(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--batch-sizes", default=default,
                        help=f"comma-separated batch sizes ({default})")


def batch_sizes(text: str) -> list[int]:
    """--batch-sizes "1,4,8" as [1, 4, 8]; an entry that is not a positive integer exits with
    the flag named."""
    try:
        sizes = [int(entry) for entry in text.split(",")]
    except ValueError:
        raise SystemExit(f"--batch-sizes {text!r}: comma-separated integers") from None
    if any(size < 1 for size in sizes):
        raise SystemExit(f"--batch-sizes {text!r}: every batch size must be >= 1")
    return sizes


def add_png(parser: argparse.ArgumentParser, name: str | None) -> None:
    """--png PATH: by default var/bench/<name>.png, outside the tracked tree (None: no PNG
    unless asked for)."""
    default = Path(f"var/bench/{name}.png") if name else None
    parser.add_argument("--png", type=Path, default=default,
                        help=f"where to draw the PNG ({default or 'none unless given'})")


def add_out(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument("--out", type=Path, default=None if default is None else Path(default),
                        help="also write the JSON lines here" +
                        (f" ({default})" if default else ""))

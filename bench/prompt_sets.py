"""The benchmarks' prompt sets, by name: `mt_bench` (first turns), `code` (bench/data/
code_prompts.jsonl, written for this project: no HumanEval), `sharegpt-tune` (first user turns
of ShareGPT records 12,000-14,999, held out for tuning the drafter; never mt_bench), and the
long-prompt code edits: `code-edits` (an edit instruction over a whole source file of this
project, the first CODE_EDIT_FILES files of 2k-16k tokens: bench/long_context.py's set) and
`code-edits-tune` (the files after those, held out for tuning the drafter's copy source)."""

from __future__ import annotations

import json
from pathlib import Path

SETS = ("mt_bench", "code", "sharegpt-tune", "code-edits", "code-edits-tune")
CODE_PROMPTS = Path(__file__).resolve().parent / "data" / "code_prompts.jsonl"
TUNE_RECORDS = (12_000, 15_000)  # ShareGPT records held out for tuning
ROOT = Path(__file__).resolve().parents[1]
EDITS = ("Add type hints to every function and method that lacks them. Return the complete "
         "file, changed only where needed.",
         "Add a one-line docstring to every function that has none. Return the complete file.",
         "Rename every local variable called `i` to `index`. Return the complete file.")
CODE_EDIT_FILES = 8  # the benchmark's files; the tuning set starts after them


def code_edits(tokenizer, limit: int, low: int = 2048, high: int = 16384,
               skip: int = 0) -> list[tuple[str, str, list[int]]]:
    """(file, user message, prompt ids) of edit instructions over whole source files of this
    project whose prompt (the message through the chat template) holds `low`-`high` tokens, in
    path order, the first `skip` of them left out. The files are this checkout's: the set
    follows the code."""
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        if "v1" in path.parts:  # generated code
            continue
        instruction = EDITS[len(found) % len(EDITS)]
        text = f"{instruction}\n\n```python\n{path.read_text()}```"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        ids = list(getattr(ids, "input_ids", ids))
        if low <= len(ids) <= high:
            found.append((str(path.relative_to(ROOT)), text, ids))
        if len(found) == skip + limit:
            break
    return found[skip:]


def prompt_texts(name: str, limit: int, tokenizer=None) -> list[str]:
    """The set's first `limit` user messages; the code-edit sets need the model's `tokenizer`
    (their files are chosen by prompt length)."""
    from sssd.common.data.corpus import first_turns, iter_sharegpt, read_mt_bench, sharegpt_messages

    if name in ("code-edits", "code-edits-tune"):
        if tokenizer is None:
            raise SystemExit(f"prompt set {name!r} needs the model's tokenizer")
        skip = CODE_EDIT_FILES if name == "code-edits-tune" else 0
        return [text for _, text, _ in code_edits(tokenizer, limit, skip=skip)]
    if name == "mt_bench":
        return first_turns(read_mt_bench())[:limit]
    if name == "code":
        with open(CODE_PROMPTS) as f:
            return [json.loads(line)["prompt"] for line in f if line.strip()][:limit]
    if name == "sharegpt-tune":
        texts = []
        for record in iter_sharegpt(*TUNE_RECORDS):
            first = next((m["content"] for m in sharegpt_messages(record)
                          if m["role"] == "user" and m["content"].strip()), None)
            if first is not None and len(first) < 2000:  # long pastes: prompts of 500+ tokens
                texts.append(first)
            if len(texts) == limit:
                break
        return texts
    raise SystemExit(f"unknown prompt set {name!r}: {', '.join(SETS)}")

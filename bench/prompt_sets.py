"""The benchmarks' prompt sets, by name: `mt_bench` (first turns), `code` (bench/data/
code_prompts.jsonl, written for this project: no HumanEval) and `sharegpt-tune` (first user turns
of ShareGPT records 12,000-14,999, held out for tuning the drafter; never mt_bench)."""

from __future__ import annotations

import json
from pathlib import Path

SETS = ("mt_bench", "code", "sharegpt-tune")
CODE_PROMPTS = Path(__file__).resolve().parent / "data" / "code_prompts.jsonl"
TUNE_RECORDS = (12_000, 15_000)  # ShareGPT records held out for tuning


def prompt_texts(name: str, limit: int) -> list[str]:
    from sssd.common.data.corpus import first_turns, iter_sharegpt, read_mt_bench, sharegpt_messages

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
    raise SystemExit(f"unknown prompt set {name!r}: mt_bench, code or sharegpt-tune")

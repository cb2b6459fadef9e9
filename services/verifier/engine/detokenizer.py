"""Incremental detokenization: the answer's text grows at a cost per token that does not depend
on how long the answer already is.

Decoding the whole output after every token (to look for stop strings and to stream text
deltas) costs O(n) per token, O(n^2) per answer. Here new tokens are decoded together with only
the tokens of the append before them, from `prefix_offset`: the text of tokens[prefix_offset:]
minus the text of tokens[prefix_offset:read_offset] is what the new tokens add. Starting the
window before the new tokens keeps what a tokenizer does at token boundaries (a SentencePiece
leading space, a byte-level character split over tokens) the same as in a full decode; tests
check the text equals `tokenizer.decode(all ids)` for real outputs.

A window that ends inside a multi-byte character decodes to a trailing U+FFFD. That tail is
never part of `text`: text is always the longest prefix that can no longer change, and the
offsets only move past a window once it decodes cleanly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """The text of one growing output; `decode(ids)` must skip special tokens itself."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.token_ids: list[int] = []  # [num_output_tokens]
        self.text = ""  # the settled text of token_ids
        self.prefix_offset = 0  # the window decoded with each new token starts here
        self.read_offset = 0  # tokens before it are in `text` for good
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._pending = 0  # characters of the unsettled window already in `text`

    def append(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they settle (possibly empty)."""
        self.token_ids.extend(token_ids)
        window = self.decode(self.token_ids[self.prefix_offset:])
        added = window[len(self._prefix_text):]
        settled = added.rstrip(REPLACEMENT)
        delta = settled[self._pending:]
        self.text += delta
        if len(settled) == len(added):  # the window ends at a character boundary: move on
            # The next window starts where this one's new tokens did: a clean boundary, with
            # the tokens before the next new ones as context.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self._prefix_text = self.decode(self.token_ids[self.prefix_offset:])
            self._pending = 0
        else:
            self._pending = len(settled)
        return delta

    def flush(self) -> str:
        """At the end of the output: the unsettled tail as the tokenizer decodes it (a stray
        byte stays U+FFFD, as in a full decode)."""
        window = self.decode(self.token_ids[self.prefix_offset:])
        delta = window[len(self._prefix_text):][self._pending:]
        self.text += delta
        self._pending += len(delta)
        return delta


def find_stop(text: str, stops: Sequence[str], searched: int) -> int | None:
    """Where the earliest stop string starts in `text`, looking only at what can contain a
    match that ends after `searched` characters; None when there is none."""
    hits = []
    for stop in stops:
        start = max(0, searched - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0:
            hits.append(index)
    return min(hits) if hits else None


def stream_safe_end(text: str, stops: Sequence[str]) -> int:
    """How much of a running output's text can be streamed: a tail that could still grow
    into a stop string is held back, so streamed text never has to be taken back."""
    end = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, end), 0, -1):
            if text.endswith(stop[:size], 0, end):
                end -= size
                break
    return end

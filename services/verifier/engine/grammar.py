"""A request's structured-output constraint: what its answer must match, validated once at the
API boundary.

The kinds are OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's guided
decoding names (`regex`, `choice`, `grammar` in Lark or llama.cpp's GBNF syntax). Each
becomes one llguidance grammar (`llguidance_grammar`); the engine masks the target's logits by
it at every node of a draft tree and drops the draft nodes it rejects (constraint.py).

llguidance rather than xgrammar or outlines-core: it builds a grammar in well under a
millisecond and computes a mask over a 49k-151k vocabulary in 10 us to 2 ms on these CPUs
without precompiling per-state tables, so a schema that arrives with a request costs nothing
up front; it needs no torch, transformers or triton of its own (xgrammar's wheel requires all
three), so the frontend validates grammars without the model's stack.

Torch-free: the frontend imports it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from sssd.verifier.engine.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# The API field each kind is given in, for error messages.
FIELDS = {"json_object": "response_format", "json_schema": "response_format.json_schema",
          "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
MAX_SPEC_CHARS = 65_536  # a schema, regex or grammar; a schema this long is a mistake
MAX_CHOICES = 256
# The characters Rust's regex syntax (llguidance's) treats as meta: escaped in choices.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


@dataclass(frozen=True)
class Grammar:
    """What the answer must match. `spec`: the JSON schema's text (json_schema), the regex
    (regex) or the grammar (grammar: Lark, or GBNF, which llguidance translates); `choices`: the
    strings one of which is the whole answer (choice). Raises InvalidRequest, naming the API
    field, for a grammar llguidance cannot build."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in KINDS:
            raise InvalidRequest(f"response_format: kind {self.kind!r} is not one of "
                                 f"{', '.join(KINDS)}")
        name = FIELDS[self.kind]
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"{name}: must be a string of at most {MAX_SPEC_CHARS} "
                                 "characters")
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES or any(
                    not isinstance(c, str) or not c for c in self.choices):
                raise InvalidRequest(f"{name}: 1 to {MAX_CHOICES} non-empty strings")
        elif self.choices:
            raise InvalidRequest(f"{name}: choices belong to guided_choice only")
        if self.kind in ("regex", "grammar", "json_schema") and not self.spec:
            raise InvalidRequest(f"{name}: must not be empty")
        error = llguidance.LLMatcher.validate_grammar(self.llguidance_grammar)
        if error:
            raise InvalidRequest(f"{name}: {' '.join(error.split())[:400]}")

    @functools.cached_property
    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{FIELDS[self.kind]}: the schema is not JSON ({exc})") \
                    from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"{FIELDS[self.kind]}: a schema is a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex(
                "|".join(f"({_escaped(choice)})" for choice in self.choices))
        try:
            lark = any_to_lark(self.spec)
        except Exception as exc:  # noqa: BLE001 - the translator's errors are the grammar's
            raise InvalidRequest(f"{FIELDS[self.kind]}: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)


def _escaped(text: str) -> str:
    """`text` as a regex that matches it literally."""
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)

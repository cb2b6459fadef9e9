"""What one generation request asks for, as one frozen, validated type.

`GenerateRequest` travels unchanged from the API boundary (the gRPC frontend builds it from the
proto message) through the serving backend and the Ray workers to the engine. Its constructor
checks everything that does not depend on the model; `RequestLimits.check` adds what does (the
vocabulary, the context window). Both raise `InvalidRequest`, whose message starts with the API
field it is about.

Torch-free: the frontend and the Ray backend import it without loading the model's stack.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field

from sssd.verifier.engine.errors import InvalidRequest
from sssd.verifier.engine.grammar import Grammar

MAX_STOP_STRINGS, MAX_STOP_LEN = 8, 256
MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS = 64, 300
MAX_TOP_LOGPROBS = 20
# Drafting sources a request may name (the API's speculation modes sssd and ssd); a server
# offers those its engine mode has (RequestLimits.sources).
SOURCES = ("sssd", "ssd")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; validated here."""

    temperature: float = 0.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    # The same seed, prompt and settings give the same answer, with or without speculation;
    # None: a random seed per request.
    seed: int | None = None
    # Adjustments of the logits (logits_processing.py), applied before temperature at every
    # node of a draft tree from the tokens on that node's path, so speculation stays lossless.
    # OpenAI's and vLLM's meanings: presence and frequency penalties count the answer's tokens,
    # the repetition penalty (HF / CTRL) the prompt's and the answer's.
    presence_penalty: float = 0.0  # [-2, 2]: minus this for every token the answer has used
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the times the answer used it
    repetition_penalty: float = 1.0  # > 0: seen tokens' logits divided by it (> 0) or times it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added
    min_p: float = 0.0  # [0, 1]: drops tokens below min_p times the most likely one's mass
    # Log-probabilities to report (not a sampling setting): None = none; k >= 0 = each emitted
    # token's and the k most likely alternatives', from the model's raw logits.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", tuple(
            (int(token), float(bias)) for token, bias in self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and -2 <= value <= 2):
                raise InvalidRequest(f"{name}: must be a number in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, numbers.Real)
                and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequest(f"repetition_penalty: must be a number > 0 (1 = off), got "
                                 f"{self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
                token < 0 or not -100 <= bias <= 100 for token, bias in self.logit_bias):
            raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids >= 0 with "
                                 "biases in [-100, 100]")
        if not (isinstance(self.min_p, numbers.Real) and 0 <= self.min_p <= 1):
            raise InvalidRequest(f"min_p: must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logprobs is not None and (
                isinstance(self.logprobs, bool) or not isinstance(self.logprobs, numbers.Integral)
                or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(f"top_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {self.logprobs!r}")
        if not (isinstance(self.temperature, numbers.Real) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise InvalidRequest(f"temperature: must be a finite number >= 0 (0 = greedy), "
                                 f"got {self.temperature!r}")
        if not (isinstance(self.top_p, numbers.Real) and 0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p: must be in (0, 1] (1 = off), got {self.top_p!r}")
        if (isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral)
                or self.top_k < 0):
            raise InvalidRequest(f"top_k: must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, numbers.Integral)
                                      or not 0 <= self.seed < 2**64):
            raise InvalidRequest(f"seed: must be unset or an integer in [0, 2^64), got "
                                 f"{self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens before them (or are biased)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1)


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to answer. Built once at the API boundary, then passed along unchanged."""

    prompt_ids: tuple[int, ...]  # [num_prompt_tokens] the prompt, chat template applied
    max_tokens: int  # most tokens to generate
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    speculate: bool = True  # False: decode without drafts (speculation "off")
    # The drafting source to use, one of SOURCES; "" (speculation "auto"): the server's choice,
    # by measured cost where it has several.
    source: str = ""
    ignore_eos: bool = False  # EOS does not end the answer (benchmarks' fixed output lengths)
    # These tokens end the answer as EOS does ("stop"); they stay in its token ids (and in its
    # text unless special), as vLLM's stop_token_ids.
    stop_token_ids: tuple[int, ...] = ()
    # Until the answer holds this many tokens, EOS and stop_token_ids cannot be drawn.
    min_tokens: int = 0
    # Structured output: the answer matches this grammar (None: free text). The target's
    # logits are masked by it at every node, so speculation stays lossless (constraint.py).
    grammar: Grammar | None = None
    # Failover (serving/ray_backend.py): the answer's tokens a worker that died already
    # streamed. The engine takes them as its output so far (prefilled with the prompt; they
    # count towards max_tokens; sampling positions, the text and the published conversation
    # go on from them) and streams only what follows. `resume_text_chars`: the characters of
    # the answer's text the client already has.
    resume_ids: tuple[int, ...] = ()
    resume_text_chars: int = 0

    def __post_init__(self) -> None:
        # Accept any sequence of ints at construction, keep an immutable tuple.
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "resume_ids", tuple(self.resume_ids))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0
                for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids >= 0")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, numbers.Integral)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequest(f"min_tokens: must be an integer in [0, max_tokens="
                                 f"{self.max_tokens}], got {self.min_tokens!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidRequest("response_format: must be a Grammar")
        if not self.prompt_ids:
            raise InvalidRequest("prompt: must hold at least one token")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
               for t in self.prompt_ids):
            raise InvalidRequest("prompt: token ids must be integers")
        if (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral)
                or self.max_tokens < 1):
            raise InvalidRequest(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN for s in self.stop):
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} strings of 1 to "
                                 f"{MAX_STOP_LEN} characters")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos: must be true or false, got {self.ignore_eos!r}")
        if self.source and self.source not in SOURCES:
            raise InvalidRequest(f"speculation: source {self.source!r} is not one of "
                                 f"{', '.join(SOURCES)} (or empty: the server's choice)")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
               for t in self.resume_ids):
            raise InvalidRequest("resume: token ids must be integers")
        if len(self.resume_ids) >= self.max_tokens:
            raise InvalidRequest(f"resume: {len(self.resume_ids)} tokens already generated, "
                                 f"max_tokens {self.max_tokens} leaves nothing to resume")
        if (isinstance(self.resume_text_chars, bool)
                or not isinstance(self.resume_text_chars, numbers.Integral)
                or self.resume_text_chars < 0):
            raise InvalidRequest("resume: text characters must be an integer >= 0")

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What the model reads before the next token: the prompt and any resumed answer."""
        return self.prompt_ids + self.resume_ids if self.resume_ids else self.prompt_ids


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this model and server."""

    vocab_size: int  # token ids are in [0, vocab_size)
    max_prompt_tokens: int  # the context window leaves room for at least one new token
    sources: tuple[str, ...] = ()  # the drafting sources the server has
    context_window: int = 0  # positions of a sequence, prompt and answer (0: unknown)

    @classmethod
    def for_context(cls, vocab_size: int, max_len: int,
                    sources: tuple[str, ...] = ()) -> "RequestLimits":
        """Limits of a context window of `max_len` positions: the prompt, one new token and
        the root of its first draft tree must fit."""
        return cls(vocab_size, max_len - 2, tuple(sources), max_len)

    def check(self, request: GenerateRequest) -> None:
        """Raises InvalidRequest naming the field."""
        # One pass in C over the ids instead of a Python loop: prompts run to thousands.
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.vocab_size:
            bad = next(t for t in request.prompt_ids if not 0 <= t < self.vocab_size)
            raise InvalidRequest(f"prompt: token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if len(request.prompt_ids) > self.max_prompt_tokens:
            window = f" of {self.context_window} positions" if self.context_window else ""
            raise InvalidRequest(f"prompt: {len(request.prompt_ids)} tokens, the context window"
                                 f"{window} allows at most {self.max_prompt_tokens}")
        if request.resume_ids:
            if min(request.resume_ids) < 0 or max(request.resume_ids) >= self.vocab_size:
                raise InvalidRequest("resume: a token id is outside the vocabulary "
                                     f"[0, {self.vocab_size})")
            if len(request.context_ids) > self.max_prompt_tokens:
                raise InvalidRequest(f"resume: prompt and answer hold "
                                     f"{len(request.context_ids)} tokens, the context window "
                                     f"allows at most {self.max_prompt_tokens}")
        for name, ids in (("stop_token_ids", request.stop_token_ids),
                          ("logit_bias", [t for t, _ in request.sampling.logit_bias])):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        if request.speculate and request.source and request.source not in self.sources:
            offered = ", ".join(self.sources) or "none: it decodes without speculation"
            raise InvalidRequest(f"speculation: this server has no {request.source!r} drafting "
                                 f"source (it has {offered}; ssd needs a server started with "
                                 f"--speculator)")


def end_reason(token_id: int, num_output_tokens: int, request: GenerateRequest,
               eos_token_ids: Collection[int]) -> str | None:
    """How `request`'s answer ends at its `num_output_tokens`-th token `token_id`, as far as the
    token ids tell (the engine and the Ray backend's failover both judge by it): EOS ends it as
    "stop" (unless the request ignores EOS), reaching max_tokens as "length", else None. Stop
    strings (on the text) and the end of the context window are the engine's own checks."""
    if (token_id in eos_token_ids and not request.ignore_eos) or \
            token_id in request.stop_token_ids:
        return "stop"
    if num_output_tokens >= request.max_tokens:
        return "length"
    return None

"""A request being generated: its request, output so far, stop state and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sssd.verifier.engine.block_manager import BlockTable
from sssd.verifier.engine.detokenizer import IncrementalDetokenizer
from sssd.verifier.engine.handoff import PrefilledPrompt
from sssd.verifier.engine.request import GenerateRequest

if TYPE_CHECKING:
    from sssd.verifier.engine.constraint import Constraint

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class Sequence:
    request_id: str  # the engine's key for it, and the sequence id the proposer sees
    request: GenerateRequest
    output_ids: list[int] = field(default_factory=list)  # [num_output_tokens]
    finish_reason: str | None = None  # one of FINISH_REASONS once it ended
    # Tokens the proposer has seen; the rest go with the next propose call.
    num_proposer_tokens: int = 0
    seed: int = 0  # the request's randomness: sampling is a function of (seed, position)
    num_steps: int = 0  # verification steps it took part in
    num_accepted: int = 0  # draft tokens accepted over all steps
    # The answer's text, when the engine detokenizes (stop strings, streaming servers).
    detokenizer: IncrementalDetokenizer | None = None
    stop_text_len: int | None = None  # the text is cut here: a stop string starts here
    # The prompt's KV cache from a prefill worker (disaggregated serving); dropped on admission.
    prefilled: PrefilledPrompt | None = None
    # Its blocks of the paged KV cache, and how many leading positions they hold computed.
    table: BlockTable = field(default_factory=BlockTable)
    # Its context (prompt and output so far) is computed but for the last token, which the
    # next step's tree holds as its root: it decodes (else it is prefilled, or waits).
    is_prefilled: bool = False
    # Its context's leading tokens the prefix cache held at its first admission (None before).
    num_cached_tokens: int | None = None
    # Its grammar's state after the answer so far (structured output; None: free text).
    constraint: Constraint | None = None

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def num_resumed(self) -> int:
        """Output tokens another worker generated (request.resume_ids; failover)."""
        return len(self.request.resume_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.request.prompt_ids[-1]

    def token_ids_from(self, start: int) -> list[int]:
        """[num_tokens - start] the tokens of prompt + output from position `start` on; costs
        what it returns, not the whole context."""
        num_prompt = len(self.request.prompt_ids)
        if start >= num_prompt:
            return self.output_ids[start - num_prompt:]
        return list(self.request.prompt_ids[start:]) + self.output_ids

    @property
    def text(self) -> str:
        """The answer's settled text so far, cut at a matched stop string."""
        if self.detokenizer is None:
            return ""
        text = self.detokenizer.text
        return text if self.stop_text_len is None else text[: self.stop_text_len]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

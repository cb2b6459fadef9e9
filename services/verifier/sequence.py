"""A request being generated: its tokens, sampling settings, stop conditions and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sssd.verifier.handoff import PrefilledPrompt
from sssd.verifier.sampling import SamplingParams


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    # Tokens the drafter has seen; beyond this they are sent as new tokens on the next call.
    num_drafter_tokens: int = 0
    generator: torch.Generator | None = None
    num_steps: int = 0  # verification steps
    num_accepted: int = 0  # draft tokens accepted over all steps
    stop_text_len: int | None = None  # output text is cut here when a stop string matched
    speculate: bool = True  # False: this request decodes without drafts (budget 1)
    last_accepted: int = 0  # draft tokens accepted in the latest verification step
    last_budget: int = 1  # this sequence's speculation budget in that step
    # The prompt's KV cache from a prefill worker (disaggregated serving); dropped on admission.
    prefilled: PrefilledPrompt | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

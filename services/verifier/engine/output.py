"""What one engine step produced: `StepOutput`, consumed by the serving loop, the metrics and
the conversation sink (nano-vllm's shape: the step returns its outputs; nobody reads the
engine's internals afterwards). `EngineStats` adds step outputs up."""

from __future__ import annotations

from dataclasses import dataclass, field

from sssd.verifier.engine.sequence import Sequence
from sssd.verifier.engine.token_logprob import TokenLogprob


@dataclass(frozen=True)
class RowOutput:
    """One sequence that gained tokens in the step."""

    request_id: str
    token_ids: list[int]  # [num_new_tokens] appended to the output (after EOS/stop/length cuts)
    # The answer's settled text so far, cut at a stop string once one matched ("" when the
    # engine does not detokenize). A reference to the sequence's string, not a copy.
    text: str
    num_accepted: int  # draft tokens the verification accepted (0 when not verified)
    budget: int  # this row's speculation budget in the step (1: no drafts)
    is_verified: bool  # took part in the verification forward (False: its prefill token only)
    num_drafted: int = 0  # draft tokens the row's tree held (its nodes but the root)
    num_pruned: int = 0  # draft tokens its grammar rejected before verification (not drafted)
    # [len(token_ids)] with the request's `logprobs` set, else None.
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class StepOutput:
    rows: list[RowOutput]  # every sequence that gained tokens, admissions included
    finished: list[Sequence]  # sequences that ended in the step (not cancellations)
    num_verified: int = 0  # sequences in the verification forward (0: admissions only)
    budget: int = 1  # the step's speculation budget (1: none)
    draft_s: float = 0.0  # the batched proposer call
    verify_s: float = 0.0  # the verification forward
    prefill_s: float = 0.0  # prompts run (or prefilled KV taken over) in the step
    num_draft_errors: int = 0  # proposer errors, a NOT_FOUND answered by a re-send included
    is_draft_fallback: bool = False  # the proposer failed: the step decoded without drafts


@dataclass
class EngineStats:
    num_steps: int = 0  # verification forward passes
    num_tokens: int = 0  # tokens emitted by verification steps (accepted + bonus)
    num_accepted: int = 0  # draft tokens accepted
    num_drafted: int = 0  # draft tokens verified
    num_pruned: int = 0  # draft tokens grammars rejected before verification
    num_row_steps: int = 0  # sum over steps of the batch size
    draft_s: float = 0.0  # time in the proposer
    verify_s: float = 0.0  # time in verification forwards
    prefill_s: float = 0.0
    num_prefill_tokens: int = 0  # prompt tokens computed (not those taken from the prefix cache)
    num_draft_failures: int = 0  # steps decoded without speculation because the proposer failed
    num_draft_errors: int = 0  # proposer errors, NOT_FOUND (answered by a resend) included
    budget_counts: dict[int, int] = field(default_factory=dict)  # steps per chosen budget
    verify_s_by_budget: dict[int, float] = field(default_factory=dict)  # verify_s per budget

    def add(self, step: StepOutput) -> None:
        self.prefill_s += step.prefill_s
        self.draft_s += step.draft_s
        self.num_draft_errors += step.num_draft_errors
        self.num_draft_failures += step.is_draft_fallback
        if not step.num_verified:
            return
        self.num_steps += 1
        self.num_row_steps += step.num_verified
        self.verify_s += step.verify_s
        self.budget_counts[step.budget] = self.budget_counts.get(step.budget, 0) + 1
        self.verify_s_by_budget[step.budget] = \
            self.verify_s_by_budget.get(step.budget, 0.0) + step.verify_s
        for row in step.rows:
            if row.is_verified:
                self.num_accepted += row.num_accepted
                self.num_drafted += row.num_drafted
                self.num_pruned += row.num_pruned
                self.num_tokens += row.num_accepted + 1

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens emitted per sequence per verification step (accepted + bonus)."""
        return self.num_tokens / self.num_row_steps if self.num_row_steps else 0.0

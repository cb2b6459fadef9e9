"""The verifier engine: continuous batching with lossless tree verification (DESIGN.md 3 and 5).

One `step()` reads as schedule, draft, verify, post-process:
1. schedule: admit waiting requests into free KV slots and prefill them (their first token);
2. draft: one `propose` call to the proposer for the whole running batch;
3. verify: one forward pass over every draft tree;
4. post-process: accept per row, commit the KV cache, emit tokens (EOS, stop strings and
   max_tokens end a sequence inside an accepted path), retire finished sequences.
It returns a `StepOutput`; observers read that, never the engine.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound
from sssd.common.drafting.router import SourceRouter
from sssd.verifier.engine.acceptance import AcceptResult, accept_at_positions, accept_greedy
from sssd.verifier.engine.budget_policy import BudgetPolicy
from sssd.verifier.engine.detokenizer import Decode, IncrementalDetokenizer, find_stop
from sssd.verifier.engine.handoff import PrefilledPrompt
from sssd.verifier.engine.hindsight import HindsightTracker
from sssd.verifier.engine.model_runner import ModelRunner
from sssd.verifier.engine.output import EngineStats, RowOutput, StepOutput
from sssd.verifier.engine.request import GenerateRequest, RequestLimits, SamplingParams
from sssd.verifier.engine.sampling import position_uniforms, sample_with_uniforms, target_probs
from sssd.verifier.engine.scheduler import Scheduler
from sssd.verifier.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Drafts:
    """What the draft stage of a step produced."""

    trees: list[DraftTree]  # [num_running] one per running sequence, roots only when none
    budgets: list[int]  # [num_running] each row's budget (1: no drafts)
    draft_s: float = 0.0
    num_errors: int = 0
    is_fallback: bool = False
    is_hindsight: bool = False  # drafted larger than verified, to score the rest in hindsight


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Seq[int],
        budget_policy: BudgetPolicy,
        proposer: Proposer | None = None,
        detokenize: Decode | None = None,
        max_batch_size: int = 8,
    ) -> None:
        """`proposer`: the drafting source (None: autoregressive decoding); the engine owns it
        and closes it in `close()`. `detokenize(ids)` gives the text of token ids with special
        tokens skipped; with it the engine tracks each answer's text (stop strings, streamed
        text), without it requests may not have stop strings."""
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.budget_policy = budget_policy
        self.proposer = proposer
        self.detokenize = detokenize
        self.scheduler = Scheduler(min(max_batch_size, runner.max_seqs), runner.move_slot)
        # A request may name a drafting source only when the proposer routes between named
        # ones (sssd.verifier.proposers builds a SourceRouter for every speculating mode).
        sources = proposer.sources if isinstance(proposer, SourceRouter) else ()
        self.limits = RequestLimits.for_context(runner.vocab_size, runner.max_len, sources)
        self.stats = EngineStats()
        # Larger trees than are verified, scored against the output later (hindsight.py): only
        # for proposers whose trees are best-first and cheap to draft.
        self._hindsight = HindsightTracker() \
            if getattr(proposer, "hindsight_drafts", False) else None
        # Default request ids are unique per engine: engines that share a drafter service must
        # not collide on its per-sequence state.
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------

    def add_request(self, request: GenerateRequest, request_id: str | None = None,
                    prefilled: PrefilledPrompt | None = None) -> Sequence:
        """Queues a request. `prefilled`: the prompt's KV cache made by a prefill worker, taken
        over instead of running the prefill here. Raises InvalidRequest for a request this
        model cannot serve (the API boundary checks the same limits before)."""
        self.limits.check(request)
        if prefilled is not None:
            if prefilled.num_tokens != len(request.context_ids):
                raise ValueError(f"the prefilled KV holds {prefilled.num_tokens} tokens, the "
                                 f"prompt (and resumed answer) {len(request.context_ids)}")
            self.runner.check_prefilled(prefilled)
        if request.stop and self.detokenize is None:
            raise ValueError("stop strings need an engine built with a detokenize function")
        sequence = Sequence(
            request_id or f"{self._id_prefix}-{next(self._ids)}", request,
            seed=request.sampling.seed if request.sampling.seed is not None
            else secrets.randbits(64),
            detokenizer=IncrementalDetokenizer(self.detokenize) if self.detokenize else None,
            prefilled=prefilled)
        if request.resume_ids:  # an answer another worker began: its output so far
            sequence.output_ids.extend(request.resume_ids)
            if sequence.detokenizer is not None:
                sequence.detokenizer.append(request.resume_ids)
        self.scheduler.add(sequence)
        return sequence

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Drops a waiting or running request at once (client cancelled); returns it, or None
        when no such request is here (already finished)."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._end_in_proposer([seq])
            if self._hindsight is not None:
                self._hindsight.forget(seq)
        return seq

    def generate(self, prompts: Seq[Seq[int]], max_tokens: int,
                 sampling: SamplingParams | None = None) -> list[list[int]]:
        """Convenience: runs the prompts to completion, returns the output token ids."""
        sampling = sampling or SamplingParams()
        sequences = [self.add_request(GenerateRequest(tuple(p), max_tokens, sampling))
                     for p in prompts]
        while self.has_work():
            self.step()
        return [s.output_ids for s in sequences]

    def close(self) -> None:
        """Releases the proposer (connections, threads)."""
        if self.proposer is not None:
            self.proposer.close()

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        rows: dict[str, RowOutput] = {}
        prefill_s = self._schedule(rows)
        finished = self._retire()
        running = self.scheduler.running
        if not running:
            output = StepOutput(list(rows.values()), finished, prefill_s=prefill_s)
            self.stats.add(output)
            return output
        budget = self.budget_policy.budget(len(running))
        step_start = time.perf_counter()
        drafts = self._draft(budget)
        start = time.perf_counter()
        logits = self.runner.verify(drafts.trees)  # [num_seqs, max_nodes, vocab_size]
        verify_s = time.perf_counter() - start
        results = [self._accept(seq, tree, logits[row, : tree.num_nodes])
                   for row, (seq, tree) in enumerate(zip(running, drafts.trees))]
        self.runner.commit([r.accepted_nodes for r in results])
        for seq, result, row_budget in zip(running, results, drafts.budgets):
            seq.num_steps += 1
            seq.num_accepted += result.num_accepted
            earlier = rows.get(seq.request_id)  # admitted in this step: its prefill token
            token_ids = self._emit(seq, result.emitted_tokens)
            if earlier is not None:
                token_ids = earlier.token_ids + token_ids
            rows[seq.request_id] = RowOutput(seq.request_id, token_ids, seq.text,
                                             result.num_accepted, row_budget, is_verified=True)
        # The policy prices a budget by the whole step's speculation work; a step that drafted
        # a larger tree than it verified says nothing about the cost of `budget`.
        step_s = None if drafts.is_hindsight else time.perf_counter() - step_start
        self.budget_policy.observe(len(running), budget, [r.accepted_nodes for r in results],
                                   step_s)
        if self._hindsight is not None:  # the tokens just emitted decide earlier trees
            for decided in self._hindsight.decided():
                self.budget_policy.observe_hindsight(decided.batch_size, decided.verified_budget,
                                                     decided.paths)
        num_verified = len(running)
        finished += self._retire()
        output = StepOutput(list(rows.values()), finished, num_verified, budget,
                            drafts.draft_s, verify_s, prefill_s, drafts.num_errors,
                            drafts.is_fallback)
        self.stats.add(output)
        return output

    def _schedule(self, rows: dict[str, RowOutput]) -> float:
        """Admits waiting sequences while slots are free; each gets its prefill token.
        Returns the seconds spent prefilling."""
        start = time.perf_counter()
        while self.scheduler.can_admit():
            slot, seq = self.scheduler.admit()
            if seq.prefilled is not None:
                logits = self.runner.load_prefilled(slot, seq.prefilled)  # [vocab_size]
                seq.prefilled = None  # the cache slot holds it now; free the transfer buffer
            else:
                logits = self.runner.prefill(slot, seq.request.context_ids)  # [vocab_size]
            token_ids = self._emit(seq, [self._sample_one(seq, logits)])
            rows[seq.request_id] = RowOutput(seq.request_id, token_ids, seq.text, 0, 1,
                                             is_verified=False)
        return time.perf_counter() - start

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.request.sampling.is_greedy:
            return int(logits.argmax())
        probs = target_probs(logits.unsqueeze(0), seq.request.sampling)  # [1, vocab_size]
        uniforms = position_uniforms(seq.seed, [len(seq.output_ids)])  # [1]
        return int(sample_with_uniforms(probs, uniforms)[0])

    def _draft(self, budget: int) -> _Drafts:
        """The trees to verify at `budget`. On the policy's hindsight steps it drafts larger
        trees, keeps them for scoring later, and returns their first `budget` nodes."""
        running = self.scheduler.running
        draft_budget = budget
        if self._hindsight is not None:
            draft_budget = self.budget_policy.draft_budget(len(running), budget)
        drafts = self._propose(draft_budget)
        if draft_budget <= budget or drafts.is_fallback:
            return drafts
        self._hindsight.add(len(running), budget, running, drafts.trees)
        return _Drafts([tree.prefix(budget) for tree in drafts.trees],
                       [min(budget, row_budget) for row_budget in drafts.budgets],
                       drafts.draft_s, drafts.num_errors, is_hindsight=True)

    def _propose(self, budget: int) -> _Drafts:
        running = self.scheduler.running
        roots = [DraftTree.root_only(seq.last_token) for seq in running]
        no_drafts = _Drafts(roots, [1] * len(running))
        if self.proposer is None or budget <= 1:
            return no_drafts
        # A tree must fit in the cache; near the end of the window speculate less.
        budgets = [max(1, min(budget if seq.request.speculate else 1, self.runner.room(slot) - 1))
                   for slot, seq in enumerate(running)]
        if max(budgets) <= 1:  # every sequence decodes without drafts (speculation off)
            return no_drafts
        num_errors = 0
        start = time.perf_counter()
        try:
            try:
                trees = self.proposer.propose(self._draft_requests(budgets))
            except SequenceNotFound as missing:
                # The proposer lost their state (restart, eviction): re-send full contexts.
                num_errors += 1
                for seq in running:
                    if seq.request_id in missing.seq_ids:
                        seq.num_proposer_tokens = 0
                trees = self.proposer.propose(self._draft_requests(budgets))
        except Exception as exc:  # noqa: BLE001 - any proposer failure: decode without it
            logger.warning("proposer failed (%s); this step decodes without speculation", exc)
            for seq in running:
                seq.num_proposer_tokens = 0  # its state is unknown now: restart next time
            return _Drafts(roots, [1] * len(running), time.perf_counter() - start,
                           num_errors + 1, is_fallback=True)
        for seq in running:
            seq.num_proposer_tokens = seq.num_tokens
        return _Drafts(trees, budgets, time.perf_counter() - start, num_errors)

    def _draft_requests(self, budgets: list[int]) -> list[DraftRequest]:
        return [DraftRequest(seq.request_id, seq.token_ids_from(seq.num_proposer_tokens), budget,
                             is_start=seq.num_proposer_tokens == 0,
                             temperature=seq.request.sampling.temperature, seed=seq.seed,
                             source=seq.request.source)
                for seq, budget in zip(self.scheduler.running, budgets)]

    def _accept(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        # logits: [num_nodes, vocab_size]
        if seq.request.sampling.is_greedy:
            return accept_greedy(tree.token_ids, tree.parents, logits.argmax(-1))
        probs = target_probs(logits, seq.request.sampling)  # [num_nodes, vocab_size]
        return accept_at_positions(tree.token_ids, tree.parents, probs, seq.seed,
                                   first_position=len(seq.output_ids))

    def _emit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Appends tokens until EOS, a stop string or the length limit ends the sequence;
        returns the tokens appended."""
        appended: list[int] = []
        for token in tokens:
            seq.output_ids.append(token)
            appended.append(token)
            if token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif seq.request.stop and self._hit_stop(seq, token):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.request.max_tokens \
                    or seq.num_tokens + 1 >= self.runner.max_len:
                seq.finish_reason = "length"
            if seq.is_finished:
                break
        detokenizer = seq.detokenizer
        if detokenizer is not None:
            if not seq.request.stop:  # with stop strings each token was added in _hit_stop
                detokenizer.append(appended)
            if seq.is_finished:
                detokenizer.flush()
        return appended

    def _hit_stop(self, seq: Sequence, token: int) -> bool:
        """Adds `token` to the text; True when a stop string now appears (it is then cut)."""
        detokenizer = seq.detokenizer
        searched = len(detokenizer.text)
        detokenizer.append([token])
        start = find_stop(detokenizer.text, seq.request.stop, searched)
        if start is None:
            return False
        seq.stop_text_len = start
        return True

    def _retire(self) -> list[Sequence]:
        finished = self.scheduler.retire()
        if finished:
            self._end_in_proposer(finished)
        return finished

    def _end_in_proposer(self, sequences: list[Sequence]) -> None:
        if self.proposer is None:
            return
        try:
            self.proposer.end([seq.request_id for seq in sequences])
        except Exception as exc:  # noqa: BLE001 - state is freed again at restart anyway
            logger.warning("proposer end() failed: %s", exc)

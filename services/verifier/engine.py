"""The verifier engine: continuous batching with lossless tree verification (DESIGN.md 3 and 5).

One `step()` reads as: admit and prefill waiting requests, draft for the whole batch in one
call, verify every tree in one forward pass, accept, commit the KV cache, emit tokens, retire
finished sequences.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from sssd.common.draft_tree import DraftTree
from sssd.drafter.drafter import DraftRequest, SequenceNotFound
from sssd.verifier.acceptance import accept_greedy, accept_sampling
from sssd.verifier.budget_policy import BudgetPolicy
from sssd.verifier.handoff import PrefilledPrompt
from sssd.verifier.model_runner import ModelRunner
from sssd.verifier.sampling import SamplingParams, sample_tokens, target_probs
from sssd.verifier.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_steps: int = 0  # verification forward passes
    num_tokens: int = 0  # tokens emitted by verification steps (accepted + bonus)
    num_accepted: int = 0  # draft tokens accepted
    num_row_steps: int = 0  # sum over steps of the batch size
    draft_s: float = 0.0  # time in the drafter
    verify_s: float = 0.0  # time in verification forwards
    prefill_s: float = 0.0
    num_draft_failures: int = 0  # steps decoded without speculation because the drafter failed
    num_draft_errors: int = 0  # errors from the drafter, NOT_FOUND (answered by a resend) included
    budget_counts: dict[int, int] = field(default_factory=dict)  # steps per chosen budget

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens emitted per sequence per verification step (accepted + bonus)."""
        return self.num_tokens / self.num_row_steps if self.num_row_steps else 0.0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Seq[int],
        budget_policy: BudgetPolicy,
        proposer: object | None = None,
        decode: Callable[[list[int]], str] | None = None,
        max_batch_size: int = 8,
    ) -> None:
        """`proposer` implements propose(list[DraftRequest]) -> list[DraftTree] and end(ids)
        (the in-process Drafter or the gRPC RemoteDrafter); None decodes autoregressively.
        `decode` turns token ids into text; it is needed only for stop strings."""
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.budget_policy = budget_policy
        self.proposer = proposer
        self.decode = decode
        self.max_batch_size = min(max_batch_size, runner.cache.max_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] owns KV slot i
        self.stats = EngineStats()
        # The latest step, for per-step statistics of streaming servers.
        self.last_budget, self.last_draft_s, self.last_verify_s = 1, 0.0, 0.0
        # Default request ids are unique per engine: engines that share a drafter service must
        # not collide on its per-sequence state.
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------

    def add_request(self, prompt_ids: Seq[int], max_tokens: int,
                    sampling: SamplingParams | None = None, stop: Seq[str] = (),
                    request_id: str | None = None, speculate: bool = True,
                    prefilled: PrefilledPrompt | None = None) -> Sequence:
        """Queues a request. `prefilled`: the prompt's KV cache made by a prefill worker, taken
        over instead of running the prefill here."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt_ids) + 1 >= self.runner.max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the context window "
                             f"({self.runner.max_len - 1})")
        if prefilled is not None:
            if prefilled.num_tokens != len(prompt_ids):
                raise ValueError(f"the prefilled KV holds {prefilled.num_tokens} tokens, the "
                                 f"prompt has {len(prompt_ids)}")
            self.runner.check_prefilled(prefilled)
        if stop and self.decode is None:
            raise ValueError("stop strings need an engine built with a decode function")
        vocab_size = self.runner.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        sampling = sampling or SamplingParams()
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(sampling.seed if sampling.seed is not None
                                  else torch.seed())
        sequence = Sequence(request_id or f"{self._id_prefix}-{next(self._ids)}",
                            list(prompt_ids), sampling, max_tokens, tuple(stop),
                            generator=generator, speculate=speculate, prefilled=prefilled)
        self.waiting.append(sequence)
        return sequence

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Drops a waiting or running request at once (client cancelled); returns it, or None
        when no such request is here (already finished)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "cancelled"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "cancelled"
                self._retire()
                return seq
        return None

    def generate(self, prompts: Seq[Seq[int]], max_tokens: int,
                 sampling: SamplingParams | None = None) -> list[list[int]]:
        """Convenience: runs the prompts to completion, returns the output token ids."""
        sequences = [self.add_request(p, max_tokens, sampling) for p in prompts]
        while self.has_work():
            self.step()
        return [s.output_ids for s in sequences]

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Runs one decoding step; returns the sequences that finished in it."""
        finished = self._admit()
        if not self.running:
            return finished
        budget = self.budget_policy.budget(len(self.running))
        trees = self._draft(budget)
        start = time.perf_counter()
        logits = self.runner.verify(trees)  # [num_seqs, max_nodes, vocab_size]
        verify_s = time.perf_counter() - start
        results = [self._accept(seq, tree, logits[row, : tree.num_nodes])
                   for row, (seq, tree) in enumerate(zip(self.running, trees))]
        self.runner.commit([r.accepted_nodes for r in results])
        self.last_budget, self.last_verify_s = budget, verify_s
        for seq, result in zip(self.running, results):
            seq.num_steps += 1
            seq.last_accepted = len(result.accepted_tokens)
            seq.num_accepted += len(result.accepted_tokens)
            self._emit(seq, result.accepted_tokens + [result.bonus_token])
            self.stats.num_accepted += len(result.accepted_tokens)
            self.stats.num_tokens += len(result.accepted_tokens) + 1
        self.stats.num_steps += 1
        self.stats.num_row_steps += len(self.running)
        self.stats.verify_s += verify_s
        self.stats.budget_counts[budget] = self.stats.budget_counts.get(budget, 0) + 1
        self.budget_policy.observe(len(self.running), budget,
                                   [r.accepted_nodes for r in results], verify_s)
        return finished + self._retire()

    def _admit(self) -> list[Sequence]:
        finished = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            slot = len(self.running)
            start = time.perf_counter()
            if seq.prefilled is not None:
                logits = self.runner.load_prefilled(slot, seq.prefilled)  # [vocab_size]
                seq.prefilled = None  # the cache slot holds it now; free the transfer buffer
            else:
                logits = self.runner.prefill(slot, seq.prompt_ids)  # [vocab_size]
            self.stats.prefill_s += time.perf_counter() - start
            first = self._sample_one(seq, logits)
            self.running.append(seq)
            self._emit(seq, [first])
        finished += self._retire()
        return finished

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.sampling.temperature == 0:
            return int(logits.argmax())
        probs = target_probs(logits.unsqueeze(0), seq.sampling)  # [1, vocab_size]
        return int(sample_tokens(probs, seq.generator)[0])

    def _draft(self, budget: int) -> list[DraftTree]:
        self.last_draft_s = 0.0
        roots = [DraftTree.root_only(seq.token_ids[-1]) for seq in self.running]
        for seq in self.running:
            seq.last_budget = 1
        if self.proposer is None or budget <= 1:
            return roots
        # A tree must fit in the cache; near the end of the window speculate less.
        budgets = [max(1, min(budget if seq.speculate else 1, self.runner.room(slot) - 1))
                   for slot, seq in enumerate(self.running)]
        if max(budgets) <= 1:  # every sequence decodes without drafts (speculation off)
            return roots
        start = time.perf_counter()
        try:
            try:
                trees = self.proposer.propose(self._draft_requests(budgets))
            except SequenceNotFound as missing:
                # The drafter lost their state (restart, eviction): re-send full contexts.
                self.stats.num_draft_errors += 1
                for seq in self.running:
                    if seq.request_id in missing.seq_ids:
                        seq.num_drafter_tokens = 0
                trees = self.proposer.propose(self._draft_requests(budgets))
        except Exception as exc:  # noqa: BLE001 - any drafter failure: decode without it
            self.stats.num_draft_failures += 1
            self.stats.num_draft_errors += 1
            logger.warning("drafter failed (%s); this step decodes without speculation", exc)
            for seq in self.running:
                seq.num_drafter_tokens = 0  # its state is unknown now: restart next time
            return roots
        finally:
            self.last_draft_s = time.perf_counter() - start
            self.stats.draft_s += self.last_draft_s
        for seq, seq_budget in zip(self.running, budgets):
            seq.num_drafter_tokens = len(seq.prompt_ids) + len(seq.output_ids)
            seq.last_budget = seq_budget
        return trees

    def _draft_requests(self, budgets: list[int]) -> list[DraftRequest]:
        requests = []
        for seq, budget in zip(self.running, budgets):
            tokens = seq.token_ids
            is_start = seq.num_drafter_tokens == 0
            requests.append(DraftRequest(seq.request_id, tokens[seq.num_drafter_tokens:], budget,
                                         is_start=is_start))
        return requests

    def _accept(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor):
        # logits: [num_nodes, vocab_size]
        if seq.sampling.temperature == 0:
            return accept_greedy(tree.token_ids, tree.parents, logits.argmax(-1))
        probs = target_probs(logits, seq.sampling)  # [num_nodes, vocab_size]
        return accept_sampling(tree.token_ids, tree.parents, probs, seq.generator)

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        """Appends tokens until EOS, a stop string or max_tokens ends the sequence."""
        for token in tokens:
            seq.output_ids.append(token)
            if token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif seq.stop and self._hit_stop(seq):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens:
                seq.finish_reason = "length"
            elif len(seq.prompt_ids) + len(seq.output_ids) + 1 >= self.runner.max_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                return

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.decode(seq.output_ids)
        hits = [text.find(stop) for stop in seq.stop if stop in text]
        if not hits:
            return False
        seq.stop_text_len = min(hits)
        return True

    def _retire(self) -> list[Sequence]:
        """Removes finished sequences, keeping the running batch in slots [0, num_running)."""
        finished = [seq for seq in self.running if seq.is_finished]
        if not finished:
            return []
        for seq in finished:
            slot = self.running.index(seq)
            last = len(self.running) - 1
            if slot != last:
                self.runner.cache.move(last, slot)
                self.running[slot] = self.running[last]
            self.running.pop()
        if self.proposer is not None:
            try:
                self.proposer.end([seq.request_id for seq in finished])
            except Exception as exc:  # noqa: BLE001 - state is freed again at restart anyway
                logger.warning("drafter end() failed: %s", exc)
        return finished

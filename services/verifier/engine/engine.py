"""The verifier engine: continuous batching with lossless tree verification.

One `step()` reads as schedule, draft, forward, accept, emit:
1. schedule: within the KV cache's blocks (scheduler.py), the decoding sequences' trees, the
   next chunks of prompts being prefilled, and newly admitted requests (which take the blocks of
   their longest cached prefix first; a prompt prefilled by another worker gets its first token
   here);
2. draft: one `propose` call for the decoding sequences (drafting.py);
3. forward: one pass over every draft tree and every prefill chunk; a context's last chunk gives
   its first token (a step that prefills reads the weights once, as vLLM's mixed prefill and
   decode batches do);
4. accept: per row, the longest path the target agrees with (acceptance.py), and the KV cache
   keeps the accepted nodes only; blocks that are now full enter the prefix cache;
5. emit: append the accepted tokens and the bonus token; EOS, stop strings and max_tokens end a
   sequence inside an accepted path; finished sequences leave the batch and free their blocks.
It returns a `StepOutput`; observers read that, never the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Sequence as Seq

import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import Proposer
from sssd.common.model.argmax import argmax_last
from sssd.common.model.tree_batch import MAX_TREE_BITS_NODES
from sssd.verifier.engine.acceptance import AcceptResult, accept_greedy, draws_at_positions
from sssd.verifier.engine.block_manager import BlockManager
from sssd.verifier.engine.budget_policy import BudgetPolicy
from sssd.verifier.engine.constraint import GrammarCompiler
from sssd.verifier.engine.detokenizer import Decode, IncrementalDetokenizer, find_stop
from sssd.verifier.engine.drafting import Drafting, Drafts
from sssd.verifier.engine.handoff import PrefilledPrompt
from sssd.verifier.engine.logits_processing import (
    needs_processing,
    process_tree_logits,
    token_logprobs,
)
from sssd.verifier.engine.model_runner import CacheRow, Chunk, ModelRunner
from sssd.verifier.engine.output import EngineStats, RowOutput, StepOutput
from sssd.verifier.engine.request import (
    GenerateRequest,
    RequestLimits,
    SamplingParams,
    end_reason,
)
from sssd.verifier.engine.sampling import position_uniforms, sample_with_uniforms, target_probs
from sssd.verifier.engine.scheduler import ChunkPlan, Scheduler
from sssd.verifier.engine.sequence import Sequence
from sssd.verifier.engine.token_logprob import TokenLogprob

logger = logging.getLogger(__name__)


class Engine:
    # Positions of the cache kept beside a sequence of the longest window: one draft tree, or
    # a prefill chunk's padding.
    _tree_room = MAX_TREE_BITS_NODES

    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Seq[int],
        budget_policy: BudgetPolicy,
        proposer: Proposer | None = None,
        detokenize: Decode | None = None,
        max_batch_size: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`proposer`: the drafting source (None: autoregressive decoding); the engine owns it
        and closes it in `close()`. `detokenize(ids)` gives the text of token ids with special
        tokens skipped; with it the engine tracks each answer's text (stop strings, streamed
        text), without it requests may not have stop strings. `max_batch_size`: the most
        sequences running at once; `max_num_batched_tokens`: the prompt tokens a step prefills
        at most (chunked prefill); `enable_prefix_caching`: full blocks are reused across
        requests; `grammars`: makes the constraints of requests with structured output (None:
        such requests are refused)."""
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.budget_policy = budget_policy
        self.drafting = Drafting(proposer, runner.vocab_size)
        self.detokenize = detokenize
        self.grammars = grammars
        self.blocks = BlockManager(runner.cache.num_blocks, runner.block_size,
                                   runner.prefix_salt, enable_prefix_caching)
        self.scheduler = Scheduler(max_batch_size, self.blocks, max_num_batched_tokens)
        # A sequence's window: the model's, and what the whole cache holds beside one tree.
        self.max_len = min(runner.max_len,
                           runner.cache.num_blocks * runner.block_size - self._tree_room)
        self.limits = RequestLimits.for_context(runner.vocab_size, self.max_len,
                                                self.drafting.sources)
        self.stats = EngineStats()
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
        if request.grammar is not None and self.grammars is None:
            raise ValueError("structured output needs an engine built with its tokenizer's "
                             "grammars (GrammarCompiler)")
        sequence = Sequence(
            request_id or f"{self._id_prefix}-{next(self._ids)}", request,
            seed=request.sampling.seed if request.sampling.seed is not None
            else secrets.randbits(64),
            detokenizer=IncrementalDetokenizer(self.detokenize) if self.detokenize else None,
            prefilled=prefilled)
        if request.grammar is not None:
            sequence.constraint = self.grammars.constraint(request.grammar)
        if request.resume_ids:  # an answer another worker began: its output so far
            sequence.output_ids.extend(request.resume_ids)
            if sequence.detokenizer is not None:
                sequence.detokenizer.append(request.resume_ids)
            if sequence.constraint is not None:
                sequence.constraint.advance(request.resume_ids)
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

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache's blocks held by sequences, 0..1."""
        return self.blocks.usage

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def abort(self, request_id: str) -> Sequence | None:
        """Drops a waiting or running request at once (client cancelled); returns it, or None
        when no such request is here (already finished)."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.drafting.end([seq], is_abort=True)
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

    @property
    def proposer(self) -> Proposer | None:
        return self.drafting.proposer

    def close(self) -> None:
        """Releases the proposer (connections, threads)."""
        self.drafting.close()

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        rows: dict[str, RowOutput] = {}  # by request id
        finished = self._retire()
        waiting_to_decode = self.scheduler.decoding
        budget = self.budget_policy.budget(len(waiting_to_decode), [
            seq.request_id for seq in waiting_to_decode]) if waiting_to_decode else 1
        verifying, plans = self.scheduler.schedule(budget)
        keys = [seq.request_id for seq in verifying]  # the policy's names of the rows
        handed_over = [p for p in plans if p.seq.prefilled is not None]
        plans = [p for p in plans if p.seq.prefilled is None]
        prefill_s = self._load_prefilled(handed_over, rows)
        drafts, step_start = None, time.perf_counter()
        if verifying:
            drafts = self.drafting.draft(
                verifying, budget, self._draft_budget(len(verifying), budget),
                lambda i: self.max_len - verifying[i].table.num_cached)
            drafts, masks, num_pruned = self._constrained(verifying, drafts)
        verify_s = 0.0
        if drafts is not None or plans:
            logits, verify_s, chunks_s = self._forward(verifying, drafts, plans, rows)
            prefill_s += chunks_s
        if drafts is None:  # prefill only
            finished += self._retire()
            output = StepOutput(list(rows.values()), finished, prefill_s=prefill_s)
            self.stats.add(output)
            return output
        results, logprobs = self._accept(verifying, drafts.trees, logits, masks)
        self._emit_verified(verifying, drafts, results, logprobs, num_pruned, rows)
        # The policy prices a budget by the step's speculation work: a pass that also ran a
        # prompt says nothing about it.
        self._learn(keys, drafts, results, None if plans else step_start)
        finished += self._retire()
        output = StepOutput(list(rows.values()), finished, len(results), budget, drafts.draft_s,
                            verify_s, prefill_s, drafts.num_errors, drafts.is_fallback)
        self.stats.add(output)
        return output

    def _forward(self, verifying: list[Sequence], drafts: Drafts | None,
                 plans: list[ChunkPlan], rows: dict[str, RowOutput],
                 ) -> tuple[torch.Tensor | None, float, float]:
        """The step's one forward pass: the decoding rows' trees and the prefill chunks; a
        context's last chunk gives its first token. Returns the verification logits and the
        seconds of the pass spent verifying and prefilling (a pass that does both splits its
        time by tokens)."""
        trees = drafts.trees if drafts is not None else []
        tree_rows = [(_row(seq), tree) for seq, tree in zip(verifying, trees)]
        chunks = [Chunk(_row(plan.seq), plan.seq.token_ids_from(plan.seq.table.num_cached)[
            :plan.num_tokens], plan.is_last) for plan in plans]
        start = time.perf_counter()
        logits, chunk_logits = self.runner.forward(tree_rows, chunks)
        seconds = time.perf_counter() - start
        for plan, chunk, next_logits in zip(plans, chunks, chunk_logits):
            seq = plan.seq
            seq.table.num_cached += plan.num_tokens
            self._register(seq)
            if chunk.wants_logits:  # the context's last chunk
                seq.is_prefilled = True
                self._first_token(seq, next_logits, rows)
        prompt_tokens = sum(plan.num_tokens for plan in plans)
        self.stats.num_prefill_tokens += prompt_tokens
        tokens = prompt_tokens + sum(tree.num_nodes for tree in trees)
        prefill_s = seconds * prompt_tokens / tokens
        return logits, seconds - prefill_s, prefill_s

    def _load_prefilled(self, plans: list[ChunkPlan], rows: dict[str, RowOutput]) -> float:
        """Takes over prompts prefilled by another worker into their new blocks; each gets its
        first token now. Returns the seconds it took."""
        start = time.perf_counter()
        for plan in plans:
            seq = plan.seq
            logits = self.runner.load_prefilled(seq.table.blocks, seq.prefilled)  # [vocab_size]
            seq.prefilled = None  # the cache holds it now; free the transfer buffer
            seq.table.num_cached = seq.num_tokens
            seq.is_prefilled = True
            self._register(seq)
            self._first_token(seq, logits, rows)
        return time.perf_counter() - start

    def _register(self, seq: Sequence) -> None:
        """Its blocks now full of final keys and values enter the prefix cache."""
        self.blocks.register_full(seq.table, seq.table.num_cached, seq.token_ids_from)

    def _first_token(self, seq: Sequence, logits: torch.Tensor,
                     rows: dict[str, RowOutput]) -> None:
        """Samples an admitted sequence's first token from its prompt's logits [vocab_size]."""
        token = self._sample_one(seq, logits)
        token_ids = self._append(seq, [token])
        num_top = seq.request.sampling.logprobs
        logprobs = None if num_top is None else token_logprobs(logits.unsqueeze(0), [token],
                                                               num_top)
        rows[seq.request_id] = RowOutput(seq.request_id, token_ids, seq.text, 0, 1,
                                         is_verified=False, logprobs=logprobs)

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        """The token after the context, from its logits [vocab_size]: a one-node tree."""
        mask = seq.constraint.next_mask() if seq.constraint is not None else None
        logits = self._processed(seq, logits.unsqueeze(0), [-1], [seq.last_token], mask)[0]
        if seq.request.sampling.is_greedy:
            return int(argmax_last(logits))
        probs = target_probs(logits.unsqueeze(0), seq.request.sampling)  # [1, vocab_size]
        uniforms = position_uniforms(seq.seed, [len(seq.output_ids)])  # [1]
        return int(sample_with_uniforms(probs, uniforms)[0])

    def _draft_budget(self, batch_size: int, budget: int) -> int:
        """How large to draft when `budget` is verified: larger on the policy's hindsight steps,
        for proposers that can (hindsight.py)."""
        if not self.drafting.has_hindsight:
            return budget
        return self.budget_policy.draft_budget(batch_size, budget)

    def _constrained(self, running: list[Sequence], drafts: Drafts,
                     ) -> tuple[Drafts, dict[int, torch.Tensor], dict[int, int]]:
        """The drafts without the nodes the rows' grammars reject; by constrained row, its
        masks after its kept nodes [num_nodes, vocab_size] bool (constraint.py) and the number
        of nodes dropped."""
        masks: dict[int, torch.Tensor] = {}
        num_pruned: dict[int, int] = {}
        trees = list(drafts.trees)
        for row, seq in enumerate(running):
            if seq.constraint is not None:
                drafted = trees[row].num_nodes
                trees[row], masks[row] = seq.constraint.tree(trees[row])
                num_pruned[row] = drafted - trees[row].num_nodes
        if not masks:
            return drafts, masks, num_pruned
        return dataclasses.replace(drafts, trees=trees), masks, num_pruned

    def _accept(self, running: list[Sequence], trees: list[DraftTree], logits: torch.Tensor,
                masks: dict[int, torch.Tensor],
                ) -> tuple[list[AcceptResult], dict[int, list[TokenLogprob]]]:
        """Per row, the accepted path and bonus token; the KV cache keeps only accepted nodes.
        Also the log-probabilities of each emitted token, by row, for rows that asked.
        `masks`: the grammar's masks of constrained rows, by row.

        The token the target chooses after every node (greedy rows: the argmax; sampled rows:
        the draw at the node's output position, acceptance.accept_at_positions) is decided on
        the logits' device for the whole batch, and comes to the host in one transfer: the
        step's only read-back, whatever the number of rows and nodes (rows with penalties or
        log-probabilities add their own)."""
        num_seqs, max_nodes = logits.shape[:2]
        chosen = argmax_last(logits) if any(seq.request.sampling.is_greedy for seq in running) \
            else torch.zeros((num_seqs, max_nodes), dtype=torch.int64, device=logits.device)
        for row, (seq, tree) in enumerate(zip(running, trees)):  # [num_seqs, max_nodes]
            row_logits = logits[row, : tree.num_nodes]  # [num_nodes, vocab_size]
            node_logits = self._processed(seq, row_logits, tree.parents, tree.token_ids,
                                          masks.get(row))
            if not seq.request.sampling.is_greedy:
                probs = target_probs(node_logits, seq.request.sampling)
                chosen[row, : tree.num_nodes] = draws_at_positions(
                    tree.parents, probs, seq.seed, first_position=len(seq.output_ids))
            elif node_logits is not row_logits:
                chosen[row, : tree.num_nodes] = node_logits.argmax(dim=-1)
        chosen_ids = chosen.tolist()
        results = [accept_greedy(tree.token_ids, tree.parents, chosen_ids[row][: tree.num_nodes])
                   for row, tree in enumerate(trees)]
        logprobs = {}
        for row, (seq, result) in enumerate(zip(running, results)):
            num_top = seq.request.sampling.logprobs
            if num_top is not None:  # the node before each emitted token: root, then the path
                nodes = torch.tensor([0] + result.accepted_nodes, device=logits.device)
                logprobs[row] = token_logprobs(logits[row].index_select(0, nodes),
                                               result.emitted_tokens, num_top)
        self.runner.commit([_row(seq) for seq in running], [r.accepted_nodes for r in results])
        for seq, result in zip(running, results):  # the root and the accepted path are final
            seq.table.num_cached += 1 + result.num_accepted
            self._register(seq)
        return results, logprobs

    def _processed(self, seq: Sequence, logits: torch.Tensor, parents: Seq[int],
                   token_ids: Seq[int], mask: torch.Tensor | None = None) -> torch.Tensor:
        """A tree's logits [num_nodes, vocab_size] as `seq` samples from them: `logits` itself
        when its request adjusts nothing, else an adjusted float copy (logits_processing.py),
        with the tokens its grammar forbids (`mask` [num_nodes, vocab_size] bool, False)
        impossible."""
        if mask is None and not needs_processing(seq.request, len(seq.output_ids)):
            return logits
        adjusted = logits.float().clone()  # [num_nodes, vocab_size]
        if needs_processing(seq.request, len(seq.output_ids)):
            process_tree_logits(adjusted, seq.request, seq.output_ids, parents, token_ids,
                                self.eos_token_ids)
        if mask is not None:
            adjusted.masked_fill_(~mask.to(adjusted.device), float("-inf"))
        return adjusted

    def _emit_verified(self, running: list[Sequence], drafts: Drafts,
                       results: list[AcceptResult], logprobs: dict[int, list[TokenLogprob]],
                       num_pruned: dict[int, int], rows: dict[str, RowOutput]) -> None:
        """Appends each row's accepted tokens and bonus token; one RowOutput per row."""
        for row, (seq, result, row_budget, tree) in enumerate(
                zip(running, results, drafts.budgets, drafts.trees)):
            seq.num_steps += 1
            seq.num_accepted += result.num_accepted
            token_ids = self._append(seq, result.emitted_tokens)
            row_logprobs = logprobs.get(row)
            rows[seq.request_id] = RowOutput(
                seq.request_id, token_ids, seq.text, result.num_accepted, row_budget,
                is_verified=True, num_drafted=tree.num_nodes - 1,
                num_pruned=num_pruned.get(row, 0),
                logprobs=None if row_logprobs is None else row_logprobs[: len(token_ids)])

    def _learn(self, keys: list[str], drafts: Drafts, results: list[AcceptResult],
               step_start: float | None) -> None:
        """The budget policy learns from the step: its cost and what each row accepted, and
        what earlier hindsight trees would have accepted, now that the tokens are out.

        It learns the budget the rows were verified at, which is less than the policy chose
        for a row whose request turned speculation off or whose cache slot is nearly
        full, and 1 for every row when the proposer failed. Only the rows verified at the
        step's largest budget teach its acceptance, and the step's time teaches its cost only
        when every row was verified at it: a batch of requests with speculation off, timed as
        a step of budget 32, would price budget 32 at a plain step's cost, and their empty
        paths would pull its acceptance to zero."""
        verified = max(drafts.budgets)
        rows = [row for row, row_budget in enumerate(drafts.budgets) if row_budget == verified]
        # The policy prices a budget by the whole step's speculation work; a step that drafted
        # a larger tree than it verified, or waited for a proposer that failed, says nothing
        # about the cost of its budget.
        timed = step_start is not None and len(rows) == len(keys) and \
            not (drafts.is_hindsight or drafts.is_fallback)
        step_s = time.perf_counter() - step_start if timed else None
        self.budget_policy.observe(len(keys), verified, [results[row].accepted_nodes
                                                         for row in rows],
                                   step_s, [keys[row] for row in rows])
        for decided in self.drafting.decided_in_hindsight():
            self.budget_policy.observe_hindsight(decided.batch_size, decided.verified_budget,
                                                 decided.paths, decided.request_ids)

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Appends tokens until EOS, a stop string or the length limit ends the sequence;
        returns the tokens appended."""
        appended: list[int] = []
        for token in tokens:
            seq.output_ids.append(token)
            appended.append(token)
            reason = end_reason(token, len(seq.output_ids), seq.request, self.eos_token_ids)
            if reason != "stop" and seq.request.stop and self._hit_stop(seq, token):
                reason = "stop"  # a stop string ends it before the length limit does
            elif reason is None and seq.num_tokens + 1 >= self.max_len:
                reason = "length"  # the context window is full
            seq.finish_reason = reason
            if seq.is_finished:
                break
        if seq.constraint is not None:
            seq.constraint.advance(appended)
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
        self.drafting.end(finished)
        return finished


def _row(seq: Sequence) -> CacheRow:
    """A sequence's place in the cache for this step."""
    return CacheRow(seq.table.blocks, seq.table.num_cached)

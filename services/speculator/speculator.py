"""The speculator's core: per-sequence state, the speculation cache, and the round protocol.

A round (proto/sssd/v1/speculator.proto), per sequence:
1. The caller reports the outcome of the previous round: k of the drafts s_1..s_K it was sent
   were accepted, then the bonus token b.
2. If (k, b) is in the speculation cache, the drafts drafted for it are returned at once (a hit).
   Otherwise (a miss) the draft model drafts just in time, or, above the critical batch size b*,
   the sequence is marked `fallback` and the caller drafts it with the SSSD drafter.
3. The answer goes back, and in the background the speculation for the next round starts: the
   draft model runs over [uncommitted context, s'_1..s'_K] (the drafts just sent), takes at each
   position j the top-F_j tokens of its distribution except s'_{j+1} as the predicted bonus
   tokens, and drafts K tokens after each predicted outcome, all outcomes of all sequences in
   one forward per depth. The next round waits for this only if it arrives before it is done:
   the speculation overlaps the caller's verification.

The draft KV cache holds, per sequence, the committed context `tokens[:cache_len]` (always all
but at least the last token), the chain above it while a round is being verified, and the
branches above the chain while they are drafted.

Every public method takes the lock and first waits for the background speculation, so state is
only ever touched by one thread at a time. A call that raises changes no state.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from sssd.common.drafting.proposer import CapacityError, SequenceNotFound
from sssd.speculator.fanout import FanoutEstimator, fanout
from sssd.speculator.protocol import FingerprintMismatch, RoundInput, RoundOutput
from sssd.speculator.runner import DraftRunner, Node, chain_nodes
from sssd.speculator.sampling import saguaro_probs

logger = logging.getLogger(__name__)

MAX_TEMPERATURE = 100.0


@dataclass
class _Prediction:
    tokens: list[int]  # [lookahead] drafts after the predicted outcome
    probs: list[float]  # [lookahead]


@dataclass
class _SeqState:
    slot: int
    tokens: list[int]  # the verified context
    cache_len: int  # tokens[:cache_len] hold their KV in the draft cache
    temperature: float
    generator: torch.Generator
    sent: list[int] = field(default_factory=list)  # drafts of the round being verified
    # After the background speculation: KV of tokens[cache_len:] + sent sits at cache_len...
    chain_ready: bool = False
    predictions: dict[tuple[int, int], _Prediction] = field(default_factory=dict)
    fanout: list[int] = field(default_factory=list)  # F_0..F_K of `predictions`


@dataclass
class SpeculatorStats:
    rounds: int = 0
    rows: int = 0  # sequence-rounds
    hits: int = 0
    misses_jit: int = 0
    misses_fallback: int = 0
    speculate_s: float = 0.0  # background speculation, summed
    wait_s: float = 0.0  # time rounds spent waiting for it
    jit_s: float = 0.0  # just-in-time drafting on misses, summed


class Speculator:
    """SSD / Saguaro drafting with a draft model on `runner`."""

    def __init__(self, runner: DraftRunner, *, vocab_size: int, fingerprint: str | None,
                 lookahead: int = 3, fanout_budget: int = 12, fanout_kind: str = "geometric",
                 saguaro_c: float = 1.0, critical_batch_size: int = -1,
                 max_batch_size: int = 64, speculate_ahead: bool = True,
                 model_name: str = "", device: str = "cpu") -> None:
        self.runner = runner
        self.model_name = model_name  # for GetInfo and logs
        self.device = device
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.lookahead = lookahead
        self.fanout_budget = fanout_budget
        self.fanout_kind = fanout_kind
        self.saguaro_c = saguaro_c
        self.fixed_critical_batch_size = critical_batch_size
        self.max_batch_size = max_batch_size
        self.speculate_ahead = speculate_ahead  # False: every round drafts just in time
        self.max_sequences = runner.cache.max_seqs
        self.estimator = FanoutEstimator()
        self.stats = SpeculatorStats()
        self._seqs: dict[str, _SeqState] = {}
        self._free_slots = list(range(self.max_sequences - 1, -1, -1))
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="speculate")
        self._pending: Future[None] | None = None
        self._draining = False
        # Cost model of the critical batch size (EWMAs, seconds).
        self._jit_s_per_round: float | None = None
        self._verify_s: float | None = None  # time between a round's answer and the next round
        self._miss_rate = 0.3
        self._answered_at: float | None = None

    # --- the round protocol --------------------------------------------------------------------

    def round(self, inputs: Sequence[RoundInput],
              fingerprint: str | None = None) -> list[RoundOutput]:
        """Outcomes of the previous round in, this round's drafts out (one per input)."""
        arrived = time.perf_counter()
        with self._lock:
            if self._draining:
                raise ConnectionError("the speculator is draining (shutting down)")
            self._wait_for_speculation()
            self._validate(inputs, fingerprint)
            if self._answered_at is not None:
                self._verify_s = _ewma(self._verify_s, arrived - self._answered_at)
            outputs = self._apply(inputs)
            self._answered_at = time.perf_counter()
            rows = [self._seqs[i.seq_id] for i in inputs if self._seqs[i.seq_id].sent]
            if rows and self.speculate_ahead:
                self._pending = self._executor.submit(self._speculate_logged, rows)
            return outputs

    def end(self, seq_ids: Sequence[str]) -> int:
        with self._lock:
            self._wait_for_speculation()
            ended = 0
            for seq_id in seq_ids:
                seq = self._seqs.pop(seq_id, None)
                if seq is not None:
                    self.runner.set_live_end(seq.slot, 0)
                    self._free_slots.append(seq.slot)
                    ended += 1
            return ended

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def critical_batch_size(self) -> int:
        """b*: the largest batch whose misses are drafted just in time. Theorem 17's point: the
        batch's step waits for its slowest row, so a just-in-time draft (t_jit) is paid whenever
        any of the b rows misses, probability 1 - (1 - m)^b. Allowed while that expected stall
        stays under a quarter of the verification it delays; above, the fast SSSD drafter. A
        single sequence always drafts its misses just in time (b* >= 1): nothing else waits."""
        if self.fixed_critical_batch_size >= 0:
            return self.fixed_critical_batch_size
        if self._jit_s_per_round is None or self._verify_s is None:
            return self.max_batch_size  # nothing measured yet: speculate
        for b in range(2, self.max_batch_size + 1):
            stall = (1 - (1 - self._miss_rate) ** b) * self._jit_s_per_round
            if stall > 0.25 * self._verify_s:
                return b - 1
        return self.max_batch_size

    def drain(self) -> None:
        """Refuses further rounds (UNAVAILABLE) and finishes the background work."""
        with self._lock:
            self._draining = True
            self._wait_for_speculation()

    def close(self) -> None:
        with self._lock:
            self._wait_for_speculation()
            self._executor.shutdown(wait=True)

    # --- inside a round ------------------------------------------------------------------------

    def _wait_for_speculation(self) -> None:
        if self._pending is None:
            return
        start = time.perf_counter()
        self._pending.result()
        self._pending = None
        self.stats.wait_s += time.perf_counter() - start

    def _validate(self, inputs: Sequence[RoundInput], fingerprint: str | None) -> None:
        if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"tokenizer fingerprint {fingerprint} differs from the draft model's "
                f"{self.fingerprint}: the draft model must use the target's tokenizer")
        if not inputs:
            raise ValueError("empty batch: a Round needs 1 to "
                             f"{self.max_batch_size} sequences")
        if len(inputs) > self.max_batch_size:
            raise ValueError(f"batch of {len(inputs)} sequences exceeds max_batch_size "
                             f"{self.max_batch_size}")
        seen: set[str] = set()
        unknown: list[str] = []
        num_new = 0
        for i in inputs:
            if not i.seq_id:
                raise ValueError("seq_id must be non-empty")
            if i.seq_id in seen:
                raise ValueError(f"seq_id {i.seq_id!r} appears twice in one Round")
            seen.add(i.seq_id)
            if not 0 <= i.temperature <= MAX_TEMPERATURE or math.isnan(i.temperature):
                raise ValueError(f"{i.seq_id}: temperature must be in [0, {MAX_TEMPERATURE}], "
                                 f"got {i.temperature}")
            if i.budget < 0:
                raise ValueError(f"{i.seq_id}: budget must be >= 0, got {i.budget}")
            bad = [t for t in i.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{i.seq_id}: token ids must be in [0, {self.vocab_size}), got "
                                 f"{bad[:5]}")
            if i.is_start:
                if i.num_accepted != 0:
                    raise ValueError(f"{i.seq_id}: num_accepted must be 0 with is_start")
                if not i.token_ids:
                    raise ValueError(f"{i.seq_id}: is_start needs the full context, got no "
                                     "tokens")
                if len(i.token_ids) + self._per_round_room() > self.runner.capacity:
                    raise ValueError(f"{i.seq_id}: context of {len(i.token_ids)} tokens does "
                                     f"not fit the draft cache ({self.runner.capacity} "
                                     "positions)")
                if i.seq_id not in self._seqs:
                    num_new += 1
                continue
            seq = self._seqs.get(i.seq_id)
            if seq is None:
                unknown.append(i.seq_id)
                continue
            if seq.sent:
                k = i.num_accepted
                if k > len(seq.sent):
                    raise ValueError(f"{i.seq_id}: num_accepted {k} is out of range: the "
                                     f"previous round sent {len(seq.sent)} drafts")
                if len(i.token_ids) != k + 1 or list(i.token_ids[:k]) != seq.sent[:k]:
                    raise ValueError(f"{i.seq_id}: token_ids must be the {k} accepted drafts "
                                     f"{seq.sent[:k]} and the bonus token, got "
                                     f"{list(i.token_ids)}")
            elif i.num_accepted != 0:
                raise ValueError(f"{i.seq_id}: num_accepted {i.num_accepted} is out of range: "
                                 "the previous round sent no drafts")
        if unknown:
            raise SequenceNotFound(unknown)
        if num_new > len(self._free_slots):
            raise CapacityError(f"starting {num_new} sequences would exceed max_sequences "
                                f"{self.max_sequences} ({len(self._seqs)} live)")

    def _per_round_room(self) -> int:
        """Cache positions a round may use above the context: the chain, the branches, and the
        padding of the widest step (the branches, or a chain), aligned."""
        chain = 2 * (self.lookahead + 2)
        return chain + self.fanout_budget * (self.lookahead + 1) + max(chain, self.fanout_budget) \
            + 64

    def _catch_up(self, seqs: Sequence[_SeqState]) -> None:
        """Writes the KV of long uncommitted contexts (a new prompt, tokens decoded without
        drafts) one sequence at a time, all but the last token, so that the batched steps that
        follow are short and pad short rows little."""
        for seq in seqs:
            pending = seq.tokens[seq.cache_len:-1]
            if len(pending) > self.lookahead + 2:
                self.runner.forward({seq.slot: chain_nodes(pending, seq.cache_len)}, {})
                seq.cache_len = len(seq.tokens) - 1
                self.runner.set_live_end(seq.slot, seq.cache_len)

    def _apply(self, inputs: Sequence[RoundInput]) -> list[RoundOutput]:
        self.stats.rounds += 1
        self.stats.rows += len(inputs)
        outputs: list[RoundOutput | None] = [None] * len(inputs)
        misses: list[int] = []  # input indices that need drafts and were not predicted
        for index, i in enumerate(inputs):
            want = min(i.budget - 1, self.lookahead)
            if i.is_start:
                seq = self._start(i)
            else:
                seq = self._seqs[i.seq_id]
                seq.temperature = i.temperature
                prediction = self._take_outcome(seq, i)
                if prediction is not None and want > 0:
                    outputs[index] = RoundOutput(True, False, prediction.tokens[:want],
                                                 prediction.probs[:want])
                    self.stats.hits += 1
                    self._miss_rate = _ewma(self._miss_rate, 0.0, 0.05)
                    continue
            if want > 0 and len(seq.tokens) + self._per_round_room() <= self.runner.capacity:
                misses.append(index)
                self._miss_rate = _ewma(self._miss_rate, 1.0, 0.05)
            else:
                outputs[index] = RoundOutput(False, False, [], [])
        if misses:
            if len(inputs) <= self.critical_batch_size():
                drafted = self._draft_just_in_time(
                    [self._seqs[inputs[m].seq_id] for m in misses],
                    [min(inputs[m].budget - 1, self.lookahead) for m in misses])
                for m, (tokens, probs) in zip(misses, drafted):
                    outputs[m] = RoundOutput(False, False, tokens, probs)
                self.stats.misses_jit += len(misses)
            else:
                for m in misses:
                    outputs[m] = RoundOutput(False, True, [], [])
                self.stats.misses_fallback += len(misses)
        for i, output in zip(inputs, outputs):
            seq = self._seqs[i.seq_id]
            seq.sent = list(output.token_ids)
            seq.chain_ready = False
            seq.predictions = {}
        return outputs  # type: ignore[return-value]

    def _start(self, i: RoundInput) -> _SeqState:
        old = self._seqs.pop(i.seq_id, None)
        slot = old.slot if old is not None else self._free_slots.pop()
        self.runner.set_live_end(slot, 0)
        generator = torch.Generator().manual_seed(i.seed)
        seq = _SeqState(slot, list(i.token_ids), 0, i.temperature, generator)
        self._seqs[i.seq_id] = seq
        return seq

    def _take_outcome(self, seq: _SeqState, i: RoundInput) -> _Prediction | None:
        """Applies the outcome to the sequence; returns the cached drafts on a hit."""
        new = [int(t) for t in i.token_ids]
        if not seq.sent:
            seq.tokens.extend(new)
            return None
        k, bonus = i.num_accepted, new[-1]
        if seq.chain_ready:
            # The chain's KV sits at cache_len...: keep the verified part, all but the bonus.
            seq.cache_len = len(seq.tokens) + k
            self.runner.set_live_end(seq.slot, seq.cache_len)
        seq.tokens.extend(new)
        prediction = seq.predictions.get((k, bonus))
        fanout_at_k = seq.fanout[k] if k < len(seq.fanout) else None
        self.estimator.observe(len(seq.sent), k, fanout_at_k, prediction is not None)
        return prediction

    # --- drafting with the draft model ---------------------------------------------------------

    def _draft_just_in_time(self, seqs: list[_SeqState],
                            wants: list[int]) -> list[tuple[list[int], list[float]]]:
        """Drafts `wants[i]` tokens after each sequence's context, one forward per depth."""
        self._catch_up(seqs)  # prompt-sized work, not part of the per-round cost below
        start = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[float]] = [[] for _ in seqs]
        nodes = {}
        keep = {}
        for seq in seqs:
            pending = seq.tokens[seq.cache_len:]
            nodes[seq.slot] = chain_nodes(pending, seq.cache_len)
            keep[seq.slot] = [len(pending) - 1]
        fan = self._current_fanout(self.lookahead)
        for depth in range(max(wants)):
            logits = self.runner.forward(nodes, keep)
            if depth == 0:
                for seq in seqs:  # the context is in the cache now, all but its last token
                    seq.cache_len = len(seq.tokens) - 1
            nodes, keep = {}, {}
            for row, seq in enumerate(seqs):
                if depth >= wants[row]:
                    continue
                token, prob = self._pick(seq, logits[seq.slot][-1], fan[depth])
                tokens[row].append(token)
                probs[row].append(prob)
                if depth + 1 < wants[row]:
                    position = len(seq.tokens) + depth
                    nodes[seq.slot] = chain_nodes([token], position)
                    keep[seq.slot] = [0]
            if not nodes:
                break
        for seq in seqs:
            self.runner.set_live_end(seq.slot, seq.cache_len)
        elapsed = time.perf_counter() - start
        self.stats.jit_s += elapsed
        self._jit_s_per_round = _ewma(self._jit_s_per_round, elapsed)
        return list(zip(tokens, probs))

    def _pick(self, seq: _SeqState, logits: torch.Tensor, top_f: int) -> tuple[int, float]:
        """The next draft token from float32 `logits` [vocab]: argmax at temperature 0, else a
        sample of Saguaro's q' (the top-`top_f` tokens' probability scaled by C)."""
        if seq.temperature == 0:
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
            return token, float(probs[token])
        probs = saguaro_probs(torch.softmax(logits / seq.temperature, dim=-1), top_f,
                              self.saguaro_c)
        token = int(torch.multinomial(probs, 1, generator=seq.generator))
        return token, float(probs[token])

    def current_fanout(self) -> list[int]:
        """F_0..F_K for a full round of `lookahead` drafts at the current estimates."""
        return self._current_fanout(self.lookahead)

    def _current_fanout(self, num_drafts: int) -> list[int]:
        return fanout(self.fanout_kind, max(self.fanout_budget, num_drafts + 1), num_drafts,
                      self.estimator.acceptance, self.estimator.miss_exponent)

    def _speculate_logged(self, rows: list[_SeqState]) -> None:
        start = time.perf_counter()
        try:
            self._speculate(rows)
        except Exception:  # noqa: BLE001 - a failed speculation is a round of misses
            logger.exception("speculation failed; the next round drafts just in time")
            for seq in rows:
                seq.chain_ready = False
                seq.predictions = {}
        self.stats.speculate_s += time.perf_counter() - start

    def _speculate(self, rows: list[_SeqState]) -> None:
        """Runs the chain [tokens[cache_len:], sent] of every row, predicts the outcomes and
        drafts `lookahead` tokens after each (the speculation cache of the next round)."""
        self._catch_up(rows)
        nodes, keep = {}, {}
        for seq in rows:
            pending = seq.tokens[seq.cache_len:] + seq.sent
            nodes[seq.slot] = chain_nodes(pending, seq.cache_len)
            # Distributions after the last verified token and after each draft: d_0..d_K.
            keep[seq.slot] = list(range(len(pending) - len(seq.sent) - 1, len(pending)))
        logits = self.runner.forward(nodes, keep)
        # Branches: (row, k, bonus) with their nodes growing one depth per forward.
        branches: dict[int, list[tuple[int, int]]] = {}
        for seq in rows:
            seq.chain_ready = True
            num_drafts = len(seq.sent)
            seq.fanout = self._current_fanout(num_drafts)
            outcome_logits = logits[seq.slot]  # [num_drafts + 1, vocab]
            predicted = []
            for k in range(num_drafts + 1):
                ranked = torch.topk(outcome_logits[k], seq.fanout[k] + 1).indices.tolist()
                if k < num_drafts:  # a rejected draft is never the bonus token
                    ranked = [t for t in ranked if t != seq.sent[k]]
                predicted.extend((k, t) for t in ranked[: seq.fanout[k]])
            branches[seq.slot] = predicted
        by_slot = {seq.slot: seq for seq in rows}
        drafts: dict[int, list[list[int]]] = {s: [[] for _ in b] for s, b in branches.items()}
        draft_probs: dict[int, list[list[float]]] = {s: [[] for _ in b]
                                                     for s, b in branches.items()}
        last: dict[int, list[int]] = {s: [t for _, t in b] for s, b in branches.items()}
        fan_next = self._current_fanout(self.lookahead)
        for depth in range(self.lookahead):
            nodes, keep = {}, {}
            for slot, outcomes in branches.items():
                seq = by_slot[slot]
                chain_start = seq.cache_len
                chain_len = len(seq.tokens) - seq.cache_len + len(seq.sent)
                first_outcome = chain_start + chain_len - len(seq.sent) - 1  # position of d_0
                base = chain_start + chain_len
                row_nodes = []
                for b, (k, _) in enumerate(outcomes):
                    attach = first_outcome + k  # the chain node the outcome follows
                    own = [base + d * len(outcomes) + b for d in range(depth + 1)]
                    row_nodes.append(Node(last[slot][b], attach + 1 + depth, own[-1],
                                          attach + 1, tuple(own)))
                nodes[slot] = row_nodes
                keep[slot] = list(range(len(row_nodes)))
            logits = self.runner.forward(nodes, keep)
            for slot in branches:
                seq = by_slot[slot]
                for b in range(len(branches[slot])):
                    token, prob = self._pick(seq, logits[slot][b], fan_next[depth])
                    drafts[slot][b].append(token)
                    draft_probs[slot][b].append(prob)
                    last[slot][b] = token
        for slot, outcomes in branches.items():
            seq = by_slot[slot]
            seq.predictions = {
                outcome: _Prediction(drafts[slot][b], draft_probs[slot][b])
                for b, outcome in enumerate(outcomes)}
            # Only the chain is needed from here on; branches may be overwritten.
            self.runner.set_live_end(slot, len(seq.tokens) + len(seq.sent))


def _ewma(previous: float | None, value: float, weight: float = 0.2) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value

"""Several drafting sources behind one `Proposer`: each sequence drafts with one of them.

Only a server with two or more sources has a router (mode ssd: the speculator, and the SSSD
drafter that is also its fallback); a lone source meets the engine directly.

The engine makes one `propose` call per step for its batch; the router splits the batch by the
source each sequence uses (the request's choice, `DraftRequest.source`, else the cheapest by
measured cost), calls each source once with its rows and puts the trees back in batch order.
A sequence keeps its source for its whole life: the sources hold per-sequence state (the
speculator's KV cache, the drafter's input trie), so a switch would mean a restart.

"Cheapest by measured cost" (the API's speculation mode `auto`): per source, the tokens a
sequence gains per step (the new tokens of each continuation are the previous step's accepted
tokens plus the bonus token) over the time a step takes with that source, which is the
source's draft call plus the rest of the step (the time between two `propose` calls, mostly the
verification, shared by all sources). Until every source has `min_steps` measured steps the
new sequences go to the least measured one; afterwards every `explore_every`-th new sequence
goes to a source other than the best, so the estimates follow a changing load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sssd.common.drafting.batch_split import propose_split, raise_failure
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound

logger = logging.getLogger(__name__)

# Mode `auto`: the source is chosen by the router.
AUTO = ""


@dataclass
class SourceCost:
    """Running averages of one source (exponentially weighted; `num_steps` is a plain count)."""

    num_steps: int = 0  # sequence-steps measured (a continuation after a drafted step)
    tokens_per_step: float = 0.0  # accepted + 1, per sequence and step
    draft_s: float = 0.0  # the source's propose call, per step it was called
    num_sequences: int = 0  # sequences assigned to the source


class CostChooser:
    """Picks the source of a new sequence from measured tokens per step and step times."""

    def __init__(self, names: Sequence[str], min_steps: int = 16, explore_every: int = 8,
                 smoothing: float = 0.05) -> None:
        if not names:
            raise ValueError("at least one drafting source is needed")
        if min_steps < 1 or explore_every < 2 or not 0 < smoothing <= 1:
            raise ValueError("min_steps must be >= 1, explore_every >= 2, smoothing in (0, 1]")
        self.names = tuple(names)
        self.costs = {name: SourceCost() for name in self.names}
        self.rest_s = 0.0  # the step without drafting (verification, bookkeeping), averaged
        self.min_steps = min_steps
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._num_picks = 0

    def observe_tokens(self, name: str, num_tokens: int) -> None:
        """`num_tokens`: what a continuing sequence's last drafted step emitted."""
        cost = self.costs[name]
        weight = max(self.smoothing, 1.0 / (cost.num_steps + 1))  # plain mean at first
        cost.tokens_per_step += weight * (num_tokens - cost.tokens_per_step)
        cost.num_steps += 1

    def observe_draft(self, name: str, seconds: float) -> None:
        cost = self.costs[name]
        cost.draft_s += max(self.smoothing, 1.0 / (cost.num_steps + 1)) * (seconds - cost.draft_s)

    def observe_rest(self, seconds: float) -> None:
        self.rest_s += self.smoothing * (seconds - self.rest_s) if self.rest_s else seconds

    def tokens_per_second(self, name: str) -> float:
        """The speed a sequence gets from the source, as measured (0 before any measurement)."""
        cost = self.costs[name]
        step_s = cost.draft_s + self.rest_s
        return cost.tokens_per_step / step_s if cost.num_steps and step_s > 0 else 0.0

    def pick(self) -> str:
        self._num_picks += 1
        unmeasured = [n for n in self.names if self.costs[n].num_steps < self.min_steps]
        if unmeasured:  # measure every source first: the least measured, then the least used
            name = min(unmeasured, key=lambda n: (self.costs[n].num_steps,
                                                  self.costs[n].num_sequences))
        else:
            ranked = sorted(self.names, key=self.tokens_per_second, reverse=True)
            name = ranked[0]
            if len(ranked) > 1 and self._num_picks % self.explore_every == 0:
                name = ranked[1 + (self._num_picks // self.explore_every) % (len(ranked) - 1)]
        self.costs[name].num_sequences += 1
        return name

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: {"steps": cost.num_steps, "sequences": cost.num_sequences,
                       "tokens_per_step": cost.tokens_per_step, "draft_ms": 1e3 * cost.draft_s,
                       "tokens_per_second": self.tokens_per_second(name)}
                for name, cost in self.costs.items()}


class SourceRouter:
    """A `Proposer` over named sources; see the module docstring."""

    # A tree drafted larger than is verified would skew the tokens per step the chooser
    # compares the sources by.
    hindsight_drafts = False

    def __init__(self, sources: Mapping[str, Proposer], chooser: CostChooser | None = None) -> None:
        if len(sources) < 2:
            raise ValueError("a router needs two or more drafting sources (a lone source "
                             "meets the engine directly)")
        self.proposers = dict(sources)
        self.chooser = chooser or CostChooser(list(self.proposers))
        if set(self.chooser.names) != set(self.proposers):
            raise ValueError(f"the chooser's sources {self.chooser.names} are not the router's "
                             f"{tuple(self.proposers)}")
        self._source_of: dict[str, str] = {}  # seq_id -> its source
        self._last_budget: dict[str, int] = {}  # seq_id -> budget of its last drafted step
        self._returned_at: float | None = None  # when the previous propose call returned
        self._last_ids: set[str] = set()  # the sequences of the previous propose call

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self.proposers)

    def source_of(self, seq_id: str) -> str | None:
        return self._source_of.get(seq_id)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per source: the measurements `auto` chooses by, and the source's own counters."""
        summary = self.chooser.summary()
        for name, proposer in self.proposers.items():
            summary[name].update(proposer.stats().get(name, {}))
        return summary

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        called_at = time.perf_counter()
        # The time since the last call is a step without its drafting only when the engine
        # went straight on with the same sequences, not after an idle spell.
        if self._returned_at is not None and any(
                not r.is_start and r.seq_id in self._last_ids for r in requests):
            self.chooser.observe_rest(called_at - self._returned_at)
        unknown = [r.seq_id for r in requests
                   if not r.is_start and r.seq_id not in self._source_of]
        if unknown:
            raise SequenceNotFound(unknown)
        names = [self._assign(r) for r in requests]  # ValueError before any source is called
        split = propose_split(requests, names, self.proposers.__getitem__)
        if split.failures:
            # A lost sequence is re-sent whole to every source; another error restarts all.
            raise_failure(split, requests)
        if any(r.budget > 1 for r in requests):  # not a bare append
            for name, seconds in split.seconds.items():
                self.chooser.observe_draft(name, seconds)
        for request, name in zip(requests, names):
            previous = self._last_budget.get(request.seq_id, 1)
            if not request.is_start and previous > 1:
                self.chooser.observe_tokens(name, len(request.token_ids))
            self._source_of[request.seq_id] = name
            self._last_budget[request.seq_id] = request.budget
        self._last_ids = {r.seq_id for r in requests}
        self._returned_at = time.perf_counter()
        return split.trees  # type: ignore[return-value]

    def end(self, seq_ids: Sequence[str]) -> int:
        by_source: dict[str, list[str]] = {}
        for seq_id in seq_ids:
            name = self._source_of.pop(seq_id, None)
            self._last_budget.pop(seq_id, None)
            if name is not None:
                by_source.setdefault(name, []).append(seq_id)
        return sum(self.proposers[name].end(ids) for name, ids in by_source.items())

    def close(self) -> None:
        for proposer in self.proposers.values():
            proposer.close()

    def _assign(self, request: DraftRequest) -> str:
        if request.source:
            if request.source not in self.proposers:
                raise ValueError(f"drafting source {request.source!r} is not available here "
                                 f"(sources: {', '.join(self.proposers)})")
            return request.source
        known = self._source_of.get(request.seq_id)
        if known is not None:
            return known
        return self.chooser.pick()

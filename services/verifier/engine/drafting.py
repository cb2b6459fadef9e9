"""The draft stage of an engine step: one batched `propose` call for the running sequences.

Everything the engine does with its proposer lives here: each row's budget (speculation off for
the request, room left in its cache slot), the incremental hand-over (a sequence sends only the
tokens the proposer has not seen), the re-send of whole contexts after `SequenceNotFound`, the
fallback to no drafts when the proposer fails (a request never fails because of its drafter),
hindsight trees (drafted larger than verified, scored once the sequence's tokens are out, see
hindsight.py) and ending sequences in the proposer. The proposer is known only through the
`Proposer` protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound
from sssd.verifier.engine.hindsight import HindsightPaths, HindsightTracker
from sssd.verifier.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drafts:
    """What the draft stage of a step produced."""

    trees: list[DraftTree]  # [num_running] one per running sequence, roots only when none
    budgets: list[int]  # [num_running] each row's budget (1: no drafts)
    draft_s: float = 0.0
    num_errors: int = 0  # proposer errors, a SequenceNotFound answered by a re-send included
    is_fallback: bool = False  # the proposer failed: the step decodes without drafts
    is_hindsight: bool = False  # drafted larger than verified, to score the rest in hindsight


class Drafting:
    """The engine's side of its proposer (None: autoregressive decoding). Owns the proposer and
    closes it in `close()`."""

    def __init__(self, proposer: Proposer | None, vocab_size: int | None = None) -> None:
        """`vocab_size`: the model's; a tree with a token id outside it (a drafter whose
        datastore was built with another tokenizer) is a proposer failure, never a forward."""
        self.proposer = proposer
        self.vocab_size = vocab_size
        # Larger trees than are verified, scored against the output later: only for proposers
        # whose trees are best-first and cheap to draft.
        self._hindsight = HindsightTracker() \
            if proposer is not None and proposer.hindsight_drafts else None

    @property
    def has_hindsight(self) -> bool:
        """Whether trees may be drafted larger than verified (`Proposer.hindsight_drafts`)."""
        return self._hindsight is not None

    @property
    def sources(self) -> tuple[str, ...]:
        """The drafting sources a request may name (none without a proposer)."""
        return self.proposer.sources if self.proposer is not None else ()

    def draft(self, running: Seq[Sequence], budget: int, draft_budget: int,
              room: Callable[[int], int]) -> Drafts:
        """The trees to verify at `budget` for `running` (row i in cache slot i, which has
        `room(i)` positions left). With `draft_budget` > `budget` (the policy's hindsight
        steps; only when `has_hindsight`) it drafts larger trees, keeps them for scoring
        later, and returns their first `budget` nodes."""
        drafts = self._propose(running, draft_budget, room)
        if draft_budget <= budget or drafts.is_fallback:
            return drafts
        assert self._hindsight is not None, "drafting ahead needs a hindsight proposer"
        self._hindsight.add(len(running), budget, running, drafts.trees, drafts.budgets)
        return Drafts([tree.prefix(budget) for tree in drafts.trees],
                      [min(budget, row_budget) for row_budget in drafts.budgets],
                      drafts.draft_s, drafts.num_errors, is_hindsight=True)

    def decided_in_hindsight(self) -> list[HindsightPaths]:
        """After a step's tokens were emitted: the hindsight trees they decide, oldest first."""
        return self._hindsight.decided() if self._hindsight is not None else []

    def end(self, sequences: Seq[Sequence], is_abort: bool = False) -> None:
        """Frees finished (or, `is_abort`, cancelled) sequences in the proposer; a failure is
        only logged: the proposer's state is restarted on its next use anyway."""
        if is_abort and self._hindsight is not None:
            for seq in sequences:  # it emits nothing more: its trees are never decided
                self._hindsight.forget(seq)
        if self.proposer is None or not sequences:
            return
        try:
            self.proposer.end([seq.request_id for seq in sequences])
        except Exception as exc:  # noqa: BLE001 - state is freed again at restart anyway
            logger.warning("proposer end() failed: %s", exc)

    def close(self) -> None:
        if self.proposer is not None:
            self.proposer.close()

    def _propose(self, running: Seq[Sequence], budget: int,
                 room: Callable[[int], int]) -> Drafts:
        roots = [DraftTree.root_only(seq.last_token) for seq in running]
        no_drafts = Drafts(roots, [1] * len(running))
        if self.proposer is None or budget <= 1:
            return no_drafts
        # A tree must fit in the cache; near the end of the window speculate less.
        budgets = [max(1, min(budget if seq.request.speculate else 1, room(slot) - 1))
                   for slot, seq in enumerate(running)]
        if max(budgets) <= 1:  # every sequence decodes without drafts (speculation off)
            return no_drafts
        num_errors = 0
        start = time.perf_counter()
        try:
            try:
                trees = self.proposer.propose(_requests(running, budgets))
            except SequenceNotFound as missing:
                # The proposer lost their state (restart, eviction): re-send full contexts.
                num_errors += 1
                for seq in running:
                    if seq.request_id in missing.seq_ids:
                        seq.num_proposer_tokens = 0
                trees = self.proposer.propose(_requests(running, budgets))
            self._check_vocabulary(trees)
        except Exception as exc:  # noqa: BLE001 - any proposer failure: decode without it
            logger.warning("proposer failed (%s); this step decodes without speculation", exc)
            for seq in running:
                seq.num_proposer_tokens = 0  # its state is unknown now: restart next time
            return Drafts(roots, [1] * len(running), time.perf_counter() - start,
                          num_errors + 1, is_fallback=True)
        for seq in running:
            seq.num_proposer_tokens = seq.num_tokens
        return Drafts(trees, budgets, time.perf_counter() - start, num_errors)


    def _check_vocabulary(self, trees: list[DraftTree]) -> None:
        """ValueError when a tree holds a token id the model does not have."""
        if self.vocab_size is None or not trees:
            return
        largest = max(int(tree.token_ids.max()) for tree in trees)
        smallest = min(int(tree.token_ids.min()) for tree in trees)
        if largest >= self.vocab_size or smallest < 0:
            bad = largest if largest >= self.vocab_size else smallest
            raise ValueError(f"the proposer drafted token id {bad}, outside the model's "
                             f"vocabulary of {self.vocab_size}: is its datastore built with "
                             "another tokenizer?")


def _requests(running: Seq[Sequence], budgets: list[int]) -> list[DraftRequest]:
    return [DraftRequest(seq.request_id, seq.token_ids_from(seq.num_proposer_tokens), budget,
                         is_start=seq.num_proposer_tokens == 0,
                         temperature=seq.request.sampling.temperature, seed=seq.seed,
                         source=seq.request.source)
            for seq, budget in zip(running, budgets)]

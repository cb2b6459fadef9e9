"""In-memory stand-ins for tests of routing and error handling."""

import numpy as np
import pytest

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import SequenceNotFound


class FakeProposer:
    """A `Proposer` in memory for routing tests: records each call's sequence ids and each
    sequence's context, drafts a chain of `num_drafts` tokens (1, 2, ...) after the last token,
    loses the ids in `lose` (SequenceNotFound) and raises `failure` while it is set."""

    sources = ("sssd",)
    hindsight_drafts = False

    def __init__(self, num_drafts: int = 0) -> None:
        self.num_drafts = num_drafts
        self.contexts: dict[str, list[int]] = {}
        self.calls: list[list[str]] = []
        self.lose: set[str] = set()
        self.failure: Exception | None = None
        self.closed = 0

    def propose(self, requests):


        self.calls.append([r.seq_id for r in requests])
        if self.failure is not None:
            raise self.failure
        missing = [r.seq_id for r in requests if r.seq_id in self.lose
                   or (not r.is_start and r.seq_id not in self.contexts)]
        if missing:
            raise SequenceNotFound(missing)
        for r in requests:
            if r.is_start:
                self.contexts[r.seq_id] = list(r.token_ids)
            else:
                self.contexts[r.seq_id].extend(r.token_ids)
        chain = list(range(1, self.num_drafts + 1))
        return [DraftTree(np.array([self.contexts[r.seq_id][-1], *chain], dtype=np.int32),
                          np.arange(-1, self.num_drafts, dtype=np.int32)) for r in requests]

    def end(self, seq_ids):
        if self.failure is not None:
            raise self.failure
        return sum(self.contexts.pop(s, None) is not None for s in seq_ids)

    def stats(self):
        return {}

    def close(self):
        self.closed += 1


@pytest.fixture(scope="session")
def fake_proposer():
    """The FakeProposer class (tests cannot import each other's modules)."""
    return FakeProposer

"""One batch over several proposers, as the source router (by drafting source) and the drafter
replicas client (by replica) both need it: each proposer gets its rows in one call, the trees
come back in batch order, and a call that fails anywhere leaves every proposer as the engine's
re-send expects.

The drafting interface promises that a call that raises changes no state. A proposer that
answered has taken its rows' tokens, so when another one fails, the answered rows are ended
where they went, and the error raised names them with the lost ones (`SequenceNotFound`): the
engine then re-sends their full contexts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


@dataclass
class Split(Generic[K]):
    rows_of: dict[K, list[int]]  # each proposer's batch rows, in batch order
    trees: list[DraftTree | None]  # [num_rows]; None where the row's proposer failed
    seconds: dict[K, float]  # each answered call's wall time
    failures: dict[K, Exception]


def propose_split(requests: Sequence[DraftRequest], keys: Sequence[K],
                  proposer_of: Callable[[K], Proposer], pool: Executor | None = None) -> Split[K]:
    """Calls `proposer_of(key)` once with the rows whose key it is (`keys[row]`), concurrently
    on `pool` when given. If any call failed, the answered rows are ended in their proposers."""
    rows_of: dict[K, list[int]] = {}
    for row, key in enumerate(keys):
        rows_of.setdefault(key, []).append(row)

    def call(key: K) -> tuple[list[DraftTree], float]:
        start = time.perf_counter()
        trees = proposer_of(key).propose([requests[row] for row in rows_of[key]])
        return trees, time.perf_counter() - start

    if pool is not None and len(rows_of) > 1:
        futures = {key: pool.submit(call, key) for key in rows_of}
        outcomes = {key: future.exception() or future.result() for key, future in futures.items()}
    else:
        outcomes = {}
        for key in rows_of:
            try:
                outcomes[key] = call(key)
            except Exception as exc:  # noqa: BLE001 - sorted out by the caller
                outcomes[key] = exc
    split: Split[K] = Split(rows_of, [None] * len(requests), {}, {})
    for key, outcome in outcomes.items():
        if isinstance(outcome, Exception):
            split.failures[key] = outcome
            continue
        trees, split.seconds[key] = outcome
        for row, tree in zip(rows_of[key], trees):
            split.trees[row] = tree
    if split.failures:
        for key in split.seconds:  # answered: their rows' tokens were taken
            ids = [requests[row].seq_id for row in rows_of[key]]
            try:
                proposer_of(key).end(ids)
            except Exception as exc:  # noqa: BLE001 - they restart from scratch anyway
                logger.warning("ending %d sequences after a failed batch failed: %s", len(ids),
                               exc)
    return split


def raise_failure(split: Split[K], requests: Sequence[DraftRequest],
                  is_lost: Callable[[Exception], bool] = lambda exc: False) -> None:
    """Raises for a split with failures: the first error that is neither `SequenceNotFound`
    nor lost by `is_lost` as it is, else `SequenceNotFound` naming the answered rows (ended
    by `propose_split`), the ids a proposer did not know, and every row of a lost proposer."""
    ids = [requests[row].seq_id for key in split.seconds for row in split.rows_of[key]]
    for key, exc in split.failures.items():
        if isinstance(exc, SequenceNotFound):
            ids.extend(exc.seq_ids)
        elif is_lost(exc):
            ids.extend(requests[row].seq_id for row in split.rows_of[key])
        else:
            raise exc
    raise SequenceNotFound(ids)

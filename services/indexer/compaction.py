"""Size-tiered compaction of the live datastore's shards (an LSM tree of suffix arrays).

Every build writes the new conversations into a new small shard, so a build costs what its
own tokens cost, whatever the size of the datastore. Small shards are merged in the background.
A shard of n tokens is in tier 0 while n < base * fanout and in tier t when
base * fanout^t <= n < base * fanout^(t+1). Only neighbours are merged (the manifest keeps the
order in which conversations arrived), and the plan keeps the shards' tiers non-increasing from
oldest to newest with fewer than `fanout` shards per tier:

1. a shard bigger (in tier) than the one before it takes in the smaller shards just before it
   (a build larger than the previous ones; their tokens climb to its tier);
2. `fanout` neighbours of one tier become one shard of the next tier, lowest tier first.

So the number of shards stays near (fanout - 1) per tier, and a token is re-indexed a few times
per tier it climbs: about log_fanout(shard_tokens / base) tiers over its life, independent of
how big the datastore is. No merge produces a shard above `shard_tokens`: shards that cannot be
merged without passing it are final (sealed).

`plan_merge` plans; a `Compactor` carries the plan out on the live datastore (builder.py's
`ShardStore`) and publishes the result through the same atomic manifest as a build. A merge
changes which shards hold the documents, never which documents are held nor their order.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sssd.datastore.manifest import Manifest, write_manifest
from sssd.datastore.shard import read_meta, write_shard
from sssd.indexer.builder import ShardStore

logger = logging.getLogger(__name__)

MERGE_POINTS = ("during_merge", "after_merge_build", "after_merge_manifest")


def tier(num_tokens: int, base_tokens: int, fanout: int) -> int:
    """The size tier of a shard of `num_tokens` tokens."""
    level, limit = 0, base_tokens * fanout
    while num_tokens >= limit:
        level += 1
        limit *= fanout
    return level


def plan_merge(sizes: Sequence[int], base_tokens: int, fanout: int,
               shard_tokens: int) -> tuple[int, int] | None:
    """The next merge for shards of these sizes (manifest order, oldest first) as a slice
    (start, stop) of neighbours, or None when nothing is due (see the module's rules)."""
    if fanout < 2:
        raise ValueError("fanout must be >= 2")
    tiers = [tier(size, base_tokens, fanout) for size in sizes]

    def fits(start: int, stop: int) -> bool:
        return stop - start >= 2 and sum(sizes[start:stop]) <= shard_tokens

    for i in range(1, len(sizes)):  # rule 1: a bigger shard after smaller ones
        if tiers[i] <= tiers[i - 1]:
            continue
        j = i - 1
        while j > 0 and tiers[j - 1] < tiers[i]:
            j -= 1
        if fits(j, i + 1):
            return j, i + 1
        if fits(j, i):  # too big with it: the small ones among themselves
            return j, i
    best: tuple[int, int] | None = None  # rule 2: (tier, start) of a full tier
    for start in range(len(sizes) - fanout + 1):
        window = tiers[start:start + fanout]
        if any(t != window[0] for t in window) or not fits(start, start + fanout):
            continue
        if best is None or window[0] < best[0]:
            best = (window[0], start)
    if best is None:
        return None
    return best[1], best[1] + fanout


@dataclass
class MergeStats:
    merges: int = 0
    tokens_merged: int = 0  # tokens re-indexed by merges (the compaction's write amplification)
    last_merge_s: float = 0.0


class Compactor:
    """Merges the live datastore's shards as `plan_merge` says, one run at a time."""

    def __init__(self, store: ShardStore, base_tokens: int, fanout: int) -> None:
        self.store = store
        self.base_tokens = base_tokens
        self.fanout = fanout
        self.stats = MergeStats()

    def merge_once(self) -> Manifest | None:
        """Merges one run of same-tier shards if one is due and publishes the manifest with
        the merged shard in their place; None when nothing is due. The heavy part (the suffix
        array) runs without the lock, so builds go on meanwhile."""
        store = self.store
        with store.lock:
            manifest = store.manifest
            run = plan_merge([store.size(name) for name in manifest.shards], self.base_tokens,
                             self.fanout, store.shard_tokens)
            if run is None:
                return None
            sources = list(manifest.shards[run[0]:run[1]])
            name = store.allocate(manifest)
        start = time.perf_counter()
        metas = [read_meta(store.directory / source) for source in sources]
        merged = np.concatenate([np.fromfile(store.directory / source / "tokens.u32",
                                             dtype="<u4") for source in sources])
        store.fault("during_merge", store.directory / name, merged)
        # A merge keeps the weight only if every source is the model's text (a run that
        # includes a corpus shard is weighted like the corpus).
        origin = "model" if all(m.origin == "model" for m in metas) else "corpus"
        write_shard(store.directory / name, merged, store.vocab_size,
                    store.tokenizer_fingerprint, source_first=metas[0].source_first,
                    source_last=metas[-1].source_last, origin=origin)
        store.fault("after_merge_build", store.directory / name, merged)
        with store.lock:
            current = store.manifest  # builds may have added shards after the sources
            names = list(current.shards)
            at = _find_run(names, sources)
            if at is None:  # retention dropped some of them meanwhile: the merge is moot
                shutil.rmtree(store.directory / name, ignore_errors=True)
                return None
            names[at:at + len(sources)] = [name]
            store.record_size(name, int(merged.shape[0]))
            new_manifest = current.next(tuple(names), current.last_entry_id)
            write_manifest(store.directory, new_manifest)
            store.fault("after_merge_manifest", store.directory, merged)
            store.retire(sources)
        self.stats.merges += 1
        self.stats.tokens_merged += int(merged.shape[0])
        self.stats.last_merge_s = time.perf_counter() - start
        logger.info("manifest v%d: merged %d shards (%d tokens) into %s in %.2f s",
                    new_manifest.version, len(sources), merged.shape[0], name,
                    self.stats.last_merge_s)
        return new_manifest

    def merge_all(self) -> int:
        """Merges until nothing is due (tests, benchmarks); returns the number of merges."""
        count = 0
        while self.merge_once() is not None:
            count += 1
        return count


def _find_run(names: list[str], run: list[str]) -> int | None:
    """Where `run` sits, contiguous, in `names`; None if it does not."""
    if run[0] not in names:
        return None
    at = names.index(run[0])
    return at if names[at:at + len(run)] == run else None

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

This module only plans; the indexer (indexer.py) executes the plan and publishes the result.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def keep_newest(sizes: Sequence[int], max_tokens: int) -> int:
    """How many of the oldest shards leave so that the rest hold at most `max_tokens` tokens
    (the newest shard always stays)."""
    total, drop = sum(sizes), 0
    while drop < len(sizes) - 1 and total > max_tokens:
        total -= sizes[drop]
        drop += 1
    return drop

"""Plain-Python reference of the SSSD drafter ("SSSD: Simply-Scalable Speculative Decoding",
arXiv 2411.05894, Appendix A, Algorithms 1-3).

This module follows docs/algorithm.md line by line and favours being obviously right over being
fast: the suffix array is a plain sort, the range lookup a bisect, the queue a heapq. Property
tests compare the C++ core (`sssd._core`) with it node for node, so every floating-point product
is written in the order that docs/algorithm.md prescribes.
"""

from __future__ import annotations

import bisect
import heapq
import struct
from dataclasses import dataclass, field

from sssd.drafter.config import DraftParams as ConfiguredParams

DOCUMENT_SEPARATOR = 0xFFFFFFFF  # ends every document of a shard; sorts above every token

_DEFAULTS = ConfiguredParams()
Shard = tuple[list[int], list[int]]  # (stream [num_tokens], suffix_array [num_tokens])


@dataclass(frozen=True)
class DraftParams:
    """The constants of the algorithm; the same fields and checks as C++ `DrafterParams`,
    written again here, and its defaults (taken from the service's configuration, which takes
    them from the core: one definition)."""

    prefix_len: int = _DEFAULTS.prefix_len  # P: longest suffix used as a lookup key
    branch_len: int = _DEFAULTS.branch_len  # input-trie window; longest continuation
    max_continuations: int = _DEFAULTS.max_continuations  # datastore samples per prefix length
    min_continuations: int = _DEFAULTS.min_continuations  # shorten the prefix below this
    datastore_discount: float = _DEFAULTS.datastore_discount  # first level, datastore
    input_discount: float = _DEFAULTS.input_discount  # first level, input tries
    datastore_child_discount: float = _DEFAULTS.datastore_child_discount  # deeper, datastore
    # input child discount = base + per_match * m
    input_child_discount_base: float = _DEFAULTS.input_child_discount_base
    input_child_discount_per_match: float = _DEFAULTS.input_child_discount_per_match
    copy_min_match: int = _DEFAULTS.copy_min_match  # copy source (not in the paper); 0: off
    copy_len: int = _DEFAULTS.copy_len  # longest copy chain
    copy_discount: float = _DEFAULTS.copy_discount  # first level, copy chain
    copy_child_discount: float = _DEFAULTS.copy_child_discount  # deeper, copy chain

    def __post_init__(self) -> None:
        if not 1 <= self.prefix_len <= 64:
            raise ValueError(f"prefix_len must be in [1, 64], got {self.prefix_len}")
        if not 1 <= self.branch_len <= 64:
            raise ValueError(f"branch_len must be in [1, 64], got {self.branch_len}")
        if self.prefix_len > self.branch_len:
            raise ValueError("prefix_len must not exceed branch_len")
        if self.max_continuations < 0:
            raise ValueError("max_continuations must be >= 0")
        if self.min_continuations < 0:
            raise ValueError("min_continuations must be >= 0")
        discounts = (self.datastore_discount, self.input_discount, self.datastore_child_discount,
                     self.input_child_discount_base, self.input_child_discount_per_match)
        if not all(0.0 < d <= 1.0 for d in discounts[:4]):
            raise ValueError("discounts must be in (0, 1]")
        if not 0.0 <= self.input_child_discount_per_match <= 1.0:
            raise ValueError("input_child_discount_per_match must be in [0, 1]")
        largest = (self.input_child_discount_base
                   + self.input_child_discount_per_match * self.prefix_len)
        if largest > 1.0 + 1e-12:
            raise ValueError("input_child_discount_base + input_child_discount_per_match * "
                             f"prefix_len must be <= 1, got {largest}")
        if not 0 <= self.copy_min_match <= 64:
            raise ValueError("copy_min_match must be in [0, 64] (0: off)")
        if not 1 <= self.copy_len <= 256:
            raise ValueError("copy_len must be in [1, 256]")
        if not all(0.0 < d <= 1.0 for d in (self.copy_discount, self.copy_child_discount)):
            raise ValueError("copy discounts must be in (0, 1]")


@dataclass
class CountNode:
    """A node of a counted tree (input trie or datastore tree); children keyed by token."""

    token: int
    count: int = 0
    children: dict[int, CountNode] = field(default_factory=dict)

    def child(self, token: int) -> CountNode:
        """The child holding `token`, created with count 0 if missing."""
        if token not in self.children:
            self.children[token] = CountNode(token)
        return self.children[token]

    def sorted_children(self) -> list[CountNode]:
        """Children in ascending token order, the order in which Algorithm 3 visits them."""
        return [self.children[t] for t in sorted(self.children)]

    def canonical(self) -> tuple:
        """(token, count, (children...)) with children ascending: equal trees, equal values."""
        return (self.token, self.count, tuple(c.canonical() for c in self.sorted_children()))


def insert_path(root: CountNode, tokens: list[int], weight: int = 1) -> None:
    """Adds `weight` to `root` and to every node along `tokens` (missing nodes start at 0)."""
    root.count += weight
    node = root
    for token in tokens:
        node = node.child(token)
        node.count += weight


# --- Input trie (Algorithm 1) ---------------------------------------------------------------------


class InputTrie:
    """Windows of `branch_len` tokens of the sequence, counted; the root is virtual (token -1).

    Every window start passes through the root, so the root counts the windows (= tokens).
    """

    def __init__(self, branch_len: int):
        self.branch_len = branch_len
        self.tokens: list[int] = []
        self.root = CountNode(-1)

    def append(self, tokens: list[int]) -> None:
        """Extends the windows that end at each new token; equal to a rebuild from scratch."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            self.root.count += 1  # the window starting at this token
            for start in range(max(0, end - self.branch_len), end):
                node = self.root
                for earlier in self.tokens[start:end - 1]:
                    node = node.children[earlier]  # the window's shorter version exists already
                node.child(token).count += 1

    def match(self, prefix_len: int) -> list[tuple[CountNode, int]]:
        """Algorithm 1: (node, m) for m = len(prefix) down to 1 where prefix[-m:] is in the trie."""
        prefix = self.tokens[-prefix_len:]
        matches = []
        for m in range(len(prefix), 0, -1):
            node: CountNode | None = self.root
            for token in prefix[-m:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None:
                matches.append((node, m))
        return matches


def copy_match(sequence: list[int], min_len: int, branch_len: int) -> tuple[int, int] | None:
    """(end, m) of the copy source (docs/algorithm.md, Copy source): for m from
    min(branch_len, len - 1) down to min_len, the latest end < len at which the last m tokens
    occurred before; None if no such m."""
    n = len(sequence)
    for m in range(min(branch_len, n - 1), max(min_len, 1) - 1, -1):
        for end in range(n - 1, m - 1, -1):
            if sequence[end - m:end] == sequence[n - m:]:
                return end, m
    return None


def copy_chain(sequence: list[int], params: DraftParams) -> list[int]:
    """The copy source's tokens: what followed the copy match, at most copy_len; [] if none."""
    found = (copy_match(sequence, params.copy_min_match, params.branch_len)
             if params.copy_min_match > 0 else None)
    return [] if found is None else sequence[found[0]:found[0] + params.copy_len]


def build_trie(sequence: list[int], branch_len: int) -> InputTrie:
    """The input trie of a whole sequence, every window inserted from the root."""
    trie = InputTrie(branch_len)
    trie.root.count = len(sequence)
    for start in range(len(sequence)):
        node = trie.root
        for token in sequence[start:start + branch_len]:
            node = node.child(token)
            node.count += 1
    trie.tokens = list(sequence)
    return trie


# --- Datastore (Algorithm 2) ----------------------------------------------------------------------


def build_stream(documents: list[list[int]]) -> list[int]:
    """A shard's token stream: every document followed by the separator."""
    stream: list[int] = []
    for document in documents:
        stream.extend(document)
        stream.append(DOCUMENT_SEPARATOR)
    return stream


def suffix_array(stream: list[int]) -> list[int]:
    """Start positions sorted by suffix; a proper prefix sorts before its extensions."""
    return sorted(range(len(stream)), key=lambda position: stream[position:])


def bucket_starts(stream: list[int], vocab_size: int) -> list[int]:
    """[vocab_size + 2]: the first suffix-array row of each first token, then of the separator
    block (index vocab_size), then len(stream)."""
    counts = [0] * (vocab_size + 1)
    for token in stream:
        counts[vocab_size if token == DOCUMENT_SEPARATOR else token] += 1
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return starts


def find_range(stream: list[int], sa: list[int], query: list[int]) -> tuple[int, int]:
    """Rows [lo, hi) of `sa` whose suffixes start with `query`.

    Cutting every suffix to len(query) tokens keeps the rows sorted, so two bisects find the block;
    a suffix shorter than the query is cut to a proper prefix of it and never matches.
    """
    length = len(query)
    key = tuple(query)

    def head(position: int) -> tuple[int, ...]:
        return tuple(stream[position:position + length])

    lo = bisect.bisect_left(sa, key, key=head)
    hi = bisect.bisect_right(sa, key, lo=lo, key=head)
    return lo, hi


def apportion(total: int, sizes: list[int]) -> list[int]:
    """Largest-remainder split of `total` over shards in proportion to `sizes` (docs/algorithm.md).

    docs/algorithm.md leaves N = 0 (all shards empty) open; like the C++ core, every quota is
    then 0.
    """
    num_tokens = sum(sizes)
    if num_tokens <= 0 or total <= 0:
        return [0] * len(sizes)
    quotas = [(total * n) // num_tokens for n in sizes]
    remainders = [(total * n) % num_tokens for n in sizes]
    by_remainder = sorted(range(len(sizes)), key=lambda s: (-remainders[s], s))
    for s in by_remainder[:total - sum(quotas)]:
        quotas[s] += 1
    return quotas


def continuation(stream: list[int], position: int, branch_len: int) -> list[int]:
    """stream[position : position + branch_len], cut before the first separator."""
    tokens = []
    for token in stream[position:position + branch_len]:
        if token == DOCUMENT_SEPARATOR:
            break
        tokens.append(token)
    return tokens


def collect(sequence: list[int], shards: list[Shard], params: DraftParams,
            weights: list[int] | None = None) -> CountNode:
    """Algorithm 2: the weighted tree of sampled continuations; its root is sequence[-1].

    `weights` (one integer >= 1 per shard, default 1): see "Shard weights" in docs/algorithm.md.
    """
    weights = weights or [1] * len(shards)
    if len(weights) != len(shards) or not all(1 <= w <= 1000 for w in weights):
        raise ValueError("one weight in [1, 1000] per shard")
    tree = CountNode(sequence[-1])
    quotas = apportion(params.max_continuations,
                       [len(stream) * w for (stream, _), w in zip(shards, weights)])
    prefix = sequence[-params.prefix_len:]
    for length in range(len(prefix), 0, -1):
        if tree.count >= params.min_continuations:  # the root counts the continuations
            break
        query = prefix[-length:]
        for (stream, sa), quota, weight in zip(shards, quotas, weights):
            if quota == 0:
                continue
            lo, hi = find_range(stream, sa, query)
            if lo == hi:
                continue
            samples = min(quota, hi - lo)  # spread evenly over the whole range
            for k in range(samples):
                position = sa[lo + k * (hi - lo) // samples] + length
                insert_path(tree, continuation(stream, position, params.branch_len), weight)
    return tree


# --- Merge (Algorithm 3) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A candidate tree for the merge: the subtree under `root`, with its discounts."""

    root: CountNode
    discount: float  # factor on first-level priorities
    child_discount: float  # factor per level below the first
    # Input tries: a child's probability is its count over the children's total, so that the
    # occurrence ending the sequence (no continuation yet) does not count.
    over_children: bool = False

    def total(self, node: CountNode) -> int:
        """What the probabilities of `node`'s children divide by."""
        if self.over_children:
            return sum(c.count for c in node.children.values())
        return node.count


def make_sources(datastore_tree: CountNode | None, matches: list[tuple[CountNode, int]],
                 params: DraftParams, copy_tokens: list[int] | None = None) -> list[Source]:
    """The datastore tree if it has a child, then the input matches, longest first, then the
    copy chain if it has a token."""
    sources = []
    if datastore_tree is not None and datastore_tree.children:
        sources.append(Source(datastore_tree, params.datastore_discount,
                              params.datastore_child_discount))
    for node, m in matches:
        child_discount = (params.input_child_discount_base
                          + params.input_child_discount_per_match * m)
        sources.append(Source(node, params.input_discount, child_discount, over_children=True))
    if copy_tokens:
        chain = CountNode(-1)
        insert_path(chain, copy_tokens)
        sources.append(Source(chain, params.copy_discount, params.copy_child_discount,
                              over_children=True))
    return sources


def to_float32(value: float) -> float:
    """The float32 nearest to `value` (what `static_cast<float>` gives), as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def merge(sources: list[Source], root_token: int, dec_len: int
          ) -> tuple[list[int], list[int], list[float]]:
    """Algorithm 3: pops the highest priority (then the deeper node, then the earlier push) until
    the draft tree holds `dec_len` nodes, root included."""
    token_ids, parents, probs = [root_token], [-1], [1.0]
    children: dict[tuple[int, int], int] = {}  # (parent draft node, token) -> draft node
    heap: list[tuple] = []
    pushes = 0

    def push(priority: float, depth: int, source: Source, node: CountNode, parent: int) -> None:
        nonlocal pushes
        heapq.heappush(heap, (-priority, -depth, pushes, source, node, parent))
        pushes += 1

    for source in sources:
        for c in source.root.sorted_children():
            push((c.count / source.total(source.root)) * source.discount, 1, source, c, 0)

    while heap and len(token_ids) < dec_len:
        negative_priority, negative_depth, _, source, node, parent = heapq.heappop(heap)
        priority, depth = -negative_priority, -negative_depth
        draft_node = children.get((parent, node.token))
        if draft_node is None:  # a reused node keeps its first probability
            draft_node = len(token_ids)
            children[(parent, node.token)] = draft_node
            token_ids.append(node.token)
            parents.append(parent)
            probs.append(to_float32(priority))
        for c in node.sorted_children():
            push((c.count / source.total(node)) * priority * source.child_discount, depth + 1,
                 source, c, draft_node)
    return token_ids, parents, probs


# --- Entry point ----------------------------------------------------------------------------------


def propose(sequence: list[int], shards: list[Shard], budget: int, params: DraftParams,
            weights: list[int] | None = None) -> tuple[list[int], list[int], list[float]]:
    """One draft tree of at most `budget` nodes (root included) for a non-empty sequence.

    Returns (token_ids, parents, probs) in insertion order, probs rounded to float32.
    """
    if not sequence:
        raise ValueError("the sequence is empty")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    datastore_tree = collect(sequence, shards, params, weights) if shards else None
    matches = build_trie(sequence, params.branch_len).match(params.prefix_len)
    copy_tokens = copy_chain(sequence, params) if budget > 1 else []
    return merge(make_sources(datastore_tree, matches, params, copy_tokens), sequence[-1], budget)

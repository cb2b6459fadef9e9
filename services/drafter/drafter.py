"""The in-process SSSD drafter: per-sequence input tries plus the shared datastore.

This is the pure core of the drafter service: the gRPC servicer only translates messages into
`DraftRequest`s and exceptions into status codes. Every input is validated before any state
changes, so a refused call leaves the drafter exactly as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sssd import _core
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import CapacityError, DraftRequest, SequenceNotFound
from sssd.drafter.config import DrafterConfig
from sssd.drafter.watcher import DatastoreWatcher


@dataclass
class _Sequence:
    trie: _core.InputTrie
    num_tokens: int


class LocalDrafter:
    """The in-process SSSD `Proposer` (sssd.common.drafting.proposer). Call `start()` first (or
    use it as a context manager): it loads the datastore and watches its manifest.

        with LocalDrafter(DrafterConfig(datastore_dir="var/ds", vocab_size=49152)) as drafter:
            trees = drafter.propose([DraftRequest("seq-1", prompt_ids, 8, is_start=True)])
    """

    sources = ("sssd",)
    hindsight_drafts = True  # trees are best-first and cheap: see sssd.common.drafting.proposer

    def __init__(self, config: DrafterConfig, core: _core.BatchDrafter | None = None) -> None:
        """`core`: the C++ batch drafter its calls go to (default: one made from `config`); a
        benchmark passes one wrapped to time the C++ call apart from this layer."""
        self.config = config
        self._is_started = False
        self._is_closed = False
        self._core = core if core is not None else \
            _core.BatchDrafter(config.params.to_core(), config.resolved_num_threads)
        self._sequences: dict[str, _Sequence] = {}
        self._lock = threading.Lock()
        self.watcher: DatastoreWatcher | None = None
        if config.datastore_dir is not None:
            self.watcher = DatastoreWatcher(
                config.datastore_dir,
                vocab_size=config.vocab_size,
                max_continuations=config.params.max_continuations,
                tokenizer_fingerprint=config.tokenizer_fingerprint,
                verify_checksums=config.verify_checksums,
                poll_interval_s=config.poll_interval_s,
                model_shard_weight=config.model_shard_weight,
            )

    def start(self) -> "LocalDrafter":
        """Loads the datastore and starts watching its manifest."""
        if self.watcher is not None:
            self.watcher.start()
        self._is_started = True
        return self

    def close(self) -> None:
        """Stops the watcher and releases the datastore; `propose` is refused afterwards."""
        self._is_closed = True
        if self.watcher is not None:
            self.watcher.close()

    def __enter__(self) -> "LocalDrafter":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """Appends each request's tokens to its sequence and drafts a tree per request.

        Raises ValueError for malformed input, SequenceNotFound for continuations of unknown
        sequences, CapacityError when too many sequences are live; nothing changes on error.
        RuntimeError before `start()`: without it the datastore was never loaded and every
        tree would silently come from the input trie alone.
        """
        if self._is_closed:
            raise RuntimeError("this drafter is closed: its datastore was released")
        if not self._is_started:
            raise RuntimeError("LocalDrafter.start() was not called: the datastore is not loaded "
                               "yet (call start(), or use the drafter as a context manager)")
        new_tokens, cu_num_new_tokens, budgets = self._validate(requests)
        offsets = cu_num_new_tokens.tolist()
        num_new_tokens = [end - begin for begin, end in zip(offsets[:-1], offsets[1:])]
        with self._lock:
            missing = [r.seq_id for r in requests
                       if not r.is_start and r.seq_id not in self._sequences]
            if missing:
                raise SequenceNotFound(missing)
            num_new = sum(1 for r in requests if r.seq_id not in self._sequences)
            if len(self._sequences) + num_new > self.config.max_sequences:
                raise CapacityError(
                    f"{len(self._sequences)} live sequences + {num_new} new exceeds "
                    f"max_sequences={self.config.max_sequences}; end finished sequences first"
                )
            tries = []
            for request, num_tokens in zip(requests, num_new_tokens):
                if request.is_start:
                    # A fresh trie replaces the old state only after the call succeeds.
                    tries.append(_core.InputTrie(self.config.params.branch_len))
                    continue
                state = self._sequences[request.seq_id]
                if state.num_tokens + num_tokens > self.config.max_tokens_per_sequence:
                    raise ValueError(
                        f"sequence {request.seq_id!r} would hold "
                        f"{state.num_tokens + num_tokens} tokens, more than "
                        f"max_tokens_per_sequence={self.config.max_tokens_per_sequence}"
                    )
                tries.append(state.trie)

        datastore = self.watcher.current if self.watcher is not None else None
        token_ids, parents, probs, cu_num_nodes = self._core.propose(
            datastore.core if datastore is not None else None,
            tries, new_tokens, cu_num_new_tokens, budgets,
        )

        with self._lock:
            for request, num_tokens, trie in zip(requests, num_new_tokens, tries):
                if request.is_start:
                    self._sequences[request.seq_id] = _Sequence(trie, num_tokens)
                else:
                    state = self._sequences.get(request.seq_id)
                    if state is not None and state.trie is trie:
                        state.num_tokens += num_tokens
        return [
            DraftTree(token_ids[begin:end], parents[begin:end], probs[begin:end])
            for begin, end in zip(cu_num_nodes[:-1].tolist(), cu_num_nodes[1:].tolist())
        ]

    def _validate(
        self, requests: Sequence[DraftRequest]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Returns new_tokens [num_tokens] int32, cu_num_new_tokens [num_seqs + 1], budgets."""
        config = self.config
        if not requests:
            raise ValueError("empty batch: send at least one sequence")
        if len(requests) > config.max_batch_size:
            raise ValueError(
                f"batch of {len(requests)} sequences exceeds max_batch_size={config.max_batch_size}"
            )
        seen: set[str] = set()
        token_arrays: list[np.ndarray] = []
        offsets = [0]  # becomes cu_num_new_tokens
        total = 0
        budgets = np.empty(len(requests), dtype=np.int32)
        for row, request in enumerate(requests):
            if not request.seq_id:
                raise ValueError(f"row {row}: seq_id must be a non-empty string")
            if request.seq_id in seen:
                raise ValueError(f"seq_id {request.seq_id!r} appears twice in one batch")
            seen.add(request.seq_id)
            if not 1 <= request.budget <= config.max_budget:
                raise ValueError(
                    f"seq_id {request.seq_id!r}: budget {request.budget} outside "
                    f"[1, {config.max_budget}]"
                )
            budgets[row] = request.budget
            tokens = np.asarray(request.token_ids)
            if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
                raise ValueError(f"seq_id {request.seq_id!r}: token_ids must be a flat list of "
                                 "ints")
            if request.is_start and tokens.size == 0:
                raise ValueError(f"seq_id {request.seq_id!r}: is_start needs the full context, got "
                                 "no tokens")
            if tokens.size > config.max_tokens_per_sequence:
                raise ValueError(
                    f"seq_id {request.seq_id!r}: {tokens.size} tokens exceed "
                    f"max_tokens_per_sequence={config.max_tokens_per_sequence}"
                )
            token_arrays.append(tokens)
            total += tokens.shape[0]
            offsets.append(total)
        cu_num_new_tokens = np.array(offsets, dtype=np.int64)
        # One vectorized range check for the whole batch; the slow path only names the culprit.
        new_tokens = token_arrays[0] if len(token_arrays) == 1 else np.concatenate(token_arrays)
        if new_tokens.size and (new_tokens.min() < 0 or new_tokens.max() >= config.vocab_size):
            first_bad = int(np.flatnonzero((new_tokens < 0) | (new_tokens >= config.vocab_size))[0])
            row = int(np.searchsorted(cu_num_new_tokens, first_bad, side="right")) - 1
            raise ValueError(
                f"seq_id {requests[row].seq_id!r}: token id {int(new_tokens[first_bad])} outside "
                f"the vocabulary [0, {config.vocab_size})"
            )
        return new_tokens.astype(np.int32, copy=False), cu_num_new_tokens, budgets

    def end(self, seq_ids: Iterable[str]) -> int:
        """Frees the state of finished sequences; unknown ids are ignored. Returns how many."""
        with self._lock:
            return sum(self._sequences.pop(seq_id, None) is not None for seq_id in seq_ids)

    def stats(self) -> dict[str, dict[str, float]]:
        return {}

    @property
    def tokenizer_fingerprint(self) -> str | None:
        """The tokenizer this drafter's tokens are of: configured, else its datastore's."""
        if self.config.tokenizer_fingerprint is not None or self.watcher is None:
            return self.config.tokenizer_fingerprint
        return self.watcher.tokenizer_fingerprint

    def info(self) -> dict:
        current = self.watcher.current if self.watcher is not None else None
        return {
            "vocab_size": self.config.vocab_size,
            "tokenizer_fingerprint": self.tokenizer_fingerprint or "",
            "manifest_version": current.manifest.version if current else 0,
            "num_shards": len(current.shards) if current else 0,
            "num_datastore_tokens": current.num_tokens if current else 0,
            "num_sequences": self.num_sequences,
            "max_batch_size": self.config.max_batch_size,
            "max_budget": self.config.max_budget,
        }

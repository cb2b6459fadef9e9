"""Configuration of the drafter service: one frozen object, built once at the entry point."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from sssd import _core
from sssd.common.config.flags import add_flags, from_args, option
from sssd.common.rpc.ports import DRAFTER_PORT
from sssd.common.rpc.tls import add_tls_flags, tls_from_args

ENV_PREFIX = "SSSD_DRAFTER_"


# The defaults live in one place, the C++ core (services/drafter/core/params.h).
_CORE_DEFAULTS = _core.DrafterParams()


@dataclass(frozen=True)
class DraftParams:
    """Algorithm constants (docs/algorithm.md); the defaults are the C++ core's: the paper's
    except branch_len and datastore_child_discount, tuned on held-out data, and the copy
    source's, which the paper does not have."""

    prefix_len: int = option(_CORE_DEFAULTS.prefix_len,
                             "P: longest suffix of the sequence used as a lookup key")
    branch_len: int = option(_CORE_DEFAULTS.branch_len,
                             "input-trie window and longest datastore continuation, tokens")
    max_continuations: int = option(_CORE_DEFAULTS.max_continuations,
                                    "datastore samples per prefix length, over all shards")
    min_continuations: int = option(
        _CORE_DEFAULTS.min_continuations,
        "shorten the datastore prefix while fewer continuations were sampled")
    datastore_discount: float = option(_CORE_DEFAULTS.datastore_discount,
                                       "first-level discount of datastore candidates")
    input_discount: float = option(_CORE_DEFAULTS.input_discount,
                                   "first-level discount of input-trie candidates")
    datastore_child_discount: float = option(_CORE_DEFAULTS.datastore_child_discount,
                                             "child discount of datastore candidates")
    input_child_discount_base: float = option(
        _CORE_DEFAULTS.input_child_discount_base,
        "child discount of input-trie candidates at match length 0")
    input_child_discount_per_match: float = option(
        _CORE_DEFAULTS.input_child_discount_per_match,
        "added to the input-trie child discount per matched token")
    copy_min_match: int = option(
        _CORE_DEFAULTS.copy_min_match,
        "copy source: draft what followed the latest earlier occurrence of the last N or more "
        "tokens as one chain (not in the paper); 0: off")
    copy_len: int = option(_CORE_DEFAULTS.copy_len, "copy source: longest chain, tokens")
    copy_discount: float = option(_CORE_DEFAULTS.copy_discount,
                                  "copy source: first-level discount")
    copy_child_discount: float = option(_CORE_DEFAULTS.copy_child_discount,
                                        "copy source: discount per level below the first")

    def __post_init__(self) -> None:
        problem = self.to_core().validate()
        if problem:
            raise ValueError(problem)

    def to_core(self) -> _core.DrafterParams:
        params = _core.DrafterParams()
        for name, value in dataclasses.asdict(self).items():
            setattr(params, name, value)
        return params


@dataclass(frozen=True)
class DrafterConfig:
    """Everything the drafter service reads; invalid values raise ValueError here."""

    datastore_dir: str | None = option(
        None, "directory of manifest.json and the shards; unset: the input trie only")
    vocab_size: int = option(
        49152, "token ids must be below it (SmolLM2-135M: 49152); shards of another size are "
        "refused")
    tokenizer_fingerprint: str | None = option(
        None, "when set, shards built with another tokenizer are refused at load; unset: the "
        "first datastore's tokenizer is kept")
    num_threads: int = option(0, "threads of the batch call, the caller included; 0: one per "
                              "CPU core")
    max_batch_size: int = option(256, "sequences per Propose call")
    max_budget: int = option(256, "largest speculation budget (draft-tree nodes, root included)")
    max_sequences: int = option(8192, "live sequence states; more is RESOURCE_EXHAUSTED")
    max_tokens_per_sequence: int = option(1 << 20, "tokens a sequence may accumulate")
    poll_interval_s: float = option(1.0, "seconds between checks of the manifest for a new "
                                    "version")
    verify_checksums: bool = option(True, "hash every shard file at load")
    model_shard_weight: int = option(
        5, "weight of shards of the served model's own text (live datastore, self-outputs) "
        "against 1 for an offline corpus: their share of the datastore samples and the count "
        "of each (docs/algorithm.md, shard weights); 1: the paper's algorithm")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(DRAFTER_PORT, "port to bind; 0: the OS picks a free port")
    max_workers: int = option(8, "gRPC server threads")
    grace_s: float = option(5.0, "graceful-shutdown window on SIGTERM, seconds")
    params: DraftParams = field(default_factory=DraftParams)

    def __post_init__(self) -> None:
        checks = [
            (self.vocab_size >= 1, "vocab_size must be >= 1"),
            (self.vocab_size < _core.DOCUMENT_SEPARATOR, "vocab_size must be < 2^32 - 1"),
            (self.num_threads >= 0, "num_threads must be >= 0 (0: one per core)"),
            (1 <= self.max_batch_size <= 65536, "max_batch_size must be in [1, 65536]"),
            (1 <= self.max_budget <= 4096, "max_budget must be in [1, 4096]"),
            (self.max_sequences >= 1, "max_sequences must be >= 1"),
            (self.max_tokens_per_sequence >= 1, "max_tokens_per_sequence must be >= 1"),
            (self.poll_interval_s > 0, "poll_interval_s must be > 0"),
            (1 <= self.model_shard_weight <= _core.MAX_SHARD_WEIGHT,
             f"model_shard_weight must be in [1, {_core.MAX_SHARD_WEIGHT}]"),
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (self.max_workers >= 1, "max_workers must be >= 1"),
            (self.grace_s >= 0, "grace_s must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def resolved_num_threads(self) -> int:
        return self.num_threads or (os.cpu_count() or 1)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "DrafterConfig":
        """Flags override SSSD_DRAFTER_* environment variables, which override defaults."""
        parser = argparse.ArgumentParser(
            prog="sssd-drafter",
            description="SSSD drafter service (gRPC): draft trees from the input trie and the "
            "suffix-array datastore.",
        )
        add_flags(parser, cls, env_prefix=ENV_PREFIX)
        add_flags(parser.add_argument_group("algorithm constants (docs/algorithm.md)"),
                  DraftParams,
                  env_prefix=ENV_PREFIX)
        add_tls_flags(parser)
        args = parser.parse_args(argv)
        try:
            tls_from_args(args)  # the server binds with it (sssd.common.rpc.tls)
            return from_args(cls, args, params=from_args(DraftParams, args))
        except ValueError as exc:
            parser.error(str(exc))

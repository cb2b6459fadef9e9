"""Configuration of the drafter service: one frozen object, built once at the entry point."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from sssd.drafter import _core

ENV_PREFIX = "SSSD_DRAFTER_"


@dataclass(frozen=True)
class DraftParams:
    """Algorithm constants (ALGORITHM.md); the defaults are the paper's."""

    prefix_len: int = 4  # P: longest suffix of the sequence used as a lookup key
    branch_len: int = 8  # input-trie window and longest datastore continuation, in tokens
    max_continuations: int = 100  # datastore samples per prefix length, over all shards
    min_tree_nodes: int = 50  # shorten the datastore prefix while its tree is smaller
    datastore_discount: float = 1.0
    input_discount: float = 0.6
    datastore_child_discount: float = 1.0
    input_child_discount_base: float = 0.6
    input_child_discount_per_match: float = 0.1

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

    # Directory holding manifest.json and the shard directories; None: input trie only.
    datastore_dir: str | None = None
    # Token ids must be < vocab_size (SmolLM2-135M: 49152). Shards of another size are refused.
    vocab_size: int = 49152
    # When set, shards built with another tokenizer are refused at load.
    tokenizer_fingerprint: str | None = None
    # Threads of the batch call, the caller included; 0 means one per CPU core.
    num_threads: int = 0
    max_batch_size: int = 256  # sequences per Propose call
    max_budget: int = 256  # largest speculation budget (draft-tree nodes, root included)
    max_sequences: int = 8192  # live sequence states; more is RESOURCE_EXHAUSTED
    max_tokens_per_sequence: int = 1 << 20  # tokens a sequence may accumulate
    poll_interval_s: float = 1.0  # how often the manifest is checked for a new version
    verify_checksums: bool = True  # hash every shard file at load
    host: str = "127.0.0.1"
    port: int = 50061  # 0: the OS picks a free port
    max_workers: int = 8  # gRPC server threads
    grace_s: float = 5.0  # graceful-shutdown window on SIGTERM
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
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name == "params":
                continue
            _add_flag(parser, f.name, getattr(defaults, f.name), f.type)
        for f in dataclasses.fields(DraftParams):
            _add_flag(parser, f.name, getattr(defaults.params, f.name), f.type)
        args = vars(parser.parse_args(argv))
        param_names = {f.name for f in dataclasses.fields(DraftParams)}
        params = DraftParams(**{k: v for k, v in args.items() if k in param_names})
        return cls(params=params, **{k: v for k, v in args.items() if k not in param_names})


def _add_flag(parser: argparse.ArgumentParser, name: str, default: object, type_name: str) -> None:
    env_name = ENV_PREFIX + name.upper()
    env_value = os.environ.get(env_name)
    flag = "--" + name.replace("_", "-")
    if "bool" in str(type_name):
        value = default if env_value is None else env_value.lower() in ("1", "true", "yes")
        parser.add_argument(flag, default=value, action=argparse.BooleanOptionalAction,
                            help=f"(env {env_name}; default {value})")
        return
    convert = float if "float" in str(type_name) else int if "int" in str(type_name) else str
    value = default if env_value is None else convert(env_value)
    parser.add_argument(flag, default=value, type=convert, help=f"(env {env_name}; default {value})")

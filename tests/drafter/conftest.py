"""Shared helpers for the drafter tests: the C++ core's objects built from plain lists.

The helpers are handed out as session fixtures (plain functions), so test modules need no package
and hypothesis tests can use them.
"""

from __future__ import annotations

import numpy as np
import pytest

from sssd import _core
from sssd.drafter import reference


def _core_shard(documents: list[list[int]], vocab_size: int) -> tuple[np.ndarray, ...]:
    """(stream, suffix_array, bucket_starts) uint32 arrays of one shard, built by the reference."""
    stream = reference.build_stream(documents)
    return (
        np.asarray(stream, dtype=np.uint32),  # [num_tokens]
        np.asarray(reference.suffix_array(stream), dtype=np.uint32),  # [num_tokens]
        # [vocab_size + 2]
        np.asarray(reference.bucket_starts(stream, vocab_size), dtype=np.uint32),
    )


def _core_params(params: reference.DraftParams) -> _core.DrafterParams:
    """The C++ DrafterParams with every field of `params`."""
    core = _core.DrafterParams()
    for name in reference.DraftParams.__dataclass_fields__:
        setattr(core, name, getattr(params, name))
    return core


def _core_tree(nodes: np.ndarray, index: int = 0) -> tuple:
    """Canonical (token, count, (children...)) of exported nodes [num_nodes, 4] (token, count,
    first_child, next_sibling), children in ascending token order."""
    token, count, child, _ = (int(v) for v in nodes[index])
    children = []
    while child != -1:
        children.append(_core_tree(nodes, child))
        child = int(nodes[child][3])
    return (token, count, tuple(sorted(children)))  # siblings hold distinct tokens


@pytest.fixture(scope="session")
def core_shard():
    return _core_shard


@pytest.fixture(scope="session")
def core_params():
    return _core_params


@pytest.fixture(scope="session")
def core_tree():
    return _core_tree

"""The side-by-side adapter of bench/draft_quality.py for the paper's reference drafter, against
a stand-in for its Reader (the library itself is built by hand, not installed here)."""

from pathlib import Path

import numpy as np
import pytest

from bench.draft_quality import ReferenceDrafter, reference_vocab, replay
from sssd.common.drafting.proposer import DraftRequest


class FakeReader:
    """Records the calls; answers every sequence with the same tree of five nodes:
    root - 6 - 7 and root - 8 - 9, flattened depth-first as the library does."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.puts: list[tuple[str, list[int], int]] = []
        self.calls: list[dict] = []
        self.finished: list[int] = []

    def sync_put(self, tokens, seq_id):
        self.puts.append(("sync", list(tokens), seq_id))

    def stream_put(self, tokens, seq_id):
        self.puts.append(("stream", list(tokens), seq_id))

    def get_candidates(self, prefixes, decoding_lengths, branch_lengths, seq_ids):
        self.calls.append(dict(prefixes=prefixes, decoding_lengths=decoding_lengths,
                               branch_lengths=branch_lengths, seq_ids=seq_ids))
        mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=bool)
        tree = [p[-1] for p in prefixes]
        return ([[root, 6, 7, 8, 9] for root in tree], [[0, 1, 2, 1, 2]] * len(prefixes),
                [mask] * len(prefixes))

    def sync_finish_sequence(self, seq_id):
        self.finished.append(seq_id)


class FakeModule:
    Reader = FakeReader


def make_drafter(branch_len=None) -> ReferenceDrafter:
    return ReferenceDrafter(FakeModule, Path("unused.idx"), vocab_size=49152, stop_token=49152,
                            branch_len=branch_len)


def test_parents_come_from_the_ancestor_mask():
    drafter = make_drafter()
    (tree,) = drafter.propose([DraftRequest("a", [1, 2, 3, 4, 5], 8, is_start=True)])
    assert tree.token_ids == [5, 6, 7, 8, 9]
    assert tree.parents == [-1, 0, 1, 0, 3]


def test_context_lookup_key_and_branch_length_follow_the_papers_evaluation():
    drafter = make_drafter()
    drafter.propose([DraftRequest("a", [1, 2, 3, 4, 5], 4, is_start=True),
                     DraftRequest("b", [9, 8], 32, is_start=True)])
    drafter.propose([DraftRequest("a", [6, 7], 16)])
    reader = drafter.reader
    assert reader.kwargs["prompt_prefix_length"] == 4
    assert reader.kwargs["vocab_size"] == 65_537
    assert reader.puts == [("sync", [1, 2, 3, 4, 5], 0), ("sync", [9, 8], 1),
                           ("stream", [6, 7], 0)]
    assert reader.calls[0]["prefixes"] == [[2, 3, 4, 5], [9, 8]]
    assert reader.calls[0]["branch_lengths"] == [3, 6]
    assert reader.calls[1]["prefixes"] == [[4, 5, 6, 7]]
    assert reader.calls[1]["branch_lengths"] == [6]
    assert make_drafter(branch_len=8).paper_branch_len(64) == 10


def test_replay_scores_the_reference_tree_and_ends_its_sequences():
    drafter = make_drafter()
    # Prompt [1, 5]; the answer's first token comes from the prefill, then 8 9 follows the
    # second branch (2 accepted + bonus 3), then 3 -> nothing matches (bonus only).
    result = replay(drafter, [([1], [5, 8, 9, 3, 4])], budget=5)
    assert result["num_steps"] == 2
    assert result["accepted_per_step"] == pytest.approx(1.0)
    assert result["tokens_per_step"] == pytest.approx(2.0)
    assert drafter.reader.finished == [0]
    # A finished sequence's slot (the reader's seq_id, below its batch size) is used again.
    drafter.propose([DraftRequest("next", [7, 5], 4, is_start=True)])
    assert drafter.reader.puts[-1] == ("sync", [7, 5], 0)


def test_vocabulary_size_forces_four_byte_tokens():
    assert reference_vocab(49152) == 65_537
    assert reference_vocab(32000) == 65_537
    assert reference_vocab(128_256) == 128_257

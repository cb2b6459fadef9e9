"""The vLLM proposer without vLLM: its calls as vLLM makes them (rows of a token table), content
tracking of sequences across rows, the best linear path of a tree, and a drafter that fails."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from sssd.common.drafting.draft_tree import DraftTree
from sssd.vllm.proposer import ProposerSettings, VllmDrafterProposer, best_path

MAX_LEN = 64
K = 3


def vllm_config(k=K):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k))


class Table:
    """vLLM's input batch as the proposer sees it: token_ids_cpu and num_tokens_no_spec."""

    def __init__(self, rows):
        self.rows = [list(r) for r in rows]

    def arrays(self):
        table = np.zeros((8, MAX_LEN), dtype=np.int32)
        counts = np.zeros(8, dtype=np.int32)
        for i, row in enumerate(self.rows):
            table[i, :len(row)] = row
            counts[i] = len(row)
        return table, counts

    def call(self, proposer):
        table, counts = self.arrays()
        return proposer.propose([[0]] * len(self.rows), counts, table)


def make(fake_proposer, num_drafts=4):
    drafter = fake_proposer(num_drafts)
    settings = ProposerSettings(drafter="127.0.0.1:1", budget=8)
    return VllmDrafterProposer(vllm_config(), drafter=drafter, settings=settings), drafter


def test_rows_continue_their_sequences_with_only_the_new_tokens(fake_proposer):
    proposer, drafter = make(fake_proposer)
    table = Table([[5, 6, 7], [9, 9]])
    drafts = table.call(proposer)
    assert drafts == [[1, 2, 3], [1, 2, 3]]  # K = 3 of the 4-token chains
    ids = [seq_id for seq_id in drafter.contexts]
    table.rows[0] += [1, 2]  # two accepted + the bonus, as vLLM appends them
    table.rows[1] += [4]
    table.call(proposer)
    assert [drafter.contexts[i] for i in ids] == [[5, 6, 7, 1, 2], [9, 9, 4]]
    assert len(drafter.calls) == 2 and len(drafter.contexts) == 2  # no new sequences


def test_drafts_stop_before_a_token_outside_the_vocabulary(fake_proposer):
    """A drafter of another tokenizer must not crash vLLM (an index past its embedding): the
    drafts are cut at the first foreign token id."""
    config = vllm_config()
    config.model_config = SimpleNamespace(get_vocab_size=lambda: 3)
    proposer = VllmDrafterProposer(config, drafter=fake_proposer(4),
                                   settings=ProposerSettings(drafter="127.0.0.1:1", budget=8))
    assert Table([[0, 1, 2], [2, 2]]).call(proposer) == [[1, 2], [1, 2]]  # 3 is outside
    assert proposer.num_foreign_drafts == 2


def test_a_row_that_holds_another_request_starts_a_new_sequence(fake_proposer):
    proposer, drafter = make(fake_proposer)
    table = Table([[5, 6, 7], [9, 9]])
    table.call(proposer)
    first_ids = list(drafter.contexts)
    table.rows[0] = [3, 3, 3, 3]  # request 0 finished, another took its row
    table.call(proposer)
    assert first_ids[0] not in drafter.contexts  # ended in the drafter
    assert first_ids[1] in drafter.contexts and len(drafter.contexts) == 2
    assert [3, 3, 3, 3] in drafter.contexts.values()
    table.rows = table.rows[:1]  # the batch shrank: row 1's sequence ends
    table.call(proposer)
    assert list(drafter.contexts.values()) == [[3, 3, 3, 3]]
    proposer.close()
    assert not drafter.contexts and drafter.closed == 1


def test_a_lost_sequence_is_sent_again_whole(fake_proposer):
    proposer, drafter = make(fake_proposer)
    table = Table([[5, 6, 7]])
    table.call(proposer)
    (seq_id,) = drafter.contexts
    drafter.contexts.clear()  # the drafter restarted
    table.rows[0] += [8]
    assert table.call(proposer) == [[1, 2, 3]]
    assert list(drafter.contexts.values()) == [[5, 6, 7, 8]]


def test_a_new_row_whose_start_was_lost_is_started_again(fake_proposer):
    proposer, drafter = make(fake_proposer)
    table = Table([[5, 6, 7]])
    table.call(proposer)
    (old_id,) = drafter.contexts
    drafter.lose = {old_id}  # the drafter lost row 0's sequence...
    table.rows[0] += [8]
    table.rows.append([1, 2])  # ...in the step a new request joins
    assert table.call(proposer) == [[1, 2, 3], [1, 2, 3]]
    assert len(drafter.calls) == 3  # the refused call and its re-send
    # Row 0 restarted under a new id with its whole context; row 1's start, refused with the
    # first attempt, went again as a start (not as a continuation of nothing).
    held = {seq_id: ctx for seq_id, ctx in drafter.contexts.items() if seq_id != old_id}
    assert sorted(held.values()) == [[1, 2], [5, 6, 7, 8]]


def test_a_failing_drafter_gives_no_drafts_and_never_raises(fake_proposer):
    proposer, drafter = make(fake_proposer)
    table = Table([[5, 6, 7], [1]])
    drafter.failure = TimeoutError("deadline")
    assert table.call(proposer) == [[], []]
    assert proposer.num_failures == 1
    drafter.failure = None
    assert table.call(proposer) == [[1, 2, 3], [1, 2, 3]]  # restarted with full contexts
    assert sorted(drafter.contexts.values()) == [[1], [5, 6, 7]]


def test_best_path_maximizes_expected_accepted_tokens():
    #        0
    #      /   \
    #     1(.9)  2(.5)
    #     |      |
    #     3(.1)  4(.45)
    #            |
    #            5(.4)
    tree = DraftTree(np.array([0, 10, 20, 11, 21, 22], dtype=np.int32),
                     np.array([-1, 0, 0, 1, 2, 4], dtype=np.int32),
                     np.array([1, .9, .5, .1, .45, .4], dtype=np.float32))
    assert best_path(tree, 3) == [20, 21, 22]  # 1.35 expected against 1.0
    assert best_path(tree, 1) == [10]
    assert best_path(tree, 2) == [10, 11]  # 1.0 against 0.95
    assert best_path(DraftTree.root_only(7), 3) == []
    chain = DraftTree(np.array([0, 1, 2], dtype=np.int32), np.array([-1, 0, 1], dtype=np.int32))
    assert best_path(chain, 5) == [1, 2]  # no scores: the deepest path
    # min_score: only nodes that likely; the best path among them.
    assert best_path(tree, 3, min_score=0.42) == [20, 21]  # 0.95 against 0.9
    assert best_path(tree, 3, min_score=0.47) == [10]  # 0.9 against 0.5
    assert best_path(tree, 3, min_score=0.3) == [20, 21, 22]
    assert best_path(tree, 3, min_score=0.95) == []
    assert best_path(chain, 5, min_score=0.99) == [1, 2]  # no scores to compare


def test_settings_come_from_the_environment_with_clear_errors():
    settings = ProposerSettings.from_env({"SSSD_VLLM_DRAFTER": "a:1,b:2",
                                          "SSSD_VLLM_BUDGET": "24", "SSSD_VLLM_TIMEOUT_S": "0.5",
                                          "SSSD_VLLM_CHECK_TOKENIZER": "no"})
    assert settings == ProposerSettings("a:1,b:2", 24, 0.5, False)
    assert ProposerSettings.from_env({"SSSD_VLLM_DRAFTER": "a:1",
                                      "SSSD_VLLM_MIN_SCORE": "0.25"}).min_score == 0.25
    with pytest.raises(ValueError, match=r"MIN_SCORE\) must be in \[0, 1\]"):
        ProposerSettings.from_env({"SSSD_VLLM_DRAFTER": "a:1", "SSSD_VLLM_MIN_SCORE": "2"})
    with pytest.raises(ValueError, match="SSSD_VLLM_DRAFTER"):
        ProposerSettings.from_env({})
    with pytest.raises(ValueError, match="SSSD_VLLM_BUDGET='x'"):
        ProposerSettings.from_env({"SSSD_VLLM_DRAFTER": "a:1", "SSSD_VLLM_BUDGET": "x"})
    with pytest.raises(ValueError, match=r"BUDGET\) must be >= 2"):
        ProposerSettings.from_env({"SSSD_VLLM_DRAFTER": "a:1", "SSSD_VLLM_BUDGET": "1"})


def test_settings_from_vllms_additional_config_override_the_environment():
    def config(section):
        return SimpleNamespace(additional_config={"sssd": section} if section is not None
                               else {})

    env = {"SSSD_VLLM_DRAFTER": "env:1", "SSSD_VLLM_BUDGET": "24"}
    assert ProposerSettings.from_config(config(None), env) == ProposerSettings("env:1", 24)
    assert ProposerSettings.from_config(config({"drafter": "cfg:2", "timeout_s": 1}), env) == \
        ProposerSettings("cfg:2", 24, 1.0)
    assert ProposerSettings.from_config(config({"drafter": "cfg:2"}), {}).drafter == "cfg:2"
    with pytest.raises(ValueError, match="unknown field.*budgett.*known: drafter"):
        ProposerSettings.from_config(config({"budgett": 3}), env)
    with pytest.raises(ValueError, match=r'\["budget"\]=True: not a int'):
        ProposerSettings.from_config(config({"budget": True}), env)
    with pytest.raises(ValueError, match=r'\["drafter"\]=5: not a str'):
        ProposerSettings.from_config(config({"drafter": 5}), env)
    with pytest.raises(ValueError, match="must be a dict"):
        ProposerSettings.from_config(config("a:1"), env)
    with pytest.raises(ValueError, match=r'no drafter address: set additional_config\["sssd"\]'):
        ProposerSettings.from_config(config({"budget": 8}), {})


def stream_entries(redis_server, stream):
    import redis

    entries = redis.Redis.from_url(redis_server.url).xrange(stream)
    return [(np.frombuffer(f[b"prompt"], "<u4").tolist(),
             np.frombuffer(f[b"output"], "<u4").tolist(), f[b"fingerprint"].decode(),
             f[b"uid"].decode() if b"uid" in f else "") for _, f in entries]


def test_finished_sequences_are_published_once_with_prompt_and_answer_apart(
        fake_proposer, redis_server, tmp_path, wait_until):
    stream = "test:vllm-proposer"
    settings = ProposerSettings(drafter="127.0.0.1:1", budget=8, redis_url=redis_server.url,
                                stream=stream, spool_dir=str(tmp_path / "spool"), idle_s=3.0)
    proposer = VllmDrafterProposer(vllm_config(), drafter=fake_proposer(4), settings=settings,
                                   fingerprint="fp-test")
    table = Table([[5, 6, 7], [9, 9]])

    def step(sampled):
        table_ids, counts = table.arrays()
        proposer.propose(sampled, counts, table_ids)

    step([[7], []])  # row 0 sampled its first token (7); row 1 is still prefilling
    table.rows[0] += [1, 2]
    table.rows[1] += [9, 4]  # row 1's prompt was [9, 9, 9]; 4 is its first token
    step([[1, 2], [4]])
    table.rows[0] = [3, 3, 3]  # request 0 finished; another took its row
    table.rows[1] += [5]
    step([[3], [5]])
    assert wait_until(lambda: len(stream_entries(redis_server, stream)) >= 1, timeout=10)
    first = stream_entries(redis_server, stream)[0]
    assert first[:3] == ([5, 6], [7, 1, 2], "fp-test")
    # No step for idle_s: every row has ended and is published, each once.
    assert wait_until(lambda: len(stream_entries(redis_server, stream)) == 3, timeout=10)
    entries = stream_entries(redis_server, stream)
    assert sorted(e[:2] for e in entries[1:]) == [([3, 3], [3]), ([9, 9, 9], [4, 5])]
    assert len({e[3] for e in entries}) == 3  # one uid per sequence
    time.sleep(3.5)
    proposer.close()
    assert len(stream_entries(redis_server, stream)) == 3  # nothing twice
    assert proposer.num_published == 3


def test_rows_that_vllm_moves_keep_their_sequences(fake_proposer, redis_server, tmp_path,
                                                   wait_until):
    """vLLM condenses its batch when a request leaves: the last row moves into the hole. The
    moved sequence goes on (no new drafter sequence, no early publication)."""
    stream = "test:vllm-moved"
    settings = ProposerSettings(drafter="127.0.0.1:1", budget=8, redis_url=redis_server.url,
                                stream=stream, spool_dir=str(tmp_path / "spool"), idle_s=30)
    drafter = fake_proposer(4)
    proposer = VllmDrafterProposer(vllm_config(), drafter=drafter, settings=settings,
                                   fingerprint="fp-test")
    table = Table([[5, 6, 7], [1, 1], [8, 8, 8]])
    proposer.propose([[7], [1], [8]], *reversed(table.arrays()))
    ids = list(drafter.contexts)
    table.rows = [table.rows[2] + [4], table.rows[1] + [2]]  # row 0 left; row 2 moved to 0
    proposer.propose([[4], [2]], *reversed(table.arrays()))
    assert drafter.contexts == {ids[1]: [1, 1, 2], ids[2]: [8, 8, 8, 4]}
    assert wait_until(lambda: len(stream_entries(redis_server, stream)) == 1, timeout=10)
    assert stream_entries(redis_server, stream)[0][:2] == ([5, 6], [7])
    # After a drafter failure the sequences are sent whole again (under new drafter ids), and
    # published once each with their prompts where they were.
    drafter.failure = TimeoutError("deadline")
    table.rows[0] += [3]
    assert proposer.propose([[3], [2]], *reversed(table.arrays())) == [[], []]
    drafter.failure = None
    table.rows[1] += [9]
    proposer.propose([[3], [9]], *reversed(table.arrays()))
    assert sorted(drafter.contexts.values()) == [[1, 1, 2, 9], [8, 8, 8, 4, 3]]
    assert not set(ids) & set(drafter.contexts)  # the old ids were ended
    proposer.close()
    entries = stream_entries(redis_server, stream)
    assert sorted(e[:2] for e in entries) == [([1], [1, 2, 9]), ([5, 6], [7]),
                                              ([8, 8], [8, 4, 3])]

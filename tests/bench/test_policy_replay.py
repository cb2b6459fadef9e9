"""bench/policy_replay.py: accepted paths cut at a budget, the cost table, and a replayed server
driven by a drafter that knows the answer."""

import argparse

import numpy as np
import pytest

from bench.draft_quality import accepted_path
from bench.policy_replay import parse_costs, serve
from sssd.common.drafting.draft_tree import DraftTree
from sssd.verifier.engine.budget_policy import FixedBudget

COSTS = "1:100,2:100,4:100,8:110,16:120,32:200"


def tree(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(np.asarray(tokens, dtype=np.int32), np.asarray(parents, dtype=np.int32))


def test_the_accepted_path_follows_the_answer_through_the_first_budget_nodes():
    # root - 5 - 6 - 7, and root - 9 (node 2) as a sibling; node indices best-first
    drafted = tree([0, 5, 9, 6, 7], [-1, 0, 0, 1, 3])
    answer = [4, 5, 6, 7, 8]
    assert accepted_path(drafted, answer, 1, 5) == [1, 3, 4]
    assert accepted_path(drafted, answer, 1, 4) == [1, 3]  # node 4 is beyond a tree of 4
    assert accepted_path(drafted, answer, 1, 1) == []
    assert accepted_path(drafted, answer, 2, 5) == []  # the answer goes on with 6, not 5 or 9
    assert accepted_path(drafted, answer, 3, 5) == []


def test_costs_need_every_budget_and_positive_times():
    assert parse_costs(COSTS) == {1: 100.0, 2: 100.0, 4: 100.0, 8: 110.0, 16: 120.0, 32: 200.0}
    for bad in ("1:100,2:100", "1:100,2:100,4:100,8:110,16:120,32:0", "1=100", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_costs(bad)


class Oracle:
    """Drafts the next `width` answer tokens as a chain, from whatever position the replay is
    at (it is told the new tokens, as the engine's drafter is)."""

    def __init__(self, answer: list[int], prompt_len: int, width: int) -> None:
        self.answer, self.width = answer, width
        self.position = -prompt_len  # answer positions seen so far, less the prompt
        self.ended: list[str] = []

    def propose(self, requests):
        (request,) = requests
        self.position += len(request.token_ids)
        chain = [0] + self.answer[self.position: self.position + self.width]
        return [tree(chain, list(range(-1, len(chain) - 1)))]

    def end(self, seq_ids):
        self.ended += seq_ids


def test_a_fixed_budget_emits_the_answer_in_budget_sized_steps():
    answer = list(range(10, 31))  # 21 tokens: the first comes from the prefill
    costs = parse_costs(COSTS)
    rate, counts = serve(Oracle(answer, 3, 3), [([1, 2, 3], answer)], FixedBudget(4), costs,
                         seed=0, noise=0.0, hindsight_delay=1)
    # a tree of 4 (3 drafts) accepts all 3 and adds the bonus: 4 tokens a step, 20 tokens
    assert counts == {4: 5}
    assert rate == pytest.approx(20 / (5 * 0.1))
    rate, counts = serve(Oracle(answer, 3, 3), [([1, 2, 3], answer)], FixedBudget(1), costs,
                         seed=0, noise=0.0, hindsight_delay=1)
    assert counts == {1: 20} and rate == pytest.approx(20 / (20 * 0.1))


def test_a_drifting_pace_changes_the_time_of_the_steps_and_not_their_tokens():
    answer = list(range(10, 31))
    costs = parse_costs(COSTS)
    steady = serve(Oracle(answer, 3, 3), [([1, 2, 3], answer)], FixedBudget(4), costs,
                   seed=0, noise=0.0, hindsight_delay=1)
    # a swing of +-50 % over 0.4 s of replayed time: the five steps of 0.1 s see other paces
    swinging = serve(Oracle(answer, 3, 3), [([1, 2, 3], answer)], FixedBudget(4), costs,
                     seed=0, noise=0.0, hindsight_delay=1, drift=0.5, drift_period_s=0.4)
    assert swinging[1] == steady[1] == {4: 5}
    assert swinging[0] != pytest.approx(steady[0])
    assert 20 / (5 * 0.15) <= swinging[0] <= 20 / (5 * 0.05)  # each step between 0.05 and 0.15 s

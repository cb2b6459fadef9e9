"""Acceptance in hindsight: trees drafted larger than verified, scored against the output."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from sssd.common.drafting.draft_tree import DraftTree
from sssd.verifier.engine.budget_policy import FixedBudget, MeasuredBudget
from sssd.verifier.engine.forward_profile import ForwardProfile
from sssd.verifier.engine.hindsight import MAX_PENDING_GROUPS, HindsightTracker


@dataclass
class FakeSequence:
    output_ids: list[int] = field(default_factory=list)
    is_finished: bool = False
    request_id: str = "a request"


def tree(tokens, parents):
    return DraftTree(np.array(tokens, dtype=np.int32), np.array(parents, dtype=np.int32))


# Root 5; branches 5 -> 7 -> 8 -> 9 and 5 -> 6 -> 3; node indices as listed.
BRANCHY = tree([5, 7, 6, 8, 3, 9], [-1, 0, 0, 1, 2, 3])


def test_path_follows_emitted_tokens_until_mismatch():
    seq = FakeSequence([5])
    tracker = HindsightTracker()
    tracker.add(1, 1, [seq], [BRANCHY], [32])
    assert tracker.decided() == []  # nothing emitted after the root yet
    seq.output_ids += [7, 8]
    assert tracker.decided() == []  # on the path, node 3 still has a child
    seq.output_ids += [4]  # 9 was drafted, 4 came: the path ends at node 3
    [decided] = tracker.decided()
    assert decided.paths == [[1, 3]] and decided.starts == [1] and decided.verified_budget == 1
    assert len(tracker) == 0


def test_leaf_and_first_token_mismatch_and_finish_decide():
    leaf, miss, finished = FakeSequence([5]), FakeSequence([5]), FakeSequence([5])
    tracker = HindsightTracker()
    tracker.add(3, 2, [leaf, miss, finished], [BRANCHY, BRANCHY, BRANCHY], [32, 32, 32])
    leaf.output_ids += [6, 3]  # node 4 is a leaf
    miss.output_ids += [1]
    finished.output_ids += [7]
    assert tracker.decided() == []  # `finished` may still go on along node 1
    finished.is_finished = True
    [decided] = tracker.decided()
    assert decided.batch_size == 3
    assert decided.paths == [[2, 4], [], [1]]


def test_duplicate_siblings_follow_the_first_as_verification_does():
    seq = FakeSequence([5])
    tracker = HindsightTracker()
    tracker.add(1, 1, [seq], [tree([5, 7, 7, 8], [-1, 0, 0, 2])], [32])  # 2nd 7 goes on
    seq.output_ids += [7, 8]
    [decided] = tracker.decided()
    assert decided.paths == [[1]]  # node 1, a leaf, like accept_greedy's walk


def test_rows_drafted_below_the_full_budget_are_left_out_and_aborted_rows_forgotten():
    kept, aborted, plain = FakeSequence([5]), FakeSequence([5]), FakeSequence([5])
    tracker = HindsightTracker()
    # `plain` has speculation off: drafted at budget 1, it says nothing of a tree of 32.
    tracker.add(3, 1, [kept, aborted, plain], [BRANCHY, BRANCHY, DraftTree.root_only(5)],
                [32, 32, 1])
    tracker.forget(aborted)
    kept.output_ids += [2]
    [decided] = tracker.decided()
    assert decided.paths == [[]] and decided.starts == [1]


def test_a_step_whose_rows_all_have_speculation_off_teaches_nothing():
    tracker = HindsightTracker()
    tracker.add(2, 1, [FakeSequence([5]), FakeSequence([5])],
                [DraftTree.root_only(5), DraftTree.root_only(5)], [1, 1])
    assert len(tracker) == 0 and tracker.decided() == []


def test_a_row_the_proposer_found_nothing_for_accepted_nothing():
    """Drafted at the full budget, a tree that is its root alone counts as accepting nothing,
    as it does in a verified step: left out, such rows made larger budgets look better."""
    found, empty = FakeSequence([5]), FakeSequence([5])
    tracker = HindsightTracker()
    tracker.add(2, 1, [found, empty], [BRANCHY, DraftTree.root_only(5)], [32, 32])
    found.output_ids += [7, 8, 9]  # node 5 is a leaf
    [decided] = tracker.decided()
    assert decided.paths == [[1, 3, 5], []] and decided.request_ids == ["a request"] * 2


def test_pending_groups_are_bounded():
    seq = FakeSequence([5])
    tracker = HindsightTracker()
    for _ in range(MAX_PENDING_GROUPS + 10):
        tracker.add(1, 1, [seq], [BRANCHY], [32])
    assert len(tracker) == MAX_PENDING_GROUPS


def test_prefix_keeps_the_first_nodes():
    assert BRANCHY.prefix(3) == tree([5, 7, 6], [-1, 0, 0])
    assert BRANCHY.prefix(1) == DraftTree(BRANCHY.token_ids[:1], BRANCHY.parents[:1])
    assert BRANCHY.prefix(99) is BRANCHY
    with pytest.raises(ValueError, match="at least its root"):
        BRANCHY.prefix(0)


def steep_profile():
    # A batch of 8 where every node costs: speculation must be accepted well to pay.
    batches, budgets = [1, 8], [1, 2, 4, 8, 16, 32]
    seconds = np.array([[0.04] * 6, [0.05 * (1 + 0.3 * np.log2(s)) for s in budgets]])
    return ForwardProfile(batches, budgets, seconds)


def test_policy_drafts_largest_tree_every_nth_step_and_learns_only_above():
    policy = MeasuredBudget(steep_profile(), max_budget=32, hindsight_every=4,
                            prior={1: 0.0, 2: 0.1, 4: 0.2, 8: 0.3, 16: 0.3, 32: 0.3})
    # At budget 1 a hindsight tree is a drafter call the step would not make: 4x as rarely.
    assert [policy.draft_budget(8, 1) for _ in range(32)] == ([1] * 15 + [32]) * 2
    assert [policy.draft_budget(8, 2) for _ in range(8)] == [2, 2, 2, 32] * 2
    assert policy.draft_budget(8, 32) == 32  # nothing larger to learn
    before = dict(policy.expected_accepted)
    # Every row accepted nodes 1, 2, 5: 2 tokens at budget 4, 3 from budget 8 on, so 1 and 2
    # beyond the tree of 2 (whose own estimate its verified steps teach, not these).
    for _ in range(150):
        policy.observe_hindsight(8, 2, [[1, 2, 5]] * 8)
    after = policy.expected_accepted
    assert after[1] == before[1] and after[2] == before[2]
    assert after[4] - after[2] == pytest.approx(1.0, abs=0.05)
    assert after[8] - after[2] == pytest.approx(2.0, abs=0.05)
    assert after[32] - after[2] == pytest.approx(2.0, abs=0.05)


def test_policy_explores_less_once_hindsight_arrives():
    # Nothing is ever accepted, on verified steps and in hindsight, and at b = 1 every budget
    # costs the same. Without hindsight the policy explores budget 2 every 8th step (its
    # acceptance is unknown) until its step time is calibrated (3 steps), then every 32nd;
    # with hindsight, acceptance is known, and budget 2 is tried for its step time only,
    # every 64th step.
    policy = MeasuredBudget(steep_profile(), max_budget=32, prior={s: 0.0 for s in
                                                                   (1, 2, 4, 8, 16, 32)})
    chosen = []
    for step in range(356):
        s = policy.budget(1)
        chosen.append(s)
        policy.observe(1, s, [[]], 0.04)
        if step == 99:
            policy.observe_hindsight(1, 1, [[]])
    assert [i for i, s in enumerate(chosen[:100]) if s == 2] == [7, 15, 23, 31, 63, 95]
    assert [i for i, s in enumerate(chosen[100:], 100) if s == 2] == [119, 183, 247, 311]
    assert set(chosen) == {1, 2}


def test_policy_learns_the_fallback_cost_by_exploring_downwards():
    # The profile overprices budget 1 at b = 8 (0.05 s; the steps really take 0.04 s) and
    # underprices budget 2 (0.065 s; really 0.085 s), and every row accepts one draft: by the
    # profile budget 2 pays (2 tokens for 1.3x an AR step), by the true costs it does not. The
    # policy starts at budget 2, tries budget 1 now and then, learns its true cost, falls back.
    policy = MeasuredBudget(steep_profile(), max_budget=32, prior={1: 0.0, 2: 1.0, 4: 1.0,
                                                                   8: 1.0, 16: 1.0, 32: 1.0})
    true_seconds = {1: 0.04, 2: 0.085, 4: 0.1, 8: 0.12, 16: 0.14, 32: 0.16}
    policy.observe_hindsight(8, 1, [[1]] * 8)
    chosen = []
    for _ in range(1000):
        s = policy.budget(8)
        chosen.append(s)
        policy.observe(8, s, [[1] if s > 1 else []] * 8, true_seconds[s])
    assert chosen[0] == 2
    assert 1 in chosen[:100]  # explored: rarely, as budget 2 looks far ahead by the profile
    assert chosen[-100:].count(1) >= 90  # fallen back; budget 2 explored now and then


def test_steps_that_drafted_more_than_they_verified_leave_the_step_times_alone():
    policy = MeasuredBudget(steep_profile(), max_budget=32)
    policy.observe(8, 1, [[]] * 8, None)
    assert policy.observed_seconds == {}
    assert policy.expected_accepted[1] == 0.0  # the acceptance was still learned


def test_hindsight_paths_equal_verified_paths(engine_factory, mt_bench_prompts, warm_datastore):
    """What a larger tree would have accepted, scored in hindsight while verifying one node a
    step, equals what verifying that whole tree accepts at the same position (float32)."""

    class Recorder(FixedBudget):
        """Verifies `budget`, drafts 16 every step; records paths by output position."""

        def __init__(self, engine, budget):
            super().__init__(budget)
            self.engine, self.verified, self.hindsight = engine, {}, {}

        def budget(self, batch_size, rows=None):
            self.position = len(self.engine.scheduler.running[0].output_ids)
            return self._budget

        def draft_budget(self, batch_size, budget):
            return 16

        def observe(self, batch_size, budget, accepted_nodes, step_s, rows=None):
            self.verified[self.position] = list(accepted_nodes[0])

        def observe_hindsight(self, batch_size, verified_budget, accepted_nodes, rows=None):
            assert verified_budget == 1
            self.hindsight.setdefault("paths", []).append(list(accepted_nodes[0]))

    prompt = mt_bench_prompts[0]
    full, drafter = engine_factory(1, warm_datastore)
    try:
        full.budget_policy = Recorder(full, 16)
        [reference] = full.generate([prompt], max_tokens=48)
    finally:
        drafter.close()
    scored, drafter = engine_factory(1, warm_datastore)
    starts = []
    original = scored.drafting._hindsight.decided

    def decided():
        groups = original()
        starts.extend(group.starts[0] for group in groups)
        return groups

    scored.drafting._hindsight.decided = decided
    try:
        scored.budget_policy = Recorder(scored, 1)
        [output] = scored.generate([prompt], max_tokens=48)
    finally:
        drafter.close()
    assert output == reference
    paths = dict(zip(starts, scored.budget_policy.hindsight["paths"]))
    # Where the output ends inside a verified path, verification accepted nodes past the end
    # that were never emitted; hindsight sees only the emitted tokens. Those are left out.
    common = [p for p, path in full.budget_policy.verified.items()
              if p in paths and p + len(path) < len(output)]
    assert len(common) >= 5
    assert any(full.budget_policy.verified[p] for p in common)  # some accepted drafts
    for position in common:
        assert paths[position] == full.budget_policy.verified[position], position

"""The source router: sticky per-sequence sources, explicit choices, the measured-cost choice
of `auto`, and a failed call that leaves every source able to restart its sequences exactly."""

from __future__ import annotations

import pytest

from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound
from sssd.common.drafting.router import CostChooser, SourceRouter


def start(seq_id, tokens=(5, 6), source="", budget=4):
    return DraftRequest(seq_id, list(tokens), budget, is_start=True, source=source)


def step(seq_id, tokens, budget=4):
    return DraftRequest(seq_id, list(tokens), budget)


def test_the_router_is_a_proposer_and_keeps_batch_order(fake_proposer):
    a, b = fake_proposer(1), fake_proposer(3)
    router = SourceRouter({"sssd": a, "ssd": b})
    assert isinstance(router, Proposer) and router.sources == ("sssd", "ssd")
    trees = router.propose([start("x", source="ssd"), start("y", source="sssd"),
                            start("z", (9,), source="ssd")])
    assert [t.num_nodes for t in trees] == [4, 2, 4]  # each row's tree from its source
    assert [t.root_token for t in trees] == [6, 6, 9]
    assert a.calls == [["y"]] and b.calls == [["x", "z"]]  # one call per source per step
    router.propose([step("x", [1, 2]), step("y", [7])])
    assert b.contexts["x"] == [5, 6, 1, 2] and a.contexts["y"] == [5, 6, 7]
    assert router.end(["x", "y", "never-seen"]) == 2
    assert not a.contexts and list(b.contexts) == ["z"]


def test_a_sequence_keeps_its_source_across_restarts(fake_proposer):
    a, b = fake_proposer(), fake_proposer()
    router = SourceRouter({"sssd": a, "ssd": b})
    router.propose([start("x")])  # auto: the least measured source, the first
    owner = router.source_of("x")
    router.propose([start("x", (1, 2, 3))])  # a re-send of the full context
    assert router.source_of("x") == owner
    assert (a if owner == "sssd" else b).contexts["x"] == [1, 2, 3]


def test_unknown_and_unavailable_sources_are_refused_without_calls(fake_proposer):
    a, b = fake_proposer(), fake_proposer()
    router = SourceRouter({"sssd": a, "ssd": b})
    with pytest.raises(SequenceNotFound) as missing:
        router.propose([start("x"), step("ghost", [1])])
    assert missing.value.seq_ids == ["ghost"] and a.calls == [] and b.calls == []
    with pytest.raises(ValueError, match="'other' is not available"):
        router.propose([start("x"), start("y", source="other")])
    assert a.calls == [] and b.calls == [] and router.source_of("x") is None


def test_a_router_needs_two_sources(fake_proposer):
    with pytest.raises(ValueError, match="two or more"):
        SourceRouter({"sssd": fake_proposer()})


def test_a_source_losing_sequences_makes_every_source_of_the_call_restart_them(fake_proposer):
    a, b = fake_proposer(), fake_proposer()
    router = SourceRouter({"sssd": a, "ssd": b})
    router.propose([start("x", source="sssd"), start("y", source="ssd")])
    b.lose = {"y"}
    with pytest.raises(SequenceNotFound) as missing:
        router.propose([step("x", [1]), step("y", [2])])
    # "x" was appended in "sssd" before "ssd" failed: ended there, so its re-send is exact.
    assert sorted(missing.value.seq_ids) == ["x", "y"] and "x" not in a.contexts
    b.lose = set()
    router.propose([start("x", (5, 6, 1), source="sssd"), start("y", (5, 6, 2), source="ssd")])
    assert a.contexts["x"] == [5, 6, 1] and b.contexts["y"] == [5, 6, 2]


def test_a_failing_source_raises_and_the_others_restart(fake_proposer):
    a, b = fake_proposer(), fake_proposer()
    router = SourceRouter({"sssd": a, "ssd": b})
    router.propose([start("x", source="sssd"), start("y", source="ssd")])
    b.failure = TimeoutError("slow")
    with pytest.raises(TimeoutError):
        router.propose([step("x", [1]), step("y", [2])])
    assert "x" not in a.contexts  # ended: the engine re-sends every context after a failure
    assert router.source_of("x") == "sssd"  # and the sequence keeps its source
    router.close()
    assert a.closed == b.closed == 1


def test_auto_measures_every_source_then_picks_the_faster_and_keeps_exploring():
    chooser = CostChooser(["sssd", "ssd"], min_steps=4, explore_every=4)
    firsts = []
    for _ in range(2):
        name = chooser.pick()
        firsts.append(name)
        for _ in range(4):
            chooser.observe_tokens(name, 2)
    assert set(firsts) == {"sssd", "ssd"}  # each measured before any is preferred
    chooser.observe_rest(0.100)
    chooser.observe_draft("sssd", 0.001)  # 2 tokens per 101 ms
    for _ in range(40):  # ~4 tokens per 150 ms: faster
        chooser.observe_tokens("ssd", 4)
    for _ in range(20):
        chooser.observe_draft("ssd", 0.050)
    assert chooser.tokens_per_second("ssd") > chooser.tokens_per_second("sssd")
    picks = [chooser.pick() for _ in range(16)]
    assert picks.count("sssd") == 4 and picks.count("ssd") == 12  # every 4th explores
    summary = chooser.summary()
    assert summary["ssd"]["tokens_per_step"] == pytest.approx(4, abs=0.3)


def test_router_measures_tokens_from_continuations_of_drafted_steps(fake_proposer):
    a, b = fake_proposer(), fake_proposer()
    router = SourceRouter({"sssd": a, "ssd": b})
    router.propose([start("x", budget=4, source="sssd"), start("y", budget=1, source="sssd")])
    router.propose([step("x", [1, 2, 3]), step("y", [9], budget=1)])
    cost = router.chooser.costs["sssd"]
    # x's 3 new tokens follow a drafted step; y's follow a step without drafts: not counted.
    assert cost.num_steps == 1 and cost.tokens_per_step == 3
    assert router.chooser.rest_s > 0 and cost.draft_s > 0
    rest = router.chooser.rest_s
    router.end(["x", "y"])
    router.propose([start("z")])  # after an idle spell: not a step's rest
    assert router.chooser.rest_s == rest


def test_chooser_rejects_bad_settings(fake_proposer):
    with pytest.raises(ValueError):
        CostChooser([])
    with pytest.raises(ValueError):
        CostChooser(["a"], explore_every=1)
    with pytest.raises(ValueError, match="chooser"):
        SourceRouter({"a": fake_proposer(), "b": fake_proposer()}, CostChooser(["b", "c"]))

"""Loop observers that are not metrics or sinks: the acceptance statistics saved to disk."""

import numpy as np
import pytest

from sssd.verifier.engine.acceptance_estimates import DEFAULT_ACCEPTANCE_PRIOR, load_acceptance
from sssd.verifier.engine.budget_policy import MeasuredBudget
from sssd.verifier.engine.forward_profile import ForwardProfile
from sssd.verifier.engine.output import StepOutput
from sssd.verifier.serving.observers import SAVE_EVERY, AcceptanceSaver


def flat_then_linear_profile():
    batches, budgets = [1, 2, 4, 8], [1, 2, 4, 8, 16, 32]
    seconds = np.array([[0.04 * max(1.0, b * s / 16) for s in budgets] for b in batches])
    return ForwardProfile(batches, budgets, seconds)


def test_acceptance_statistics_are_saved_and_become_the_next_prior(tmp_path):
    path = tmp_path / "forward.sssd.acceptance.json"
    policy = MeasuredBudget(flat_then_linear_profile(), max_budget=32,
                            prior=DEFAULT_ACCEPTANCE_PRIOR)
    saver = AcceptanceSaver(policy, path)
    step = StepOutput([], [], num_verified=1, budget=32)
    for _ in range(SAVE_EVERY):
        assert not path.exists()  # the policy's steps never write; the saver does
        policy.observe(1, 32, [[1, 3, 7, 15, 31]], 0.04)
        saver.on_step(step, 0.04)
    saved = load_acceptance(path)
    assert saved == pytest.approx({s: v for s, v in policy.expected_accepted.items()})
    assert saved[32] > 4 > DEFAULT_ACCEPTANCE_PRIOR[32]
    assert load_acceptance(tmp_path / "missing.json") is None
    policy.observe(1, 32, [[1]], 0.04)
    saver.close()  # the loop stopped: the latest estimates are saved too
    assert load_acceptance(path)[32] == pytest.approx(policy.expected_accepted[32])


def test_the_step_trace_has_a_line_per_step_of_a_served_request(tmp_path, target_model_fp32,
                                                                mt_bench_prompts):
    """A loop built with step_trace appends one JSON line per engine step: its verified rows'
    budgets and accepted drafts add up to the answer, its times are the step's."""
    import json

    from sssd.verifier.engine import EngineConfig, GenerateRequest
    from sssd.verifier.serving.assembly import build_engine_loop

    trace = tmp_path / "steps.jsonl"
    config = EngineConfig(mode="prompt_lookup", dtype="float32", max_batch_size=2, max_len=512,
                          budget_policy="rule", profile_path="", step_trace=str(trace))
    loop = build_engine_loop(config, target_model_fp32, max_requests=4)
    try:
        prompt = tuple(mt_bench_prompts[0])
        handle = loop.submit(GenerateRequest(prompt, 24))
        event = handle.events.get(timeout=60)
        while event.totals is None and event.error is None:
            event = handle.events.get(timeout=60)
        assert event.error is None
    finally:
        loop.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["prompts"] == 1 and lines[0]["rows"] == 0 and lines[0]["prefill_s"] > 0
    verified = lines[1:]
    assert verified and all(line["rows"] == 1 and line["step_s"] > 0 for line in verified)
    assert all(len(line["accepted"]) == len(line["row_budgets"]) == 1 for line in verified)
    # 1 token from the prompt, then each verification step its accepted drafts and one more
    # (the last step may be cut by max_tokens)
    emitted = 1 + sum(line["accepted"][0] + 1 for line in verified)
    assert 24 <= emitted <= 24 + verified[-1]["accepted"][0]
    assert any(line["drafted"][0] > 0 for line in verified)  # prompt lookup drafted something


def test_the_step_trace_refuses_a_path_it_cannot_write_and_stops_quietly_when_closed(tmp_path):
    from sssd.verifier.serving.observers import StepTrace

    with pytest.raises(ValueError, match="step_trace: cannot write"):
        StepTrace(tmp_path / "missing" / "steps.jsonl")
    trace = StepTrace(tmp_path / "steps.jsonl")
    trace.on_step(StepOutput([], [], num_verified=0), 0.01)
    trace.close()
    trace.on_step(StepOutput([], [], num_verified=0), 0.01)  # after close: nothing, no error
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 1

"""Engines built from configuration: every mode and both budget policies stay exact."""

import pytest

from sssd.verifier.engine.budget_policy import FixedBudget, MeasuredBudget, RuleBudget
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.factory import build_engine


@pytest.mark.parametrize(
    "mode, policy, policy_type",
    [("ar", "rule", FixedBudget), ("prompt_lookup", "rule", RuleBudget),
     ("sssd", "measured", MeasuredBudget)],
)
def test_configured_engines_equal_generate(target_model_fp32, mt_bench_prompts, greedy_references,
                                           warm_datastore, tmp_path, mode, policy, policy_type):
    config = EngineConfig(mode=mode, budget_policy=policy, max_batch_size=2, max_len=512,
                          datastore_dir=warm_datastore, dtype="float32",
                          profile_path=str(tmp_path / "profile.json"))
    engine = build_engine(config, target_model_fp32)
    assert isinstance(engine.budget_policy, policy_type)
    outputs = engine.generate(mt_bench_prompts[:2], max_tokens=32)
    assert outputs == [reference[:32] for reference in greedy_references[:2]]
    if policy == "measured":
        assert (tmp_path / "profile.json").is_file()  # the profile is saved for the next start


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="mode must be one of"):
        EngineConfig(mode="fast")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")


def test_a_drafter_service_of_another_tokenizer_is_refused(target_model_fp32, tmp_path):
    """A drafter started on a datastore alone reports that datastore's tokenizer; an engine
    whose model has another refuses it at build, before any request is served."""
    from sssd.datastore.build import build_datastore
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.service import create_server
    from sssd.verifier.proposers import PROPOSERS

    vocab_size = target_model_fp32.vocab_size
    build_datastore(tmp_path, [[1, 2, 3, 4, 5]] * 20, vocab_size, "another-tokenizer")
    server, port, drafter = create_server(DrafterConfig(
        datastore_dir=str(tmp_path), vocab_size=vocab_size, host="127.0.0.1", port=0,
        num_threads=1))
    try:
        config = EngineConfig(mode="sssd", drafter_target=f"127.0.0.1:{port}")
        with pytest.raises(ValueError, match="another-toke.*refused"):
            PROPOSERS["sssd"](config, target_model_fp32)
    finally:
        server.stop(grace=0).wait()
        drafter.close()


def test_a_profile_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(
        target_model_fp32, tmp_path, monkeypatch):
    """A profile taken under load is saved as such; a later start on a quiet machine measures
    again (and saves a quiet one), a start on a busy machine keeps it rather than measuring
    under load once more, and a quiet profile is reused."""
    import json

    from sssd.verifier import factory
    from sssd.verifier.engine.forward_profile import ForwardProfile
    from sssd.verifier.engine.model_runner import ModelRunner

    runner = ModelRunner(target_model_fp32.model, max_seqs=2, max_len=512)
    path = tmp_path / "profile.json"
    config = EngineConfig(mode="sssd", budget_policy="measured", max_batch_size=2, max_len=512,
                          dtype="float32", profile_path=str(path))

    def build(busy):
        monkeypatch.setattr(factory, "machine_load", lambda: (3.0 if busy else 0.1, 2, busy))
        return factory.make_budget_policy(config, runner, model_name="m")

    assert build(busy=True).profile.busy and ForwardProfile.load(path).busy
    # Mark the saved profile so that a re-measurement shows: no real step takes an hour.
    stale = ForwardProfile.load(path)
    stale.seconds[:] = 3600.0
    stale.save(path, json.loads(path.read_text())["setting"])
    assert build(busy=True).profile.seconds.max() == 3600.0  # still busy: kept
    quiet = build(busy=False).profile
    assert not quiet.busy and quiet.seconds.max() < 3600.0  # quiet: measured again, saved
    assert not ForwardProfile.load(path).busy
    assert build(busy=False).profile.seconds.tolist() == quiet.seconds.tolist()  # reused


@pytest.mark.parametrize("key,value", [("processor", "another CPU"), ("kernels", "0" * 16)])
def test_a_profile_of_another_processor_or_kernels_build_is_measured_again(
        target_model_fp32, tmp_path, monkeypatch, key, value):
    """A profile is the processor's and the kernels build's: one saved on another machine (a
    shared var/ directory) or before the kernels were rebuilt is not reused."""
    import json

    from sssd.verifier import factory
    from sssd.verifier.engine.forward_profile import ForwardProfile
    from sssd.verifier.engine.model_runner import ModelRunner

    monkeypatch.setattr(factory, "machine_load", lambda: (0.1, 2, False))
    runner = ModelRunner(target_model_fp32.model, max_seqs=1, max_len=512)
    path = tmp_path / "profile.json"
    config = EngineConfig(mode="sssd", budget_policy="measured", max_batch_size=1, max_len=512,
                          dtype="float32", profile_path=str(path))
    factory.make_budget_policy(config, runner, model_name="m")
    setting = json.loads(path.read_text())["setting"]
    assert setting["processor"] and setting["kernels"] == factory.kernels_build()
    foreign = ForwardProfile.load(path)
    foreign.seconds[:] = 3600.0  # no real step takes an hour: a reuse would show
    foreign.save(path, {**setting, key: value})
    assert factory.make_budget_policy(config, runner, model_name="m").profile.seconds.max() \
        < 3600.0
    assert json.loads(path.read_text())["setting"] == setting  # measured again and saved


def test_drafting_in_process_reads_the_drafter_services_constants(target_model_fp32,
                                                                   monkeypatch):
    """An engine without a drafter service takes the algorithm's constants from SSSD_DRAFTER_*
    as the service does; a bad value is refused naming the variable."""
    from sssd.verifier.proposers import PROPOSERS

    monkeypatch.setenv("SSSD_DRAFTER_COPY_MIN_MATCH", "5")
    monkeypatch.setenv("SSSD_DRAFTER_INPUT_DISCOUNT", "0.5")
    drafter = PROPOSERS["prompt_lookup"](EngineConfig(mode="prompt_lookup"), target_model_fp32)
    try:
        assert drafter.config.params.copy_min_match == 5
        assert drafter.config.params.input_discount == 0.5
    finally:
        drafter.close()
    monkeypatch.setenv("SSSD_DRAFTER_COPY_MIN_MATCH", "five")
    with pytest.raises(ValueError, match="SSSD_DRAFTER_COPY_MIN_MATCH"):
        PROPOSERS["prompt_lookup"](EngineConfig(mode="prompt_lookup"), target_model_fp32)

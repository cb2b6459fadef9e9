"""The engine on every device: the CPU always, CUDA where this machine has one (skipped with the
reason otherwise). On each, speculation gives plain decoding's answer on the same device and
dtype, greedy and seeded sampling alike; the model, its KV cache and the step's tensors are on
that device; and a decode step reads back from the device once, however many rows and draft
nodes it verifies."""

from __future__ import annotations

import warnings

import pytest
import torch

from sssd.common.model.loader import load_causal_lm
from sssd.verifier.engine import EngineConfig, GenerateRequest, SamplingParams
from sssd.verifier.factory import build_engine

from support.devices import DEVICES, HAS_CUDA
from support.model import make_engine

# Every way a tensor's value reaches Python: each is a read-back (on a GPU, a synchronisation).
READ_BACKS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture(scope="module")
def model_on(target_model_fp32):
    """model_on(device) -> the default model in float32 on that device, loaded once."""
    loaded = {"cpu": target_model_fp32}

    def get(device: str):
        if device not in loaded:
            loaded[device] = load_causal_lm(None, "float32", device)
        return loaded[device]

    return get


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_speculation_equals_plain_decoding_on_the_device(device, model_on,
                                                                mt_bench_prompts,
                                                                warm_datastore):
    loaded = model_on(device)
    plain, _ = make_engine(loaded, 4, proposer=None)
    assert plain.runner.device.type == device
    assert all(t.device.type == device for t in plain.runner.cache.keys)
    reference = plain.generate(mt_bench_prompts[:4], max_tokens=40)
    engine, drafter = make_engine(loaded, 4, warm_datastore)
    try:
        outputs = engine.generate(mt_bench_prompts[:4], max_tokens=40)
    finally:
        drafter.close()
    assert outputs == reference
    assert engine.stats.mean_accepted_per_step > 1.3  # drafts were verified and kept


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_with_speculation_equals_plain_sampling_on_the_device(
        device, model_on, mt_bench_prompts, warm_datastore):
    loaded = model_on(device)
    prompts = mt_bench_prompts[:3]

    def sample(engine, seed):
        sequences = [engine.add_request(GenerateRequest(
            tuple(p), 24, SamplingParams(temperature=0.8, top_p=0.95, seed=seed + i)))
            for i, p in enumerate(prompts)]
        while engine.has_work():
            engine.step()
        return [s.output_ids for s in sequences]

    plain, _ = make_engine(loaded, 3, proposer=None)
    engine, drafter = make_engine(loaded, 3, warm_datastore)
    try:
        reference = sample(plain, 100)
        assert sample(engine, 100) == reference
    finally:
        drafter.close()
    assert engine.stats.num_accepted > 0
    assert sample(plain, 200) != reference  # not vacuous: the seed decides


def read_backs_per_step(monkeypatch, engine, prompts, sampling):
    """Adds the prompts (all admitted by the first step), then counts the read-backs of every
    later step, which only verifies. Returns (counts per step, budgets per step)."""
    calls = []
    for name in READ_BACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for p, params in zip(prompts, sampling):
        engine.add_request(GenerateRequest(tuple(p), 32, params))
    engine.step()  # admission: each prompt's first token
    counts, budgets = [], []
    while engine.has_work():
        calls.clear()
        output = engine.step()
        counts.append(len(calls))
        budgets.append(output.budget)
    monkeypatch.undo()
    return counts, budgets


@pytest.mark.parametrize("device", DEVICES)
def test_a_decode_step_reads_back_once_whatever_its_rows_and_nodes(device, monkeypatch,
                                                                   model_on, mt_bench_prompts,
                                                                   warm_datastore):
    loaded = model_on(device)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, seed=7)
    small, small_drafter = make_engine(loaded, 1, warm_datastore, max_budget=2)
    large, large_drafter = make_engine(loaded, 4, warm_datastore, max_budget=16)
    try:
        small_counts, small_budgets = read_backs_per_step(monkeypatch, small,
                                                          mt_bench_prompts[:1], [greedy])
        large_counts, large_budgets = read_backs_per_step(
            monkeypatch, large, mt_bench_prompts[:4], [greedy, sampled, greedy, sampled])
    finally:
        small_drafter.close()
        large_drafter.close()
    # Not vacuous: one row of 2-node trees against four rows of trees up to 16 nodes.
    assert max(small_budgets) == 2 and max(large_budgets) >= 8
    assert set(small_counts) == {1} and set(large_counts) == {1}, (small_counts, large_counts)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA's synchronisation debug mode needs a GPU")
def test_a_cuda_decode_step_synchronises_as_often_with_large_trees_as_with_small(
        model_on, mt_bench_prompts, warm_datastore):
    loaded = model_on("cuda")

    def synchronisations(engine, prompts):
        for p in prompts:
            engine.add_request(GenerateRequest(tuple(p), 24, SamplingParams()))
        engine.step()
        counts = []
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while engine.has_work():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    engine.step()
                counts.append(sum("synchroniz" in str(w.message) for w in caught))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return counts

    small, small_drafter = make_engine(loaded, 1, warm_datastore, max_budget=2)
    large, large_drafter = make_engine(loaded, 4, warm_datastore, max_budget=16)
    try:
        small_counts = synchronisations(small, mt_bench_prompts[:1])
        large_counts = synchronisations(large, mt_bench_prompts[:4])
    finally:
        small_drafter.close()
        large_drafter.close()
    assert max(large_counts) == max(small_counts) <= 2, (small_counts, large_counts)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_an_engine_for_a_missing_gpu_is_refused_before_anything_loads(target_model_fp32):
    with pytest.raises(ValueError, match="sees no CUDA device"):
        load_causal_lm(None, "float32", "cuda")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        build_engine(EngineConfig(device="cuda", mode="ar", budget_policy="rule"),
                     target_model_fp32)


def test_auto_takes_a_given_model_where_it_is(target_model_fp32):
    engine = build_engine(EngineConfig(device="auto", mode="ar", budget_policy="rule",
                                       max_batch_size=1, max_len=64), target_model_fp32)
    assert engine.runner.device == torch.device("cpu")
    engine.close()

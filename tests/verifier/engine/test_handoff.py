"""The prefill -> decode KV handoff without Ray: exact bits, exact outputs, clear refusals."""

import dataclasses

import numpy as np
import pytest
import torch

from sssd.verifier.engine import GenerateRequest
from sssd.verifier.engine.handoff import PrefilledPrompt
from sssd.verifier.engine.model_runner import ModelRunner


def test_bfloat16_travels_as_raw_bits_and_comes_back_exact():
    keys = torch.randn(3, 2, 5, 4).to(torch.bfloat16)
    values = torch.randn(3, 2, 5, 4).to(torch.bfloat16)
    prefilled = PrefilledPrompt.from_tensors(keys, values, torch.randn(7))
    assert prefilled.keys.dtype == np.int16 and prefilled.dtype == "bfloat16"
    assert prefilled.num_tokens == 5
    back_keys, back_values, logits = prefilled.tensors()
    assert back_keys.dtype == torch.bfloat16 and torch.equal(back_keys, keys)
    assert torch.equal(back_values, values) and logits.shape == (7,)
    # Read-only arrays (as the object store hands them out) are read without a copy.
    prefilled.keys.flags.writeable = False
    assert PrefilledPrompt.tensors(prefilled)[0].data_ptr() == prefilled.keys.ctypes.data


def test_prefilled_requests_decode_exactly_like_local_prefill(engine_factory, target_model_fp32,
                                                              mt_bench_prompts,
                                                              greedy_references):
    prefill_runner = ModelRunner(target_model_fp32.model, max_seqs=1, max_len=1024)
    engine, drafter = engine_factory(3)
    try:
        indices = (1, 4, 7)
        sequences = [engine.add_request(GenerateRequest(mt_bench_prompts[i], 32),
                                        prefilled=prefill_runner.prefill_for_handoff(
                                            mt_bench_prompts[i]))
                     for i in indices]
        while engine.has_work():
            engine.step()
    finally:
        drafter.close()
    for seq, index in zip(sequences, indices):
        assert seq.output_ids == greedy_references[index][:32]
        assert seq.prefilled is None  # dropped once the cache slot holds it


def test_mismatched_prefill_is_refused(engine_factory, target_model_fp32, mt_bench_prompts):
    runner = ModelRunner(target_model_fp32.model, max_seqs=1, max_len=1024)
    prompt = mt_bench_prompts[0]
    prefilled = runner.prefill_for_handoff(prompt)
    engine, drafter = engine_factory(1)
    try:
        with pytest.raises(ValueError, match="holds .* tokens"):
            engine.add_request(GenerateRequest(prompt[:-1], 8), prefilled=prefilled)
        fewer_layers = dataclasses.replace(prefilled, keys=prefilled.keys[:-1],
                                           values=prefilled.values[:-1])
        with pytest.raises(ValueError, match="does not match this model"):
            engine.add_request(GenerateRequest(prompt, 8), prefilled=fewer_layers)
        as_bf16 = dataclasses.replace(prefilled, dtype="bfloat16")
        with pytest.raises(ValueError, match="does not match this model"):
            engine.add_request(GenerateRequest(prompt, 8), prefilled=as_bf16)
        assert not engine.has_work()  # nothing was queued
    finally:
        drafter.close()

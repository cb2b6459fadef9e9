"""Fixtures for the verifier tests: prompts, greedy references, engines on the real model."""

import numpy as np
import pytest
import torch

from sssd.common.corpus import first_turns, read_mt_bench
from sssd.drafter.build import build_datastore
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import Drafter
from sssd.verifier.budget_policy import RuleBudget
from sssd.verifier.engine import Engine
from sssd.verifier.model_runner import ModelRunner

NUM_PROMPTS = 20
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def mt_bench_prompts(target_model_fp32):
    tokenizer = target_model_fp32.tokenizer
    prompts = []
    for text in first_turns(read_mt_bench())[:NUM_PROMPTS]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


@pytest.fixture(scope="session")
def greedy_references(target_model_fp32, mt_bench_prompts):
    """Plain greedy decoding by transformers' own generate(), one prompt at a time."""
    model = target_model_fp32.model
    references = []
    with torch.inference_mode():
        for prompt in mt_bench_prompts:
            output = model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=MAX_NEW_TOKENS)
            references.append(output[0, len(prompt):].tolist())
    return references


@pytest.fixture(scope="session")
def warm_datastore(tmp_path_factory, target_model_fp32, greedy_references):
    """A datastore holding the model's own answers to half the prompts, plus unrelated noise."""
    directory = tmp_path_factory.mktemp("datastore")
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, target_model_fp32.vocab_size, size=200) for _ in range(50)]
    build_datastore(directory, greedy_references[::2] + noise, target_model_fp32.vocab_size,
                    target_model_fp32.fingerprint, shard_tokens=8000)
    return str(directory)


@pytest.fixture(scope="session")
def engine_factory(target_model_fp32):
    """make(max_batch_size, datastore_dir=None, proposer="inproc" | None | object) -> (engine,
    drafter); "inproc" builds an in-process SSSD drafter, None decodes autoregressively."""

    def make(max_batch_size, datastore_dir=None, proposer="inproc", max_budget=16):
        return make_engine(target_model_fp32, max_batch_size, datastore_dir, proposer, max_budget)

    return make


def make_engine(loaded, max_batch_size, datastore_dir=None, proposer="inproc", max_budget=16):
    runner = ModelRunner(loaded.model, max_seqs=max_batch_size, max_len=1024)
    drafter = None
    if proposer == "inproc":
        drafter = Drafter(DrafterConfig(datastore_dir=datastore_dir, vocab_size=loaded.vocab_size,
                                        tokenizer_fingerprint=loaded.fingerprint, num_threads=1))
        drafter.start()
    elif proposer is not None:
        drafter = proposer
    engine = Engine(runner, loaded.eos_token_ids, RuleBudget(32.0, max_budget), drafter,
                    decode=loaded.tokenizer.decode, max_batch_size=max_batch_size)
    return engine, drafter

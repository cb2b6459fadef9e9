"""bench/ssd.py's measuring loop runs (it had stopped running once without a test noticing) and
a proposer's answers equal plain decoding's there."""


from bench.ssd import run


def test_the_loop_decodes_the_same_with_a_proposer(target_model_fp32, mt_bench_prompts):
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    prompts = mt_bench_prompts[:2]
    plain = run(target_model_fp32, None, prompts, 2, 0.0, 12, 1)
    config = DrafterConfig(vocab_size=target_model_fp32.vocab_size, num_threads=1)
    with LocalDrafter(config) as proposer:  # prompt lookup: no datastore
        drafted = run(target_model_fp32, proposer, prompts, 2, 0.0, 12, 4)
    assert drafted["outputs"] == plain["outputs"]
    assert all(len(output) == 12 for output in plain["outputs"])
    assert drafted["tokens_per_step"] >= plain["tokens_per_step"] >= 1.0
    assert drafted["draft_failures"] == 0

"""bfloat16 verification whose per-row result does not depend on the rows beside it
(`EngineConfig.attention = "eager"` with the step's key length aligned to tree_batch.KV_ALIGN).

On CPUs whose bf16 matmul computes a row the same way whatever the number of rows (checked first;
the tests skip elsewhere, with the reason), eager attention makes a row's logits independent of
the tree and batch around it at the step's start, and plain bfloat16 greedy decoding gives the
same answer at every batch size. PyTorch's fused SDPA kernel (the default, faster) does neither:
its rounding changes with the number of query rows (bench/batch_invariance.py measures both).
"""

import numpy as np
import pytest
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.verifier.engine.model_runner import ModelRunner


def bf16_matmul_is_row_invariant() -> bool:
    """Every projection shape of the model (576 -> 1536, 1536 -> 576, 576 -> 576), on several
    inputs: one shape or one input is not enough (an AVX512-BF16 EPYC rounded 1536 -> 576 rows
    differently alone and in pairs, about one input in ten, while 576 -> 1536 never did)."""
    generator = torch.Generator().manual_seed(0)
    for features, outputs in ((576, 1536), (1536, 576), (576, 576)):
        weight = torch.randn(outputs, features, generator=generator).bfloat16()
        for _ in range(20):
            rows = (3 * torch.randn(32, features, generator=generator)).bfloat16()
            single = torch.nn.functional.linear(rows[:1], weight)[0]
            if not all(torch.equal(torch.nn.functional.linear(rows[:m], weight)[0], single)
                       for m in (2, 3, 8, 32)):
                return False
    return True


pytestmark = pytest.mark.skipif(not bf16_matmul_is_row_invariant(),
                                reason="this CPU's bf16 matmul rounds a row differently with "
                                "the number of rows: eager attention cannot make a step "
                                "batch-invariant here")


def chain(root: int, length: int) -> DraftTree:
    tokens = [root] + [100 + i for i in range(length)]
    return DraftTree(np.array(tokens, np.int32), np.arange(-1, length, dtype=np.int32))


def test_a_rows_logits_do_not_depend_on_tree_or_batch(target_model_bf16, mt_bench_prompts):
    runner = ModelRunner(target_model_bf16.model, max_seqs=2, max_len=512, attention="eager")
    try:
        root = int(runner.prefill(0, mt_bench_prompts[0]).argmax())
        runner.prefill(1, mt_bench_prompts[1])
        alone = runner.verify([chain(root, 0)])[0, 0]
        for length in (1, 7, 31):
            assert torch.equal(runner.verify([chain(root, length)])[0, 0], alone), length
            assert torch.equal(runner.verify([chain(root, length), chain(7, length)])[0, 0],
                               alone)
    finally:
        target_model_bf16.model.set_attn_implementation("sdpa")


def test_bf16_plain_greedy_is_the_same_at_every_batch_size(
        target_model_bf16, mt_bench_prompts, engine_factory):
    # Alone, then three at a time: rows see other rows of other lengths join and leave.
    prompts = mt_bench_prompts[:4]
    outputs = {}
    try:
        for batch_size in (1, 3):
            engine, _ = engine_factory(batch_size, proposer=None, loaded=target_model_bf16,
                                       attention="eager")
            outputs[batch_size] = engine.generate(prompts, max_tokens=48)
    finally:
        target_model_bf16.model.set_attn_implementation("sdpa")
    for index, (single, batched) in enumerate(zip(outputs[1], outputs[3])):
        assert single == batched, f"prompt {index} differs"

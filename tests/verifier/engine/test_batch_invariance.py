"""bfloat16 verification whose per-row result does not depend on the tree or batch around it.

With eager attention (EngineConfig.attention, the default) every op of a verification step
computes a row the same way whatever the number of rows, on CPUs whose bf16 matmul is
row-invariant (checked first; the test is skipped elsewhere, with the reason). Then a bfloat16
answer with speculation equals plain bfloat16 greedy decoding token for token, which PyTorch's
fused SDPA kernel does not give: its rounding changes with the number of query rows.
"""

import numpy as np
import pytest
import torch

from sssd.common.draft_tree import DraftTree
from sssd.verifier.engine.model_runner import ModelRunner


def bf16_matmul_is_row_invariant() -> bool:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=generator).bfloat16()
    rows = torch.randn(32, 576, generator=generator).bfloat16()
    single = torch.nn.functional.linear(rows[:1], weight)[0]
    return all(torch.equal(torch.nn.functional.linear(rows[:m], weight)[0], single)
               for m in (2, 8, 32))


pytestmark = pytest.mark.skipif(not bf16_matmul_is_row_invariant(),
                                reason="this CPU's bf16 matmul rounds a row differently with "
                                "the number of rows: eager attention cannot make a step "
                                "batch-invariant here")


def chain(root: int, length: int) -> DraftTree:
    tokens = [root] + [100 + i for i in range(length)]
    return DraftTree(np.array(tokens, np.int32), np.arange(-1, length, dtype=np.int32))


def test_a_rows_logits_do_not_depend_on_tree_or_batch(target_model_bf16, mt_bench_prompts):
    runner = ModelRunner(target_model_bf16.model, max_seqs=2, max_len=512, attention="eager")
    root = int(runner.prefill(0, mt_bench_prompts[0]).argmax())
    runner.prefill(1, mt_bench_prompts[1])
    alone = runner.verify([chain(root, 0)])[0, 0]
    for length in (1, 7, 31):
        assert torch.equal(runner.verify([chain(root, length)])[0, 0], alone), length
        assert torch.equal(runner.verify([chain(root, length), chain(7, length)])[0, 0], alone)


def test_bf16_greedy_with_speculation_equals_plain_bf16_greedy(
        target_model_bf16, mt_bench_prompts, warm_datastore, engine_factory):
    # Plain decoding one prompt at a time against speculation three at a time: rows see other
    # rows, of other lengths, and trees of many shapes; the answers must not notice.
    prompts = mt_bench_prompts[:6]
    plain, _ = engine_factory(1, proposer=None, loaded=target_model_bf16)
    expected = plain.generate(prompts, max_tokens=32)
    engine, drafter = engine_factory(3, warm_datastore, loaded=target_model_bf16)
    try:
        outputs = engine.generate(prompts, max_tokens=32)
    finally:
        drafter.close()
    for index, (output, reference) in enumerate(zip(outputs, expected)):
        assert output == reference, f"prompt {index} differs"
    assert engine.stats.mean_accepted_per_step > 1.5  # trees of many shapes were verified

"""The verifier's own forward pass (decoder.py) against the transformers forward it replaces:
the same logits in float32 on the served model and on small random Llama and Qwen2 models (the
Qwen2 one with its projection biases), on each of its paths, and the fallback for an
architecture it does not implement."""

import logging

import numpy as np
import pytest
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model.decoder import Decoder, UnsupportedModel
from sssd.verifier.engine.model_runner import ModelRunner

# float32 logits of the two forward passes differ by the order of their sums only: measured
# below 1e-4 on SmolLM2 (logits of magnitude ~20).
LOGITS_TOLERANCE = 5e-4


def random_trees(rng, num_trees, num_nodes, vocab_size):
    trees = []
    for _ in range(num_trees):
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, num_nodes)]
        tokens = rng.integers(0, vocab_size, num_nodes).astype(np.int32)
        trees.append(DraftTree(tokens, np.array(parents, np.int32)))
    return trees


def compare_runners(model, prompts, variants, rng, steps=((2, 8), (2, 1), (1, 40), (2, 80))):
    """Prefills `prompts` and verifies random trees in a transformers runner and in one runner
    per Decoder variant; asserts equal logits (to rounding) and equal argmax where the top two
    logits are apart. (1, 40): one long chain; (2, 80): trees past the kernel's 64 nodes."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    reference = ModelRunner(model, max_seqs=len(prompts), max_len=512, model_impl="transformers")
    runners = []
    for options in variants:
        options = dict(options)
        runner = ModelRunner(model, max_seqs=len(prompts), max_len=512, model_impl="sssd",
                             fixed_nodes=options.pop("fixed_nodes", None))
        runner.decoder = Decoder(model, **options)
        runners.append(runner)
    for slot, prompt in enumerate(prompts):
        expected = reference.prefill(slot, prompt)
        for runner in runners:
            assert (runner.prefill(slot, prompt) - expected).abs().max() < LOGITS_TOLERANCE
    for num_seqs, num_nodes in steps:
        trees = random_trees(rng, num_seqs, num_nodes, vocab_size)
        expected = reference.verify(trees).float()
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 1e-3
        for runner, options in zip(runners, variants):
            got = runner.verify(trees).float()
            assert (got - expected).abs().max() < LOGITS_TOLERANCE, (options, num_nodes)
            assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
        # Keep a random path, as the engine does, so that later steps see a ragged cache.
        accepted = [root_path(tree, int(rng.integers(0, 4))) for tree in trees]
        for runner in [reference] + runners:
            runner.commit_slots(accepted)


def root_path(tree, length):
    """Up to `length` nodes (root excluded) of a path down from the root: what acceptance may
    keep."""
    path, current = [], 0
    for node in range(1, tree.num_nodes):
        if len(path) == length:
            break
        if int(tree.parents[node]) == current:
            path.append(node)
            current = node
    return path


# The last: the GPU's fixed verification shape (ModelRunner.fixed_nodes) on the CPU, trees of
# up to 16 nodes padded to 16 on every slot's row, larger ones at their own shape.
VARIANTS = [{}, {"fused": False}, {"fused": False, "products": "plain"},
            {"fused": False, "products": "plain", "fixed_nodes": 16}]
VARIANT_IDS = ["fused-kernels", "torch-ops", "torch-ops-unpacked", "torch-ops-fixed-shape"]


def test_served_model_matches_transformers_in_float32(target_model_fp32, mt_bench_prompts):
    compare_runners(target_model_fp32.model, mt_bench_prompts[:2], VARIANTS,
                    np.random.default_rng(0))


def tiny_model(family, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    settings = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    tie_word_embeddings=family == "qwen2")
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**settings)).eval()
    with torch.no_grad():  # biases are zero at initialisation: make them count
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_and_qwen2_match_transformers(family):
    model = tiny_model(family)
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    prompts = [list(range(3, 70)), list(range(100, 117))]
    compare_runners(model, prompts, VARIANTS, np.random.default_rng(1))


def test_rotary_tables_are_the_models_own_values(target_model_fp32):
    model = target_model_fp32.model
    decoder = Decoder(model)
    cos_table, sin_table = decoder.rotary_tables(300)
    probe = torch.empty(1, 1)
    for start in (0, 17, 255):  # a step's positions, as transformers computes them
        positions = torch.arange(start, start + 9).unsqueeze(0)
        cos, sin = model.model.rotary_emb(probe, positions)
        assert torch.equal(cos_table[start:start + 9], cos[0])
        assert torch.equal(sin_table[start:start + 9], sin[0])


def test_an_unimplemented_architecture_falls_back_with_a_log_line(caplog):
    model = tiny_model("llama", hidden_act="gelu")
    assert "activation 'gelu'" in Decoder.supports(model)
    with caplog.at_level(logging.INFO, logger="sssd.common.model.decoder"):
        runner = ModelRunner(model, max_seqs=1, max_len=64, model_impl="auto")
    assert runner.impl == "transformers"
    assert "does not implement activation 'gelu'" in caplog.text
    with pytest.raises(UnsupportedModel, match="activation 'gelu'"):
        ModelRunner(model, max_seqs=1, max_len=64, model_impl="sssd")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        ModelRunner(model, max_seqs=1, max_len=64, model_impl="vllm")
    assert ModelRunner(tiny_model("llama"), max_seqs=1, max_len=64).impl == "sssd"


def test_a_step_that_does_not_fit_is_refused(target_model_fp32):
    # The engine never asks for this (its scheduler gives each row the blocks its tree needs
    # first): the runner refuses rather than write past the row's blocks.
    runner = ModelRunner(target_model_fp32.model, max_seqs=1, max_len=128, model_impl="sssd",
                         num_blocks=8)
    runner.prefill(0, list(range(10, 110)))
    with pytest.raises(ValueError, match="8 blocks hold 128 positions, the step writes up to "
                       "140"):
        runner.verify(random_trees(np.random.default_rng(0), 1, 40, 1000))


def test_a_bfloat16_model_where_onednn_cannot_prepack_it_gets_panels_or_plain_weights(
        monkeypatch):
    """On CPUs without AVX-512 (AMD Zen 2 and 3, say) oneDNN raises when asked to prepack a
    bfloat16 weight: the decoder asks first and takes the panels' AVX2 build, or keeps the
    weights as they are where no panels run either; asked for oneDNN anyway, it says why not."""
    from sssd.common.model import kernel_paths

    model = tiny_model("llama").to(torch.bfloat16)
    monkeypatch.setattr(kernel_paths, "_onednn_packs", lambda dtype: False)
    panels = kernel_paths.path("panels", torch.bfloat16) != "none"
    assert Decoder(model).layout in (("panels", "amx") if panels else ("plain",))
    with kernel_paths.forced(products="plain"):
        plain = Decoder(model)
    assert plain.layout == "plain"
    runner = ModelRunner(model, max_seqs=1, max_len=128, model_impl="sssd")
    runner.decoder = plain
    reference = ModelRunner(model, max_seqs=1, max_len=128, model_impl="transformers")
    prompt = list(range(3, 40))
    got, expected = runner.prefill(0, prompt).float(), reference.prefill(0, prompt).float()
    # bfloat16 logits of two orders of summation: a few units in the last place (0.008 seen)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05)
    with pytest.raises(ValueError, match="cannot run"):
        Decoder(model, products="onednn")
"""The draft runner's two forward passes: the project's own (the default for Llama and Qwen2) and
the transformers model's give the same logits for the speculator's steps, a chain and then
branches that see the chain up to where they attach and their own earlier nodes."""

import pytest
import torch

from sssd.common.model.decoder import Decoder
from sssd.speculator.config import SpeculatorConfig
from sssd.speculator.runner import DraftRunner, Node, chain_nodes


def branch_steps(runner: DraftRunner, prompt: list[int]) -> list[torch.Tensor]:
    """Slot 0: the prompt as a chain; then two branches grown two deep, one attached after the
    prompt's 10th token and one after its last, written past the chain (as speculator.py lays
    them out). Slot 1: a shorter chain in the same steps. Returns every step's kept logits."""
    out = runner.forward({0: chain_nodes(prompt, 0), 1: chain_nodes(prompt[:7], 0)},
                         {0: [9, len(prompt) - 1], 1: [6]})
    logits = [out[0], out[1]]
    base = len(prompt)
    attach = (9, len(prompt) - 1)
    tokens = [[11, 12], [21, 22]]  # per branch, per depth
    for depth in range(2):
        nodes = []
        for b, point in enumerate(attach):
            own = tuple(base + d * 2 + b for d in range(depth + 1))
            nodes.append(Node(tokens[b][depth], point + 1 + depth, own[-1], point + 1, own))
        out = runner.forward({0: nodes}, {0: [0, 1]})
        logits.append(out[0])
    return logits


def test_own_forward_pass_gives_the_transformers_logits_for_chains_and_branches(
        target_model_fp32):
    model = target_model_fp32.model
    own = DraftRunner(model, 2, 256, torch.device("cpu"), model_impl="sssd")
    reference = DraftRunner(model, 2, 256, torch.device("cpu"), model_impl="transformers")
    assert isinstance(own.own, Decoder) and reference.own is None
    prompt = list(range(40, 70))
    got, expected = branch_steps(own, prompt), branch_steps(reference, prompt)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.shape == theirs.shape and mine.dtype == torch.float32
        # float32 through two orders of summation
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-3)
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    # a branch depends on where it attaches: the two branches' logits differ
    assert not torch.allclose(got[2][0], got[2][1])


def test_the_speculator_refuses_an_unknown_forward_pass():
    assert SpeculatorConfig().model_impl == "auto"
    with pytest.raises(ValueError, match="model_impl must be one of"):
        SpeculatorConfig(model_impl="vllm")

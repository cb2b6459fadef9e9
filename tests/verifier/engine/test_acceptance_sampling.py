"""Tests of sssd.verifier.engine.acceptance, sampling: lossless verification of draft trees.

Sampling verification is checked for distribution equality: a tiny randomly initialized Llama
gives realistic target distributions at every node of a fixed draft tree, `accept_sampling` runs
NUM_TRIALS times, and a chi-square test compares, at every node the walk reached often enough,
the next emitted token with the target distribution at that node. Node 0 tests the first emitted
token (accepted child or recovered token) against the target at the root; a child c tests the
second emitted token given that c was accepted, against the target at c. Chains drafted from a
second tiny model (a perturbed copy) test speculative sampling with draft_probs the same way, per
accepted prefix. A deliberately wrong acceptance rule, and a wrong draft distribution, must fail
the same tests, so they are known to have power.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from sssd.speculator.sampling import saguaro_probs
from sssd.verifier.engine import acceptance
from sssd.verifier.engine.acceptance import (
    AcceptResult,
    TreeIndex,
    accept_at_positions,
    accept_greedy,
    accept_sampling,
)
from sssd.verifier.engine.request import SamplingParams
from sssd.verifier.engine.sampling import sample_tokens, target_probs

from support.devices import DEVICES
from support.tiny_llama import (
    CONTEXT,
    VOCAB_SIZE,
    next_token_logits,
    tiny_llama,
    tree_logits,
)

ALPHA = 1e-3  # family-wise significance level: split over the chi-square tests of one run
NUM_TRIALS = 20000  # verification steps per statistical test
MIN_VISITS = 400  # a node is tested when the walk reached it at least this often
MIN_EXPECTED = 5.0  # chi-square bins with a smaller expected count are pooled
# The draft model is the target with DRAFT_NOISE x std x N(0, 1) added to every weight; the tiny
# random Llama is chaotic enough that this alone makes q differ from p by a total variation of
# about 0.35-0.5 at the root, with about half the drafts accepted.
DRAFT_NOISE = 0.02
SAMPLING_CASES = {
    "temperature_1": SamplingParams(temperature=1.0),
    "temperature_0.7_top_k_5": SamplingParams(temperature=0.7, top_k=5),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Every tensor here is tiny: intra-op threads only add hand-off latency, which made this
    module three times slower on a loaded 2-core machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi2_critical(df: int, alpha: float) -> float:
    """The value a chi-square(df) variable exceeds with probability alpha (bisection)."""
    low, high = 0.0, df + 100.0 * (1.0 + df**0.5)
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if chi2_sf(middle, df) > alpha else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    df: int
    critical: float  # at the test's significance level
    num_samples: int

    @property
    def passed(self) -> bool:
        return self.statistic <= self.critical

    def __str__(self) -> str:
        return (f"chi2={self.statistic:.2f} df={self.df} critical={self.critical:.2f} "
                f"p={chi2_sf(self.statistic, self.df) if self.df else 1.0:.3g} "
                f"n={self.num_samples}")


def chi_square(counts: np.ndarray, probs: np.ndarray, alpha: float) -> ChiSquare:
    """Goodness of fit of counts [vocab_size] to probs [vocab_size] at significance alpha.

    A count on a token of zero probability fails outright (statistic = inf). Tokens whose
    expected count is below MIN_EXPECTED are pooled into one bin, itself merged into the
    smallest other bin while still too small, so the chi-square approximation holds.
    """
    num_samples = int(counts.sum())
    probs = probs.astype(np.float64) / probs.sum()
    if counts[probs == 0].sum() > 0:
        return ChiSquare(float("inf"), 0, 0.0, num_samples)
    expected = num_samples * probs  # [vocab_size]
    large = expected >= MIN_EXPECTED
    bins_observed = list(counts[large].astype(np.float64))
    bins_expected = list(expected[large])
    pooled_expected, pooled_observed = expected[~large].sum(), counts[~large].sum()
    if pooled_expected > 0:
        if pooled_expected < MIN_EXPECTED and bins_expected:
            smallest = int(np.argmin(bins_expected))
            bins_expected[smallest] += pooled_expected
            bins_observed[smallest] += pooled_observed
        else:
            bins_expected.append(pooled_expected)
            bins_observed.append(pooled_observed)
    df = len(bins_expected) - 1
    if df == 0:  # one bin holds all the mass: nothing left to test beyond the zero counts
        return ChiSquare(0.0, 0, 0.0, num_samples)
    observed_arr, expected_arr = np.array(bins_observed), np.array(bins_expected)
    statistic = float(((observed_arr - expected_arr) ** 2 / expected_arr).sum())
    return ChiSquare(statistic, df, chi2_critical(df, alpha), num_samples)


def test_chi2_critical_values_match_tables():
    assert chi2_critical(1, 0.05) == pytest.approx(3.8415, abs=1e-3)
    assert chi2_critical(4, 1e-3) == pytest.approx(18.467, abs=1e-3)
    assert chi2_critical(10, 1e-3) == pytest.approx(29.588, abs=1e-3)


def test_chi_square_accepts_the_true_distribution_and_rejects_another():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    tokens = sample_tokens(probs.expand(5000, -1), generator)
    counts = np.bincount(tokens.numpy(), minlength=5)
    assert chi_square(counts, probs.numpy(), ALPHA).passed
    assert not chi_square(counts, np.array([0.45, 0.35, 0.15, 0.05, 0.0]), ALPHA).passed
    assert not chi_square(counts + np.array([0, 0, 0, 0, 1]), probs.numpy(), ALPHA).passed


@pytest.fixture(scope="module")
def target_model() -> LlamaForCausalLM:
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft_model(target_model) -> LlamaForCausalLM:
    """The target with every weight perturbed: close enough that drafts are often accepted."""
    model = copy.deepcopy(target_model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(DRAFT_NOISE * parameter.std() * torch.randn(
                parameter.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def draft_tree(target_model) -> TreeIndex:
    """Root with a likely, an unlikely and a second likely child, some with children of their own.

    Children are chosen by the model's plain (temperature 1) distribution, so under top-k the
    unlikely child has no target mass at all.
    """

    def ranked(path: list[int]) -> list[int]:
        logits = next_token_logits(target_model, [CONTEXT + path])[0]
        return logits.argsort(descending=True).tolist()

    root = ranked([])
    a1, a2, unlikely = root[0], root[1], root[-1]
    after_a1 = ranked([a1])
    after_a2 = ranked([a2])
    after_a1_b1 = ranked([a1, after_a1[0]])
    token_ids = [CONTEXT[-1], a1, unlikely, a2, after_a1[0], after_a1[2], after_a2[0],
                 after_a1_b1[0]]
    parents = [-1, 0, 0, 0, 1, 1, 3, 4]
    return TreeIndex(np.array(token_ids, dtype=np.int32), np.array(parents, dtype=np.int32))


def random_tree(rng: random.Random, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    parents = [-1] + [rng.randrange(node) for node in range(1, num_nodes)]
    token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(num_nodes)]
    return np.array(token_ids, dtype=np.int32), np.array(parents, dtype=np.int32)


@pytest.mark.parametrize("rule", ["generator", "position_keyed"])
def test_sampling_at_temperature_zero_equals_greedy(rule):
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    for seed in range(200):
        token_ids, parents = random_tree(rng, rng.randint(1, 16))
        # Few distinct logit values: argmax ties and frequent matches.
        logits = torch.randint(0, 3, (len(token_ids), VOCAB_SIZE), generator=generator).float()
        probs = target_probs(logits, SamplingParams(temperature=0.0))
        expected = accept_greedy(token_ids, parents, logits.argmax(dim=-1))
        result = accept_sampling(token_ids, parents, probs, generator) if rule == "generator" \
            else accept_at_positions(token_ids, parents, probs, seed, 0)
        assert result == expected


def test_sampling_is_reproducible_with_a_seed():
    rng = random.Random(1)
    token_ids, parents = random_tree(rng, 12)
    probs = torch.softmax(torch.randn(12, VOCAB_SIZE), dim=-1)
    params = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(params.seed)
        runs.append([accept_sampling(token_ids, parents, probs, generator) for _ in range(50)])
    assert runs[0] == runs[1]


def test_children_holding_all_the_mass_are_always_accepted():
    # Rounding in R must never reject the last child when it holds all the remaining mass.
    probs = torch.tensor([[0.3, 0.0, 0.7, 0.0], [0.25, 0.25, 0.25, 0.25], [0.25] * 4])
    generator = torch.Generator().manual_seed(0)
    counts = {1: 0, 2: 0}
    for _ in range(2000):
        result = accept_sampling(np.array([3, 0, 2]), np.array([-1, 0, 0]), probs, generator)
        assert result.num_accepted == 1
        counts[result.accepted_nodes[0]] += 1
    assert 450 < counts[1] < 750  # 0.3 of 2000 = 600, binomial sd 20


def test_children_without_mass_are_never_accepted():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25] * 4, [0.25] * 4])
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        result = accept_sampling(np.array([3, 0, 2]), np.array([-1, 0, 0]), probs, generator)
        assert result.num_accepted == 0 and result.bonus_token in (1, 3)


def test_all_zero_residual_falls_back_to_the_target(monkeypatch):
    # Force a rejection that only rounding could cause: every child rejected though they hold
    # all the mass. The recovered token then comes from the target instead of failing.
    monkeypatch.setattr(acceptance, "_point_mass_accept_probability",
                        lambda mass, remaining: 0.0)
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.25] * 4, [0.25] * 4])
    result = accept_sampling(np.array([3, 0, 2]), np.array([-1, 0, 0]), probs,
                             torch.Generator().manual_seed(0))
    assert result.num_accepted == 0 and result.bonus_token in (0, 2)


def test_draft_distribution_equal_to_target_accepts_everything():
    probs = torch.softmax(torch.randn(4, VOCAB_SIZE), dim=-1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        result = accept_sampling(np.array([3, 1, 2, 5]), np.array([-1, 0, 1, 2]), probs,
                                 generator, draft_probs=probs)
        assert result.accepted_tokens == [1, 2, 5]


def test_draft_probs_need_a_chain_and_matching_shapes():
    probs = torch.full((3, VOCAB_SIZE), 1.0 / VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="chain"):
        accept_sampling(np.array([3, 1, 2]), np.array([-1, 0, 0]), probs, generator,
                        draft_probs=probs)
    with pytest.raises(ValueError, match="shape"):
        accept_sampling(np.array([3, 1, 2]), np.array([-1, 0, 1]), probs, generator,
                        draft_probs=probs[:2])
    with pytest.raises(ValueError, match="num_nodes=3"):
        accept_sampling(np.array([3, 1, 2]), np.array([-1, 0, 1]), probs[:2], generator)


def count_next_tokens(results: list[AcceptResult], key: Callable[[AcceptResult, int], object]
                      ) -> dict[object, np.ndarray]:
    """Per reached position, counts [vocab_size] of the token emitted right after it.

    Position i of a step (i = 0 .. num_accepted) is identified by key(result, i); the token
    emitted after it is the next accepted token or, at the end, the recovered / bonus token.
    """
    counts: dict[object, np.ndarray] = {}
    for result in results:
        emitted = result.emitted_tokens
        for position in range(len(emitted)):
            row = counts.setdefault(key(result, position), np.zeros(VOCAB_SIZE, dtype=np.int64))
            row[emitted[position]] += 1
    return counts


def tree_chi_squares(tree: TreeIndex, probs: torch.Tensor, seed: int) -> dict[int, ChiSquare]:
    """accept_sampling NUM_TRIALS times; a chi-square test per node reached MIN_VISITS times."""
    generator = torch.Generator(probs.device).manual_seed(seed)
    token_ids, parents = np.array(tree.token_ids), np.array(tree.parents)
    results = [accept_sampling(token_ids, parents, probs, generator) for _ in range(NUM_TRIALS)]
    counts = count_next_tokens(
        results, lambda result, i: ([0] + result.accepted_nodes)[i])  # the node reached
    return chi_squares(counts, {node: probs[node] for node in counts})


def chi_squares(counts: dict[object, np.ndarray], probs: dict[object, torch.Tensor]
                ) -> dict[object, ChiSquare]:
    """A chi-square test per position reached MIN_VISITS times, with a Bonferroni split of
    ALPHA over them so that a correct sampler fails a run with probability below ALPHA."""
    tested = [key for key in counts if counts[key].sum() >= MIN_VISITS]
    return {key: chi_square(counts[key], probs[key].cpu().numpy(), ALPHA / len(tested))
            for key in tested}


def describe(tests: dict) -> str:
    return "\n".join(f"  {key}: {test}" for key, test in tests.items())


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_point_mass_sampling_keeps_the_target_distribution(case, device, target_model,
                                                           draft_tree):
    probs = target_probs(tree_logits(target_model, draft_tree).to(device),
                         SAMPLING_CASES[case])
    tests = tree_chi_squares(draft_tree, probs, seed=1)
    # Not vacuous: the root, its two likely children and a grandchild are tested.
    assert {0, 1, 3} <= tests.keys() and tests.keys() & {4, 5, 6, 7}, describe(tests)
    assert all(test.passed for test in tests.values()), describe(tests)


def keyed_chi_squares(tree: TreeIndex, probs: torch.Tensor, first_seed: int
                      ) -> dict[int, ChiSquare]:
    """accept_at_positions with NUM_TRIALS different seeds; a chi-square test per node reached
    MIN_VISITS times, as tree_chi_squares."""
    token_ids, parents = np.array(tree.token_ids), np.array(tree.parents)
    results = [accept_at_positions(token_ids, parents, probs, first_seed + trial, 17)
               for trial in range(NUM_TRIALS)]
    counts = count_next_tokens(results, lambda result, i: ([0] + result.accepted_nodes)[i])
    return chi_squares(counts, {node: probs[node] for node in counts})


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_position_keyed_sampling_keeps_the_target_distribution(case, device, target_model,
                                                               draft_tree):
    """The engine's rule, on every device: the probabilities stay where the logits are."""
    probs = target_probs(tree_logits(target_model, draft_tree).to(device),
                         SAMPLING_CASES[case])
    assert probs.device.type == device
    tests = keyed_chi_squares(draft_tree, probs, first_seed=10**6)
    assert {0, 1, 3} <= tests.keys() and tests.keys() & {4, 5, 6, 7}, describe(tests)
    assert all(test.passed for test in tests.values()), describe(tests)


def test_one_uniform_for_every_position_fails_the_same_test(monkeypatch, target_model,
                                                            draft_tree):
    # The mistake keying must avoid: the same draw at every depth. A child accepted because
    # u fell into its slice of p then draws its own successor from that slice only.
    original = acceptance.position_uniforms
    monkeypatch.setattr(acceptance, "position_uniforms",
                        lambda seed, positions: original(seed, [0] * len(positions)))
    probs = target_probs(tree_logits(target_model, draft_tree), SAMPLING_CASES["temperature_1"])
    tests = keyed_chi_squares(draft_tree, probs, first_seed=10**6)
    assert not all(test.passed for test in tests.values()), describe(tests)


def test_position_keyed_tokens_do_not_depend_on_the_drafts(target_model, draft_tree):
    # Whatever the tree, the emitted tokens are the ones plain decoding draws at those
    # positions: here, the chain that follows the draws from the root is accepted whole when
    # drafted, and a tree without it stops at the same first token.
    probs = target_probs(tree_logits(target_model, draft_tree), SAMPLING_CASES["temperature_1"])
    for seed in range(50):
        lone = accept_at_positions(np.array(draft_tree.token_ids[:1]), np.array([-1]),
                                   probs[:1], seed, 4)
        full = accept_at_positions(np.array(draft_tree.token_ids), np.array(draft_tree.parents),
                                   probs, seed, 4)
        assert full.emitted_tokens[0] == lone.bonus_token


def test_wrong_acceptance_rule_fails_the_same_test(monkeypatch, target_model, draft_tree):
    # The classic mistake: accept child i with probability p(c_i), forgetting to divide by the
    # mass R_i left after the earlier siblings were rejected.
    monkeypatch.setattr(acceptance, "_point_mass_accept_probability",
                        lambda mass, remaining: min(1.0, mass))
    probs = target_probs(tree_logits(target_model, draft_tree), SAMPLING_CASES["temperature_1"])
    tests = tree_chi_squares(draft_tree, probs, seed=1)
    assert not tests[0].passed, describe(tests)


CHAIN_LENGTH = 3


@dataclass(frozen=True)
class PrefixTables:
    """Next-token distributions after CONTEXT + every prefix of up to CHAIN_LENGTH tokens."""

    by_depth: list[torch.Tensor]  # [depth] of [vocab_size] * depth + [vocab_size] float32

    def at(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """[vocab_size] the distribution after CONTEXT + prefix."""
        return self.by_depth[len(prefix)][prefix]

    def along(self, chains: torch.Tensor) -> torch.Tensor:
        """[num_chains, length + 1, vocab_size] the distributions at every node of chains
        [num_chains, length]: after CONTEXT, CONTEXT + chain[:1], ..., CONTEXT + chain."""
        num_chains, length = chains.shape
        rows = [self.by_depth[0].expand(num_chains, -1)]  # [num_chains, vocab_size] each
        rows += [self.by_depth[depth][tuple(chains[:, :depth].T)]
                 for depth in range(1, length + 1)]
        return torch.stack(rows, dim=1)


def prefix_tables(model: LlamaForCausalLM, params: SamplingParams) -> PrefixTables:
    by_depth = []
    for depth in range(CHAIN_LENGTH + 1):
        prefixes = itertools.product(range(VOCAB_SIZE), repeat=depth)  # in row-major order
        logits = next_token_logits(model, [CONTEXT + list(prefix) for prefix in prefixes])
        by_depth.append(target_probs(logits, params).reshape((VOCAB_SIZE,) * (depth + 1)))
    return PrefixTables(by_depth)


def chain_chi_squares(target: PrefixTables, draft: PrefixTables, seed: int,
                      claimed_draft: PrefixTables | None = None) -> dict[tuple, ChiSquare]:
    """Drafts a chain from `draft` per trial, verifies it with draft_probs from `claimed_draft`
    (default: the true draft distribution), and tests every accepted prefix reached often enough.
    """
    claimed_draft = claimed_draft or draft
    draft_generator = torch.Generator().manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    chains = torch.empty((NUM_TRIALS, CHAIN_LENGTH), dtype=torch.int64)  # [num_trials, length]
    for depth in range(CHAIN_LENGTH):
        rows = draft.along(chains[:, :depth])[:, depth]  # [num_trials, vocab_size]
        chains[:, depth] = sample_tokens(rows, draft_generator)
    probs = target.along(chains)  # [num_trials, num_nodes, vocab_size]
    draft_probs = claimed_draft.along(chains)  # [num_trials, num_nodes, vocab_size]
    parents = np.arange(-1, CHAIN_LENGTH)
    token_ids = np.concatenate([np.full((NUM_TRIALS, 1), CONTEXT[-1]), chains.numpy()], axis=1)
    results = [accept_sampling(token_ids[trial], parents, probs[trial], generator,
                               draft_probs=draft_probs[trial]) for trial in range(NUM_TRIALS)]
    counts = count_next_tokens(results, lambda result, i: tuple(result.accepted_tokens[:i]))
    visited = sorted(counts, key=lambda prefix: (len(prefix), prefix))
    return chi_squares({prefix: counts[prefix] for prefix in visited},
                       {prefix: target.at(prefix) for prefix in visited})


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_speculative_sampling_keeps_the_target_distribution(case, target_model, draft_model):
    params = SAMPLING_CASES[case]
    tests = chain_chi_squares(prefix_tables(target_model, params),
                              prefix_tables(draft_model, params), seed=2)
    assert () in tests and any(len(prefix) == 1 for prefix in tests), describe(tests)
    assert all(test.passed for test in tests.values()), describe(tests)


def test_wrong_draft_distribution_fails_the_same_test(target_model, draft_model):
    # Claiming q = p while drafting from the real q accepts every draft: the output is q.
    params = SAMPLING_CASES["temperature_1"]
    target = prefix_tables(target_model, params)
    tests = chain_chi_squares(target, prefix_tables(draft_model, params), seed=2,
                              claimed_draft=target)
    assert not tests[()].passed, describe(tests)


def saguaro_tables(draft: PrefixTables, top_f: int, c: float) -> PrefixTables:
    """The speculator's q' (sssd.speculator.sampling) at every prefix of `draft`."""
    return PrefixTables([saguaro_probs(rows, top_f, c) for rows in draft.by_depth])


def test_saguaro_drafts_verified_with_their_distribution_keep_the_target(target_model,
                                                                        draft_model):
    params = SAMPLING_CASES["temperature_1"]
    saguaro = saguaro_tables(prefix_tables(draft_model, params), top_f=3, c=0.3)
    tests = chain_chi_squares(prefix_tables(target_model, params), saguaro, seed=4)
    assert () in tests and any(len(prefix) == 1 for prefix in tests), describe(tests)
    assert all(test.passed for test in tests.values()), describe(tests)


def test_saguaro_drafts_verified_with_the_plain_draft_distribution_fail(target_model,
                                                                       draft_model):
    # Sampling from q' but verifying as if the drafts came from q: the output is no longer p.
    params = SAMPLING_CASES["temperature_1"]
    draft = prefix_tables(draft_model, params)
    tests = chain_chi_squares(prefix_tables(target_model, params),
                              saguaro_tables(draft, top_f=3, c=0.3), seed=4,
                              claimed_draft=draft)
    assert not all(test.passed for test in tests.values()), describe(tests)

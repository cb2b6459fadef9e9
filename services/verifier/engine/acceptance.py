"""The acceptance step of tree verification: pure functions on tensors.

After the forward pass over a draft tree, the target's distribution is known at every node.
Walking from the root, each step emits:
- accepted tokens: draft tokens on one root-to-node path that the target keeps;
- then one more token, `AcceptResult.bonus_token`. When the walk stops at a node because every
  child was rejected it is the *recovered* token, sampled from the residual distribution; when
  the walk runs off a leaf it is the *bonus* token, sampled from the target at that leaf. Either
  way the step emits `accepted_tokens + [bonus_token]`, at least one token.

Greedy verification compares children with the target's argmax. The engine samples with
`accept_at_positions`: the token after every node is drawn with randomness keyed by (seed,
output position) and compared like an argmax, so a seeded answer does not depend on the drafts.
`accept_sampling` is the generator-driven alternative. Its sampling verification is lossless
rejection sampling: n-gram drafts carry no draft distribution, so each draft token is a point mass
and SpecInfer's multi-step speculative sampling (Miao et al., ASPLOS 2024) reduces to trying the
children one by one against the target's remaining mass; drafts from a draft model carry their
distribution q and are verified by standard speculative sampling (Leviathan et al., ICML 2023,
Algorithm 1; Chen et al., 2023, Algorithm 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sssd.verifier.engine.sampling import position_uniforms, sample_with_uniforms


@dataclass(frozen=True)
class AcceptResult:
    """What one verification step keeps of one draft tree."""

    accepted_nodes: list[int]  # [num_accepted] tree nodes along the accepted path, root excluded
    accepted_tokens: list[int]  # [num_accepted] their tokens
    bonus_token: int  # the step's last token: recovered after a rejection, or bonus after a leaf

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def emitted_tokens(self) -> list[int]:
        """[num_accepted + 1] the tokens the step appends to the sequence."""
        return self.accepted_tokens + [self.bonus_token]


class TreeIndex:
    """Children of every node of a draft tree, in tree order (increasing node index).

    Built once per step from `parents` and used by both acceptance functions.
    """

    def __init__(self, token_ids: np.ndarray | torch.Tensor, parents: np.ndarray | torch.Tensor):
        tokens = _as_int_list(token_ids)  # [num_nodes]
        parent_list = _as_int_list(parents)  # [num_nodes]
        if not tokens or len(tokens) != len(parent_list):
            raise ValueError(f"token_ids and parents must have the same non-zero length, got "
                             f"{len(tokens)} and {len(parent_list)}")
        if parent_list[0] != -1:
            raise ValueError(f"node 0 must be the root (parent -1), got parent {parent_list[0]}")
        children: list[list[int]] = [[] for _ in parent_list]
        for node, parent in enumerate(parent_list[1:], start=1):
            if not 0 <= parent < node:
                raise ValueError(f"parents[{node}] must be in [0, {node}) (parents before "
                                 f"children, one root), got {parent}")
            children[parent].append(node)
        self.token_ids = tokens  # [num_nodes] Python ints, token_ids[0] is the root
        self.parents = parent_list  # [num_nodes] Python ints, -1 for the root
        self.children = [tuple(kids) for kids in children]  # [num_nodes] child nodes, tree order

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def child_tokens(self, node: int) -> list[int]:
        return [self.token_ids[child] for child in self.children[node]]


def accept_greedy(
    token_ids: np.ndarray | torch.Tensor,
    parents: np.ndarray | torch.Tensor,
    target_argmax: np.ndarray | torch.Tensor,
) -> AcceptResult:
    """Greedy verification: descend while a child's token is the target's argmax at its parent.

    target_argmax [num_nodes] int64: argmax of the target logits at each node. If two siblings
    carry the same token, the first in tree order is taken. The result equals plain greedy
    decoding token for token.
    """
    tree = TreeIndex(token_ids, parents)
    argmax = _as_int_list(target_argmax)  # [num_nodes]
    if len(argmax) != tree.num_nodes:
        raise ValueError(f"target_argmax must have one entry per node ({tree.num_nodes}), "
                         f"got {len(argmax)}")
    accepted_nodes: list[int] = []
    node = 0
    while True:
        match = next((c for c in tree.children[node] if tree.token_ids[c] == argmax[node]), None)
        if match is None:
            break
        accepted_nodes.append(match)
        node = match
    return AcceptResult(accepted_nodes, [tree.token_ids[n] for n in accepted_nodes], argmax[node])


def accept_at_positions(
    token_ids: np.ndarray | torch.Tensor,
    parents: np.ndarray | torch.Tensor,
    probs: torch.Tensor,
    seed: int,
    first_position: int,
) -> AcceptResult:
    """Lossless sampling verification with randomness keyed by (seed, output position).

    probs [num_nodes, vocab_size]: the target distribution at each node. The token that follows
    node j is drawn at output position `first_position + depth(j)` with
    `sampling.position_uniforms(seed, ...)`, exactly as plain decoding would draw it there; a
    draft token is accepted when it equals that draw. This is greedy acceptance against the
    sampled tokens instead of the argmax: an accepted child's probability is p(c), a walk that
    stops emits the draw itself, so every emitted token follows p, and the answer depends on
    (seed, prompt, settings) only, never on which drafts were offered.
    """
    tree = TreeIndex(token_ids, parents)
    drawn = draws_at_positions(tree.parents, probs, seed, first_position)
    return accept_greedy(tree.token_ids, tree.parents, drawn)


def draws_at_positions(parents: np.ndarray | list[int], probs: torch.Tensor, seed: int,
                       first_position: int) -> torch.Tensor:
    """[num_nodes] int64 on probs' device: the token drawn after each node of a tree, node j
    at output position `first_position + depth(j)` (see accept_at_positions). The depths come
    from `parents` on the host; nothing is read back from the device."""
    parent_list = _as_int_list(parents)  # [num_nodes]
    if probs.dim() != 2 or probs.shape[0] != len(parent_list):
        raise ValueError(f"probs must be [num_nodes={len(parent_list)}, vocab_size], got shape "
                         f"{tuple(probs.shape)}")
    depths = [0] * len(parent_list)
    for node in range(1, len(parent_list)):
        depths[node] = depths[parent_list[node]] + 1
    uniforms = position_uniforms(seed, [first_position + depth for depth in depths])
    return sample_with_uniforms(probs, uniforms)  # [num_nodes]


def accept_sampling(
    token_ids: np.ndarray | torch.Tensor,
    parents: np.ndarray | torch.Tensor,
    probs: torch.Tensor,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> AcceptResult:
    """Lossless rejection sampling over a draft tree: the emitted tokens follow the target exactly.

    probs [num_nodes, vocab_size] float: the target distribution at each node, from
    `sampling.target_probs`. Without `draft_probs` every draft token is a point mass (n-gram
    drafts). With `draft_probs` [num_nodes, vocab_size] the tree must be a chain (at most one
    child per node) and draft_probs[node] is the distribution the child of `node` was sampled
    from, with the same sampling params as the target. All randomness comes from `generator`
    (on probs.device; None = torch's default generator), so a seeded generator reproduces the
    result.

    The walk itself runs on Python floats gathered once per call (each node's mass on its own
    token under its parent's distribution, one uniform per node); tensors over the vocabulary
    are touched again only to sample the final recovered or bonus token.
    """
    tree = TreeIndex(token_ids, parents)
    num_nodes = tree.num_nodes
    if probs.dim() != 2 or probs.shape[0] != num_nodes:
        raise ValueError(f"probs must be [num_nodes={num_nodes}, vocab_size], got shape "
                         f"{tuple(probs.shape)}")
    if draft_probs is not None:
        if draft_probs.shape != probs.shape:
            raise ValueError(f"draft_probs must have the shape of probs {tuple(probs.shape)}, "
                             f"got {tuple(draft_probs.shape)}")
        if any(len(kids) > 1 for kids in tree.children):
            raise ValueError("draft_probs requires a chain (at most one child per node); "
                             "a branching tree's drafts must be verified as point masses")
    device = probs.device
    vocab_size = probs.shape[1]
    # Each node's token under its parent's row, as flat indices; entry node - 1 is node's.
    flat_index = torch.tensor([parent * vocab_size + token for parent, token
                               in zip(tree.parents[1:], tree.token_ids[1:])],
                              dtype=torch.int64, device=device)  # [num_nodes - 1]
    target_mass = probs.reshape(-1)[flat_index].tolist()  # [num_nodes - 1] p(x)
    # uniforms[node] decides node's acceptance, uniforms[0] samples the step's last token.
    uniforms = torch.rand(num_nodes, dtype=torch.float64, device=device,
                          generator=generator).tolist()  # [num_nodes]
    if draft_probs is None:
        row_mass = probs.sum(dim=-1, dtype=torch.float64).tolist()  # [num_nodes]
    else:
        draft_mass = draft_probs.reshape(-1)[flat_index].tolist()  # [num_nodes - 1] q(x)

    accepted_nodes: list[int] = []
    node = 0
    while tree.children[node]:
        children = tree.children[node]
        if draft_probs is None:
            chosen = _choose_point_mass(tree, children, target_mass, row_mass[node], uniforms)
        else:
            child = children[0]
            accept_prob = _speculative_accept_probability(target_mass[child - 1],
                                                          draft_mass[child - 1])
            chosen = child if uniforms[child] < accept_prob else None
        if chosen is None:  # every child rejected: the recovered token ends the step
            if draft_probs is None:
                residual = probs[node].clone()  # [vocab_size]
                residual[torch.tensor(tree.child_tokens(node), device=device)] = 0.0
            else:
                # Leviathan et al. 2023, Algorithm 1: sample from norm(max(0, p - q)).
                residual = (probs[node].float() - draft_probs[node].float()).clamp(min=0.0)
            # An all-zero residual is only reachable through rounding (the rejection had
            # probability ~0): fall back to p rather than fail.
            recovered = _sample_one(residual, uniforms[0])
            if recovered is None:
                recovered = _sample_one(probs[node], uniforms[0])
            return AcceptResult(accepted_nodes, [tree.token_ids[n] for n in accepted_nodes],
                                recovered)
        accepted_nodes.append(chosen)
        node = chosen
    # Ran off a leaf with every draft on the path accepted: the bonus token comes from p there.
    bonus = _sample_one(probs[node], uniforms[0])
    return AcceptResult(accepted_nodes, [tree.token_ids[n] for n in accepted_nodes], bonus)


def _choose_point_mass(
    tree: TreeIndex,
    children: tuple[int, ...],
    target_mass: list[float],
    row_mass: float,
    uniforms: list[float],
) -> int | None:
    """One node of SpecInfer's multi-step speculative sampling with point-mass drafts.

    p is the target distribution at the node, R the mass not yet removed (initially all of p).
    Child c, tried in tree order, is accepted with probability p(c) / R; a rejection removes it
    (R -= p(c), p(c) = 0). Overall child c_i is accepted with probability p(c_i), and if none
    is, the recovered token is drawn from p without the children, renormalized: together
    exactly p (the same law as one draw from p that is accepted when it is a child's token).
    Returns the accepted child, or None when all were rejected.
    """
    remaining = row_mass
    tried: set[int] = set()
    for child in children:
        token = tree.token_ids[child]
        # A sibling repeating an earlier token finds that token's mass already removed.
        mass = 0.0 if token in tried else target_mass[child - 1]
        tried.add(token)
        if uniforms[child] < _point_mass_accept_probability(mass, remaining):
            return child
        remaining -= mass
    return None


def _point_mass_accept_probability(mass: float, remaining: float) -> float:
    """p(c) / R, exact up to rounding: a child holding (by rounding, more than) all of the
    remaining mass is accepted for sure, a child without mass never."""
    if mass <= 0.0:
        return 0.0
    if mass >= remaining:
        return 1.0
    return mass / remaining


def _speculative_accept_probability(target_mass: float, draft_mass: float) -> float:
    """min(1, p(x) / q(x)) (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    q(x) = 0 cannot happen for a token drawn from q; such a token is accepted if p allows it.
    """
    if draft_mass <= 0.0:
        return 1.0 if target_mass > 0.0 else 0.0
    return min(1.0, target_mass / draft_mass)


def _sample_one(weights: torch.Tensor, uniform: float) -> int | None:
    """Inverse-CDF sample from weights [vocab_size] with a given uniform in [0, 1); None when
    the weights are all zero. The one-row form of `sampling.sample_tokens`."""
    cumulative = weights.double().cumsum(dim=0)  # [vocab_size]
    total = float(cumulative[-1])
    if not total > 0.0:
        return None
    target = torch.tensor([uniform * total], dtype=torch.float64, device=weights.device)  # [1]
    token = int(torch.searchsorted(cumulative, target, right=True))
    if token == cumulative.shape[0]:  # uniform * total rounded up to total
        token = int((cumulative < total).sum())  # the last token with mass
    return token


def _as_int_list(values: np.ndarray | torch.Tensor | list[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return np.asarray(values).tolist()

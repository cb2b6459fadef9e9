"""A request's adjustments of the target's logits at every node of a draft tree, and the
log-probabilities it reports.

A token's penalties depend on the tokens before it. At node j of a tree those are the answer so
far *and the draft tokens on the path from the root to j*, which only become the answer if j is
accepted. So each node is adjusted with its own path, and the token drawn after j is drawn from
exactly the distribution plain decoding would use had it generated that path: verification
against these rows stays lossless (a seeded answer is the same with speculation off; tested).

The adjustments, in vLLM's order and meanings (OpenAI's for the first two):
- frequency / presence penalty: minus `frequency * count + presence * (count > 0)`, counts of
  the answer's tokens (the prompt's do not count);
- repetition penalty (Keskar et al., 2019, CTRL): a token seen in the prompt or the answer has
  its logit divided by the penalty when positive, multiplied by it when negative;
- logit bias: added to the logit;
- min_tokens: EOS and the stop token ids are impossible while the answer is shorter.
Temperature, top-k, top-p and min-p follow in sampling.target_probs.

Log-probabilities are the model's own (vLLM's default "raw" mode): log-softmax of the logits
before any adjustment, at the node before each emitted token, so they are the same with and
without speculation.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from sssd.verifier.engine.request import GenerateRequest
from sssd.verifier.engine.token_logprob import TokenLogprob


def needs_processing(request: GenerateRequest, num_output_tokens: int) -> bool:
    """Whether this request's logits are adjusted at all while it has this many tokens."""
    return request.sampling.has_penalties or num_output_tokens < request.min_tokens


def node_paths(parents: Sequence[int], token_ids: Sequence[int]) -> list[list[int]]:
    """[num_nodes] the draft tokens from the root (excluded: it is already in the answer)
    down to each node, that node's token included."""
    paths: list[list[int]] = [[]]
    for node in range(1, len(parents)):
        paths.append(paths[parents[node]] + [token_ids[node]])
    return paths


def process_tree_logits(logits: torch.Tensor, request: GenerateRequest,
                        output_ids: Sequence[int], parents: Sequence[int],
                        token_ids: Sequence[int], eos_token_ids: Collection[int]) -> None:
    """Adjusts `logits` [num_nodes, vocab_size] float in place: row j becomes the logits the
    request samples from after node j (see the module docstring)."""
    num_nodes, vocab_size = logits.shape
    params = request.sampling
    device = logits.device
    paths = node_paths(parents, token_ids)
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        counts = _path_counts(output_ids, paths, vocab_size, device)  # [num_nodes, vocab_size]
        if params.frequency_penalty:
            logits -= params.frequency_penalty * counts
        if params.presence_penalty:
            logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
        if params.repetition_penalty != 1:
            seen = counts > 0  # [num_nodes, vocab_size]
            prompt = torch.tensor(request.prompt_ids, dtype=torch.int64, device=device)
            seen[:, prompt] = True
            penalty = params.repetition_penalty
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits.copy_(torch.where(seen, penalized, logits))
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=device)
        logits[:, ids] += bias
    if len(output_ids) < request.min_tokens:
        ends = sorted(set(request.stop_token_ids) | (set() if request.ignore_eos
                                                      else set(eos_token_ids)))
        ends = [t for t in ends if t < vocab_size]
        # Node j's token would be the answer's (len(output_ids) + depth(j) + 1)-th.
        short = [j for j in range(num_nodes)
                 if len(output_ids) + len(paths[j]) < request.min_tokens]
        if ends and short:
            rows = torch.tensor(short, dtype=torch.int64, device=device)
            cols = torch.tensor(ends, dtype=torch.int64, device=device)
            logits[rows.unsqueeze(1), cols.unsqueeze(0)] = float("-inf")


def _path_counts(output_ids: Sequence[int], paths: list[list[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """[num_nodes, vocab_size] float32: each token's count in the answer plus the node's path."""
    base = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64),
                          minlength=vocab_size)[:vocab_size].float()  # [vocab_size]
    counts = base.to(device).expand(len(paths), vocab_size).clone()  # [num_nodes, vocab_size]
    rows = [j for j, path in enumerate(paths) for _ in path]
    cols = [t for path in paths for t in path]
    if rows:
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.ones(len(rows), device=device), accumulate=True)
    return counts


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the row before it: logits [num_tokens, vocab_size]
    (raw), token_ids [num_tokens]; with the `num_top` most likely tokens of each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_tokens, vocab_size]
    index = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, index.unsqueeze(1)).squeeze(1).tolist()  # [num_tokens]
    top: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)  # [num_tokens, num_top]
        top = [tuple(zip(row_ids, row_values))
               for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(int(t), float(lp), alternatives)
            for t, lp, alternatives in zip(token_ids, chosen, top)]

"""One budget for every row of a step, or the step's nodes shared out among its rows?

At a batch of b rows the verifier runs b x s_q tree nodes a step. This replays the model's greedy
answers (as bench/draft_quality.py does: a draft token is accepted exactly when it is the next
answer token) with b sequences drafted together each step, and compares ways of spending those
b x s_q nodes:
  uniform   every row gets s_q nodes (what the engine does);
  global    the b x s_q best nodes of all rows by the drafter's own node scores (`probs`, the
            merge priorities of docs/algorithm.md), each row keeping a best-first prefix of its
            tree;
  history   the same, each row's scores weighted by its own recent acceptance (a moving mean of
            the share of its nodes it accepted);
  split     the rows with the higher recent acceptance get 1.5 s_q nodes, the others 0.5 s_q.
Each row's tree is drafted at --draft-budget and cut to its share, so all share one drafter call.

    .venv/bin/python bench/row_budgets.py --model qwen-coder-1.5b \\
        --datastore var/demo-datastore/sharegpt-12000-<fingerprint> --sets code,mt_bench

Prints one JSON object per (set, b, s_q): tokens per row per step for each allocation, and the
number of nodes each verified per row step (the same up to rows whose trees were smaller).
"""

from __future__ import annotations

import argparse
import heapq
import json

from bench import flags
from bench.draft_quality import accepted_along, references

ALLOCATIONS = ("uniform", "global", "history", "split")
HISTORY_DECAY = 0.3  # a row's acceptance share moves this far towards each step's


def share(trees: list, total: int, allocation: str, history: list[float]) -> list[int]:
    """Nodes per row (root included, at least 1, at most its tree's) summing to at most
    `total`."""
    rows = len(trees)
    per_row = total // rows
    if allocation == "uniform":
        return [min(per_row, tree.num_nodes) for tree in trees]
    if allocation == "split":
        order = sorted(range(rows), key=lambda row: -history[row])
        counts = [1] * rows
        for rank, row in enumerate(order):
            factor = 1.5 if rank < rows // 2 else 0.5
            counts[row] = min(trees[row].num_nodes, max(1, int(per_row * factor)))
        return counts
    weights = history if allocation == "history" else [1.0] * rows
    counts, left = [1] * rows, total - rows
    # Each row's nodes are best-first, so taking its next node keeps a prefix: a tree.
    queue = [(-float(tree.probs[1]) * weights[row], row)
             for row, tree in enumerate(trees) if tree.num_nodes > 1]
    heapq.heapify(queue)
    while left > 0 and queue:
        _, row = heapq.heappop(queue)
        counts[row] += 1
        left -= 1
        if counts[row] < trees[row].num_nodes:
            heapq.heappush(queue, (-float(trees[row].probs[counts[row]]) * weights[row], row))
    return counts


def replay(drafter, pairs: list[tuple[list[int], list[int]]], batch: int, budget: int,
           allocation: str, draft_budget: int) -> dict:
    """Tokens per row step when `batch` sequences at a time share `batch * budget` nodes."""
    from sssd.common.drafting.proposer import DraftRequest

    waiting = [(f"{allocation}-{batch}-{budget}-{i}", prompt, answer)
               for i, (prompt, answer) in enumerate(pairs) if len(answer) > 1]
    running: dict[str, list] = {}  # id -> [new tokens, answer, position, is_start, history]
    row_steps = emitted = nodes = 0
    while waiting or running:
        while waiting and len(running) < batch:
            seq_id, prompt, answer = waiting.pop(0)
            running[seq_id] = [list(prompt) + answer[:1], answer, 1, True, 0.5]
        ids = list(running)
        trees = drafter.propose([DraftRequest(seq_id, running[seq_id][0], draft_budget,
                                              is_start=running[seq_id][3]) for seq_id in ids])
        counts = share(trees, budget * len(ids), allocation,
                       [running[seq_id][4] + 0.05 for seq_id in ids])
        finished = []
        for seq_id, tree, count in zip(ids, trees, counts):
            _, answer, position, _, history = running[seq_id]
            accepted = accepted_along(tree.prefix(count), answer, position)
            tokens = answer[position:position + accepted + 1]
            row_steps += 1
            emitted += len(tokens)
            nodes += count
            history += HISTORY_DECAY * (accepted / max(count - 1, 1) - history)
            running[seq_id] = [tokens, answer, position + len(tokens), False, history]
            if position + len(tokens) >= len(answer):
                finished.append(seq_id)
        for seq_id in finished:
            del running[seq_id]
        drafter.end(finished)
    return {"tokens_per_row_step": emitted / row_steps, "nodes_per_row_step": nodes / row_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_model(parser)
    flags.add_datastore(parser, "a datastore built with the model's tokenizer", required=True)
    flags.add_sets(parser, "code,mt_bench")
    flags.add_prompts(parser, 24)
    flags.add_max_tokens(parser, 128)
    flags.add_batch_sizes(parser, "4,8")
    parser.add_argument("--budgets", default="2,4,8")
    parser.add_argument("--draft-budget", type=int, default=32,
                        help="nodes each row's tree is drafted at before it is cut (32)")
    parser.add_argument("--allocations", default=",".join(ALLOCATIONS))
    args = parser.parse_args()

    from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint
    from sssd.datastore.shard import datastore_meta
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    tokenizer = load_tokenizer(args.model)
    pairs = {name: references(name, args.prompts, args.max_tokens, "bfloat16", 8, args.model)
             for name in args.sets.split(",")}
    meta = datastore_meta(args.datastore)
    if meta is None:
        raise SystemExit(f"{args.datastore}: no datastore with shards")
    config = DrafterConfig(datastore_dir=str(args.datastore), vocab_size=meta.vocab_size,
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    with LocalDrafter(config) as drafter:
        for name, set_pairs in pairs.items():
            for batch in map(int, args.batch_sizes.split(",")):
                for budget in map(int, args.budgets.split(",")):
                    row = {"set": name, "model": args.model, "batch": batch, "budget": budget}
                    for allocation in args.allocations.split(","):
                        result = replay(drafter, set_pairs, batch, budget, allocation,
                                        args.draft_budget)
                        row[allocation] = round(result["tokens_per_row_step"], 4)
                        row[f"{allocation}_nodes"] = round(result["nodes_per_row_step"], 2)
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

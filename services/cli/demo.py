"""`sssd-demo`: draft trees for real prompts from a drafter service over real conversations.

Builds (once) a datastore from ShareGPT conversations tokenized with the default model's chat
template, starts the gRPC drafter on a free local port, and prints, for a few MT-Bench prompts,
the draft tree the remote drafter proposes, decoded back to text. No target model runs here:
the later steps pretend that the target accepted the drafter's most likely path (special
tokens left out), to show the incremental calls, which send only the new tokens.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from sssd.cli.datastores import DEFAULT_DATA_DIR, default_data_dir, ensure_sharegpt_datastore
from sssd.common.config.logs import configure_logging
from sssd.common.data.corpus import first_turns, prompt_token_ids, read_mt_bench
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
from sssd.drafter.client import RemoteDrafter
from sssd.drafter.config import DrafterConfig
from sssd.drafter.service import create_server

logger = logging.getLogger(__name__)

def format_tree(tree: DraftTree, token_text: Callable[[int], str]) -> str:
    """The tree as indented lines, one node each: token text and probability."""
    children: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for node in range(1, tree.num_nodes):
        children[int(tree.parents[node])].append(node)
    lines = [f"{token_text(tree.root_token)}  (root: last accepted token)"]

    def walk(node: int, indent: str) -> None:
        for index, child in enumerate(children[node]):
            is_last = index == len(children[node]) - 1
            prob = f"{float(tree.probs[child]):.3f}" if tree.probs is not None else "-"
            lines.append(f"{indent}{'└── ' if is_last else '├── '}"
                         f"{token_text(int(tree.token_ids[child]))}  {prob}")
            walk(child, indent + ("    " if is_last else "│   "))

    walk(0, "")
    return "\n".join(lines)


def most_likely_path(tree: DraftTree, excluded: set[int]) -> list[int]:
    """Token ids along the highest-probability child at every level, root and `excluded`
    tokens left out (a chat model does not open a new turn right after its header)."""
    path, node = [], 0
    while True:
        kids = [n for n in range(1, tree.num_nodes)
                if tree.parents[n] == node and int(tree.token_ids[n]) not in excluded]
        if not kids:
            return path
        probs = tree.probs if tree.probs is not None else np.ones(tree.num_nodes)
        node = max(kids, key=lambda n: probs[n])
        path.append(int(tree.token_ids[node]))


def run_prompts(drafter: RemoteDrafter, tokenizer, prompts: Sequence[str], budget: int,
                num_steps: int) -> None:
    def token_text(token_id: int) -> str:
        return repr(tokenizer.decode([token_id]))

    for number, prompt in enumerate(prompts):
        seq_id = f"demo-{number}"
        context = prompt_token_ids(tokenizer, prompt)
        print(f"\n=== prompt {number}: {prompt[:100]!r}{'...' if len(prompt) > 100 else ''}")
        print(f"    {len(context)} tokens with the chat template")
        request = DraftRequest(seq_id, context, budget, is_start=True)
        try:
            for step in range(num_steps + 1):
                start = time.perf_counter()
                (tree,) = drafter.propose([request])
                elapsed_ms = (time.perf_counter() - start) * 1e3
                label = "full context" if step == 0 else f"+{len(request.token_ids)} tokens"
                print(f"\n--- step {step} ({label}): {tree.num_nodes} nodes in {elapsed_ms:.2f} ms")
                print(format_tree(tree, token_text))
                accepted = most_likely_path(tree, set(tokenizer.all_special_ids))[:3]
                if not accepted:
                    break
                print(f"    (simulated acceptance of {tokenizer.decode(accepted)!r})")
                request = DraftRequest(seq_id, accepted, budget)
        finally:
            drafter.end([seq_id])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sssd-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(),
                        help=f"where the datastore is built and kept ($SSSD_DATA_DIR, default "
                        f"{DEFAULT_DATA_DIR})")
    parser.add_argument("--records", type=int, default=12_000,
                        help="ShareGPT records 0 .. N-1 go into the datastore (default 12000)")
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face model directory (default: SmolLM2-135M)")
    parser.add_argument("--mt-bench", default=None, help="path of mt_bench.jsonl")
    parser.add_argument("--prompts", type=int, default=3, help="MT-Bench prompts to draft for")
    parser.add_argument("--budget", type=int, default=16, help="draft-tree nodes, root included")
    parser.add_argument("--steps", type=int, default=2,
                        help="simulated decode steps after the prompt")
    parser.add_argument("--threads", type=int, default=0, help="drafter threads (0: all cores)")
    args = parser.parse_args(argv)
    if args.records < 1 or args.prompts < 1 or args.budget < 1 or args.steps < 0:
        parser.error("need --records, --prompts, --budget >= 1 and --steps >= 0")
    configure_logging(logging.INFO)

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    print(f"tokenizer: {vocab_size(tokenizer)} tokens, loaded in "
          f"{time.perf_counter() - start:.2f} s")
    datastore_dir = ensure_sharegpt_datastore(args.data_dir, tokenizer, args.records)

    config = DrafterConfig(datastore_dir=str(datastore_dir), vocab_size=vocab_size(tokenizer),
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                           num_threads=args.threads, max_budget=max(args.budget, 1),
                           host="127.0.0.1", port=0)
    start = time.perf_counter()
    server, port, drafter = create_server(config)
    info = drafter.info()
    print(f"drafter on 127.0.0.1:{port}: {info['num_datastore_tokens']} datastore tokens in "
          f"{info['num_shards']} shards, started in {time.perf_counter() - start:.2f} s")
    prompts = first_turns(read_mt_bench(args.mt_bench))[:args.prompts]
    try:
        with RemoteDrafter(f"127.0.0.1:{port}", timeout_s=10.0) as remote:
            run_prompts(remote, tokenizer, prompts, args.budget, args.steps)
    finally:
        server.stop(grace=1.0).wait()
        drafter.close()


if __name__ == "__main__":
    main()

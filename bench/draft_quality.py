"""Draft quality without the model in the loop: tokens per verification step by replay.

Under greedy verification, how many tokens a step yields depends only on the draft tree and on
the target model's greedy continuation: a draft token is accepted exactly when it equals the
next token the model would produce. So once the model's greedy answers to a prompt set are known
(generated once by the engine, autoregressively, and cached under var/bench/references/), any
drafter configuration can be scored in seconds by replaying them: each step the drafter proposes
a tree for the context so far, the longest root path that follows the answer is accepted, the
next answer token is the bonus, and the context advances by both, exactly as the engine would.

Prompt sets: `mt_bench` (first turns), `code` (bench/data/code_prompts.jsonl, written for this
project), `sharegpt-tune` (first user turns of ShareGPT records 12,000-14,999, the held-out set
for tuning the drafter's constants; never tune on mt_bench).

    python bench/draft_quality.py --sets mt_bench,code --budgets 4,8,16,32 \\
        --config baseline: --config long:branch_len=12

Side by side with the SSSD paper's own library (`sssd_speculator`, github.com/michelemarzollo/
sssd_speculator; not a dependency of this project, built by hand, see docs/benchmarks.md):
`--reference-build DIR` imports it from DIR, writes the same datastore documents into its index
format once (cached under var/bench/reference/) and scores it by the same replay, with the
settings of the paper's own evaluation (`lookahead_comparisons.py`: lookup key 4 tokens, prompt
trie depth 9, branch length by budget) and, with `--reference-branch-len N`, a fixed one.

Prints one JSON object per (set, datastore, config, budget):
  tokens_per_step       tokens emitted per verification step (accepted + bonus), answer tokens
                        after the first (which the prefill yields) over steps
  accepted_per_step     draft tokens accepted per step
  draft_ms              mean drafter call per step (all sequences of the set in one batch)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from bench import flags
from bench.prompt_sets import prompt_texts
from sssd.common.config.logs import configure_logging

logger = logging.getLogger("draft_quality")

REFERENCE_DIR = Path("var/bench/references")


def references(name: str, limit: int, max_tokens: int, dtype: str, batch_size: int,
               model: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of the set by `model` (None: the default), generated
    once and cached."""
    from sssd.common.data.corpus import prompt_token_ids
    from sssd.common.model.tokenizer import load_tokenizer

    prefix = "" if model is None else f"{Path(model).name}-"
    tokenizer = load_tokenizer(model) if name.startswith("code-edits") else None
    texts = prompt_texts(name, limit, tokenizer)
    if tokenizer is not None:  # the files change with the code: the answers are per content
        prefix += hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12] + "-"
    path = REFERENCE_DIR / f"{prefix}{name}-{limit}-{max_tokens}-{dtype}.jsonl"
    if path.is_file():
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        return [(r["prompt_ids"], r["output_ids"]) for r in rows]
    from tqdm import tqdm

    from sssd.common.model.loader import load_causal_lm
    from sssd.verifier.engine import EngineConfig, GenerateRequest
    from sssd.verifier.factory import build_engine

    loaded = load_causal_lm(model, dtype)
    prompts = [prompt_token_ids(loaded.tokenizer, text) for text in texts]
    engine = build_engine(EngineConfig(mode="ar", dtype=dtype, max_batch_size=batch_size,
                                       max_len=max(map(len, prompts)) + max_tokens + 8), loaded)
    sequences = [engine.add_request(GenerateRequest(tuple(p), max_tokens)) for p in prompts]
    progress = tqdm(total=len(prompts), desc=f"greedy answers ({name})", unit="prompt")
    while engine.has_work():
        finished = engine.step().finished
        if finished:
            progress.update(len(finished))
    progress.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as f:
        for seq in sequences:
            f.write(json.dumps({"prompt_ids": list(seq.prompt_ids),
                                "output_ids": seq.output_ids}) + "\n")
    temporary.rename(path)
    return [(list(s.prompt_ids), s.output_ids) for s in sequences]


def accepted_path(tree, answer: Sequence[int], position: int,
                  budget: int | None = None) -> list[int]:
    """The nodes (root excluded) of the longest root path of the tree's first `budget` nodes
    (None: all) that follows the answer from `position` on: what a greedy verifier of that tree
    accepts (the root is the token before `position`)."""
    children: dict[int, dict[int, int]] = {}
    for node in range(1, tree.num_nodes if budget is None else min(tree.num_nodes, budget)):
        children.setdefault(int(tree.parents[node]), {})[int(tree.token_ids[node])] = node
    node, path = 0, []
    while position + len(path) < len(answer):
        node = children.get(node, {}).get(answer[position + len(path)])
        if node is None:
            break
        path.append(node)
    return path


def accepted_along(tree, answer: Sequence[int], position: int) -> int:
    """Draft tokens a greedy verifier accepts from the whole tree."""
    return len(accepted_path(tree, answer, position))


def replay(drafter, pairs: list[tuple[list[int], list[int]]], budget: int) -> dict:
    """Tokens per step of `drafter` (a started Proposer) on the answers, all sequences batched."""
    from sssd.common.drafting.proposer import DraftRequest

    # The prefill yields answer[0]; verification steps start from prompt + answer[0].
    state = {f"q{i}": [list(prompt) + answer[:1], answer, 1]  # new tokens, answer, position
             for i, (prompt, answer) in enumerate(pairs) if len(answer) > 1}
    started: set[str] = set()
    steps = accepted_total = 0
    draft_s = 0.0
    num_calls = 0
    while state:
        ids = list(state)
        requests = [DraftRequest(seq_id, state[seq_id][0], budget, is_start=seq_id not in started)
                    for seq_id in ids]
        start = time.perf_counter()
        trees = drafter.propose(requests)
        draft_s += time.perf_counter() - start
        num_calls += 1
        started.update(ids)
        finished = []
        for seq_id, tree in zip(ids, trees):
            _, answer, position = state[seq_id]
            accepted = accepted_along(tree, answer, position)
            emitted = answer[position: position + accepted + 1]
            steps += 1
            accepted_total += accepted
            state[seq_id] = [emitted, answer, position + len(emitted)]
            if position + len(emitted) >= len(answer):
                finished.append(seq_id)
        for seq_id in finished:
            del state[seq_id]
        drafter.end(finished)
    emitted_total = sum(len(answer) - 1 for _, answer in pairs if len(answer) > 1)
    return {"tokens_per_step": emitted_total / steps, "accepted_per_step": accepted_total / steps,
            "num_steps": steps, "draft_ms": 1e3 * draft_s / max(num_calls, 1)}


def reference_vocab(vocab_size: int) -> int:
    """The vocabulary size to give the reference: it stores tokens in 2 bytes below 65,536 and
    reads them back signed, so ids of 32,768 and above (SmolLM2 has 49,152) come back negative;
    a size above 65,536 makes it store 4 bytes."""
    return max(vocab_size + 1, 65_537)


class ReferenceDrafter:
    """The paper's reference drafter (sssd_speculator.Reader) behind the replay's interface:
    propose(requests) -> trees with parents and token ids, end(seq_ids)."""

    # The paper's evaluation (evaluation/lookahead_comparisons.py of the reference repository).
    PREFIX_LEN = 4
    PROMPT_TRIE_DEPTH = 9

    def __init__(self, module, index_path: Path, vocab_size: int, stop_token: int,
                 branch_len: int | None) -> None:
        self.reader = module.Reader(index_file_path=str(index_path), stop_token=stop_token,
                                    max_search_entries=100,
                                    prompt_branch_length=self.PROMPT_TRIE_DEPTH,
                                    prompt_prefix_length=self.PREFIX_LEN,
                                    vocab_size=reference_vocab(vocab_size))
        self.branch_len = branch_len
        self.contexts: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}  # the reader's seq_id: a slot below its max_batch_size
        self.free_slots: list[int] = []

    @staticmethod
    def paper_branch_len(budget: int) -> int:
        """get_branch_len_from_decoding_len of the paper's evaluation."""
        if budget <= 5:
            return max(budget - 1, 1)
        return 5 if budget <= 8 else 6 if budget <= 32 else 8 if budget <= 48 else 10

    def propose(self, requests) -> list:
        from types import SimpleNamespace

        for request in requests:
            tokens = [int(t) for t in request.token_ids]
            if request.is_start:
                self.slots[request.seq_id] = (self.free_slots.pop() if self.free_slots
                                              else len(self.slots))
                self.contexts[request.seq_id] = list(tokens)
                self.reader.sync_put(tokens, seq_id=self.slots[request.seq_id])
            else:
                self.contexts[request.seq_id].extend(tokens)
                self.reader.stream_put(tokens, seq_id=self.slots[request.seq_id])
        budgets = [r.budget for r in requests]
        outputs, depths, masks = self.reader.get_candidates(
            prefixes=[self.contexts[r.seq_id][-self.PREFIX_LEN:] for r in requests],
            decoding_lengths=budgets,
            branch_lengths=[self.branch_len or self.paper_branch_len(b) for b in budgets],
            seq_ids=[self.slots[r.seq_id] for r in requests])
        trees = []
        for tokens, depth, mask in zip(outputs, depths, masks):
            # mask[i - 1, j - 1]: node j is node i or one of its ancestors (the root left out);
            # the parent is the ancestor one level up.
            parents = [-1]
            for node in range(1, len(tokens)):
                ancestors = [j + 1 for j in np.flatnonzero(mask[node - 1])
                             if depth[j + 1] == depth[node] - 1]
                parents.append(ancestors[0] if ancestors else 0)
            trees.append(SimpleNamespace(num_nodes=len(tokens), token_ids=list(tokens),
                                         parents=parents))
        return trees

    def end(self, seq_ids) -> None:
        for seq_id in seq_ids:
            slot = self.slots.pop(seq_id)
            self.contexts.pop(seq_id)
            self.reader.sync_finish_sequence(seq_id=slot)
            self.free_slots.append(slot)


def reference_index(module, datastore: Path, vocab_size: int, stop_token: int) -> Path:
    """The datastore's documents written in the reference's index format, each entry opened by
    `stop_token` as the paper's builder does with BOS; built once per datastore."""
    from sssd.datastore.manifest import read_manifest
    from sssd.datastore.shard import SEPARATOR, read_meta

    shards = [datastore / name for name in read_manifest(datastore).shards]
    key = "-".join(read_meta(s).checksums["tokens.u32"][:12] for s in shards)
    path = Path("var/bench/reference") / f"{key}-4byte.idx"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    writer = module.Writer(index_file_path=str(temporary), vocab_size=reference_vocab(vocab_size))
    for shard in shards:
        stream = np.fromfile(shard / "tokens.u32", dtype=np.uint32)
        ends = np.flatnonzero(stream == SEPARATOR)
        start = 0
        for end in ends:
            writer.add_entry([stop_token] + stream[start:end].astype(np.int64).tolist())
            start = end + 1
    writer.finalize()
    temporary.rename(path)
    return path


def parse_config(text: str) -> tuple[str, dict]:
    """'name:key=value,key=value' -> (name, {key: value}) with numbers parsed."""
    name, _, body = text.partition(":")
    values = {}
    for item in filter(None, body.split(",")):
        key, _, raw = item.partition("=")
        values[key.strip()] = float(raw) if "." in raw else int(raw)
    return name or "default", values


def add_answer_arguments(parser: argparse.ArgumentParser, sets: str, prompts: int) -> None:
    """The arguments that name the greedy answers a replay reads (`references`): --sets,
    --prompts, --max-tokens, --dtype, --batch-size and --model."""
    flags.add_sets(parser, sets)
    flags.add_prompts(parser, prompts, per_set=True)
    flags.add_max_tokens(parser, 128)
    flags.add_dtype(parser)  # of the greedy answers
    parser.add_argument("--batch-size", type=int, default=8,
                        help="engine batch for generating the answers, once (8)")
    flags.add_model(parser)


def load_reference(build: Path) -> ModuleType:
    """The paper's `sssd_speculator` extension module from the directory it was built in, loaded
    by its file (the directory is not put on the import path)."""
    found = sorted(build.resolve().glob("sssd_speculator*.so"))
    if not found:
        raise ImportError(f"no sssd_speculator*.so in {build}")
    spec = importlib.util.spec_from_file_location("sssd_speculator", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_answer_arguments(parser, "mt_bench,code", 80)
    parser.add_argument("--budgets", default="4,8,16,32")
    flags.add_datastore(parser, "datastore(s) to score with (repeatable; default: the "
                        "ShareGPT datastore the main job builds)", repeat=True)
    parser.add_argument("--config", action="append", default=[],
                        help="name:key=value,... drafter constants (DraftParams fields, and "
                        "model_shard_weight), repeatable; default one config with the defaults")
    parser.add_argument("--reference-build", type=Path, default=None,
                        help="directory holding the built sssd_speculator module: also score "
                        "the paper's reference drafter on the same datastore")
    parser.add_argument("--reference-branch-len", type=int, default=None,
                        help="fixed branch length for the reference (default: the paper's "
                        "evaluation, by budget)")
    parser.add_argument("--no-ours", action="store_true",
                        help="score the reference only")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)

    from sssd.cli.datastores import pick_datastore
    from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
    from sssd.drafter.config import DrafterConfig, DraftParams
    from sssd.drafter.drafter import LocalDrafter

    tokenizer = load_tokenizer(args.model)
    datastores = args.datastore or [pick_datastore(None, tokenizer)]
    configs = [parse_config(c) for c in args.config] or [("default", {})]
    sets = {name: references(name, args.prompts, args.max_tokens, args.dtype, args.batch_size,
                             args.model) for name in args.sets.split(",")}
    reference = None
    if args.reference_build is not None:
        try:
            reference = load_reference(args.reference_build)
        except ImportError as exc:
            parser.error(f"--reference-build {args.reference_build}: cannot import "
                         f"sssd_speculator ({exc})")
    budgets = [int(b) for b in args.budgets.split(",")]
    stop_token = vocab_size(tokenizer)  # outside the vocabulary: only opens entries
    for datastore in datastores:
        if reference is not None:
            index = reference_index(reference, datastore, vocab_size(tokenizer), stop_token)
            for set_name, pairs in sets.items():
                for budget in budgets:
                    drafter = ReferenceDrafter(reference, index, vocab_size(tokenizer),
                                               stop_token, args.reference_branch_len)
                    row = {"set": set_name, "datastore": str(datastore),
                           "config": "reference", "params": {
                               "branch_len": args.reference_branch_len
                               or ReferenceDrafter.paper_branch_len(budget)},
                           "budget": budget, "num_prompts": len(pairs)}
                    row.update(replay(drafter, pairs, budget))
                    print(json.dumps(row), flush=True)
        if args.no_ours:
            continue
        for name, values in configs:
            constants = dict(values)
            weight = constants.pop("model_shard_weight", DrafterConfig.model_shard_weight)
            config = DrafterConfig(datastore_dir=str(datastore), vocab_size=vocab_size(tokenizer),
                                   tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                   model_shard_weight=weight, params=DraftParams(**constants))
            with LocalDrafter(config) as drafter:
                for set_name, pairs in sets.items():
                    for budget in budgets:
                        row = {"set": set_name, "datastore": str(datastore), "config": name,
                               "params": values, "budget": budget, "num_prompts": len(pairs)}
                        row.update(replay(drafter, pairs, budget))
                        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

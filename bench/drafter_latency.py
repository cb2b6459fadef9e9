"""Drafter latency per decode step, in process and over gRPC, and resident bytes per datastore
token.

Builds (or reuses) datastores from a synthetic token stream that looks like text to the drafter:
a Zipf vocabulary mixed with a pool of repeated phrases drawn with Zipf frequency, cut into
documents of a few hundred tokens. Then, for each batch size, it runs decode steps as a serving
worker would: every sequence starts from the prompt of a held-out document (same generator,
other seed) and each step appends the next 1-3 tokens of that document; a sequence whose
document runs out ends and a new one starts in its row (continuous batching). One measured call
is one batched `propose` at budget s_q = 16.

Prints one JSON object per line on stdout; progress goes to stderr.

    python bench/drafter_latency.py --sizes 10000000,50000000 --batches 1,8,32,64
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sssd.common.config.logs import configure_logging

logger = logging.getLogger("drafter_latency")

VOCAB_SIZE = 49152  # SmolLM2's vocabulary; the drafter's default
FINGERPRINT = "synthetic-zipf-phrases-v1"
GENERATOR_VERSION = 1  # bump when the stream changes, so cached datastores are rebuilt
BUDGET = 16  # s_q, draft-tree nodes including the root
HELD_OUT_SEED_OFFSET = 1_000_003


# --- Synthetic text ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamSpec:
    """Shape of the synthetic language."""

    vocab_size: int = VOCAB_SIZE
    token_zipf: float = 1.05  # exponent of single-token frequencies (natural text: about 1)
    num_phrases: int = 4000  # pool of recurring phrases
    phrase_zipf: float = 1.0  # exponent of phrase frequencies
    min_phrase_len: int = 4
    max_phrase_len: int = 20
    phrase_prob: float = 0.15  # chance that a unit is a phrase rather than one token
    min_doc_len: int = 128
    max_doc_len: int = 640


class SyntheticText:
    """Deterministic generator of token documents; the phrase pool depends on `pool_seed` only."""

    def __init__(self, spec: StreamSpec, pool_seed: int) -> None:
        self.spec = spec
        pool_rng = np.random.default_rng(pool_seed)
        # Frequency rank -> token id, so that frequent tokens are not simply the small ids.
        self._token_of_rank = pool_rng.permutation(spec.vocab_size).astype(np.int32)
        self._token_cdf = _zipf_cdf(spec.vocab_size, spec.token_zipf)
        self._phrase_cdf = _zipf_cdf(spec.num_phrases, spec.phrase_zipf)
        self.phrase_lens = pool_rng.integers(spec.min_phrase_len, spec.max_phrase_len + 1,
                                             spec.num_phrases)  # [num_phrases]
        self.phrase_starts = np.zeros(spec.num_phrases + 1, dtype=np.int64)  # [num_phrases + 1]
        np.cumsum(self.phrase_lens, out=self.phrase_starts[1:])
        self.phrase_tokens = self._tokens(pool_rng, int(self.phrase_starts[-1]))  # [pool tokens]

    def _tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        ranks = np.searchsorted(self._token_cdf, rng.random(n), side="right")
        return self._token_of_rank[np.minimum(ranks, self.spec.vocab_size - 1)]

    def _chunk(self, rng: np.random.Generator, num_units: int) -> np.ndarray:
        """[num_tokens] int32 made of `num_units` units (a phrase or a single token)."""
        spec = self.spec
        is_phrase = rng.random(num_units) < spec.phrase_prob  # [num_units]
        phrase_ids = np.minimum(np.searchsorted(self._phrase_cdf, rng.random(num_units),
                                                side="right"), spec.num_phrases - 1)
        singles = self._tokens(rng, num_units)  # [num_units]
        unit_lens = np.where(is_phrase, self.phrase_lens[phrase_ids], 1)  # [num_units]
        unit_starts = np.cumsum(unit_lens) - unit_lens  # [num_units]
        unit_of_pos = np.repeat(np.arange(num_units), unit_lens)  # [num_tokens]
        offset = np.arange(unit_of_pos.shape[0]) - unit_starts[unit_of_pos]  # [num_tokens]
        from_phrase = self.phrase_tokens[self.phrase_starts[phrase_ids[unit_of_pos]] + offset]
        return np.where(is_phrase[unit_of_pos], from_phrase, singles[unit_of_pos]).astype(np.int32)

    def documents(self, seed: int, num_tokens: int, min_len: int | None = None,
                  max_len: int | None = None, chunk_tokens: int = 1 << 22) -> Iterator[np.ndarray]:
        """Documents whose stream (each plus its separator) holds about `num_tokens` tokens."""
        spec = self.spec
        min_len = min_len or spec.min_doc_len
        max_len = max_len or spec.max_doc_len
        rng = np.random.default_rng(seed)
        mean_unit = 1 + spec.phrase_prob * (float(self.phrase_lens.mean()) - 1)
        remaining = num_tokens
        while remaining > 0:
            chunk = self._chunk(rng, int(min(chunk_tokens, remaining) / mean_unit) + max_len)
            pos = 0
            while remaining > 0:
                length = int(rng.integers(min_len, max_len + 1))
                length = min(length, remaining - 1) if remaining > 1 else 1
                if pos + length > chunk.shape[0]:
                    break
                yield chunk[pos:pos + length]
                pos += length
                remaining -= length + 1


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


# --- Datastores ----------------------------------------------------------------------------------

def ensure_datastore(cache_dir: Path, text: SyntheticText, num_tokens: int, num_shards: int,
                     seed: int) -> tuple[Path, dict]:
    """The datastore of `num_tokens` synthetic tokens, built unless a finished one is cached."""
    from sssd.datastore.build import build_datastore

    directory = cache_dir / (f"synthetic-v{GENERATOR_VERSION}-{num_tokens}-seed{seed}-"
                             f"{num_shards}shards")
    info_path = directory / "bench-build.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        logger.info("reusing %s (built in %.1f s)", directory, info["build_s"])
        return directory, {**info, "reused": True}
    if directory.exists():  # an interrupted build
        import shutil
        shutil.rmtree(directory)
    cache_dir.mkdir(parents=True, exist_ok=True)
    ignore = cache_dir / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")

    start = time.perf_counter()
    documents = list(text.documents(seed, num_tokens))
    gen_s = time.perf_counter() - start
    logger.info("generated %d documents (%d tokens) in %.1f s", len(documents),
                sum(d.shape[0] + 1 for d in documents), gen_s)
    shard_tokens = math.ceil(num_tokens / num_shards) + text.spec.max_doc_len + 1
    start = time.perf_counter()
    manifest = build_datastore(directory, documents, VOCAB_SIZE, FINGERPRINT,
                               shard_tokens=shard_tokens, progress=True)
    build_s = time.perf_counter() - start
    info = {"gen_s": round(gen_s, 2), "build_s": round(build_s, 2),
            "shards": len(manifest.shards), "documents": len(documents)}
    info_path.write_text(json.dumps(info))
    logger.info("built %s in %.1f s", directory, build_s)
    return directory, {**info, "reused": False}


def touch_pages(array: np.ndarray) -> int:
    """Reads one uint32 in every 4 KiB page, so that every page of a memory map is resident."""
    return int(np.asarray(array[::1024]).sum(dtype=np.uint64))


RSS_METHOD = ("fresh subprocess: RSS after LocalDrafter.start() and reading one uint32 in every "
              "4 KiB page of every memory-mapped shard array, minus RSS just before "
              "LocalDrafter.start(), divided by the datastore's tokens (separators included); "
              "file-backed pages count once mapped and touched")


def rss_probe(datastore_dir: str) -> dict:
    """Runs in the subprocess: see RSS_METHOD."""
    import psutil

    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    process = psutil.Process()
    drafter = LocalDrafter(DrafterConfig(datastore_dir=datastore_dir, vocab_size=VOCAB_SIZE,
                                    num_threads=1, verify_checksums=False))
    rss_before = process.memory_info().rss
    drafter.start()
    loaded = drafter.watcher.current
    for shard in loaded.shards:
        touch_shard(shard)
    rss_after = process.memory_info().rss
    drafter.close()
    return {"rss_before": rss_before, "rss_after": rss_after, "tokens": loaded.num_tokens}


def touch_shard(shard) -> None:
    """Reads every page of a shard's arrays (core_view's last item is the shard's weight)."""
    for array in shard.core_view()[:-1]:
        touch_pages(array)


def measure_rss(datastore_dir: Path) -> dict:
    output = subprocess.run([sys.executable, __file__, "--rss-probe", str(datastore_dir)],
                            check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


# --- Decode-step workload ------------------------------------------------------------------------

@dataclass
class Row:
    """One live sequence of the batch: it decodes `document`, of which `pos` tokens are known."""

    seq_id: str
    document: np.ndarray  # [num_tokens] int32
    pos: int  # the prompt length until the sequence is started
    is_started: bool = False


class Workload:
    """Rows of live sequences fed from held-out documents, 1-3 new tokens per row per step."""

    def __init__(self, documents: list[np.ndarray], batch: int, seed: int, tag: str) -> None:
        self._documents = documents
        self._rng = np.random.default_rng(seed)
        self._tag = tag
        self._num_started = 0
        self.rows = [self._new_row() for _ in range(batch)]
        self.ended: list[str] = []  # sequences finished since the last `take_ended`

    def _new_row(self) -> Row:
        document = self._documents[self._num_started % len(self._documents)]
        self._num_started += 1
        return Row(f"{self._tag}-{self._num_started}", document,
                   pos=int(self._rng.integers(32, 129)))

    def step(self) -> list:
        """The DraftRequests of one decode step."""
        from sssd.common.drafting.proposer import DraftRequest

        requests = []
        for index, row in enumerate(self.rows):
            num_new = int(self._rng.integers(1, 4))
            if row.is_started and row.pos + num_new > row.document.shape[0]:
                self.ended.append(row.seq_id)  # finished: a new sequence takes its row
                row = self.rows[index] = self._new_row()
            if not row.is_started:  # a new sequence sends its prompt as the full context
                row.is_started = True
                requests.append(DraftRequest(row.seq_id, row.document[:row.pos], BUDGET,
                                             is_start=True))
                continue
            requests.append(DraftRequest(row.seq_id, row.document[row.pos:row.pos + num_new],
                                         BUDGET))
            row.pos += num_new
        return requests

    def take_ended(self) -> list[str]:
        ended, self.ended = self.ended, []
        return ended


class TimedCore:
    """Wraps `_core.BatchDrafter` to time the C++ batch call apart from the Python layer around
    it."""

    def __init__(self, core) -> None:
        self._core = core
        self.last_s = 0.0

    def propose(self, *args):
        start = time.perf_counter()
        result = self._core.propose(*args)
        self.last_s = time.perf_counter() - start
        return result

    def __getattr__(self, name):
        return getattr(self._core, name)


class OtherLoad:
    """CPUs kept busy by other processes while measuring: this machine may be shared, and a
    second drafter thread only helps when a second core is free."""

    def __enter__(self) -> "OtherLoad":
        import psutil

        self._process = psutil.Process()
        self._start = (time.perf_counter(), self._busy(), self._own())
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall, busy, own = (time.perf_counter(), self._busy(), self._own())
        self.cpus = max(0.0, ((busy - self._start[1]) - (own - self._start[2]))
                        / (wall - self._start[0]))

    @staticmethod
    def _busy() -> float:
        import psutil

        times = psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0)

    def _own(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system


def run_steps(drafter, workload: Workload, warmup: int, iters: int,
              core: TimedCore | None = None) -> tuple[np.ndarray, np.ndarray | None, float]:
    """[iters] seconds per measured propose call (and per C++ call when `core` is given), and
    the CPUs other processes used meanwhile."""
    for _ in range(warmup + 1):  # the first call starts every sequence
        drafter.propose(workload.step())
        drafter.end(workload.take_ended())
    latencies = np.empty(iters)
    core_latencies = np.empty(iters) if core is not None else None
    with OtherLoad() as load:
        for i in range(iters):
            requests = workload.step()
            start = time.perf_counter()
            drafter.propose(requests)
            latencies[i] = time.perf_counter() - start
            if core is not None:
                core_latencies[i] = core.last_s
            drafter.end(workload.take_ended())
    drafter.end([row.seq_id for row in workload.rows])
    return latencies, core_latencies, round(load.cpus, 2)


def summary(latencies: np.ndarray) -> dict:
    return {"median_ms": round(float(np.median(latencies)) * 1e3, 4),
            "p99_ms": round(float(np.percentile(latencies, 99)) * 1e3, 4)}


def breakdown(drafter, core, workload: Workload, iters: int) -> dict:
    """Median per-sequence microseconds of Algorithm 2 (`collect`) and of a whole `propose_one`."""
    from sssd import _core

    datastore = drafter.watcher.current.core
    params = drafter.config.params.to_core()
    drafter.propose(workload.step())
    collect_s, propose_one_s = [], []
    for _ in range(iters):
        drafter.propose(workload.step())
        for row in workload.rows:
            trie = _core.InputTrie(params.branch_len)
            trie.append(np.ascontiguousarray(row.document[:row.pos], dtype=np.int32))
            tokens = trie.tokens()
            start = time.perf_counter()
            datastore.collect(tokens, params)
            collect_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            core.propose_one(datastore, trie, BUDGET)
            propose_one_s.append(time.perf_counter() - start)
        drafter.end(workload.take_ended())
    drafter.end([row.seq_id for row in workload.rows])
    return {"collect_us": round(float(np.median(collect_s)) * 1e6, 2),
            "propose_one_us": round(float(np.median(propose_one_s)) * 1e6, 2)}


# --- Main ----------------------------------------------------------------------------------------

def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def wait_for_quiet(max_other_cpus: float, timeout_s: float) -> float:
    """Waits (up to timeout_s) for a second in which other processes use at most
    max_other_cpus CPUs; returns the last second's load."""
    deadline = time.monotonic() + timeout_s
    while True:
        with OtherLoad() as load:
            time.sleep(1.0)
        if load.cpus <= max_other_cpus or time.monotonic() >= deadline:
            return load.cpus
        logger.info("waiting for a quiet machine: other processes use %.2f CPUs", load.cpus)


def measure(args: argparse.Namespace, drafter, held_out: list[np.ndarray], batch: int, tag: str,
            core: TimedCore | None = None) -> dict:
    """Latency summary of one batch size; measured again (up to --retries times) when other
    processes used more than --max-other-cpus CPUs meanwhile."""
    for attempt in range(1, args.retries + 2):
        wait_for_quiet(args.max_other_cpus, args.quiet_timeout_s)
        workload = Workload(held_out, batch, args.seed + batch, f"{tag}a{attempt}")
        latencies, core_latencies, other_cpus = run_steps(drafter, workload, args.warmup,
                                                          args.iters, core)
        if other_cpus <= args.max_other_cpus:
            break
        logger.info("%s: other processes used %.2f CPUs during the measurement", tag, other_cpus)
    record = {**summary(latencies), "iters": args.iters, "other_cpus": other_cpus,
              "attempts": attempt}
    if core_latencies is not None:
        record["core_median_ms"] = summary(core_latencies)["median_ms"]
    return record


def bench_datastore(args: argparse.Namespace, text: SyntheticText, held_out: list[np.ndarray],
                    num_tokens: int) -> None:
    from sssd import _core
    from sssd.drafter.client import RemoteDrafter
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter
    from sssd.drafter.service import create_server

    directory, build_info = ensure_datastore(args.cache_dir, text, num_tokens, args.shards,
                                             args.seed)
    rss = measure_rss(directory)
    emit({"tokens": rss["tokens"], "shards": build_info["shards"],
          "build_s": build_info["build_s"], "gen_s": build_info["gen_s"],
          "reused_build": build_info["reused"],
          "rss_bytes_per_token": round((rss["rss_after"] - rss["rss_before"]) / rss["tokens"], 3),
          "rss_method": RSS_METHOD})

    def config(num_threads: int) -> DrafterConfig:
        return DrafterConfig(datastore_dir=str(directory), vocab_size=VOCAB_SIZE,
                             tokenizer_fingerprint=FINGERPRINT, num_threads=num_threads,
                             max_batch_size=max(args.batches), port=0)

    common = {"tokens": rss["tokens"], "shards": build_info["shards"], "budget": BUDGET,
              "prefix_len": 4}
    for num_threads in args.threads:
        drafter_config = config(num_threads)
        # The C++ call timed apart from the Python layer around it.
        core = TimedCore(_core.BatchDrafter(drafter_config.params.to_core(),
                                            drafter_config.resolved_num_threads))
        drafter = LocalDrafter(drafter_config, core=core)
        drafter.start()
        for shard in drafter.watcher.current.shards:
            touch_shard(shard)
        for batch in args.batches:
            measured = measure(args, drafter, held_out, batch, f"t{num_threads}b{batch}", core)
            record = {**common, "batch": batch, **measured, "num_threads": num_threads,
                      "transport": "inproc"}
            if args.breakdown:
                workload = Workload(held_out, batch, args.seed + batch, f"bd{num_threads}b{batch}")
                record.update(breakdown(drafter, core, workload, max(1, 200 // batch)))
            emit(record)
            logger.info("inproc threads=%d batch=%d: median %.3f ms", num_threads, batch,
                        record["median_ms"])
        drafter.close()

    grpc_threads = max(args.threads)
    server, port, served = create_server(config(grpc_threads))
    remote = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=30.0)
    try:
        for batch in args.batches:
            measured = measure(args, remote, held_out, batch, f"g{batch}")
            emit({**common, "batch": batch, **measured, "num_threads": grpc_threads,
                  "transport": "grpc"})
            logger.info("grpc batch=%d: median %.3f ms", batch, measured["median_ms"])
    finally:
        remote.close()
        server.stop(0).wait()
        served.close()


def parse_ints(text: str) -> list[int]:
    values = [int(float(part)) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers separated by commas: {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_ints, default=[10_000_000, 50_000_000],
                        help="datastore sizes in tokens (default 10000000,50000000)")
    parser.add_argument("--batches", type=parse_ints, default=[1, 8, 32, 64])
    parser.add_argument("--threads", type=parse_ints, default=[1, 2],
                        help="num_threads values measured in process; gRPC uses the largest")
    parser.add_argument("--iters", type=int, default=500, help="measured calls per batch size")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured calls first")
    parser.add_argument("--shards", type=int, default=1, help="shards per datastore")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(__file__).resolve().parent / ".cache",
                        help="where built datastores are kept and reused")
    parser.add_argument("--max-other-cpus", type=float, default=0.2,
                        help="re-measure when other processes used more CPUs than this")
    parser.add_argument("--retries", type=int, default=3, help="re-measurements at most")
    parser.add_argument("--quiet-timeout-s", type=float, default=60.0,
                        help="longest wait for a quiet machine before each measurement")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time collect() and propose_one() per sequence")
    parser.add_argument("--rss-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_probe:
        emit(rss_probe(args.rss_probe))
        return
    if args.iters < 1 or args.warmup < 0 or args.shards < 1 or args.retries < 0:
        parser.error("need --iters >= 1, --warmup >= 0, --shards >= 1, --retries >= 0")
    configure_logging(logging.INFO)

    text = SyntheticText(StreamSpec(), pool_seed=args.seed)
    # Held-out sequences: the same language, other documents, long enough for many steps.
    held_out = list(text.documents(args.seed + HELD_OUT_SEED_OFFSET, 2_000_000,
                                   min_len=512, max_len=1536))
    emit({"cpu_count": os.cpu_count(), "vocab_size": VOCAB_SIZE, "budget": BUDGET,
          "stream": vars(text.spec), "held_out_documents": len(held_out)})
    for num_tokens in args.sizes:
        bench_datastore(args, text, held_out, num_tokens)


if __name__ == "__main__":
    main()

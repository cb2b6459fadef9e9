"""Soak: the local stack for --duration-s (default 30 minutes) at about half its capacity.

The same stack as bench/chaos.py (Redis, indexer, two drafter replicas, the Generate API with
one prefill and two decode workers on Ray; the speculator with --speculator), no faults. First
it measures capacity: --probe-s of closed-loop load with --probe-clients clients; the soak then
sends open-loop (Poisson) requests at --load (0.5) x that many requests per second, greedy,
--max-tokens each; --abandon of them are dropped by the client after a few tokens (the stream
cancelled), so the drafters must free sequences nobody will finish.

Every --sample-s it records, per process (the API's own, each Ray worker, each service): resident
memory and open file descriptors, and the drafters' live sequence counts. One JSON line per
sample, then a summary line against the targets:

  rss_change_pct       per process: last sample against the first one after --warmup-s
                       (target: within 5 %)
  fds                  per process: first after warm-up, last, max (target: flat)
  latency              p50 / p99 (arrival to last token) of the first and the last 5 minutes
                       of the load (target: flat)
  drafter_sequences    max live sequences per drafter, and at the end after the load
                       (target: bounded; back to 0 once idle)

and a PNG of the curves (memory, descriptors, latency per minute, drafter sequences).

    python bench/soak.py --duration-s 1800 --out bench/results/soak.jsonl \\
        --png bench/results/soak.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

from bench import flags
from bench.chaos import Stack
from bench.stats import percentile
from sssd.common.config.logs import configure_logging

logger = logging.getLogger("soak")


def processes(stack) -> dict[str, int]:
    """Name -> pid of every process of the stack (Ray workers asked for theirs)."""
    import ray

    pids = {"api (driver)": os.getpid()}
    for kind in ("prefill", "decode"):
        for i, slot in enumerate(stack.frontend.backend.workers(kind)):
            pids[f"{kind}-{i}"] = ray.get(slot.actor.ready.remote(), timeout=60)["pid"]
    for name in ("redis", "indexer", "drafter-0", "drafter-1", "speculator"):
        if stack.supervisor.has(name):
            pids[name] = stack.supervisor.process(name).pid
    return pids


def sample(pids: dict[str, int], drafters: dict) -> dict:
    import psutil

    row = {"rss_mb": {}, "fds": {}, "drafter_sequences": {}}
    for name, pid in pids.items():
        try:
            process = psutil.Process(pid)
            row["rss_mb"][name] = round(process.memory_info().rss / 2**20, 1)
            row["fds"][name] = process.num_fds()
        except psutil.Error:
            row["rss_mb"][name] = row["fds"][name] = None
    for name, remote in drafters.items():
        try:
            row["drafter_sequences"][name] = remote.info()["num_sequences"]
        except Exception:  # noqa: BLE001 - reported as unknown
            row["drafter_sequences"][name] = None
    return row


def request(client, prompt, max_tokens, abandon_after, sent, records, lock) -> None:
    import grpc

    record = {"sent": sent, "ok": False, "abandoned": abandon_after is not None}
    tokens = 0
    try:
        for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0):
            tokens += len(chunk.token_ids)
            if abandon_after is not None and tokens >= abandon_after:
                break  # the generator's finally cancels the call
        record["ok"] = True
    except grpc.RpcError as err:
        record["error"] = f"{err.code().name}: {err.details()}"
    record.update(ended=time.monotonic(), tokens=tokens)
    with lock:
        records.append(record)


def measure_capacity(client, prompts, args) -> float:
    """Completed requests per second with --probe-clients closed-loop clients."""
    done, stop = [], time.monotonic() + args.probe_s
    lock = threading.Lock()

    def loop(offset: int) -> None:
        i = offset
        while time.monotonic() < stop:
            client.generate(prompts[i % len(prompts)], max_tokens=args.max_tokens,
                            temperature=0.0)
            with lock:
                done.append(time.monotonic())
            i += args.probe_clients

    start = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.probe_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(done) / (time.monotonic() - start)


def run(args) -> list[dict]:
    from bench.prompt_sets import prompt_texts
    from sssd.client import GenerationClient, RetryPolicy
    from sssd.common.data.corpus import prompt_token_ids
    from sssd.common.model.tokenizer import load_tokenizer
    from sssd.drafter.client import RemoteDrafter

    tokenizer = load_tokenizer(None)
    prompts = [prompt_token_ids(tokenizer, text)
               for text in prompt_texts(args.prompt_set, args.prompts)]
    rng = random.Random(args.seed)
    stack = Stack(args, tokenizer)
    rows: list[dict] = []
    try:
        client = GenerationClient(f"127.0.0.1:{stack.frontend.port}", RetryPolicy(attempts=1),
                                  timeout_s=600)
        capacity = args.capacity or measure_capacity(client, prompts, args)
        rate = args.load * capacity
        logger.info("capacity %.3f requests/s; soaking at %.3f for %.0f s", capacity, rate,
                    args.duration_s)
        drafters = {n: RemoteDrafter(f"127.0.0.1:{stack.ports[n]}", timeout_s=5)
                    for n in ("drafter-0", "drafter-1")}
        records: list[dict] = []
        lock = threading.Lock()
        start = time.monotonic()
        end = start + args.duration_s
        stop_sampling = threading.Event()

        def sampler() -> None:
            while True:
                pids = processes(stack)
                row = {"t_s": round(time.monotonic() - start, 1)} | sample(pids, drafters)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if stop_sampling.wait(args.sample_s):
                    return

        sampling = threading.Thread(target=sampler, daemon=True)
        sampling.start()
        threads, arrival = [], start
        while True:
            arrival += rng.expovariate(rate)
            if arrival >= end:
                break
            time.sleep(max(0.0, arrival - time.monotonic()))
            abandon = rng.randint(2, 6) if rng.random() < args.abandon else None
            thread = threading.Thread(target=request, args=(
                client, rng.choice(prompts), args.max_tokens, abandon, time.monotonic(),
                records, lock), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout=600)
        time.sleep(args.sample_s)  # idle: abandoned sequences must be gone by now
        stop_sampling.set()
        sampling.join()
        rows.append(summary(rows, records, start, capacity, rate, args))
        if args.png:
            plot(rows, records, start, args.png)
        client.close()
        for remote in drafters.values():
            remote.close()
    finally:
        stack.stop()
    return rows


def summary(samples, records, start, capacity, rate, args) -> dict:
    after = [s for s in samples if s["t_s"] >= args.warmup_s] or samples
    first, last = after[0], after[-1]
    rss, fds = {}, {}
    for name, base in first["rss_mb"].items():
        end = last["rss_mb"].get(name)
        if base and end:
            rss[name] = {"after_warmup_mb": base, "last_mb": end,
                         "change_pct": round(100 * (end - base) / base, 2)}
        fds[name] = {"after_warmup": first["fds"].get(name), "last": last["fds"].get(name),
                     "max": max((s["fds"].get(name) or 0) for s in after)}
    complete = [r for r in records if r["ok"] and not r["abandoned"]]
    window = 300.0

    def latencies(lo, hi):
        return [r["ended"] - r["sent"] for r in complete if lo <= r["sent"] - start < hi]

    head, tail = latencies(0, window), latencies(args.duration_s - window, args.duration_s)
    sequences = {name: {"max": max((s["drafter_sequences"].get(name) or 0) for s in samples),
                        "at_end": last["drafter_sequences"].get(name)}
                 for name in first["drafter_sequences"]}
    return {
        "summary": True, "duration_s": args.duration_s, "capacity_rps": round(capacity, 4),
        "rate_rps": round(rate, 4), "sent": len(records),
        "completed": sum(r["ok"] for r in records),
        "abandoned": sum(r["abandoned"] for r in records),
        "failed": sum(not r["ok"] for r in records),
        "rss": rss, "rss_max_abs_change_pct": max(abs(v["change_pct"]) for v in rss.values()),
        "fds": fds, "latency_first_5min": {"p50": percentile(head, 50),
                                           "p99": percentile(head, 99), "n": len(head)},
        "latency_last_5min": {"p50": percentile(tail, 50), "p99": percentile(tail, 99),
                              "n": len(tail)},
        "drafter_sequences": sequences,
    }


def plot(rows, records, start, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [r for r in rows if "t_s" in r]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    t = [s["t_s"] / 60 for s in samples]
    for name in samples[0]["rss_mb"]:
        axes[0][0].plot(t, [s["rss_mb"].get(name) for s in samples], label=name)
        axes[0][1].plot(t, [s["fds"].get(name) for s in samples], label=name)
    axes[0][0].set_title("resident memory (MiB)")
    axes[0][1].set_title("open file descriptors")
    axes[0][0].legend(fontsize=7)
    minutes: dict[int, list[float]] = {}
    for r in records:
        if r["ok"] and not r["abandoned"]:
            minutes.setdefault(int((r["sent"] - start) // 60), []).append(r["ended"] - r["sent"])
    keys = sorted(minutes)
    axes[1][0].plot(keys, [percentile(minutes[k], 50) for k in keys], label="p50")
    axes[1][0].plot(keys, [percentile(minutes[k], 99) for k in keys], label="p99")
    axes[1][0].set_title("latency per minute of arrival (s)")
    axes[1][0].legend()
    for name in samples[0]["drafter_sequences"]:
        axes[1][1].plot(t, [s["drafter_sequences"].get(name) for s in samples], label=name)
    axes[1][1].set_title("drafter live sequences")
    axes[1][1].legend()
    for ax in axes.flat:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--warmup-s", type=float, default=300.0)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.5, help="fraction of the capacity")
    parser.add_argument("--capacity", type=float, default=0.0,
                        help="requests per second at capacity (default: measured first)")
    parser.add_argument("--probe-s", type=float, default=90.0)
    parser.add_argument("--probe-clients", type=int, default=4)
    parser.add_argument("--abandon", type=float, default=0.1,
                        help="fraction of requests the client drops after a few tokens")
    flags.add_max_tokens(parser, 32)
    parser.add_argument("--prompt-set", default="mt_bench")
    flags.add_prompts(parser, 16)
    parser.add_argument("--speculator", action="store_true")
    flags.add_datastore(parser, "the datastore the live one starts from (default: as sssd up)")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--build-tokens", type=int, default=2048)
    parser.add_argument("--build-interval-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--work-dir", type=Path, default=Path("var/bench-soak"))
    flags.add_out(parser, None)
    flags.add_png(parser, None)
    args = parser.parse_args(argv)
    if args.duration_s < 600 and args.duration_s < 2 * args.warmup_s:
        parser.error("--duration-s must be at least twice --warmup-s")
    configure_logging(logging.INFO)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # children are spawned, not forked
    for row in run(args):
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if row.get("summary"):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

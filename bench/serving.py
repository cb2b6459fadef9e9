"""Open-loop load test of the Generate API over gRPC: latency vs throughput, speculation on/off.

Requests arrive as a Poisson process (exponential gaps, fixed seed) at each `--rates` value
(requests per second), whether or not earlier ones have finished (open loop); each is an
MT-Bench first turn (chat template applied by the server), greedy, `--max-tokens` new tokens.
Every rate runs twice on the same server, once with speculation on (`auto`) and once off, in
alternating order, so the two see the same machine state.

By default the benchmark starts the stack itself, as `sssd up` does: the drafter service as a
child process, a local Ray cluster with one prefill and one decode worker, the frontend
(`--single-process` puts the engine in this process instead). `--target host:port` measures a
server that is already running.

One JSON object per (speculation, rate) on stdout:
  offered_rps, achieved_rps    arrival rate asked for / completed requests per second
  throughput_tok_s             output tokens per second over the run (first arrival to last end)
  ttft_s_p50/p90/p99           time to first token, measured by the client
  itl_ms_p50/p90/p99           inter-token latency: per request, (last token time - first token
                               time) / (tokens - 1), i.e. the mean gap the reader saw
  e2e_s_p50/p90/p99            request latency, arrival to last token
  tokens_per_step              mean tokens per verification step over the requests
  errors                       requests that failed (any status)
A PNG of p50 inter-token latency and p50 TTFT against throughput goes to `--png`.

    python bench/serving.py --rates 0.1,0.2,0.4,0.8 --requests 16 --png bench/results/serving.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import threading
import time
from pathlib import Path

from bench import flags
from bench.stats import percentile
from sssd.common.config.logs import configure_logging

logger = logging.getLogger("serving")


def one_request(client, prompt: str, max_tokens: int, speculation: str, arrival: float,
                out: list) -> None:
    record = {"arrival": arrival}
    try:
        times, counts, totals = [], [], None
        for chunk in client.stream(prompt, max_tokens=max_tokens, speculation=speculation):
            if chunk.token_ids:
                times.append(time.perf_counter())
                counts.append(len(chunk.token_ids))
            totals = chunk.totals or totals
        record.update(first=times[0], last=times[-1], tokens=sum(counts),
                      steps_tokens=totals.mean_accepted_length if totals else None)
    except Exception as exc:  # noqa: BLE001 - counted as an error of the run
        record["error"] = str(exc)[:200]
    out.append(record)


def run_load(client, prompts: list[str], rate: float, num_requests: int, max_tokens: int,
             speculation: str, seed: int) -> dict:
    rng = random.Random(seed)
    records: list[dict] = []
    threads = []
    start = time.perf_counter()
    next_arrival = start
    for index in range(num_requests):
        delay = next_arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one_request, args=(
            client, prompts[index % len(prompts)], max_tokens, speculation, next_arrival,
            records), daemon=True)
        thread.start()
        threads.append(thread)
        next_arrival += rng.expovariate(rate)
    for thread in threads:
        thread.join()
    done = [r for r in records if "error" not in r]
    end = max((r["last"] for r in done), default=time.perf_counter())
    ttft = [r["first"] - r["arrival"] for r in done]
    itl = [1e3 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    e2e = [r["last"] - r["arrival"] for r in done]
    tokens = sum(r["tokens"] for r in done)
    steps = [r["steps_tokens"] for r in done if r.get("steps_tokens")]
    row = {"speculation": speculation, "offered_rps": rate, "requests": num_requests,
           "achieved_rps": len(done) / (end - start), "throughput_tok_s": tokens / (end - start),
           "errors": len(records) - len(done),
           "tokens_per_step": statistics.mean(steps) if steps else None}
    for name, values in (("ttft_s", ttft), ("itl_ms", itl), ("e2e_s", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = percentile(values, q)
    if len(done) < len(records):
        row["first_error"] = next(r["error"] for r in records if "error" in r)
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for speculation, style in (("auto", "o-"), ("off", "s--")):
        series = sorted((r for r in rows if r["speculation"] == speculation and r["itl_ms_p50"]),
                        key=lambda r: r["offered_rps"])
        label = "speculation on (SSSD)" if speculation == "auto" else "speculation off"
        xs = [r["throughput_tok_s"] for r in series]
        axes[0].plot(xs, [r["itl_ms_p50"] for r in series], style, label=label)
        axes[1].plot(xs, [r["ttft_s_p50"] for r in series], style, label=label)
        for r in series:
            axes[0].annotate(f"{r['offered_rps']:g}/s", (r["throughput_tok_s"], r["itl_ms_p50"]),
                             fontsize=7, textcoords="offset points", xytext=(3, 3))
    axes[0].set_ylabel("inter-token latency p50 (ms)")
    axes[1].set_ylabel("time to first token p50 (s)")
    for axis in axes:
        axis.set_xlabel("throughput (output tokens/s)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def start_stack(args) -> tuple[str, callable]:
    """Starts drafter + (Ray) frontend like `sssd up`; returns the target and a stop function."""
    from sssd.cli.datastores import pick_datastore
    from sssd.cli.processes import start_drafter
    from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
    from sssd.verifier.engine.config import EngineConfig
    from sssd.verifier.serving.config import FrontendConfig, RayConfig
    from sssd.verifier.serving.frontend import start_frontend

    tokenizer = load_tokenizer()
    datastore = pick_datastore(args.datastore, tokenizer, 12_000)
    logger.info("datastore %s", datastore)
    drafter = start_drafter(datastore, vocab_size(tokenizer), tokenizer_fingerprint(tokenizer),
                            "127.0.0.1", args.drafter_port)
    engine = EngineConfig(dtype=args.dtype, mode="sssd", max_batch_size=args.max_batch_size,
                          max_len=2048, budget_policy=args.budget_policy,
                          drafter_target=f"127.0.0.1:{args.drafter_port}")
    ray = None if args.single_process else RayConfig(dashboard_port=0,
                                                     metrics_port=args.metrics_port)
    frontend = start_frontend(FrontendConfig(engine=engine, port=0, http_port=0,
                                             max_requests=256,
                                             max_workers=300, ray=ray))
    frontend.load()

    def stop() -> None:
        frontend.stop(0)
        drafter.terminate()
        drafter.wait(10)

    return f"127.0.0.1:{frontend.port}", stop, str(datastore)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.1,0.2,0.4,0.8", help="requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=16, help="per (rate, speculation)")
    flags.add_max_tokens(parser, 128)
    parser.add_argument("--target", default=None, help="a running server; else start one")
    parser.add_argument("--single-process", action="store_true",
                        help="started server: engine in this process, no Ray")
    flags.add_datastore(parser, "the drafter's datastore (default: as sssd up)")
    flags.add_dtype(parser)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--budget-policy", default="measured", choices=("rule", "measured"))
    parser.add_argument("--drafter-port", type=int, default=50151)
    parser.add_argument("--metrics-port", type=int, default=8180)
    parser.add_argument("--seed", type=int, default=0)
    flags.add_png(parser, "serving")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)

    from sssd.client import GenerationClient, RetryPolicy
    from sssd.common.data.corpus import first_turns, read_mt_bench

    rates = [float(r) for r in args.rates.split(",")]
    prompts = first_turns(read_mt_bench())
    stop, datastore = None, None
    target = args.target
    if target is None:
        target, stop, datastore = start_stack(args)
    rows = []
    try:
        with GenerationClient(target, RetryPolicy(attempts=3)) as client:
            client.generate(prompts[0], max_tokens=8)  # warm-up
            for index, rate in enumerate(rates):
                order = ("auto", "off") if index % 2 == 0 else ("off", "auto")
                for speculation in order:
                    logger.info("rate %.3g/s, speculation %s", rate, speculation)
                    row = run_load(client, prompts, rate, args.requests, args.max_tokens,
                                   speculation, args.seed + index)
                    row.update(mode="single-process" if args.single_process else "ray",
                               max_tokens=args.max_tokens, datastore=datastore,
                               target=args.target)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if stop is not None:
            stop()
    plot(rows, args.png, f"Generate API, open loop, MT-Bench x {args.max_tokens} tokens, "
                         f"{args.dtype}, {'single process' if args.single_process else 'Ray PD'}")
    logger.info("wrote %s", args.png)


if __name__ == "__main__":
    main()

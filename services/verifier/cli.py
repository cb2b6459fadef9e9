"""`sssd`: the command line of sssd-serve.

    sssd up                         the whole local stack: drafter service, Ray cluster with
                                    prefill and decode workers, the gRPC API; answers a check
                                    prompt, then serves until Ctrl-C (see `sssd up --help`)
    sssd serve                      the generation API on 127.0.0.1:50061 (single process by
                                    default; --ray: prefill/decode workers on Ray)
    sssd generate "prompt"          streams an answer from a running server
    sssd chat                       multi-turn chat with a running server

Every Generate field has an option: --max-tokens, --temperature, --top-p, --top-k, --seed,
--stop (repeatable), --speculation auto|off|sssd. --stats prints the totals after the answer.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEFAULT_TARGET = "127.0.0.1:50061"


def add_request_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"server (default {DEFAULT_TARGET})")
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the server default")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--speculation", default="auto", choices=("auto", "off", "sssd"))
    parser.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
    parser.add_argument("--stats", action="store_true", help="print the totals afterwards")


def request_options(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop, speculation=args.speculation)


def print_stream(client, prompt, args) -> str:
    text, totals = "", None
    for chunk in client.stream(prompt, **request_options(args)):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        text += chunk.text
        totals = chunk.totals or totals
    print()
    if args.stats and totals is not None:
        print(f"[{totals.completion_tokens} tokens, {totals.finish_reason}; first token after "
              f"{totals.time_to_first_token_s:.2f} s, {totals.tokens_per_second:.1f} tokens/s, "
              f"{totals.mean_accepted_length:.2f} tokens per step]", file=sys.stderr)
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from sssd.verifier.client import GenerationClient

    with GenerationClient(args.target, timeout_s=args.timeout) as client:
        print_stream(client, args.prompt, args)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from sssd.verifier.client import GenerationClient

    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: an empty line or Ctrl-D ends it", file=sys.stderr)
    with GenerationClient(args.target, timeout_s=args.timeout) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if not line.strip():
                return 0
            messages.append({"role": "user", "content": line})
            answer = print_stream(client, messages, args)
            messages.append({"role": "assistant", "content": answer})


def cmd_serve(args: argparse.Namespace) -> int:
    from sssd.verifier.config import EngineConfig
    from sssd.verifier.frontend import FrontendConfig, serve

    engine = EngineConfig(model=args.model, dtype=args.dtype, mode=args.mode,
                          max_batch_size=args.max_batch_size, max_len=args.max_len,
                          budget_policy=args.budget_policy, drafter_target=args.drafter,
                          datastore_dir=str(args.datastore) if args.datastore else None)
    ray = None
    if args.ray:
        from sssd.verifier.ray_serving import RayConfig

        ray = RayConfig(num_prefill_workers=args.prefill_workers,
                        num_decode_workers=args.decode_workers, address=args.ray_address,
                        auth=args.ray_auth, host=args.host, token_file="var/ray/auth_token")
    config = FrontendConfig(engine=engine, host=args.host, port=args.port,
                            max_requests=args.max_requests, max_workers=args.max_requests + 16,
                            grace_s=args.grace_s, ray=ray)
    serve(config)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from sssd.verifier.stack import run

    return run(args)


def stack_doc() -> str:
    from sssd.verifier import stack

    return (stack.__doc__ or "").split("\n\n")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sssd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    add_request_options(gen)
    chat = commands.add_parser("chat", help="multi-turn chat")
    chat.add_argument("--system", default=None, help="system message")
    add_request_options(chat)
    srv = commands.add_parser("serve", help="run the generation API (single process)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=50061)
    srv.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    srv.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    srv.add_argument("--mode", default="sssd", choices=("ar", "prompt_lookup", "sssd"))
    srv.add_argument("--datastore", type=Path, default=None,
                     help="datastore of the in-process drafter (mode sssd)")
    srv.add_argument("--drafter", default=None, help="host:port of a drafter service instead")
    srv.add_argument("--max-batch-size", type=int, default=8)
    srv.add_argument("--max-len", type=int, default=4096)
    srv.add_argument("--budget-policy", default="measured", choices=("rule", "measured"))
    srv.add_argument("--max-requests", type=int, default=64)
    srv.add_argument("--grace-s", type=float, default=10.0)
    srv.add_argument("--ray", action="store_true",
                     help="prefill and decode workers as Ray actors (else one process)")
    srv.add_argument("--prefill-workers", type=int, default=1)
    srv.add_argument("--decode-workers", type=int, default=1)
    srv.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (auto, host:port) instead of starting one")
    srv.add_argument("--ray-auth", default="token", choices=("token", "disabled"),
                     help="Ray token authentication (default on; see `sssd up --help`)")
    from sssd.verifier.stack import add_arguments

    add_arguments(commands.add_parser("up", help="start the whole stack locally and serve",
                                      description=stack_doc()))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
               "up": cmd_up}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # grpc.RpcError and friends: one line, not a traceback
        code = getattr(exc, "code", None)
        details = getattr(exc, "details", None)
        if callable(code) and callable(details):
            print(f"sssd: {code().name}: {details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

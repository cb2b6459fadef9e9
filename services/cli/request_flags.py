"""The Generate request's options of `sssd generate` and `sssd chat`, and how an answer is
printed: the text streamed to stdout; the totals (--stats) and each token's log-probability
table (--logprobs) to stderr, so stdout stays the answer alone."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sssd.common.rpc.api_key import KEY_ENV
from sssd.common.rpc.ports import GENERATE_PORT

DEFAULT_TARGET = f"127.0.0.1:{GENERATE_PORT}"


def add_request_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"server (default {DEFAULT_TARGET})")
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the server default")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this fraction of the top one's probability")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds sampling: the same seed, prompt and settings give the same "
                        "answer (default: a random seed)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[],
                        help="a token id that ends the answer (repeatable)")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="no end of answer before this many tokens")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="vLLM's multiplicative one, > 0 (1: off)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                        help="added to the token's logit, in [-100, 100] (repeatable)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="print each token's log-probability under the target and its N "
                        "most likely alternatives (0-20) to stderr after the answer")
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument("--json", action="store_true", help="the answer is a JSON object")
    grammar.add_argument("--json-schema", metavar="SCHEMA",
                         help="the answer validates against this JSON schema (inline JSON, or "
                         "a file)")
    grammar.add_argument("--regex", help="the answer matches this regular expression")
    grammar.add_argument("--choice", action="append", default=None,
                         help="the answer is exactly one of these strings (repeatable)")
    grammar.add_argument("--grammar", type=Path, metavar="FILE",
                         help="the answer follows this Lark grammar (llguidance's dialect)")
    parser.add_argument("--speculation", default="auto", choices=("auto", "off", "sssd", "ssd"),
                        help="auto (default): the server decides (by measured speed where it "
                        "has several sources); off: no drafts; sssd: drafts from the SSSD "
                        "drafter; ssd: from the speculator (servers started with --speculator)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
    parser.add_argument("--api-key", default=None,
                        help=f"the server's API key (default ${KEY_ENV})")
    parser.add_argument("--stats", action="store_true", help="print the totals afterwards")


def grammar_option(args: argparse.Namespace) -> dict | None:
    """The client's `grammar` of the options, or None; ValueError for a schema that is neither
    JSON nor a readable file of JSON."""
    if args.json:
        return {"json_object": True}
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as exc:
                raise ValueError(f"--json-schema: neither a JSON object nor a readable file "
                                 f"({exc.strerror}: {text})") from None
        try:
            return {"json_schema": json.loads(text)}
        except ValueError as exc:
            raise ValueError(f"--json-schema: not JSON ({exc})") from None
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    if args.grammar is not None:
        try:
            return {"lark": args.grammar.read_text()}
        except OSError as exc:
            raise ValueError(f"--grammar: {exc.strerror}: {args.grammar}") from None
    return None


def logit_bias(items: list[str]) -> dict[int, float]:
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias: TOKEN_ID=BIAS, got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias: TOKEN_ID=BIAS, got {item!r}")
    return bias


def request_options(args: argparse.Namespace) -> dict:
    """The client's keyword arguments of the parsed options (ValueError for a malformed one;
    ranges are the server's to check, as for every client)."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                stop_token_ids=args.stop_token_id, min_tokens=args.min_tokens,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty,
                logit_bias=logit_bias(args.logit_bias), top_logprobs=args.logprobs,
                grammar=grammar_option(args), speculation=args.speculation)


def print_logprobs(entries, file=None) -> None:
    """One line per token: its text, its log-probability, then its alternatives (to stderr by
    default, looked up at the call: a test's or a caller's replacement is honoured)."""
    file = file or sys.stderr
    print(f"{'token':<20} {'logprob':>9}  top alternatives", file=file)
    for entry in entries:
        others = "  ".join(f"{text!r} {logprob:.3f}"
                           for text, (_, logprob) in zip(entry.top_tokens, entry.top))
        print(f"{entry.token!r:<20} {entry.logprob:>9.4f}  {others}", file=file)


def print_stream(client, prompt, args, tools: list[dict] | None = None) -> tuple[str, list]:
    """Streams the answer to stdout; returns its text and the tool calls it made."""
    options = request_options(args) | ({"tools": tools} if tools else {})
    text, totals, logprobs, calls = "", None, [], []
    for chunk in client.stream(prompt, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        text += chunk.text
        logprobs += chunk.logprobs
        calls += chunk.tool_calls
        totals = chunk.totals or totals
    if text or not calls:
        print()
    if args.logprobs is not None:
        print_logprobs(logprobs)
    if args.stats and totals is not None:
        print(f"[{totals.completion_tokens} tokens, {totals.finish_reason}; first token after "
              f"{totals.time_to_first_token_s:.2f} s, {totals.tokens_per_second:.1f} tokens/s, "
              f"{totals.mean_accepted_length:.2f} tokens per step]", file=sys.stderr)
    return text, calls

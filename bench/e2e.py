"""End-to-end decoding speed: autoregressive vs prompt-lookup vs SSSD, greedy, on MT-Bench or code.

For each batch size, the engine decodes the prompt set's prompts (`--set mt_bench`: MT-Bench
first turns; `--set code`: bench/data/code_prompts.jsonl; chat template applied)
with continuous batching at that batch size, `--max-tokens` new tokens each, greedy. Modes:
`ar` (no speculation, the baseline), `prompt_lookup` (input trie only) and `sssd` (input trie +
datastore), the last two under both budget policies (`rule`, `measured`) and, with
`--policies ...,fixed:8`, at a fixed budget (every step drafts 8 nodes). Every configuration
runs in this one process, side by side, after a short warm-up; speedups are over `ar` at the
same batch size in the same run.

The datastore is the model's own answers to ShareGPT prompts, made with
`sssd-self-outputs generate` and `sssd-self-outputs build --conversations N`; the JSON names the
directory and the number of conversations and tokens it holds.

Prints one JSON object per (mode, batch, policy) on stdout:
  tok_s                       output tokens per second of wall time (prefill included)
  speedup                     tok_s / tok_s of ar at the same batch size
  tokens_per_step             tokens emitted per sequence per verification step (accepted + 1)
  rows_per_step               sequences per verification step: below the batch size while a
                              chunk drains (its last sequences run alone; speculation finishes
                              the easy ones sooner and so drains more); chunks of many times the
                              batch size keep the batch full, as a loaded server does
  draft_accepted_per_step     draft tokens accepted per sequence per step (tokens_per_step - 1)
  draft_ms_per_step           mean wall time of the batched drafter call per step
  verify_ms_per_step          mean wall time of the verification forward pass per step
  verify_ms_by_budget         the same for the steps of each budget (budget_counts: how many)
  tpot_ms_median              median over the prompts of each answer's time per output token
                              after its first (TPOT as vLLM's benchmark client measures it)
  speedup_tpot_median         median over the prompts of ar's TPOT over this one's for the same
                              prompt: the speed a user sees while the answer streams. Neither
                              speedup is a loaded server's: `speedup` counts a chunk's drain
                              (its last answers run alone, and speculation, finishing some
                              sooner, drains more: rows_per_step), and a TPOT counts the steps
                              that prefilled prompts admitted beside the answer, which in ar
                              come between waves (answers of max_tokens end together) and with
                              speculation in mid-answer
  same_as_ar                  prompts whose output equals ar's at the same batch size (bf16
                              ties can flip argmax between batch shapes; float32 is exact, see
                              tests/verifier/test_engine_greedy.py)
and, with `--hf-prompts`, two rows at batch size 1 for transformers' own `generate()`, plain and
with its prompt-lookup decoding (`prompt_lookup_num_tokens=10`), alternating prompt by prompt,
and a third with `--hf-assistant` (its assisted generation with that draft model, ordinary
speculative decoding); all but the first carry `speedup_over_hf_generate`.
A PNG of speedup vs batch size goes to `--png`.

    python bench/e2e.py --datastore var/self-outputs/datastore-3000 --png var/bench/e2e.png
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from pathlib import Path

import torch

from bench import flags
from bench.prompt_sets import SETS, prompt_texts
from sssd.cli.datastores import check_datastore
from sssd.common.config.logs import configure_logging
from sssd.common.data.corpus import prompt_token_ids
from sssd.common.model.loader import LoadedModel, load_causal_lm
from sssd.datastore.manifest import read_manifest
from sssd.verifier.engine import EngineConfig, EngineStats
from sssd.verifier.engine.budget_policy import FixedBudget
from sssd.verifier.engine.request import GenerateRequest, SamplingParams
from sssd.verifier.factory import build_engine

logger = logging.getLogger("e2e")


def datastore_summary(path: Path | None) -> dict:
    if path is None:
        return {}
    manifest = read_manifest(path)
    if manifest is None or not manifest.shards:
        raise SystemExit(f"{path} holds no datastore (no manifest or no shards)")
    tokens = sum(json.loads((path / shard / "meta.json").read_text()).get("num_tokens", 0)
                 for shard in manifest.shards)
    summary = {"datastore": str(path), "datastore_tokens": tokens}
    match = re.match(r"datastore-(\d+)", path.name)  # sssd-self-outputs names
    if match:
        summary["datastore_conversations"] = int(match.group(1))
    return summary


class Run:
    """One (mode, batch, policy, datastore) configuration: its engine and what it measured."""

    def __init__(self, loaded: LoadedModel, mode: str, batch: int, policy: str, max_len: int,
                 drafter_target: str | None, datastore: Path | None, profile_path: Path,
                 warmup: list[list[int]]) -> None:
        self.mode, self.batch, self.policy, self.datastore = mode, batch, policy, datastore
        fixed = int(policy.removeprefix("fixed:")) if policy.startswith("fixed:") else None
        config = EngineConfig(
            mode=mode, max_batch_size=batch, budget_policy="rule" if fixed else policy,
            max_len=max_len,
            drafter_target=drafter_target, drafter_timeout_s=5.0,
            datastore_dir=str(datastore) if mode == "sssd" and datastore else None,
            profile_path=str(profile_path), reuse_acceptance=False,
            dtype=str(loaded.dtype).removeprefix("torch."))
        self.engine = build_engine(config, loaded)
        if fixed:  # every step at this budget: what the policies are measured against
            self.engine.budget_policy = FixedBudget(fixed)
        self.engine.generate(warmup, 8)  # allocator, kernels, drafter connection
        self.engine.stats = EngineStats()
        self.elapsed = 0.0
        self.chunk_tok_s: list[float] = []
        self.outputs: list[list[int]] = []
        self.tpots: list[float | None] = []  # per prompt, in the order of self.outputs

    def run_chunk(self, prompts: list[list[int]], max_tokens: int) -> None:
        start = time.perf_counter()
        outputs, tpots = decode_timed(self.engine, prompts, max_tokens)
        elapsed = time.perf_counter() - start
        self.elapsed += elapsed
        self.chunk_tok_s.append(sum(len(o) for o in outputs) / elapsed)
        self.outputs += outputs
        self.tpots += tpots

    def row(self) -> dict:
        stats = self.engine.stats
        num_tokens = sum(len(o) for o in self.outputs)
        steps = max(stats.num_steps, 1)
        return {
            "mode": self.mode, "batch": self.batch,
            "policy": self.policy if self.mode != "ar" else None,
            "tok_s": num_tokens / self.elapsed, "elapsed_s": self.elapsed,
            "num_tokens": num_tokens,
            "tokens_per_step": stats.mean_accepted_per_step,
            "rows_per_step": stats.num_row_steps / steps,
            "draft_accepted_per_step": stats.num_accepted / max(stats.num_row_steps, 1),
            "draft_ms_per_step": 1e3 * stats.draft_s / steps,
            "verify_ms_per_step": 1e3 * stats.verify_s / steps,
            "prefill_s": stats.prefill_s, "num_steps": stats.num_steps,
            "draft_failures": stats.num_draft_failures,
            "budget_counts": {str(k): v for k, v in sorted(stats.budget_counts.items())},
            "verify_ms_by_budget": {str(k): round(1e3 * stats.verify_s_by_budget[k] / v, 1)
                                    for k, v in sorted(stats.budget_counts.items())},
            "tpot_ms_median": 1e3 * statistics.median(timed) if (timed := [
                t for t in self.tpots if t is not None]) else None,
        }

    def close(self) -> None:
        self.engine.close()


def decode_timed(engine, prompts: list[list[int]],
                 max_tokens: int) -> tuple[list[list[int]], list[float | None]]:
    """Greedy answers to the prompts, decoded as `Engine.generate` does (continuous batching at
    the engine's batch size), and each answer's time per output token: from its first token to
    its last over the tokens after the first, as vLLM's benchmark client defines TPOT (None for
    an answer of one token). Steps that also prefilled prompts admitted beside the answer
    count in its TPOT, as they do for a server's user."""
    sequences = [engine.add_request(GenerateRequest(tuple(p), max_tokens, SamplingParams()))
                 for p in prompts]
    index = {sequence.request_id: i for i, sequence in enumerate(sequences)}
    first: list[float | None] = [None] * len(sequences)
    last: list[float | None] = [None] * len(sequences)
    while engine.has_work():
        rows = engine.step().rows  # the sequences that gained tokens in the step
        now = time.perf_counter()
        for row in rows:
            i = index[row.request_id]
            if row.token_ids:
                last[i] = now
                if first[i] is None:
                    first[i] = now
    tpots = [(end - begin) / (len(s.output_ids) - 1) if len(s.output_ids) > 1 else None
             for begin, end, s in zip(first, last, sequences)]
    return [s.output_ids for s in sequences], tpots


def tpot_speedups(baseline: list[float | None], run: list[float | None]) -> list[float]:
    """Per prompt answered by both with more than one token: the baseline's TPOT over the
    run's."""
    return [b / r for b, r in zip(baseline, run) if b and r]


def start_drafters(loaded: LoadedModel, datastores: set[Path | None]) -> dict[Path | None, tuple]:
    """One gRPC drafter service on 127.0.0.1 per datastore (None: prompt lookup, no datastore).
    Returns {datastore: (target, (server, drafter))}."""
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.service import create_server

    servers = {}
    for directory in datastores:
        server, port, drafter = create_server(DrafterConfig(
            datastore_dir=str(directory) if directory else None, vocab_size=loaded.vocab_size,
            tokenizer_fingerprint=loaded.fingerprint, host="127.0.0.1", port=0))
        servers[directory] = (f"127.0.0.1:{port}", (server, drafter))
    return servers


HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


def hf_generate_rows(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int,
                     assistant: LoadedModel | None = None) -> list[dict]:
    """transformers' own generate(), greedy, one prompt at a time: plain, and with its prompt-
    lookup decoding (`prompt_lookup_num_tokens`), the peer a user of this model would reach for;
    with `assistant`, also its assisted generation (ordinary speculative decoding with that
    draft model, `assistant_model`). They alternate prompt by prompt after one warm-up call
    each, so the ratios between them are measured side by side."""
    model = loaded.model
    kinds = {"hf_generate": {}, "hf_prompt_lookup":
             {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}}
    if assistant is not None:
        kinds["hf_assisted"] = {"assistant_model": assistant.model}
    elapsed = {kind: [] for kind in kinds}
    outputs = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for extra in kinds.values():
            model.generate(torch.tensor([prompts[0]], device=model.device), do_sample=False,
                           max_new_tokens=8, **extra)
        for prompt in prompts:
            for kind, extra in kinds.items():
                start = time.perf_counter()
                out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False,
                                     max_new_tokens=max_tokens, **extra)
                elapsed[kind].append(time.perf_counter() - start)
                outputs[kind].append(out[0, len(prompt):].tolist())
    rows = []
    for kind in kinds:
        num_tokens = sum(len(o) for o in outputs[kind])
        rows.append({"mode": kind, "batch": 1, "policy": None,
                     "tok_s": num_tokens / sum(elapsed[kind]), "elapsed_s": sum(elapsed[kind]),
                     "num_tokens": num_tokens, "num_prompts": len(prompts)})
    plain = rows[0]
    for row in rows[1:]:
        row["speedup_over_hf_generate"] = row["tok_s"] / plain["tok_s"]
        row["same_as_hf_generate"] = sum(a == b for a, b in zip(outputs[row["mode"]],
                                                                outputs["hf_generate"]))
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if "speedup" in row:
            label = row["mode"] + (f" ({row['policy']})" if row["policy"] else "")
            if row.get("datastore_name"):
                label += f" [{row['datastore_name']}]"
            series.setdefault(label, []).append((row["batch"], row["speedup"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([b for b, _ in points], [s for _, s in points], marker="o", label=label)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def specs(modes: list[str], policies: list[str], datastore: Path | None,
          extra: Path | None) -> list[tuple[str, str, Path | None]]:
    """(mode, policy, datastore) of every configuration, ar first (the baseline)."""
    result = []
    for mode in modes:
        if mode == "ar":
            result.append(("ar", "rule", None))
        for policy in policies if mode != "ar" else ():
            result.append((mode, policy, datastore if mode == "sssd" else None))
    if extra is not None and "sssd" in modes:
        result += [("sssd", policy, extra) for policy in policies]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    flags.add_datastore(parser, "datastore for sssd (default: the largest "
                        "var/self-outputs/datastore-N)")
    parser.add_argument("--extra-datastore", type=Path, default=None,
                        help="a second datastore, run with sssd and every --policies policy")
    flags.add_set(parser, choices=SETS[:2])
    flags.add_prompts(parser, 80)
    flags.add_max_tokens(parser, 128)
    flags.add_batch_sizes(parser, "1,4,8")
    parser.add_argument("--modes", default="ar,prompt_lookup,sssd")
    parser.add_argument("--policies", default="rule,measured",
                        help="rule, measured, fixed:N (comma-separated)")
    flags.add_model(parser)
    flags.add_dtype(parser)
    flags.add_device(parser)
    parser.add_argument("--hf-prompts", type=int, default=10,
                        help="prompts for the transformers generate() row (0: skip)")
    parser.add_argument("--hf-assistant", default=None,
                        help="a draft model (file, directory or `sssd-models list` name, e.g. "
                        "qwen-coder-0.5b) for a row of transformers' assisted generation")
    parser.add_argument("--profile", type=Path, default=Path("var/forward-profile.json"),
                        help="forward-pass profile of the measured policy (made if missing)")
    parser.add_argument("--chunks", type=int, default=5,
                        help="prompt chunks; configurations take turns chunk by chunk (5; fewer "
                        "where a chunk would hold fewer prompts than the batch size)")
    parser.add_argument("--drafter", default="grpc", choices=("grpc", "inproc"),
                        help="drafter as a gRPC service on 127.0.0.1 (default) or in process")
    flags.add_png(parser, "e2e")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)

    datastore = args.datastore
    if datastore is None:
        candidates = sorted((p for p in Path("var/self-outputs").glob("datastore-*")
                             if p.name.split("-")[1].isdigit()),
                            key=lambda p: int(p.name.split("-")[1]))
        datastore = candidates[-1] if candidates else None
    modes = args.modes.split(",")
    if "sssd" in modes and datastore is None:
        raise SystemExit("no datastore: run `sssd-self-outputs generate` and `build` first, "
                         "or pass --datastore")
    configs = specs(modes, args.policies.split(","), datastore, args.extra_datastore)
    summaries = {ds: datastore_summary(ds) for _, _, ds in configs if ds is not None}
    args.profile.parent.mkdir(parents=True, exist_ok=True)

    loaded = load_causal_lm(args.model, args.dtype, args.device)
    for ds in summaries:
        try:
            check_datastore(ds, loaded.fingerprint)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    prompts = [prompt_token_ids(loaded.tokenizer, text)
               for text in prompt_texts(args.set, args.prompts)]
    max_len = max(len(p) for p in prompts) + args.max_tokens + 64
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if len(prompts) < max(batch_sizes):
        raise SystemExit(f"--prompts {len(prompts)} cannot fill a batch of {max(batch_sizes)}")
    servers = start_drafters(loaded, {ds for mode, _, ds in configs if mode != "ar"}) \
        if args.drafter == "grpc" else {}
    rows = []
    try:
        if args.hf_prompts:
            assistant = load_causal_lm(args.hf_assistant, args.dtype, args.device) \
                if args.hf_assistant else None
            for row in hf_generate_rows(loaded, prompts[: args.hf_prompts], args.max_tokens,
                                        assistant):
                row.update(prompt_set=args.set, dtype=args.dtype, device=loaded.device)
                print(json.dumps(row), flush=True)
                rows.append(row)
        for batch in batch_sizes:
            # Each chunk must hold at least `batch` prompts, or the batch is never full: fewer
            # chunks for the larger batches.
            num_chunks = max(1, min(args.chunks, len(prompts) // batch))
            chunks = [prompts[i::num_chunks] for i in range(num_chunks)]  # mixed lengths in each
            runs = []
            for mode, policy, ds in configs:
                logger.info("building mode=%s batch=%d policy=%s datastore=%s", mode, batch,
                            policy, ds)
                target = servers[ds][0] if mode != "ar" and servers else None
                runs.append(Run(loaded, mode, batch, policy, max_len, target, ds, args.profile,
                                prompts[:batch]))
            # Configurations take turns chunk by chunk, so a slow spell of the shared machine
            # hits all of them alike; per-chunk speedups are ratios measured side by side.
            for number, chunk in enumerate(chunks):
                for run in runs:
                    run.run_chunk(chunk, args.max_tokens)
                logger.info("batch %d: chunk %d/%d done", batch, number + 1, len(chunks))
            baseline = next((run for run in runs if run.mode == "ar"), None)
            for run in runs:
                row = run.row()
                run.close()
                if baseline is not None:
                    speedups = [a / b for a, b in zip(run.chunk_tok_s, baseline.chunk_tok_s)]
                    row["speedup"] = row["tok_s"] / baseline.row()["tok_s"]
                    row["speedup_median_chunk"] = statistics.median(speedups)
                    row["speedup_chunks"] = [round(x, 3) for x in speedups]
                    row["prompts_per_chunk"] = [len(chunk) for chunk in chunks]
                    row["same_as_ar"] = sum(a == b for a, b in zip(run.outputs, baseline.outputs))
                    by_prompt = tpot_speedups(baseline.tpots, run.tpots)
                    if by_prompt:
                        row["speedup_tpot_median"] = statistics.median(by_prompt)
                row.update(prompt_set=args.set, num_prompts=len(prompts),
                           max_tokens=args.max_tokens,
                           dtype=args.dtype, device=loaded.device, drafter=args.drafter)
                if run.datastore is not None:
                    row.update(summaries[run.datastore], datastore_name=run.datastore.name)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for _, (server, drafter) in servers.values():
            server.stop(grace=1.0).wait()
            drafter.close()
    main_summary = summaries.get(datastore, {})
    title = (f"{args.model or 'SmolLM2-135M'} {args.dtype}, {len(prompts)} {args.set} prompts x "
             f"{args.max_tokens} tokens, greedy\ndatastore {datastore.name if datastore else '-'} "
             f"({main_summary.get('datastore_tokens', 0) / 1e6:.1f} M tokens)")
    plot(rows, args.png, title)
    logger.info("wrote %s", args.png)


if __name__ == "__main__":
    main()

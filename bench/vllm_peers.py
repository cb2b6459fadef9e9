"""vLLM with our drafter service against vLLM's own `ngram` and `suffix` drafting, no speculation,
and our own engine with SSSD, on the same model and prompts.

Runs in .venv-vllm (scripts/setup_vllm.sh):

    .venv-vllm/bin/python bench/vllm_peers.py [--sets mt_bench,code] [--prompts 8]
        [--max-tokens 64] [--batch-sizes 1,8] [--modes none,ngram,suffix,sssd,sssd-self,engine]
        [--k 4] [--budget 16] [--min-score 0.2] [--datastore DIR] [--self-datastore DIR]
        [--model qwen-coder-1.5b] [--dtype bfloat16] [--out bench/results/vllm-peers.jsonl]
    .venv/bin/python bench/vllm_peers.py --plot bench/results/vllm-peers.jsonl   # the PNG only

The model is the default SmolLM2-135M-Instruct in float32 unless --model (a name of `sssd-models
list`) and --dtype say otherwise (`sssd.vllm.export_model`); a datastore must be built with the
model's tokenizer (the default is the newest under var/demo-datastore whose vocabulary is the
model's). Modes:
`none`, `ngram` (prompt lookup, n = 2..4) and `suffix` (ArcticInference's SuffixDecoding) are
vLLM's; `sssd` and `sssd-self` are vLLM with `sssd.vllm.proposer.VllmDrafterProposer` over an
`sssd-drafter` service on 127.0.0.1, holding the ShareGPT datastore `sssd up` builds (default:
the newest under var/demo-datastore) or the model's own answers (`sssd-self-outputs`, default:
the largest var/self-outputs/datastore-N); `engine` is this project's engine, once without
speculation and once with SSSD over the ShareGPT datastore (tree drafts, its own speedup). Each
run is its own process (a fresh engine), greedy, after a short warm-up; vLLM's outputs are
compared with its `none` run's, the engine's SSSD outputs with its own plain ones.

One JSON line per run: tokens/s, speedup over the same engine without speculation, drafts,
accepted tokens, acceptance length (vLLM: 1 + accepted / drafts, over the steps that had a
draft; the engine: tokens per sequence per step over all steps), identical outputs. A mode that
cannot run here is a line with "skipped" and the reason (suffix needs the arctic-inference
package: PyPI has only its sdist for this platform, which `scripts/setup_vllm.sh --with-suffix`
builds; its suffix tree is plain C++). The PNG (speedup and acceptance length per mode) is written
beside --out when matplotlib is importable, else the command to draw it is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import flags

ROOT = Path(__file__).resolve().parents[1]
RESULT = "vllm-peers-result: "  # marks the worker's line among vLLM's own output
PROPOSER = "sssd.vllm.proposer.VllmDrafterProposer"
VLLM_SPECS = {
    "none": None,
    "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k,
                        "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": lambda k: {"method": "suffix", "num_speculative_tokens": k},
    "sssd": lambda k: {"method": "custom_class", "num_speculative_tokens": k, "model": PROPOSER},
    "sssd-self": lambda k: {"method": "custom_class", "num_speculative_tokens": k,
                            "model": PROPOSER},
}
MODES = (*VLLM_SPECS, "engine")


def prompt_ids(model: Path, set_name: str, limit: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from bench.prompt_sets import prompt_texts

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for text in prompt_texts(set_name, limit):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def vllm_worker(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    spec = VLLM_SPECS[args.mode]
    extra = {}
    if spec is not None and spec(args.k)["method"] == "custom_class":
        extra["additional_config"] = {"sssd": {"drafter": args.drafter, "budget": args.budget,
                                               "min_score": args.min_score}}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, enforce_eager=True,
              max_num_seqs=args.batch_size, disable_log_stats=False,
              speculative_config=spec(args.k) if spec else None, **extra)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    before = spec_metrics(llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = spec_metrics(llm)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"seconds": seconds, "outputs": tokens, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted": accepted}


def spec_metrics(llm) -> tuple[int, int, int]:
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return tuple(int(metrics.get(f"vllm:spec_decode_num_{name}") or 0)
                 for name in ("drafts", "draft_tokens", "accepted_tokens"))


def engine_worker(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """This project's engine: plain decoding, then SSSD with tree drafts from the drafter."""
    from sssd.common.model.loader import load_causal_lm
    from sssd.verifier.engine import EngineConfig, EngineStats
    from sssd.verifier.factory import build_engine

    loaded = load_causal_lm(args.model_name or None, args.dtype)
    runs = {}
    for mode in ("ar", "sssd"):
        config = EngineConfig(mode=mode, max_batch_size=args.batch_size, max_len=1024,
                              dtype=args.dtype, drafter_target=args.drafter,
                              drafter_timeout_s=5.0, max_budget=args.budget,
                              budget_policy="rule")
        engine = build_engine(config, loaded)
        engine.generate(prompts[:1], 4)
        engine.stats = EngineStats()
        start = time.perf_counter()
        outputs = engine.generate(prompts, args.max_tokens)
        runs[mode] = (time.perf_counter() - start, outputs, engine.stats)
        engine.close()
    seconds, outputs, stats = runs["sssd"]
    plain_seconds, plain_outputs, _ = runs["ar"]
    return {"seconds": seconds, "outputs": outputs, "plain_seconds": plain_seconds,
            "identical_to_plain": outputs == plain_outputs,
            "tokens_per_step": stats.mean_accepted_per_step,
            "accepted": stats.num_accepted, "draft_failures": stats.num_draft_failures}


def worker(args: argparse.Namespace) -> None:
    """One engine, one run; prints its JSON (outputs to args.outputs)."""
    prompts = json.loads(Path(args.prompts_file).read_text())
    run = engine_worker(args, prompts) if args.mode == "engine" else vllm_worker(args, prompts)
    Path(args.outputs).write_text(json.dumps(run.pop("outputs")))
    print(RESULT + json.dumps(run), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def datastore_vocab_size(datastore: str) -> int:
    """The vocabulary the datastore's shards were built for, which the drafter must serve (before
    2026-11-27 this started every drafter for SmolLM2's 49,152, so the Qwen2.5 rows of vLLM with
    our drafter ran without drafts); an empty datastore: SmolLM2's, the default model's."""
    from sssd.datastore.shard import datastore_meta

    meta = datastore_meta(datastore)
    return 49152 if meta is None else meta.vocab_size


def start_drafter(datastore: str, port: int) -> subprocess.Popen:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    drafter = subprocess.Popen(
        [str(Path(sys.executable).with_name("sssd-drafter")), "--datastore-dir", datastore,
         "--vocab-size", str(datastore_vocab_size(datastore)), "--port", str(port),
         "--num-threads", "1"],
        stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                if health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return drafter
        except grpc.RpcError:
            time.sleep(0.5)
    drafter.kill()
    raise SystemExit(f"the drafter service over {datastore} did not start")


def newest(pattern: str, vocab_size: int | None = None) -> str | None:
    """The newest datastore under var/ matching `pattern` (the largest -N first), of
    `vocab_size` when given."""
    found = [p for p in (ROOT / "var").glob(pattern) if (p / "manifest.json").is_file()
             and (vocab_size is None or datastore_vocab_size(str(p)) == vocab_size)]
    if not found:
        return None
    number = lambda p: int(m.group(1)) if (m := re.search(r"-(\d+)$", p.name)) else 0  # noqa: E731
    return str(max(found, key=lambda p: (number(p), p.stat().st_mtime)))


def skipped_reason(mode: str) -> str | None:
    if mode == "suffix":
        try:
            import arctic_inference  # noqa: F401
        except ImportError:
            return ("vLLM's suffix method needs the arctic-inference package: "
                    "bash scripts/setup_vllm.sh --with-suffix builds it from its sdist")
    return None


def plot(rows: list[dict], path: Path, title: str = "SmolLM2-135M fp32") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "skipped" not in r and r["mode"] != "none"]
    groups = sorted({(r["set"], r["batch_size"]) for r in ran})
    modes = [m for m in MODES if any(r["mode"] == m for r in ran)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        by_group = {(r["set"], r["batch_size"]): r for r in ran if r["mode"] == mode}
        xs = [g + i * width for g in range(len(groups))]
        axes[0].bar(xs, [by_group.get(g, {}).get("speedup") or 0 for g in groups], width,
                    label=mode)
        axes[1].bar(xs, [by_group.get(g, {}).get("acceptance_length") or 0 for g in groups],
                    width, label=mode)
    labels = [f"{s}\nb={b}" for s, b in groups]
    for ax, title in zip(axes, ("speedup over the same engine without speculation",
                                "acceptance length (tokens per drafted step)")):
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], labels)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].axhline(1.0, color="grey", lw=0.5)
    fig.suptitle(f"{title}, vLLM 0.32 CPU, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_one(args: argparse.Namespace, mode: str, set_name: str, batch_size: int, work: Path,
            model: Path, prompts_file: Path, drafter: str | None, env: dict) -> tuple[dict, list]:
    outputs = work / f"out-{set_name}-{batch_size}-{mode}.json"
    done = subprocess.run(
        [sys.executable, __file__, "--worker", "--mode", mode, "--batch-size", str(batch_size),
         "--model-dir", str(model), "--prompts-file", str(prompts_file), "--outputs", str(outputs),
         "--k", str(args.k), "--max-tokens", str(args.max_tokens), "--budget", str(args.budget),
         "--min-score", str(args.min_score), "--drafter", drafter or "",
         "--model-name", args.model_name or "", "--dtype", args.dtype],
        env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} {set_name} b={batch_size} failed:\n{done.stderr[-3000:]}")
    run = json.loads(next(line[len(RESULT):] for line in done.stdout.splitlines()
                          if line.startswith(RESULT)))
    return run, json.loads(outputs.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_sets(parser, "mt_bench,code")
    flags.add_prompts(parser, 8)
    flags.add_max_tokens(parser, 64)
    flags.add_batch_sizes(parser, "1,8")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--k", type=int, default=4, help="vLLM's num_speculative_tokens")
    parser.add_argument("--budget", type=int, default=16, help="draft-tree nodes asked per step")
    parser.add_argument("--min-score", type=float, default=0.2,
                        help="the proposer's min_score (see sssd.vllm.proposer)")
    flags.add_datastore(parser, "ShareGPT datastore (sssd, engine)", type=str)
    parser.add_argument("--self-datastore", default=None, help="self-output datastore")
    parser.add_argument("--model-name", "--model", dest="model_name", default=None,
                        help="a name of `sssd-models list` (default: SmolLM2-135M-Instruct)")
    flags.add_dtype(parser, "float32")
    flags.add_out(parser, "bench/results/vllm-peers.jsonl")
    parser.add_argument("--plot", metavar="JSONL", help="only draw the PNG of a finished run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", dest="model", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--outputs", help=argparse.SUPPRESS)
    parser.add_argument("--drafter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.plot:
        rows = [json.loads(line) for line in Path(args.plot).read_text().splitlines()]
        plot(rows, Path(args.plot).with_suffix(".png"))
        print(Path(args.plot).with_suffix(".png"))
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")

    from sssd.vllm.export_model import export_model

    work = Path(tempfile.mkdtemp(prefix="vllm-peers-"))
    gguf = args.model_name
    if gguf and not Path(gguf).exists():  # a name of `sssd-models list`
        from sssd.common.model.files import model_path

        gguf = str(model_path(gguf))
    model = export_model(work / "model", gguf)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    datastores = {"sssd": args.datastore or newest("demo-datastore/*", vocab_size),
                  "sssd-self": args.self_datastore or newest("self-outputs/datastore-*")}
    datastores["engine"] = datastores["sssd"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    drafters: dict[str, tuple[subprocess.Popen, int]] = {}  # datastore -> (process, port)
    targets = {}
    rows = []
    try:
        for mode in modes:
            if mode not in datastores:
                continue
            if datastores[mode] is None:
                raise SystemExit(f"mode {mode}: no datastore; pass --datastore / "
                                 "--self-datastore, or run sssd up / sssd-self-outputs")
            if datastores[mode] not in drafters:
                port = free_port()
                drafters[datastores[mode]] = (start_drafter(datastores[mode], port), port)
            targets[mode] = f"127.0.0.1:{drafters[datastores[mode]][1]}"
        for set_name in args.sets.split(","):
            prompts_file = work / f"{set_name}.json"
            prompts_file.write_text(json.dumps(prompt_ids(model, set_name, args.prompts)))
            for batch_size in map(int, args.batch_sizes.split(",")):
                baseline = None
                for mode in modes:
                    row = {"set": set_name, "batch_size": batch_size, "mode": mode,
                           "k": args.k if mode != "engine" else None,
                           "datastore": datastores.get(mode)}
                    if (reason := skipped_reason(mode)) is not None:
                        row["skipped"] = reason
                    else:
                        run, tokens = run_one(args, mode, set_name, batch_size, work, model,
                                              prompts_file, targets.get(mode), env)
                        row.update(summarize(mode, run, tokens, baseline))
                        if mode == "none":
                            baseline = (run, tokens)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for process, _ in drafters.values():
            process.terminate()
            process.wait(10)
        shutil.rmtree(work, ignore_errors=True)  # the exported model is hundreds of MB
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        plot(rows, out.with_suffix(".png"), f"{args.model_name or 'SmolLM2-135M'} {args.dtype}")
        print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    except ImportError:
        print(f"wrote {out}; draw the PNG with: .venv/bin/python bench/vllm_peers.py --plot {out}",
              file=sys.stderr)


def summarize(mode: str, run: dict, tokens: list, baseline: tuple | None) -> dict:
    num_tokens = sum(map(len, tokens))
    row = {"tokens_per_s": num_tokens / run["seconds"], "num_tokens": num_tokens}
    if mode == "engine":
        plain = num_tokens / run["plain_seconds"]
        return row | {"plain_tokens_per_s": plain, "speedup": row["tokens_per_s"] / plain,
                      "accepted": run["accepted"], "acceptance_length": run["tokens_per_step"],
                      "identical_to_none": run["identical_to_plain"],
                      "draft_failures": run["draft_failures"]}
    row |= {"drafts": run["drafts"], "draft_tokens": run["draft_tokens"],
            "accepted": run["accepted"],
            "acceptance_length": 1 + run["accepted"] / run["drafts"] if run["drafts"] else None,
            "draft_acceptance_rate": run["accepted"] / run["draft_tokens"]
            if run["draft_tokens"] else None}
    if baseline is not None:
        base_run, base_tokens = baseline
        row["speedup"] = row["tokens_per_s"] / (sum(map(len, base_tokens)) / base_run["seconds"])
        row["identical_to_none"] = tokens == base_tokens
    return row


if __name__ == "__main__":
    main()

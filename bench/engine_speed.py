"""Plain decoding speed of the verifier engine against transformers' `generate` and vLLM's CPU
build, side by side, and then speculation on top: the engine with SSSD draft trees against vLLM
with the SSSD drafter (linear drafts).

    .venv/bin/python bench/engine_speed.py [--models smollm2,qwen-coder-1.5b]
        [--dtypes float32,bfloat16] [--batch-sizes 1,4,8] [--set mt_bench] [--prompts 8]
        [--max-tokens 64] [--systems engine,engine-transformers,generate,vllm]
        [--speculative engine-sssd,vllm-sssd] [--datastore DIR] [--repeats 1] [--policy measured]
        [--out bench/results/engine-speed.jsonl]
    .venv/bin/python bench/engine_speed.py --plot bench/results/engine-speed.jsonl

Systems, each run in a fresh process, one at a time, taking turns cell by cell (model, dtype,
batch size), so that all of them see the same machine:
- engine: this project's engine without speculation (model_impl auto: its own forward pass);
- engine-4k: the same with its packed weights on ordinary 4 KiB pages (SSSD_HUGE_PAGES=0),
  not in one buffer of 2 MiB pages: the engine before it;
- engine-avx512: the same with its AVX-512 panels (sssd._kernels.linear_bf16) where the engine
  would multiply them on the AMX tile unit (bfloat16 on CPUs with AMX): the engine before it;
- engine-onednn: the same with oneDNN's matrix products where the engine would use its own
  panels (sssd._kernels.linear_bf16 and linear_f32, on CPUs with AVX-512): the engine before
  them;
- engine-transformers: the same engine over the transformers forward (model_impl
  transformers; the engine before its own forward pass);
- generate: transformers' `generate`, greedy, `batch size` prompts at a time, left-padded;
- vllm: vLLM's CPU build (.venv-vllm, scripts/setup_vllm.sh), `LLM.generate` on the same
  prompt token ids, greedy, at most `batch size` sequences at a time, with its compiled graphs
  (--vllm-eager: without) and its threads on every core;
- engine-sssd: the engine with SSSD draft trees (in-process drafter over --datastore, the budget
  policy --policy: measured, the default, profiles the forward pass at start, before the
  timing; or rule);
- vllm-sssd: vLLM with the SSSD drafter service as its proposer (`custom_class`, k = 4).
The speculative systems run on SmolLM2 only unless --datastore names a datastore built with the
other model's tokenizer.

Every system decodes the same prompts (the model's chat template over --set's first --prompts
texts) to --max-tokens greedily, with at most --batch-size sequences running; tokens/s counts
the generated tokens over the whole run, prefill included. `ms_per_step` is the engine's mean
forward pass per step; `ms_per_token` (all systems) is batch size / tokens/s, the time one
sequence waits per token. The weight-streaming floor is the model's bytes over this machine's
memory bandwidth (measured here by reading a 2 GiB buffer, the best of every cell's
measurements): no decode step can be faster.

One JSON line per run (medians over --repeats), then the PNG beside --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import flags

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RESULT = "engine-speed-result: "
PLAIN = ("engine", "engine-4k", "engine-avx512", "engine-onednn", "engine-transformers",
         "generate", "vllm")
SPECULATIVE = ("engine-sssd", "vllm-sssd")
PROPOSER = "sssd.vllm.proposer.VllmDrafterProposer"
MODEL_NAMES = {"smollm2": None}  # None: the default model; others: sssd-models names


def model_file(name: str) -> str | None:
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]
    from sssd.cli.models import MODELS, model_path

    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}: smollm2 or one of {', '.join(MODELS)}")
    path = model_path(name)
    if not path.is_file():
        raise SystemExit(f"{name} is not fetched: run  .venv/bin/sssd-models fetch {name}")
    return str(path)


# --- workers: one system, one run, in its own process -------------------------------------


# The engine's systems that force a kernel path (kernel_paths.forced): its products by oneDNN, as
# before the panels; by the AVX-512 panels, as before the AMX products.
FORCED = {"engine-onednn": {"products": "onednn"}, "engine-avx512": {"products": "panels"}}


def engine_worker(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from sssd.common.model import kernel_paths

    with kernel_paths.forced(**FORCED.get(args.system, {})):
        return _engine_run(args, prompts)


def _engine_run(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from sssd.common.model.loader import load_causal_lm
    from sssd.verifier.engine import EngineConfig, EngineStats
    from sssd.verifier.factory import build_engine

    if args.system == "engine-4k":  # the weights on ordinary pages, as before huge_pages.py
        os.environ["SSSD_HUGE_PAGES"] = "0"
    loaded = load_causal_lm(args.model_file, args.dtype)
    speculative = args.system == "engine-sssd"
    config = EngineConfig(
        mode="sssd" if speculative else "ar", dtype=args.dtype, max_batch_size=args.batch_size,
        max_len=max(map(len, prompts)) + args.max_tokens + 64, datastore_dir=args.datastore,
        model_impl="transformers" if args.system == "engine-transformers" else "auto",
        budget_policy=args.policy, profile_path="")
    engine = build_engine(config, loaded)
    engine.generate(prompts[:1], 4)  # warm-up: first-call allocations, the drafter's start
    engine.stats = EngineStats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, args.max_tokens)
    seconds = time.perf_counter() - start
    stats = engine.stats
    engine.close()
    # What a decode step reads: every weight once, except the input embedding's unread rows
    # (when it is not also the output head, as it is in tied models).
    model = loaded.model
    weights = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        weights.pop(id(embedding))
    return {"seconds": seconds, "outputs": outputs, "impl": engine.runner.impl,
            "ms_per_step": 1000 * stats.verify_s / max(stats.num_steps, 1),
            "products": engine.runner.products,
            "tokens_per_step": stats.mean_accepted_per_step if speculative else 1.0,
            "weight_bytes": sum(weights.values())}


def generate_worker(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import torch

    from sssd.common.model.loader import load_causal_lm

    loaded = load_causal_lm(args.model_file, args.dtype)
    model, pad = loaded.model, loaded.eos_token_ids[0]

    def run(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                 max_new_tokens=max_tokens)
        answers = []
        for row in out[:, width:].tolist():  # cut at the first eos, as the engines stop
            end = next((i + 1 for i, t in enumerate(row) if t in loaded.eos_token_ids), len(row))
            answers.append(row[:end])
        return answers

    run(prompts[:1], 4)
    start = time.perf_counter()
    outputs = []
    for first in range(0, len(prompts), args.batch_size):
        outputs += run(prompts[first:first + args.batch_size], args.max_tokens)
    return {"seconds": time.perf_counter() - start, "outputs": outputs}


def vllm_worker(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    extra = {}
    if args.system == "vllm-sssd":
        extra = {"speculative_config": {"method": "custom_class", "num_speculative_tokens": 4,
                                        "model": PROPOSER},
                 "additional_config": {"sssd": {"drafter": args.drafter, "budget": 16,
                                                "min_score": 0.2}}}
    # vLLM at its fastest here: its compiled graphs (enforce_eager=False, the default; about
    # 1.2x the eager speed at b = 1, for a minute more at start), and every core (the driver
    # sets VLLM_CPU_OMP_THREADS_BIND: by default vLLM keeps one core of two for its scheduler).
    llm = LLM(model=args.vllm_model, dtype=args.dtype, max_model_len=2048,
              enforce_eager=args.vllm_eager, max_num_seqs=args.batch_size, **extra)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in done]}


def worker(args: argparse.Namespace) -> None:
    prompts = json.loads(Path(args.prompts_file).read_text())
    if args.system.startswith("vllm"):
        run = vllm_worker(args, prompts)
    elif args.system == "generate":
        run = generate_worker(args, prompts)
    else:
        run = engine_worker(args, prompts)
    print(RESULT + json.dumps(run), flush=True)


# --- the driver ---------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name, and "+AMX" where it has AMX's bfloat16 tiles: results of different
    machines differ by far more than their noise."""
    from sssd.common.model import kernel_paths
    from sssd.common.model.device import cpu_model_name

    amx = kernel_paths.cpu_features()["amx_bf16"]
    return (cpu_model_name() or "unknown") + (" +AMX" if amx else "")


def memory_bandwidth() -> float:
    """Bytes per second that this machine's cores read: the best of several passes over 2 GiB,
    each read once as the matrix products read their weights (sssd._kernels.read_bytes: both
    threads, vectors of AVX-512 or AVX2, prefetched), else by a tensor sum (which reads slower
    than the products can: the floor is then too low). The buffer is on 2 MiB
    pages, as the engine's weights are (common/model/huge_pages.py): a floor read on 4 KiB
    pages pays TLB misses that the engine's steps no longer pay, and steps came out under it."""
    import torch

    from sssd import _kernels
    from sssd.common.model import kernel_paths
    from sssd.common.model.huge_pages import empty_on_huge_pages

    buffer = empty_on_huge_pages(2 << 30).view(torch.float32).fill_(1.0)
    num_bytes = buffer.numel() * 4
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        if kernel_paths.path("panels", torch.float32) != "none":
            _kernels.read_bytes(buffer.data_ptr(), num_bytes)
        else:
            buffer.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def prompt_ids(tokenizer, set_name: str, limit: int) -> list[list[int]]:
    from bench.prompt_sets import prompt_texts
    from sssd.common.data.corpus import prompt_token_ids

    return [prompt_token_ids(tokenizer, text) for text in prompt_texts(set_name, limit)]


def check_tokenizer(datastore: Path, tokenizer) -> None:
    """Exits when the datastore was built with another tokenizer than the model's: the
    drafters would refuse it, and the speculative rows would draft without it."""
    from sssd.cli.datastores import check_datastore
    from sssd.common.model.tokenizer import tokenizer_fingerprint

    try:
        check_datastore(datastore, tokenizer_fingerprint(tokenizer))
    except ValueError as error:
        raise SystemExit(str(error)) from None


def run_system(args: argparse.Namespace, system: str, cell: dict, work: Path,
               prompts_file: Path, extra: dict) -> dict:
    python = VLLM_PYTHON if system.startswith("vllm") else Path(sys.executable)
    command = [str(python), __file__, "--worker", "--system", system,
               "--dtype", cell["dtype"], "--batch-size", str(cell["batch_size"]),
               "--max-tokens", str(args.max_tokens), "--prompts-file", str(prompts_file),
               "--policy", args.policy]
    for key, value in extra.items():
        if value is not None:
            command += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}")
    if args.vllm_eager:
        command.append("--vllm-eager")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600,
                          cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"{system} {cell} failed:\n{done.stderr[-4000:]}")
    return json.loads(next(line[len(RESULT):] for line in done.stdout.splitlines()
                           if line.startswith(RESULT)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen-coder-1.5b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    flags.add_batch_sizes(parser, "1,4,8")
    flags.add_set(parser)
    flags.add_prompts(parser, 8)
    flags.add_max_tokens(parser, 64)
    parser.add_argument("--systems", default=",".join(PLAIN))
    parser.add_argument("--speculative", default=",".join(SPECULATIVE),
                        help="speculative systems ('' for none)")
    flags.add_datastore(parser, "SSSD datastore (default: the newest under var/demo-datastore, "
                        "SmolLM2's tokenizer)", type=str)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--policy", default="measured", choices=("measured", "rule"),
                        help="engine-sssd's budget policy")
    flags.add_out(parser, "bench/results/engine-speed.jsonl")
    parser.add_argument("--plot", metavar="JSONL", help="only draw the PNG of a finished run")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM without its compiled graphs (faster start, slower decoding)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--system", "--dtype", "--prompts-file", "--model-file", "--vllm-model",
                   "--drafter"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.plot:
        rows = [json.loads(line) for line in Path(args.plot).read_text().splitlines()]
        print(plot(rows, Path(args.plot).with_suffix(".png")))
        return
    systems = [s for s in args.systems.split(",") if s]
    speculative = [s for s in args.speculative.split(",") if s]
    unknown = sorted(set(systems) - set(PLAIN)) + sorted(set(speculative) - set(SPECULATIVE))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; plain: {', '.join(PLAIN)}; "
                     f"speculative: {', '.join(SPECULATIVE)}")
    wants_vllm = any(s.startswith("vllm") for s in systems + speculative)
    if wants_vllm and not VLLM_PYTHON.is_file():
        raise SystemExit("vLLM runs from .venv-vllm: run  bash scripts/setup_vllm.sh  first, "
                         "or leave vllm out of --systems and --speculative")

    from bench.vllm_peers import free_port, newest, start_drafter
    from sssd.common.model.tokenizer import load_tokenizer
    from sssd.vllm.export_model import export_model

    bandwidth = memory_bandwidth()
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="engine-speed-"))
    # Absolute: the workers run in the work folder, where a relative path names nothing (and a
    # drafter over a missing directory serves an empty datastore).
    datastore = str(Path(args.datastore).resolve()) if args.datastore \
        else newest("demo-datastore/*")
    drafter = None
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for model_name in args.models.split(","):
            gguf = model_file(model_name)
            prompts_file = work / f"{model_name}.json"
            tokenizer = load_tokenizer(gguf)
            prompts_file.write_text(json.dumps(prompt_ids(tokenizer, args.set, args.prompts)))
            vllm_model = export_model(work / f"model-{model_name}", gguf) if wants_vllm \
                else None
            model_speculative = speculative if (model_name == "smollm2" or args.datastore) \
                else []
            if model_speculative and datastore is None:
                raise SystemExit("no datastore for the speculative systems: pass --datastore "
                                 "or run sssd up once (it builds var/demo-datastore)")
            if model_speculative:
                check_tokenizer(Path(datastore), tokenizer)
            if "vllm-sssd" in model_speculative and drafter is None:
                port = free_port()
                drafter = (start_drafter(datastore, port), f"127.0.0.1:{port}")
            for dtype in args.dtypes.split(","):
                for batch_size in map(int, args.batch_sizes.split(",")):
                    cell = {"model": model_name, "dtype": dtype, "batch_size": batch_size,
                            "set": args.set, "prompts": args.prompts,
                            "max_tokens": args.max_tokens, "policy": args.policy,
                            "cpu": cpu_name()}
                    extra = {"model_file": gguf, "vllm_model": vllm_model,
                             "datastore": datastore, "drafter": drafter and drafter[1]}
                    bandwidth = max(bandwidth, memory_bandwidth())  # the floor: the best seen
                    runs: dict[str, list[dict]] = {}
                    for _ in range(args.repeats):  # systems take turns within a repeat
                        for system in systems + model_speculative:
                            runs.setdefault(system, []).append(
                                run_system(args, system, cell, work, prompts_file, extra))
                    for row in summarize(cell, runs, bandwidth):
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    finally:
        if drafter is not None:
            drafter[0].terminate()
            drafter[0].wait(10)
        shutil.rmtree(work, ignore_errors=True)  # the exported models are gigabytes
    try:
        print(f"wrote {out} and {plot(rows, out.with_suffix('.png'))}", file=sys.stderr)
    except ImportError:
        print(f"wrote {out}; draw the PNG with: .venv/bin/python bench/engine_speed.py --plot "
              f"{out}", file=sys.stderr)


def summarize(cell: dict, runs: dict[str, list[dict]], bandwidth: float) -> list[dict]:
    reference = runs.get("engine", [None])[0]
    weight_bytes = next((r[0]["weight_bytes"] for r in runs.values() if "weight_bytes" in r[0]),
                        None)
    rows = []
    for system, repeats in runs.items():
        rates = [sum(map(len, r["outputs"])) / r["seconds"] for r in repeats]
        rate = statistics.median(rates)
        row = dict(cell, system=system, tokens_per_s=round(rate, 2),
                   ms_per_token=round(1000 * cell["batch_size"] / rate, 2),
                   num_tokens=sum(map(len, repeats[0]["outputs"])), repeats=len(repeats))
        if "ms_per_step" in repeats[0]:
            row["ms_per_step"] = round(statistics.median(r["ms_per_step"] for r in repeats), 2)
            row["impl"] = repeats[0]["impl"]
            row["products"] = repeats[0].get("products")
        if system in SPECULATIVE and "tokens_per_step" in repeats[0]:
            row["tokens_per_step"] = round(repeats[0]["tokens_per_step"], 3)
        if reference is not None and system != "engine":
            # Same tokens as the engine's plain decoding: every prompt, every token.
            row["identical_to_engine"] = repeats[0]["outputs"] == reference["outputs"]
        if weight_bytes is not None:
            row["floor_ms_per_step"] = round(1000 * weight_bytes / bandwidth, 2)
            row["bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
        rows.append(row)
    engine = next((r for r in rows if r["system"] == "engine"), None)
    for row in rows:
        if engine is not None:
            row["vs_engine"] = round(row["tokens_per_s"] / engine["tokens_per_s"], 3)
    return rows


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    systems = [s for s in PLAIN + SPECULATIVE if any(r["system"] == s for r in rows)]
    for ax, (model, dtype) in zip(axes[0], panels):
        cells = [r for r in rows if (r["model"], r["dtype"]) == (model, dtype)]
        sizes = sorted({r["batch_size"] for r in cells})
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            by_size = {r["batch_size"]: r["tokens_per_s"] for r in cells
                       if r["system"] == system}
            ax.bar([k + i * width for k in range(len(sizes))],
                   [by_size.get(b, 0) for b in sizes], width, label=system)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(sizes))],
                      [f"b={b}" for b in sizes])
        ax.set_title(f"{model} {dtype}: output tokens/s", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("greedy decoding, 2 CPU cores (higher is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()

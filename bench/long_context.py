"""Long contexts and reuse: time to first token and decoding speed by context length, a shared
prefix asked twice, multi-turn chat replayed turn by turn, and speculation on whole-file code
edits, for the engine and for vLLM's CPU build side by side (prefix caching on in both).

    .venv/bin/python bench/long_context.py [--model smollm2] [--lengths 2048,4096,8192]
        [--parts lengths,prefix,turns,code,streams] [--systems engine,vllm]
        [--modes ar,prompt_lookup,sssd] [--vllm-modes ar,ngram,suffix] [--datastore DIR]
        [--code-prompts 6] [--code-batches 1,4] [--conversations 3]
        [--budget-policy measured] [--out FILE] [--png FILE]

Parts (each system runs them in one process of its own, in this order):
- lengths: a prompt of L random token ids to its first token (cold: never seen), median of
  --repeats; then another such prompt cached, to 1 token and to --decode-tokens + 1 (EOS
  ignored): the difference is the decoding speed at that context, whatever the prefill cost;
  a length the model's window cannot hold with its decoded tokens is cut to fit;
- prefix: a random prefix of --prefix-tokens (4,096) with two different 64-token questions
  after it: the first request's time to first token (cold) and the second's (prefix cached);
- turns: ShareGPT conversations (records 0-11,999 with at least 4 user turns) replayed turn by
  turn with the model's own greedy answers (--turn-tokens each): every turn's time to first
  token beside its prompt's length and the tokens new in it;
- code: an edit instruction and a whole source file of this project (services/, 2k-16k
  tokens: code no datastore or corpus of the project reads) per prompt; the answer is the
  edited file. Each prompt once to its first token (which caches it), then to --code-tokens
  greedy tokens: tokens per second of the answer, per speculation mode (engine: --modes;
  vLLM: --vllm-modes, `ngram` its prompt lookup with k = --ngram-k, `suffix` SuffixDecoding
  with at most --suffix-k); then in groups of
  each --code-batches size above 1, submitted together;
- streams: --streams (64) short prompts submitted at once, 32 tokens each (the engine only):
  requests that failed, the most running at once, tokens per second.

One JSON line per measurement; the engine's lines say whether each greedy answer equals plain
decoding's (`same_as_ar`) and the KV cache's bytes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import flags
from bench.engine_speed import VLLM_PYTHON, cpu_name, model_file
from bench.prompt_sets import code_edits

ROOT = Path(__file__).resolve().parents[1]
RESULT = "long-context-result: "
PARTS = ("lengths", "prefix", "turns", "code", "streams")
QUESTION_TOKENS = 64


# --- the prompt plan (the parent, with the tokenizer) ---------------------------------------------

def code_edit_prompts(tokenizer, limit: int, low: int = 2048, high: int = 16384) -> list[dict]:
    """Edit instructions over whole source files of this project, `low`-`high` tokens each."""
    return [{"file": file, "ids": ids} for file, _, ids in code_edits(tokenizer, limit, low, high)]


def conversations(limit: int, min_turns: int = 4, max_turns: int = 6) -> list[list[str]]:
    """The user turns of ShareGPT conversations (records 0-11,999) with at least `min_turns`."""
    from sssd.common.data.corpus import iter_sharegpt, sharegpt_messages

    found = []
    for record in iter_sharegpt(0, 12_000):
        turns = [m["content"] for m in sharegpt_messages(record)
                 if m["role"] == "user" and m["content"].strip()]
        if len(turns) >= min_turns and all(len(t) < 4000 for t in turns):
            found.append(turns[:max_turns])
        if len(found) == limit:
            break
    return found


def model_window(model: str) -> int:
    """The model's context window (max_position_embeddings), from its config or GGUF header."""
    from transformers import AutoConfig

    from sssd.common.model.files import resolve_model

    files = resolve_model(model_file(model))
    config = AutoConfig.from_pretrained(files.directory, gguf_file=files.gguf_file) \
        if files.is_gguf else AutoConfig.from_pretrained(files.directory)
    return int(config.max_position_embeddings)


def plan(args: argparse.Namespace, tokenizer, window: int) -> dict:
    """The prompts of every part; a length the window cannot hold with its decoded tokens is
    cut to fit (a `--lengths 8192` on an 8,192-token window measures 8,192 less the tokens)."""
    rng = random.Random(0)
    vocab = min(len(tokenizer), 30_000)

    def noise(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    lengths = [min(int(n), window - args.decode_tokens - 2) for n in args.lengths.split(",")]
    return {
        "lengths": {str(n): [noise(n) for _ in range(args.repeats + 1)] for n in lengths},
        "prefix": [[noise(args.prefix_tokens), noise(QUESTION_TOKENS), noise(QUESTION_TOKENS)]
                   for _ in range(args.repeats)],
        "turns": conversations(args.conversations),
        "code": code_edit_prompts(tokenizer, args.code_prompts, low=args.code_min_tokens,
                                  high=min(args.code_max_tokens, window - args.code_tokens - 16)),
        "streams": [noise(rng.randrange(32, 256)) for _ in range(args.streams)],
        "warmup": noise(256),
    }


# --- a system's process ------------------------------------------------------------------------

class EngineSystem:
    """The engine in this process; `generate` runs one request alone."""

    def __init__(self, args: argparse.Namespace, mode: str, max_len: int) -> None:
        from sssd.common.model.loader import load_causal_lm
        from sssd.verifier.engine import EngineConfig
        from sssd.verifier.factory import build_engine

        self.loaded = load_causal_lm(args.model_file or None, args.dtype)
        self.engine = build_engine(EngineConfig(
            mode=mode, dtype=args.dtype, max_len=max_len,
            datastore_dir=args.datastore if mode == "sssd" else None,
            budget_policy=args.budget_policy, reuse_acceptance=False), self.loaded)
        self.tokenizer = self.loaded.tokenizer
        self.budget_policy = args.budget_policy

    def generate(self, ids: list[int], max_tokens: int, ignore_eos: bool = False,
                 ) -> tuple[float, list[int]]:
        from sssd.verifier.engine.request import GenerateRequest

        start = time.perf_counter()
        seq = self.engine.add_request(GenerateRequest(tuple(ids), max_tokens,
                                                      ignore_eos=ignore_eos))
        self.last_steps = 0  # the request's engine steps (its prefill's included)
        while self.engine.has_work():
            self.engine.step()
            self.last_steps += 1
        return time.perf_counter() - start, seq.output_ids

    def generate_batch(self, prompts: list[list[int]], max_tokens: int,
                       ) -> tuple[float, list[list[int]]]:
        """The prompts submitted at once and run to their ends together."""
        from sssd.verifier.engine.request import GenerateRequest

        start = time.perf_counter()
        seqs = [self.engine.add_request(GenerateRequest(tuple(p), max_tokens)) for p in prompts]
        while self.engine.has_work():
            self.engine.step()
        return time.perf_counter() - start, [s.output_ids for s in seqs]

    def streams(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from sssd.verifier.engine.request import GenerateRequest

        start = time.perf_counter()
        seqs = [self.engine.add_request(GenerateRequest(tuple(p), max_tokens, ignore_eos=True))
                for p in prompts]
        most = 0
        while self.engine.has_work():
            self.engine.step()
            most = max(most, self.engine.num_running)
        seconds = time.perf_counter() - start
        tokens = sum(len(s.output_ids) for s in seqs)
        return {"requests": len(seqs), "failed": sum(len(s.output_ids) != max_tokens
                                                     for s in seqs),
                "most_running": most, "tok_s": tokens / seconds,
                "preemptions": self.engine.num_preemptions}

    def facts(self) -> dict:
        runner = self.engine.runner
        return {"kv_bytes_per_token": runner.cache.bytes_per_token,
                "kv_cache_tokens": runner.cache.num_blocks * runner.block_size,
                "context_window": self.engine.max_len, "attention": runner.attention_path,
                "budget_policy": self.budget_policy}


class VllmSystem:
    """vLLM's CPU build (.venv-vllm), prefix caching on; `mode` ar, ngram (its prompt lookup)
    or suffix (ArcticInference's SuffixDecoding: scripts/setup_vllm.sh --with-suffix)."""

    def __init__(self, args: argparse.Namespace, mode: str, max_len: int) -> None:
        from vllm import LLM

        speculative = None
        if mode == "ngram":
            speculative = {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        elif mode == "suffix":
            speculative = {"method": "suffix", "num_speculative_tokens": args.suffix_k}
        self.llm = LLM(model=args.vllm_model, dtype=args.dtype, max_model_len=max_len,
                       enable_prefix_caching=True, speculative_config=speculative,
                       max_num_seqs=64)

    def generate(self, ids: list[int], max_tokens: int, ignore_eos: bool = False,
                 ) -> tuple[float, list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        start = time.perf_counter()
        (output,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start, list(output.outputs[0].token_ids)

    def generate_batch(self, prompts: list[list[int]], max_tokens: int,
                       ) -> tuple[float, list[list[int]]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    def facts(self) -> dict:
        return {}


def run_parts(system, work: dict, args: argparse.Namespace, mode: str) -> list[dict]:
    """Every part this (system, mode) takes, as result rows without the system's name."""
    parts = args.parts.split(",")
    rows = []
    system.generate(work["warmup"], 8)
    if mode in ("ar",) and "lengths" in parts:
        for length, prompts in work["lengths"].items():
            ttft = statistics.median(system.generate(p, 1)[0] for p in prompts[1:])
            # Decoding alone: the same cached prompt to 1 token and to N + 1, whose difference
            # is N steps at this context, whatever the prefill cost.
            system.generate(prompts[0], 1)
            first = statistics.median(system.generate(prompts[0], 1)[0] for _ in range(3))
            seconds, out = system.generate(prompts[0], args.decode_tokens + 1, ignore_eos=True)
            rows.append({"part": "lengths", "length": int(length), "ttft_s": ttft,
                         "decode_tok_s": (len(out) - 1) / max(seconds - first, 1e-9),
                         "decode_ms_per_token": 1000 * (seconds - first) / max(len(out) - 1, 1)})
    if mode == "ar" and "prefix" in parts:
        for prefix, first, second in work["prefix"]:
            cold = system.generate(prefix + first, 1)[0]
            warm = system.generate(prefix + second, 1)[0]
            rows.append({"part": "prefix", "prefix": len(prefix), "cold_ttft_s": cold,
                         "warm_ttft_s": warm, "warm_over_cold": warm / cold})
    if mode == "ar" and "turns" in parts:
        rows += replay_turns(system, work["turns"], args.turn_tokens)
    if "code" in parts:
        for prompt in work["code"]:
            ttft = system.generate(prompt["ids"], 1)[0]
            seconds, out = system.generate(prompt["ids"], args.code_tokens)
            rows.append({"part": "code", "file": prompt["file"], "prompt": len(prompt["ids"]),
                         "ttft_s": ttft, "tokens": len(out), "seconds": seconds,
                         "tok_s": len(out) / seconds, "output": out,
                         "steps": getattr(system, "last_steps", None)})
        for batch in (int(b) for b in args.code_batches.split(",") if int(b) > 1):
            for at in range(0, len(work["code"]) - batch + 1, batch):
                group = work["code"][at:at + batch]  # each prompt cached by the b = 1 runs
                seconds, outs = system.generate_batch([p["ids"] for p in group],
                                                      args.code_tokens)
                tokens = sum(len(o) for o in outs)
                rows.append({"part": "code-batch", "batch": batch,
                             "file": ",".join(p["file"] for p in group), "tokens": tokens,
                             "seconds": seconds, "tok_s": tokens / seconds, "output": outs})
    if mode == "ar" and "streams" in parts and hasattr(system, "streams"):
        rows.append({"part": "streams", **system.streams(work["streams"], 32)})
    return rows


def replay_turns(system, conversations: list[list[str]], turn_tokens: int) -> list[dict]:
    """Each conversation turn by turn, the model's own answers kept in the history."""
    from transformers import AutoTokenizer

    tokenizer = system.tokenizer if hasattr(system, "tokenizer") else \
        AutoTokenizer.from_pretrained(system.llm.llm_engine.model_config.tokenizer)
    rows = []
    for index, turns in enumerate(conversations):
        messages, previous = [], 0
        for turn, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = list(getattr(ids, "input_ids", ids))
            ttft = system.generate(ids, 1)[0]
            _, answer = system.generate(ids, turn_tokens)
            rows.append({"part": "turns", "conversation": index, "turn": turn,
                         "prompt": len(ids), "new_tokens": len(ids) - previous, "ttft_s": ttft})
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(answer, skip_special_tokens=True)})
            previous = len(ids) + len(answer)
    return rows


def worker(args: argparse.Namespace) -> None:
    work = json.loads(Path(args.plan_file).read_text())
    cls = VllmSystem if args.system == "vllm" else EngineSystem
    system = cls(args, args.mode, args.max_len)
    rows = run_parts(system, work, args, args.mode)
    print(RESULT + json.dumps({"rows": rows, "facts": system.facts()}), flush=True)


def run_system(args: argparse.Namespace, system: str, mode: str, work_dir: Path,
               plan_file: Path, max_len: int, vllm_model: Path | None) -> dict:
    python = VLLM_PYTHON if system == "vllm" else Path(sys.executable)
    command = [str(python), __file__, "--worker", "--system", system, "--mode", mode,
               "--dtype", args.dtype, "--plan-file", str(plan_file), "--max-len", str(max_len),
               "--parts", args.parts, "--decode-tokens", str(args.decode_tokens),
               "--code-tokens", str(args.code_tokens), "--code-batches", args.code_batches,
               "--turn-tokens", str(args.turn_tokens),
               "--ngram-k", str(args.ngram_k), "--suffix-k", str(args.suffix_k),
               "--budget-policy", args.budget_policy,
               "--model-file", model_file(args.model) or ""]
    if args.datastore:
        command += ["--datastore", str(args.datastore)]
    if vllm_model:
        command += ["--vllm-model", str(vllm_model)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    print(f"{args.model}: {system} {mode}", file=sys.stderr, flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200,
                          cwd=work_dir)
    if done.returncode != 0:
        raise SystemExit(f"{system} {mode} failed:\n{done.stderr[-4000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def summarize(args: argparse.Namespace, runs: dict[tuple[str, str], dict]) -> list[dict]:
    """The rows with their system and mode; code rows get their speed against the same
    system's plain decoding and, for the engine, whether the answer is plain decoding's."""
    rows = []
    for (system, mode), run in runs.items():
        ar = runs.get((system, "ar"))
        ar_code = {(r["part"], r["file"]): r for r in ar["rows"]
                   if r["part"] in ("code", "code-batch")} if ar else {}
        for row in run["rows"]:
            row = {"model": args.model, "dtype": args.dtype, "system": system, "mode": mode,
                   **row, **run["facts"], "cpu": cpu_name()}
            if row["part"] in ("code", "code-batch"):
                output = row.pop("output")
                base = ar_code.get((row["part"], row["file"]))
                if base is not None:
                    row["speedup"] = row["tok_s"] / base["tok_s"]
                    if system == "engine" and mode != "ar":  # plain decoding is the reference
                        row["same_as_ar"] = output == base["output"]
            rows.append(row)
    batches = [("code", 1)] + [("code-batch", int(b)) for b in args.code_batches.split(",")
                               if int(b) > 1]
    for system, mode in runs:
        for part, batch in batches:
            code = [r for r in rows if r["part"] == part and r["system"] == system
                    and r["mode"] == mode and r.get("batch", 1) == batch]
            if not code:
                continue
            # Without its system's plain decoding in the run a mode has no speedup and no
            # answers compared: the summary leaves them out rather than claim them.
            speedups = [r["speedup"] for r in code if "speedup" in r]
            compared = [r["same_as_ar"] for r in code if "same_as_ar" in r]
            summary = {"model": args.model, "system": system, "mode": mode,
                       "part": "code-summary", "batch": batch, "prompts": len(code),
                       "median_tok_s": statistics.median(r["tok_s"] for r in code),
                       "cpu": cpu_name()}
            if len(speedups) == len(code):
                summary["median_speedup"] = statistics.median(speedups)
            if compared:
                summary["same_as_ar"] = f"{sum(compared)} / {len(compared)}"
            rows.append(summary)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Three panels: time to first token and decoding speed by context, and the code-edit
    set's speed over each system's plain decoding by batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft, decode, code) = plt.subplots(1, 3, figsize=(13, 4))
    for system in sorted({r["system"] for r in rows}):
        lengths = sorted((r for r in rows if r["part"] == "lengths" and r["system"] == system),
                         key=lambda r: r["length"])
        if lengths:
            xs = [r["length"] for r in lengths]
            ttft.plot(xs, [r["ttft_s"] for r in lengths], "o-", label=system)
            decode.plot(xs, [r["decode_tok_s"] for r in lengths], "o-", label=system)
    summaries = [r for r in rows if r["part"] == "code-summary" and r["mode"] != "ar"
                 and "median_speedup" in r]
    for index, row in enumerate(summaries):
        label = f"{row['system']} {row['mode']} b={row['batch']}"
        code.bar(index, row["median_speedup"], label=label)
    code.axhline(1.0, color="grey", lw=0.8)
    code.set_xticks(range(len(summaries)),
                    [f"{r['system']}\n{r['mode']}\nb={r['batch']}" for r in summaries],
                    fontsize=7)
    ttft.set(xlabel="prompt tokens (cold)", ylabel="time to first token (s)")
    decode.set(xlabel="context tokens", ylabel="decoding tokens/s (b = 1)")
    code.set(ylabel="code edits: speed over own plain decoding (median)")
    for axis in (ttft, decode):
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_model(parser, "smollm2")
    flags.add_dtype(parser)
    flags.add_datastore(parser, "the SSSD mode's datastore (built with the model's tokenizer)",
                        type=str)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefix-tokens", type=int, default=4096,
                        help="the shared prefix of the prefix part")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--systems", default="engine,vllm")
    parser.add_argument("--modes", default="ar,prompt_lookup,sssd")
    parser.add_argument("--vllm-modes", default="ar,ngram")
    parser.add_argument("--budget-policy", default="measured", choices=("measured", "rule"),
                        help="the engine's speculation budget policy (its default: measured)")
    parser.add_argument("--ngram-k", type=int, default=8, help="vLLM ngram's tokens a step")
    parser.add_argument("--suffix-k", type=int, default=24,
                        help="vLLM suffix's most tokens a step (its default tree depth)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--code-prompts", type=int, default=6)
    parser.add_argument("--code-tokens", type=int, default=256)
    parser.add_argument("--code-min-tokens", type=int, default=2048,
                        help="the code-edit prompts' least length")
    parser.add_argument("--code-max-tokens", type=int, default=16384,
                        help="the code-edit prompts' most length (at most the window less the "
                        "answer)")
    parser.add_argument("--streams", type=int, default=64,
                        help="short prompts submitted at once in the streams part")
    parser.add_argument("--code-batches", default="1,4",
                        help="batch sizes of the code-edit set (its prompts in groups)")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=64)
    flags.add_out(parser, None)
    flags.add_png(parser, "long_context")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--system", "--mode", "--plan-file", "--model-file", "--vllm-model"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    systems = args.systems.split(",")
    if "vllm" in systems and not VLLM_PYTHON.is_file():
        raise SystemExit("vllm needs .venv-vllm (bash scripts/setup_vllm.sh), or --systems "
                         "engine")
    if "sssd" in args.modes.split(",") and "engine" in systems and not args.datastore:
        raise SystemExit("mode sssd needs --datastore (e.g. what `sssd up` built under "
                         "var/demo-datastore/)")
    from sssd.common.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_file(args.model))
    window = model_window(args.model)
    work = plan(args, tokenizer, window)
    longest = max([int(n) for n in work["lengths"]] + [args.prefix_tokens + QUESTION_TOKENS]
                  + [len(p["ids"]) for p in work["code"]])
    max_len = min(window, longest + max(args.code_tokens, args.decode_tokens) + 16)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="long-context-") as folder:
        work_dir = Path(folder)
        plan_file = work_dir / "plan.json"
        plan_file.write_text(json.dumps(work))
        vllm_model = None
        if "vllm" in systems:
            from sssd.vllm.export_model import export_model
            vllm_model = export_model(work_dir / "model", model_file(args.model))
        for system in systems:
            modes = args.vllm_modes if system == "vllm" else args.modes
            for mode in modes.split(","):
                runs[(system, mode)] = run_system(args, system, mode, work_dir, plan_file,
                                                  max_len, vllm_model)
    rows = summarize(args, runs)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    sys.stdout.write(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.png:
        plot(rows, args.png, f"{args.model} {args.dtype}, {cpu_name()}: long contexts")


if __name__ == "__main__":
    main()

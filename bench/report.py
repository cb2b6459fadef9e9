"""The current results tables, generated from the results files so that no number on a page can
drift from the lines it came from.

`bench/results/current.toml` names, per claim, the result files that are current (a newer run of
the same cell replaces its entry there); every row of a table names its machine (the `Machine:`
line of its folder's NOTES.md), its date and its folder. This program rewrites the part of
docs/benchmarks.md between `<!-- report:begin -->` and `<!-- report:end -->` and the README's
table between `<!-- headline:begin -->` and `<!-- headline:end -->`; `--check` only says whether
they are up to date (exit status 1 if not: tests/test_style.py runs it).

    python -m bench.report            # rewrite both pages
    python -m bench.report --check
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CURRENT = RESULTS / "current.toml"
PAGES = {"docs/benchmarks.md": "report", "README.md": "headline"}


@dataclass(frozen=True)
class Source:
    """One current result file: `folder/file` under bench/results, and what the file's rows do
    not say themselves (the model; a label for the run)."""

    folder: str
    file: str
    model: str = ""
    batches: tuple[int, ...] = ()  # only these batch sizes of the file (all when empty)
    parts: tuple[str, ...] = ()  # only these parts of a long-context file (all when empty)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "parts", tuple(self.parts))

    @property
    def path(self) -> Path:
        return RESULTS / self.folder / self.file

    def rows(self) -> list[dict]:
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    @property
    def machine(self) -> str:
        """The machine's short name: the `- Machine:` line of the folder's NOTES.md up to its
        first comma or parenthesis."""
        notes = RESULTS / self.folder / "NOTES.md"
        match = re.search(r"(?m)^- Machine: (.+)$", notes.read_text()) if notes.is_file() else None
        if match is None:
            raise SystemExit(f"{notes}: no '- Machine:' line (every results folder says where "
                             "it ran)")
        return re.split(r"[,(;]", match.group(1))[0].strip()

    @property
    def where(self) -> str:
        """The cell naming the machine and the folder (whose name starts with the date),
        linked to the folder's NOTES.md."""
        return f"[{self.machine}, {self.folder}]({_link(self.folder)})"


def _link(folder: str) -> str:
    return f"../bench/results/{folder}/NOTES.md"


def load_current(path: Path = CURRENT) -> dict[str, list[Source]]:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    return {claim: [Source(**entry) for entry in entries] for claim, entries in raw.items()}


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _n(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- the claims ------------------------------------------------------------------------------


def speculation_rows(source: Source) -> list[list[str]]:
    """bench/e2e.py's lines: per batch size, plain decoding (ar), SSSD under the measured
    budget policy, SSSD at its best fixed budget, and prompt lookup where it ran."""
    rows = [r for r in source.rows() if r.get("batch") is not None and "speedup" in r]
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        if source.batches and batch not in source.batches:
            continue
        cell = [r for r in rows if r["batch"] == batch]
        ar = next((r for r in cell if r["mode"] == "ar"), None)
        measured = next((r for r in cell if r["mode"] == "sssd" and r["policy"] == "measured"),
                        None)
        if ar is None or measured is None:
            continue
        fixed = [r for r in cell if r["mode"] == "sssd" and str(r["policy"]).startswith("fixed:")]
        best = max(fixed, key=lambda r: r["speedup"], default=None)
        lookup = [r for r in cell if r["mode"] == "prompt_lookup"]
        best_lookup = max(lookup, key=lambda r: r["speedup"], default=None)
        same = min(r["same_as_ar"] for r in cell if "same_as_ar" in r)
        out.append([
            source.model, measured["prompt_set"], str(batch),
            f"{measured['num_prompts']} x {measured['max_tokens']}",
            _n(ar["tok_s"]),
            f"{_x(measured['speedup'])} ({measured['tokens_per_step']:.2f})",
            "" if best is None else f"{_x(best['speedup'])} ({best['policy'][6:]})",
            _x(best_lookup["speedup"]) if best_lookup else "",
            f"{same} / {measured['num_prompts']}",
            source.where])
    return out


SPECULATION_HEADER = ["model", "set", "b", "prompts x tokens", "plain tok/s",
                      "SSSD, measured policy (tokens/step)", "SSSD, best fixed budget",
                      "prompt lookup", "answers equal to plain", "machine, results"]


def plain_rows(source: Source) -> list[list[str]]:
    """bench/engine_speed.py's lines: the engine's plain decoding against vLLM's CPU build and
    transformers' generate(), by batch size."""
    rows = source.rows()
    out = []
    for model, dtype, batch in sorted({(r["model"], r["dtype"], r["batch_size"]) for r in rows}):
        cell = {r["system"]: r for r in rows
                if (r["model"], r["dtype"], r["batch_size"]) == (model, dtype, batch)}
        engine, vllm = cell.get("engine"), cell.get("vllm")
        if engine is None or vllm is None:
            continue
        generate = cell.get("generate")
        out.append([model, dtype, str(batch), _n(engine["tokens_per_s"]),
                    _n(vllm["tokens_per_s"]),
                    _x(engine["tokens_per_s"] / vllm["tokens_per_s"]),
                    _n(generate["tokens_per_s"]) if generate else "",
                    f"{engine['ms_per_step']:.1f} / {engine['floor_ms_per_step']:.1f}"
                    if "floor_ms_per_step" in engine else "",
                    source.where])
    return out


PLAIN_HEADER = ["model", "dtype", "b", "engine tok/s", "vLLM tok/s", "engine / vLLM",
                "transformers generate() tok/s", "engine ms a step / weight-reading floor",
                "machine, results"]


def drafter_rows(source: Source) -> list[list[str]]:
    """bench/vllm_peers.py's lines: vLLM's CPU build plain and with its `ngram` and `suffix`
    methods and our drafter, and our engine with SSSD trees, by prompt set."""
    rows = source.rows()
    out = []
    for prompt_set, batch in sorted({(r["set"], r["batch_size"]) for r in rows}):
        cell = {r["mode"]: r for r in rows if (r["set"], r["batch_size"]) == (prompt_set, batch)}
        none, engine = cell.get("none"), cell.get("engine")
        if none is None or engine is None:
            continue
        out.append([source.model, prompt_set, str(batch), _n(none["tokens_per_s"]),
                    *(_x(cell[m].get("speedup")) if m in cell else "" for m in
                      ("ngram", "suffix", "sssd")),
                    _n(engine["plain_tokens_per_s"]), _n(engine["tokens_per_s"]),
                    _x(engine["speedup"]), source.where])
    return out


DRAFTER_HEADER = ["model", "set", "b", "vLLM plain tok/s", "vLLM ngram", "vLLM suffix",
                  "vLLM + our drafter", "engine plain tok/s", "engine SSSD tok/s",
                  "engine SSSD", "machine, results"]

HTTP_SERVERS = ("ours-inproc-off", "ours-inproc", "ours-off", "ours", "vllm", "vllm-ngram",
                "vllm-suffix", "vllm-sssd")


def http_rows(source: Source) -> list[list[str]]:
    """bench/http_peers.py's lines (vLLM's own benchmark client against every server): output
    tokens/s and median TPOT per server, by prompt set and concurrency."""
    rows = source.rows()
    out = []
    for dataset, concurrency in sorted({(r["dataset"], r["concurrency"]) for r in rows}):
        cell = {r["server"]: r for r in rows
                if (r["dataset"], r["concurrency"]) == (dataset, concurrency)}
        out.append([source.model, dataset, str(concurrency),
                    *(f"{cell[s]['output_throughput']:.0f} / {cell[s]['tpot_p50_ms']:.1f}"
                      if s in cell else "" for s in HTTP_SERVERS),
                    source.where])
    return out


HTTP_HEADER = ["model", "prompts", "c", *HTTP_SERVERS, "machine, results"]


def _code_cell(summary: dict | None) -> str:
    if summary is None:
        return ""
    speedup = summary.get("median_speedup")
    return f"{summary['median_tok_s']:.1f}" + ("" if speedup is None else f" ({speedup:.2f}x)")


def long_context_rows(source: Source) -> list[list[str]]:
    """bench/long_context.py's lines: per measure, the engine beside vLLM's CPU build."""
    rows = [r for r in source.rows() if not source.parts
            or r["part"].split("-")[0] in source.parts]  # code-batch, code-summary: code
    out = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        label = source.model or model

        def cells(part: str, mode: str, value, where=lambda r: True) -> list[str]:
            """The engine's and vLLM's median of `value` over the part's rows."""
            found = []
            for system in ("engine", "vllm"):
                values = [value(r) for r in mine if r["part"] == part and r["system"] == system
                          and r["mode"] == mode and where(r)]
                found.append(statistics.median(values) if values else None)
            return found

        for length in sorted({r["length"] for r in mine if r["part"] == "lengths"}):
            at = lambda r, n=length: r["length"] == n  # noqa: E731
            engine, vllm = cells("lengths", "ar", lambda r: r["ttft_s"], at)
            out.append([label, f"time to first token, {length:,} tokens (s)", _n(engine, 2),
                        _n(vllm, 2), _x(vllm / engine) if engine and vllm else "",
                        source.where])
            engine, vllm = cells("lengths", "ar", lambda r: r["decode_tok_s"], at)
            out.append([label, f"decoding at {length:,} tokens of context (tok/s)", _n(engine),
                        _n(vllm), _x(engine / vllm) if engine and vllm else "", source.where])
        engine, vllm = cells("prefix", "ar", lambda r: r["warm_over_cold"])
        if engine is not None:
            out.append([label, "a repeated 4k prefix: warm / cold time to first token",
                        f"{100 * engine:.1f} %", "" if vllm is None else f"{100 * vllm:.1f} %",
                        "", source.where])
        later = lambda r: r["turn"] > 0  # noqa: E731
        engine, vllm = cells("turns", "ar", lambda r: r["ttft_s"], later)
        if engine is not None:
            out.append([label, "multi-turn chat: time to first token of turns 2+ (s)",
                        _n(engine, 2), _n(vllm, 2), _x(vllm / engine) if vllm else "",
                        source.where])
        summary = {(r["system"], r["mode"], r.get("batch", 1)): r for r in mine
                   if r["part"] == "code-summary"}
        for batch in sorted({key[2] for key in summary}):
            # Each of our modes beside vLLM's nearest: plain beside plain, our n-gram lookup
            # beside its ngram, SSSD trees beside its ngram and its suffix trees.
            for ours, theirs, name in (("ar", "ar", "plain"),
                                       ("prompt_lookup", "ngram", "prompt lookup"),
                                       ("sssd", "ngram", "SSSD (vLLM: ngram)"),
                                       ("sssd", "suffix", "SSSD (vLLM: suffix)")):
                engine = summary.get(("engine", ours, batch))
                vllm = summary.get(("vllm", theirs, batch))
                if engine is None or (theirs == "suffix" and vllm is None):
                    continue
                lead = _x(engine["median_tok_s"] / vllm["median_tok_s"]) if vllm else ""
                out.append([label, f"code edits, b = {batch}, {name}: tok/s (x own plain)",
                            _code_cell(engine), _code_cell(vllm), lead, source.where])
        kv = [r["kv_bytes_per_token"] for r in mine
              if r["part"] == "lengths" and "kv_bytes_per_token" in r]
        if kv:
            out.append([label, "KV cache: bytes per token in use", f"{kv[0]:,}", "", "",
                        source.where])
        streams = [r for r in mine if r["part"] == "streams"]
        if streams:
            r = streams[0]
            out.append([label, "64 concurrent streams: failed, most running, tok/s",
                        f"{r['failed']}, {r['most_running']}, {r['tok_s']:.0f}", "", "",
                        source.where])
    return out


LONG_CONTEXT_HEADER = ["model", "measure", "engine", "vLLM (CPU)", "engine's lead",
                       "machine, results"]


def headline_rows(current: dict[str, list[Source]]) -> list[list[str]]:
    """The README's table: output tokens/s of our server with speculation off and on beside
    vLLM's CPU build plain and with its drafters, one row per model and workload."""
    out = []
    for source in current.get("headline_http", []):
        rows = source.rows()
        for dataset, concurrency in sorted({(r["dataset"], r["concurrency"]) for r in rows}):
            cell = {r["server"]: r["output_throughput"] for r in rows
                    if (r["dataset"], r["concurrency"]) == (dataset, concurrency)}
            ours, off = cell.get("ours-inproc"), cell.get("ours-inproc-off")
            if ours is None or off is None:
                continue
            out.append([source.model, f"{dataset}, {concurrency} at a time, HTTP",
                        f"{off:.0f}", f"**{ours:.0f}** ({ours / off:.2f}x)",
                        *(f"{cell[s]:.0f}" if s in cell else "" for s in
                          ("vllm", "vllm-ngram", "vllm-suffix")), source.where])
    for source in current.get("headline_engine", []):
        rows = source.rows()
        for prompt_set, batch in sorted({(r["set"], r["batch_size"]) for r in rows}):
            cell = {r["mode"]: r for r in rows
                    if (r["set"], r["batch_size"]) == (prompt_set, batch)}
            engine = cell.get("engine")
            if engine is None:
                continue
            out.append([source.model, f"{prompt_set}, {batch} at a time, in process",
                        _n(engine["plain_tokens_per_s"]),
                        f"**{engine['tokens_per_s']:.1f}** ({engine['speedup']:.2f}x)",
                        *(_n(cell[m]["tokens_per_s"]) if m in cell else "" for m in
                          ("none", "ngram", "suffix")), source.where])
    return out


HEADLINE_HEADER = ["model", "workload", "ours, speculation off", "ours, SSSD",
                   "vLLM (CPU)", "vLLM ngram", "vLLM suffix", "machine, results"]


def agent_rows(source: Source) -> list[list[str]]:
    """bench/agent.py's summary lines: one row per speculation mode."""
    out = []
    for r in (r for r in source.rows() if r["kind"] == "summary"):
        speedup = (f"{r['median_speedup']:.2f}x / {r['session_speedup']:.2f}x"
                   if "median_speedup" in r else "")
        out.append([source.model or r.get("model", ""), r["mode"],
                    f"{r['sessions']} / {r['turns']}", str(r["max_prompt_tokens"]),
                    f"{r['cached_fraction']:.0%}", f"{r['median_ttft_s']:.2f}",
                    _n(r["median_tok_s"]), _n(r["session_tok_s"]),
                    _n(r.get("median_tokens_per_step"), 2), speedup,
                    {True: "yes", False: "NO"}.get(r.get("same_as_off"), ""), source.where])
    return out


AGENT_HEADER = ["model", "speculation", "sessions / calls", "max context", "prompt cached",
                "TTFT s", "tok/s per call", "tok/s overall", "tokens/step",
                "speedup per call / overall", "same as off", "machine, results"]


def attention_rows(source: Source) -> list[list[str]]:
    """A decode_ab.py file (two builds of the kernels taking turns): one row per context, the
    medians of each build's rounds."""
    rows = source.rows()
    labels = list(dict.fromkeys(r["kernels"] for r in rows))
    if len(labels) != 2:
        raise SystemExit(f"{source.path}: two builds of the kernels expected, got {labels}")
    before, after = labels

    def median(label: str, context: int, key: str) -> float:
        return statistics.median(r[key] for r in rows
                                 if r["kernels"] == label and r["context"] == context)

    out = []
    for context in sorted({r["context"] for r in rows}):
        step = [median(label, context, "step_ms") for label in (before, after)]
        ttft = [median(label, context, "ttft_s") for label in (before, after)]
        out.append([source.model or "", f"{context:,}", f"{step[0]:.1f} / {step[1]:.1f}",
                    _x(step[0] / step[1]),
                    f"{median(before, context, 'step_over_floor'):.2f}x / "
                    f"{median(after, context, 'step_over_floor'):.2f}x",
                    f"{ttft[0]:.2f} / {ttft[1]:.2f}", _x(ttft[0] / ttft[1]), f"{after} "
                    f"against {before}", source.where])
    return out


ATTENTION_HEADER = ["model", "context", "decode step ms (before / now)", "speedup",
                    "step over its streaming floor (before / now)",
                    "time to first token s (before / now)", "prefill speedup", "kernels",
                    "machine, results"]


def llamacpp_rows(source: Source) -> list[list[str]]:
    """bench/llamacpp.py's lines: per measure, the engine beside llama.cpp's server (medians)."""
    rows = [r for r in source.rows() if "system" in r]

    def median(system: str, mode: str, part: str, value, where=lambda r: True):
        values = [value(r) for r in rows if (r["system"], r["mode"], r["part"]) ==
                  (system, mode, part) and where(r)]
        return statistics.median(values) if values else None

    out = []
    for length in sorted({r["length"] for r in rows if r["part"] == "lengths"}):
        at = lambda r, n=length: r["length"] == n  # noqa: E731
        engine = median("engine", "ar", "lengths", lambda r: r["ttft_s"], at)
        llama = median("llamacpp", "plain", "lengths", lambda r: r["ttft_s"], at)
        out.append([f"time to first token, {length:,} tokens (s)", _n(engine, 2), _n(llama, 2),
                    _x(llama / engine) if engine and llama else ""])
        engine = median("engine", "ar", "lengths", lambda r: r["decode_tok_s"], at)
        llama = median("llamacpp", "plain", "lengths", lambda r: r["decode_tok_s"], at)
        out.append([f"decoding at {length:,} tokens of context (tok/s)", _n(engine), _n(llama),
                    _x(engine / llama) if engine and llama else ""])
    tok_s = lambda r: r["tok_s"]  # noqa: E731
    plain = (median("engine", "ar", "code", tok_s), median("llamacpp", "plain", "code", tok_s))
    for ours, theirs, name in (("ar", "plain", "plain"), ("sssd", "ngram",
                                                          "SSSD (llama.cpp: ngram-simple)")):
        engine = median("engine", ours, "code", tok_s)
        llama = median("llamacpp", theirs, "code", tok_s)
        if engine is None or llama is None:
            continue
        out.append([f"code edits, b = 1, {name}: tok/s (x own plain)",
                    f"{engine:.1f} ({_x(engine / plain[0])})",
                    f"{llama:.1f} ({_x(llama / plain[1])})", _x(engine / llama)])
    weights = next((r["weights"] for r in source.rows() if "weights" in r), None)
    if weights:
        out.append(["weights read a step (MB)", f"{weights['engine_bytes'] / 1e6:.0f} (bfloat16)",
                    f"{weights['gguf_bytes'] / 1e6:.0f} (the GGUF)", ""])
    return [[source.model or "", *row, source.where] for row in out]


LLAMACPP_HEADER = ["model", "measure", "engine", "llama.cpp", "engine's lead", "machine, results"]


def copy_rows(source: Source) -> list[list[str]]:
    """A copy_ab.py file (each drafter without and with its copy source, taking turns with
    plain decoding file by file): one row per drafter, its summary lines' medians."""
    summaries = {r["summary"]: r for r in source.rows() if "summary" in r}
    out = []
    for mode, label in (("prompt_lookup", "prompt lookup"), ("sssd", "SSSD")):
        before, after = summaries[f"{mode}-paper"], summaries[f"{mode}-copy"]
        out.append([source.model or "", label, str(after["files"]),
                    f"{summaries['ar']['median_tok_s']:.1f}",
                    f"{before['median_tok_s']:.1f} / {after['median_tok_s']:.1f}",
                    f"{_x(before['median_speedup'])} / {_x(after['median_speedup'])}",
                    f"{before['tokens_per_step']:.2f} / {after['tokens_per_step']:.2f}",
                    f"{before['same_as_ar'] + after['same_as_ar']} / "
                    f"{before['files'] + after['files']}", source.where])
    return out


COPY_HEADER = ["model", "drafter", "files", "plain tok/s", "tok/s (without / with copy)",
               "x plain (without / with)", "tokens/step (without / with)",
               "answers equal to plain", "machine, results"]


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    text: str
    header: list[str]
    rows: Callable[[Source], list[list[str]]]


CLAIMS = (
    Claim("speculation", "Speculation in the engine",
          "`bench/e2e.py`, greedy, bfloat16, drafting in process: tokens/s of plain decoding "
          "and the speedup of SSSD trees over it in the same run (configurations taking turns "
          "chunk by chunk), by batch size b.",
          SPECULATION_HEADER, speculation_rows),
    Claim("plain", "Plain decoding against vLLM's CPU build",
          "`bench/engine_speed.py`: the engine's own forward pass without speculation, vLLM "
          "0.32's CPU build and transformers' generate() on the same prompts, taking turns.",
          PLAIN_HEADER, plain_rows),
    Claim("drafters", "vLLM's drafters and ours",
          "`bench/vllm_peers.py` in `.venv-vllm`: vLLM with its `ngram` and `suffix` methods "
          "and with our drafter service (speedups over vLLM without speculation), and our "
          "engine with SSSD trees (over its own plain decoding), greedy.",
          DRAFTER_HEADER, drafter_rows),
    Claim("http", "Every server under vLLM's benchmark client",
          "`bench/http_peers.py`: `vllm bench serve` against each server's OpenAI API; output "
          "tokens/s / median TPOT ms per server (ours-inproc: `sssd up`, drafting in its "
          "decode worker; ours: through the drafter service; -off: speculation off).",
          HTTP_HEADER, http_rows),
    Claim("long_context", "Long contexts and reuse",
          "`bench/long_context.py`: bfloat16, prefix caching on in both, b = 1 where a row "
          "names no b; medians. Time to first token of never-seen prompts by length, decoding "
          "speed at that context, a 4k prefix asked twice, ShareGPT conversations replayed turn "
          "by turn, whole-file code edits with speculation (the engine's measured budget "
          "policy; vLLM's `ngram` with k = 8), 64 streams at once.",
          LONG_CONTEXT_HEADER, long_context_rows),
    Claim("llamacpp", "llama.cpp's server beside the engine",
          "`bench/llamacpp.py`: the same GGUF, llama.cpp on its quantized weights (Q4_1), the "
          "engine on them dequantized to bfloat16; b = 1, medians. Time to first token of "
          "random-token prompts (cold), decoding 64 tokens at that context, and the whole-file "
          "code edits (256 greedy tokens from the cached prompt) plain and with each one's "
          "n-gram speculation.",
          LLAMACPP_HEADER, llamacpp_rows),
    Claim("copy", "The drafter's copy source on whole-file code edits",
          "`copy_ab.py` of the results folder: the long-context benchmark's code edits (an edit "
          "instruction over a whole source file, 256 greedy tokens, b = 1, bfloat16), the "
          "engine in process with each drafter without its copy source (the paper's trees) "
          "and with it, taking turns with plain decoding file by file; medians over the "
          "files, tokens/step over all of them.",
          COPY_HEADER, copy_rows),
    Claim("attention", "Long-context attention by key segments",
          "`decode_ab.py` of the results folder: plain decoding at b = 1, bfloat16, the "
          "model's prefill (cold) and its decode step at each context on two builds of the "
          "kernels taking turns in one run (medians of three rounds each), beside the step's "
          "streaming floor (its weights and its keys and values at the speed the machine's "
          "memory streams, measured in the same process).",
          ATTENTION_HEADER, attention_rows),
    Claim("agent", "Agentic tool-calling sessions",
          "`bench/agent.py`: multi-turn tool-calling sessions through the `openai` SDK "
          "(`tool_choice: required`, strict schemas, an `answer` tool; tool results fed back, "
          "the model's own answers replayed), two `sssd serve` processes with prefix caching, "
          "speculation auto against off, greedy, bfloat16; medians per model call, and overall "
          "tokens over seconds.",
          AGENT_HEADER, agent_rows),
    Claim("gpu", "On a GPU", "`bench/e2e.py --device cuda` on a lent GPU, as the CPU table.",
          SPECULATION_HEADER, speculation_rows),
)


def render_report(current: dict[str, list[Source]]) -> str:
    parts = []
    for claim in CLAIMS:
        rows = [row for source in current.get(claim.key, []) for row in claim.rows(source)]
        if rows:
            parts.append(f"### {claim.title}\n\n{claim.text}\n\n{table(claim.header, rows)}")
    return "\n\n".join(parts)


def render_headline(current: dict[str, list[Source]]) -> str:
    return table(HEADLINE_HEADER, headline_rows(current))


def replace_between(text: str, marker: str, body: str) -> str:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"the page has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def pages(current: dict[str, list[Source]]) -> dict[str, str]:
    """Each page's text with its generated block rewritten."""
    bodies = {"report": render_report(current), "headline": render_headline(current)}
    out = {}
    for page, marker in PAGES.items():
        body = bodies[marker]
        if page == "README.md":  # the README's links start at the repository root
            body = body.replace("../bench/results/", "bench/results/")
        out[page] = replace_between((ROOT / page).read_text(), marker, body)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a page differs from what the results files give")
    args = parser.parse_args(argv)
    stale = []
    for page, text in pages(load_current()).items():
        if (ROOT / page).read_text() != text:
            stale.append(page)
            if not args.check:
                (ROOT / page).write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)} (run `python -m bench.report`)", file=sys.stderr)
        sys.exit(1)
    print("up to date" if args.check else f"rewrote {', '.join(stale) or 'nothing'}")


if __name__ == "__main__":
    main()

"""An agentic workload: multi-turn tool-calling sessions through the OpenAI API with the official
`openai` SDK, replayed with the model's own answers, speculation auto against off.

    .venv/bin/python -m bench.agent [--model qwen-coder-0.5b] [--sessions 6] [--max-turns 10]
        [--calls-per-turn 3] [--turn-tokens 1024] [--datastore DIR] [--out FILE] [--png FILE]
    .venv/bin/python -m bench.agent --plot FILE --png FILE

A session is a coding task over a small workspace of Python files (modules of the running
Python's own standard library, which no datastore or corpus of the project reads), with five
tools: `list_files`, `read_file`, `search`, `write_file` (which replaces a file in the session's
copy, so a later `read_file` sees the edit) and `answer`, the reply to the user. Every model
call is made with `tool_choice: "required"` and strict argument schemas, as small-model agent
loops run (smolagents' tool-calling agent and its final-answer tool): the server holds each call
to the tools' schemas by its grammar, so a 0.5B model's calls name real tools (left to `auto`,
Qwen2.5-Coder-0.5B answers in prose or invents functions). The model's calls are executed and
their results fed back; a call of `answer` ends the user's turn, and the session's next scripted
follow-up is the next user turn; after --calls-per-turn calls without one, `answer` is named.
Every session has its task and three follow-ups, and at most --max-turns model calls.
The context grows call by call (whole files read, whole files written back): the long,
copy-heavy contexts where the input trie drafts most.

Two `sssd serve` processes of the same configuration (the model in bfloat16, the SSSD drafter
in process over the ShareGPT datastore `sssd up` builds for the model's tokenizer, prefix caching
on): one answers with speculation auto, the other with the request field `speculation: off`, a
session on one and then on the other, so each server sees each session once and both find the
same prefixes cached. Greedy, so both replay the same conversation: every turn's text and calls
are compared (`same_as_off`).

A turn is one model call, a streamed chat completion; its time to first token is the first
chunk whose usage (`stream_options.continuous_usage_stats`, vLLM's extension) counts a
completion token, not the role chunk that opens every stream. One JSON line per turn and mode
(prompt tokens, of them cached, completion tokens, TTFT, tokens/s, the server's tokens per
verification step), then a summary line per mode (medians; for auto, the median per-turn
speedup over off).

vLLM's CPU build is not run here: its OpenAI server needs the model as a Hugging Face directory
with its tokenizer and a tool parser flag, and the Qwen2.5-Coder weights on this machine are the
GGUF that `sssd-models` assembles (see the results' NOTES.md for what was tried).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import flags

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
WORKSPACE = ("colorsys.py", "bisect.py", "fnmatch.py", "getopt.py", "shlex.py", "glob.py")
SYSTEM = ("You are a coding agent working on a copy of some Python files. Use the tools to look "
          "at files before you answer; never guess a file's content. To change a file, call "
          "write_file with its complete new content. Reply to the user with the answer tool, "
          "in a few sentences.")
# (task, follow-ups): every follow-up is asked when the model has answered the turn before.
SESSIONS = (
    ("Add type hints to the function rgb_to_hsv in colorsys.py and write the file back.",
     ["Now add a one-line docstring to hsv_to_rgb and write the file again.",
      "Which other files in the workspace mention 'hsv'? Use search.",
      "Summarize in two sentences what you changed."]),
    ("How does insort_left differ from insort_right in bisect.py? Read the file first.",
     ["Write bisect.py back with a comment above each function saying what it returns.",
      "Search the workspace for 'lo < 0' and say which files check it.",
      "Which function of bisect.py would you use to count the items below a value?"]),
    ("What does fnmatch.translate do? Read fnmatch.py to find out.",
     ["Add type hints to fnmatch.filter and write the whole file back.",
      "Which files in the workspace import 'os'? Use search.",
      "List the public functions of fnmatch.py."]),
    ("List the workspace's files, then read the one that parses command-line options and "
     "explain how it handles long options.",
     ["Rename the local variable 'opts' to 'options' in getopt.py and write the file back.",
      "Search for 'GetoptError' and say where it is raised.",
      "In one sentence, when should a program use gnu_getopt instead of getopt?"]),
    ("Read shlex.py and explain what shlex.quote does.",
     ["Add a docstring to the function quote in shlex.py and write the whole file back.",
      "Search the workspace for 'def split' and list what you find.",
      "Give one example input and output of shlex.split."]),
    ("Read glob.py and tell me what glob.escape is for.",
     ["Add type hints to glob.escape and glob.has_magic and write the whole file back.",
      "Which files in the workspace use 're.compile'? Use search.",
      "Summarize glob.py's public functions in a list."]),
)


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description, "strict": True,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


TOOLS = [
    _function("list_files", "The workspace's files with their line counts.", {}, []),
    _function("read_file", "A file's whole content.",
              {"path": {"type": "string", "description": "the file's name"}}, ["path"]),
    _function("search", "Lines containing a text, in every file (file:line: text).",
              {"text": {"type": "string"}}, ["text"]),
    _function("write_file", "Replace a file's content with the given complete content.",
              {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _function("answer", "Reply to the user (ends your turn).",
              {"text": {"type": "string"}}, ["text"]),
]
ANSWER = {"type": "function", "function": {"name": "answer"}}


# --- the workspace and its tools ---------------------------------------------------------------

class Workspace:
    """The session's copy of the files; every tool's result is text, an error included (an
    agent framework sends its tool's error back to the model the same way)."""

    def __init__(self) -> None:
        self.files = {name: (STDLIB / name).read_text() for name in WORKSPACE}

    def call(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"error: the arguments are not JSON ({exc.msg})"
        if not isinstance(args, dict):
            return "error: the arguments must be an object"
        path = args.get("path")
        if name == "list_files":
            return "\n".join(f"{n} ({text.count(chr(10))} lines)"
                             for n, text in self.files.items())
        if name == "search":
            needle = str(args.get("text", ""))
            if not needle:
                return "error: text is required"
            hits = [f"{n}:{i}: {line.strip()}" for n, text in self.files.items()
                    for i, line in enumerate(text.splitlines(), 1) if needle in line]
            return "\n".join(hits[:40]) or "no matches"
        if name in ("read_file", "write_file") and path not in self.files:
            return f"error: no file {path!r}; the files are {', '.join(self.files)}"
        if name == "read_file":
            return self.files[path]
        if name == "answer":
            return "delivered"
        if name == "write_file":
            content = args.get("content")
            if not isinstance(content, str):
                return "error: content must be a string"
            self.files[path] = content
            return f"wrote {path} ({content.count(chr(10)) + 1} lines)"
        return f"error: no tool {name!r}"


# --- the servers ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `sssd serve` process on loopback ports of its own; its log goes to `log`."""

    def __init__(self, args: argparse.Namespace, datastore: Path, log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        command = [sys.executable, "-m", "sssd.cli.main", "serve", "--host", "127.0.0.1",
                   "--model", args.model, "--dtype", args.dtype, "--mode", "sssd",
                   "--datastore", str(datastore), "--max-len", str(args.max_len),
                   "--port", str(self.port), "--http-port", str(self.http_port)]
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, SSSD_API_KEY=""))
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"sssd serve exited with {self.process.returncode}: see "
                                 f"{self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise SystemExit(f"sssd serve not ready after {timeout_s:.0f} s: see {self.log.name}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


# --- one turn, one session -----------------------------------------------------------------------

def stream_turn(client, model: str, messages: list[dict], mode: str, max_tokens: int,
                tool_choice: object) -> dict:
    """One streamed chat completion: its text, tool calls, timings and the server's figures."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0,
        max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"speculation": mode})
    first = None
    text, calls, finish, usage, speculation = "", {}, None, None, {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            if first is None and usage.completion_tokens >= 1:
                first = time.perf_counter() - start
        speculation = (chunk.model_extra or {}).get("speculation") or speculation
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    total = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None)
    return {"text": text, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "ttft_s": first if first is not None else total, "total_s": total,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": getattr(details, "cached_tokens", None) or 0,
            "tokens_per_step": speculation.get("tokens_per_step")}


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def run_session(client, model: str, index: int, mode: str, args: argparse.Namespace
                ) -> list[dict]:
    task, follow_ups = SESSIONS[index]
    follow_ups = list(follow_ups)
    workspace = Workspace()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    rows, calls_in_turn = [], 0
    for turn in range(1, args.max_turns + 1):
        choice = "required" if calls_in_turn < args.calls_per_turn else ANSWER
        reply = stream_turn(client, model, messages, mode, args.turn_tokens, choice)
        decode_s = reply["total_s"] - reply["ttft_s"]
        digest = hashlib.sha256(json.dumps([reply["text"], [(c["name"], c["arguments"])
                                                            for c in reply["calls"]]])
                                .encode()).hexdigest()[:16]
        rows.append({"kind": "turn", "mode": mode, "session": index, "turn": turn,
                     "prompt_tokens": reply["prompt_tokens"],
                     "cached_tokens": reply["cached_tokens"],
                     "new_tokens": reply["prompt_tokens"] - reply["cached_tokens"],
                     "completion_tokens": reply["completion_tokens"],
                     "ttft_s": round(reply["ttft_s"], 4), "total_s": round(reply["total_s"], 4),
                     "tok_s": round(reply["completion_tokens"] / reply["total_s"], 2),
                     "decode_tok_s": round((reply["completion_tokens"] - 1) / decode_s, 2)
                     if decode_s > 0 and reply["completion_tokens"] > 1 else None,
                     "tokens_per_step": reply["tokens_per_step"],
                     "finish_reason": reply["finish_reason"],
                     "tools": [c["name"] for c in reply["calls"]], "digest": digest})
        calls_in_turn += 1
        # A call cut off by max_tokens streams as far as it got: not a call to run or to send
        # back (an agent framework refuses arguments that are not JSON the same way).
        reply["calls"] = [c for c in reply["calls"] if _is_object(c["arguments"])]
        if reply["calls"]:
            messages.append({"role": "assistant", "content": reply["text"] or None,
                             "tool_calls": [{"id": c["id"], "type": "function",
                                             "function": {"name": c["name"],
                                                          "arguments": c["arguments"]}}
                                            for c in reply["calls"]]})
            messages += [{"role": "tool", "tool_call_id": c["id"],
                          "content": workspace.call(c["name"], c["arguments"])}
                         for c in reply["calls"]]
            if not any(c["name"] == "answer" for c in reply["calls"]):
                continue
        else:  # cut off by max_tokens before its call ended: the text is its reply
            messages.append({"role": "assistant", "content": reply["text"]})
        if not follow_ups:
            break
        messages.append({"role": "user", "content": follow_ups.pop(0)})
        calls_in_turn = 0
    return rows


# --- the run, the summary, the plot --------------------------------------------------------------

def summarize(rows: list[dict]) -> list[dict]:
    turns = [r for r in rows if r["kind"] == "turn"]
    off = {(r["session"], r["turn"]): r for r in turns if r["mode"] == "off"}
    summaries = []
    for mode in sorted({r["mode"] for r in turns}):
        mine = [r for r in turns if r["mode"] == mode]
        summary = {"kind": "summary", "mode": mode, "sessions": len({r["session"] for r in mine}),
                   "turns": len(mine),
                   "median_turns": statistics.median(
                       [sum(1 for r in mine if r["session"] == s)
                        for s in {r["session"] for r in mine}]),
                   "max_prompt_tokens": max(r["prompt_tokens"] for r in mine),
                   "median_ttft_s": round(statistics.median(r["ttft_s"] for r in mine), 4),
                   "median_tok_s": round(statistics.median(r["tok_s"] for r in mine), 2),
                   "session_tok_s": round(sum(r["completion_tokens"] for r in mine)
                                          / sum(r["total_s"] for r in mine), 2),
                   "cached_fraction": round(sum(r["cached_tokens"] for r in mine)
                                            / sum(r["prompt_tokens"] for r in mine), 3)}
        steps = [r["tokens_per_step"] for r in mine if r["tokens_per_step"]]
        if steps:
            summary["median_tokens_per_step"] = round(statistics.median(steps), 3)
        if mode != "off" and off:
            pairs = [(r, off[(r["session"], r["turn"])]) for r in mine
                     if (r["session"], r["turn"]) in off]
            summary["same_as_off"] = all(r["digest"] == o["digest"] for r, o in pairs) and \
                len(pairs) == len(off) == len(mine)
            summary["median_speedup"] = round(statistics.median(
                o["total_s"] / r["total_s"] for r, o in pairs), 3)
            summary["session_speedup"] = round(
                summary["session_tok_s"] / round(sum(o["completion_tokens"] for _, o in pairs)
                                                 / sum(o["total_s"] for _, o in pairs), 2), 3)
        summaries.append(summary)
    return summaries


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Two panels by turn: time to first token against the turn's new prompt tokens, and each
    turn's tokens/s, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, marker in (("auto", "o"), ("off", "x")):
        mine = [r for r in rows if r["kind"] == "turn" and r["mode"] == mode]
        if not mine:
            continue
        ttft.scatter([r["new_tokens"] for r in mine], [r["ttft_s"] for r in mine],
                     marker=marker, label=f"speculation {mode}")
        speed.scatter([r["prompt_tokens"] for r in mine], [r["tok_s"] for r in mine],
                      marker=marker, label=f"speculation {mode}")
    ttft.set(xlabel="prompt tokens new in the turn (not cached)",
             ylabel="time to first token (s)")
    speed.set(xlabel="context tokens at the turn", ylabel="turn's tokens/s")
    for axis in (ttft, speed):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def datastore_for(args: argparse.Namespace) -> Path:
    """--datastore, else the ShareGPT datastore `sssd up` builds for the model's tokenizer."""
    from sssd.cli.datastores import pick_datastore
    from sssd.cli.models import ensure_fetched
    from sssd.common.model.tokenizer import load_tokenizer

    ensure_fetched(args.model)
    return pick_datastore(args.datastore, load_tokenizer(args.model))


def run(args: argparse.Namespace) -> list[dict]:
    import openai

    datastore = datastore_for(args)
    log_dir = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    servers = {mode: Server(args, datastore, log_dir / f"serve-{mode}.log")
               for mode in ("auto", "off")}
    rows = []
    try:
        for server in servers.values():
            server.wait_ready()
        clients = {mode: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0,
                                       timeout=3600) for mode, s in servers.items()}
        model = clients["auto"].models.list().data[0].id
        for index in range(args.sessions):
            for mode in ("auto", "off"):
                session = run_session(clients[mode], model, index, mode, args)
                for row in session:
                    row["model"] = args.model
                    print(json.dumps(row), flush=True)
                print(f"session {index} {mode}: {len(session)} turns, "
                      f"{sum(r['completion_tokens'] for r in session)} tokens in "
                      f"{sum(r['total_s'] for r in session):.1f} s", file=sys.stderr)
                rows += session
    finally:
        for server in servers.values():
            server.stop()
    for summary in summarize(rows):
        summary["model"] = args.model
        print(json.dumps(summary), flush=True)
        rows.append(summary)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_model(parser, "qwen-coder-0.5b")
    flags.add_dtype(parser)
    flags.add_datastore(parser, "the drafter's datastore (default: the ShareGPT one `sssd up` "
                        "builds for the model's tokenizer)")
    parser.add_argument("--sessions", type=int, default=len(SESSIONS),
                        help=f"sessions to replay, at most {len(SESSIONS)}")
    parser.add_argument("--max-turns", type=int, default=10, help="model calls per session")
    parser.add_argument("--calls-per-turn", type=int, default=3,
                        help="tool calls a user turn may take before `answer` is named")
    parser.add_argument("--turn-tokens", type=int, default=1024, help="max_tokens per turn")
    parser.add_argument("--max-len", type=int, default=16384, help="the servers' context window")
    parser.add_argument("--out", type=Path, default=None, help="also write the lines here")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None,
                        help="only plot this file's lines (with --png)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        rows = [json.loads(line) for line in args.plot.read_text().splitlines() if line.strip()]
    else:
        if not 1 <= args.sessions <= len(SESSIONS):
            parser.error(f"--sessions must be in [1, {len(SESSIONS)}]")
        rows = run(args)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.png is not None:
        plot(rows, args.png, f"bench/agent.py: {args.model}, tool-calling sessions, greedy")


if __name__ == "__main__":
    main()

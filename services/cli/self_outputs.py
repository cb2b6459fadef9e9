"""`sssd-self-outputs`: the model's own answers to ShareGPT prompts, and a datastore built from
them.

SSSD's datastore works best when it holds text like what the target model writes (the SSSD
paper, arXiv 2411.05894, Section 4: a datastore of the model's own outputs on ShareGPT
prompts). This command

1. `generate`: answers the first user turn of ShareGPT records [start, stop) with the engine
   (greedy, no speculation, large batch), appending one JSON line per conversation to
   `<dir>/outputs.jsonl`: `{"record", "prompt_ids", "output_ids", "finish_reason"}`. It is
   resumable: records already in the file are skipped, so it can be stopped (Ctrl-C) and
   started again, and a partial last line from a kill is ignored.
2. `build`: builds a datastore from the first N conversations of that file (prompt + answer
   token ids, one document each) into `<dir>/datastore-<N>`.

Prompts longer than `--max-prompt-tokens` (chat template included) are skipped and recorded
with `"skipped": "prompt too long"`, so a resumed run does not retry them.

`--model NAME` (a name of `sssd-models list`) answers with another model than the default, into
`var/self-outputs/<NAME>` unless `--dir` says otherwise. A directory holds one model's answers:
`model.json` records its tokenizer's fingerprint at the first `generate`, and `generate` and
`build` refuse a model with another tokenizer.

On the 2-core CPU machines generation runs at a few hundred tokens per second (batch 32,
bfloat16), so a few thousand conversations take tens of minutes: run it in the background.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from sssd.common.config.logs import configure_logging
from sssd.common.data.corpus import (
    conversation_token_ids,
    iter_conversation_token_ids,
    iter_sharegpt,
    sharegpt_messages,
)
from sssd.common.model.loader import load_causal_lm
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
from sssd.datastore.build import build_datastore
from sssd.datastore.manifest import read_manifest
from sssd.verifier.engine import EngineConfig, GenerateRequest
from sssd.verifier.factory import build_engine

if TYPE_CHECKING:
    from sssd.common.model.loader import LoadedModel

logger = logging.getLogger(__name__)

DEFAULT_DIR = "var/self-outputs"
MODEL_FILE = "model.json"  # {"tokenizer_fingerprint": ...}: whose answers the directory holds


def check_model(directory: Path, fingerprint: str, model: str | None) -> None:
    """Records the tokenizer of the directory's answers, or refuses another one."""
    path = directory / MODEL_FILE
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"tokenizer_fingerprint": fingerprint}) + "\n")
        return
    held = json.loads(path.read_text()).get("tokenizer_fingerprint")
    if held != fingerprint:
        raise SystemExit(f"{directory} holds the answers of a model with another tokenizer "
                         f"({held}, not {fingerprint} of {model or 'the default model'}): give "
                         "this model its own --dir")


def read_outputs(path: Path) -> Iterator[dict[str, Any]]:
    """The records of an outputs file in order; a torn last line (a killed writer) is ignored."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.endswith("\n"):
                logger.warning("%s:%d: ignoring a partial last line", path, line_no)
                return
            yield json.loads(line)


def _truncate_partial_line(path: Path) -> None:
    """Cuts a torn last line so appended records start on a line of their own."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)


def generate(directory: Path, loaded: LoadedModel, start: int, stop: int, max_tokens: int,
             batch_size: int, max_prompt_tokens: int) -> int:
    """Answers ShareGPT records [start, stop) not yet in the file; returns how many it added."""
    check_model(directory, loaded.fingerprint, loaded.name)
    path = directory / "outputs.jsonl"
    _truncate_partial_line(path)
    done = {record["record"] for record in read_outputs(path)}
    config = EngineConfig(dtype=str(loaded.dtype).removeprefix("torch."), mode="ar",
                          max_batch_size=batch_size, max_len=max_prompt_tokens + max_tokens + 2)
    engine = build_engine(config, loaded)

    def prompts() -> Iterator[tuple[int, list[int] | None]]:
        for index, record in enumerate(iter_sharegpt(start, stop), start=start):
            if index in done:
                continue
            messages = sharegpt_messages(record)
            first_user = next((m for m in messages if m["role"] == "user" and m["content"]), None)
            if first_user is None:
                yield index, None
                continue
            ids = conversation_token_ids(loaded.tokenizer, [first_user], add_generation_prompt=True)
            yield index, ids if len(ids) <= max_prompt_tokens else None

    pending = prompts()
    added, num_tokens, began = 0, 0, time.perf_counter()
    by_request: dict[str, int] = {}
    progress = tqdm(total=stop - start, initial=len(done), desc="self outputs", unit="conv")
    with open(path, "a", encoding="utf-8") as out:
        def write(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()
            progress.update(1)

        exhausted = False
        while True:
            # Keep a batch worth of prompts waiting so finished slots refill at once.
            while not exhausted and engine.num_waiting < batch_size:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                index, ids = item
                if ids is None:
                    write({"record": index, "skipped": "no user turn or prompt too long"})
                    continue
                seq = engine.add_request(GenerateRequest(tuple(ids), max_tokens),
                                         request_id=f"r{index}")
                by_request[seq.request_id] = index
            if not engine.has_work():
                break
            for seq in engine.step().finished:
                write({"record": by_request.pop(seq.request_id),
                       "prompt_ids": list(seq.prompt_ids),
                       "output_ids": seq.output_ids, "finish_reason": seq.finish_reason})
                added += 1
                num_tokens += len(seq.output_ids)
                elapsed = time.perf_counter() - began
                progress.set_postfix(tok_s=f"{num_tokens / elapsed:.0f}")
    progress.close()
    return added


def build(directory: Path, num_conversations: int, sharegpt_records: int = 0,
          model: str | None = None) -> Path:
    """Builds `<dir>/datastore-<N>` from the first N answered conversations of the file.

    With `sharegpt_records` = M > 0 the datastore also holds ShareGPT records [0, M) as they
    are (the human and ChatGPT turns, chat template applied): `<dir>/datastore-<N>+sharegpt<M>`,
    the warm start an operator gets from an offline corpus plus the model's own answers. The
    answers are shards of origin "model" and ShareGPT of origin "corpus", so the drafter weights
    the answers (docs/algorithm.md, "Shard weights").
    """
    documents = []
    for record in read_outputs(directory / "outputs.jsonl"):
        if "output_ids" in record:
            documents.append(record["prompt_ids"] + record["output_ids"])
        if len(documents) == num_conversations:
            break
    if len(documents) < num_conversations:
        raise SystemExit(f"only {len(documents)} conversations in {directory}/outputs.jsonl; "
                         f"run `sssd-self-outputs generate` first or ask for fewer")
    name = f"datastore-{num_conversations}"
    if sharegpt_records:
        name += f"+sharegpt{sharegpt_records}"
    target = directory / name
    manifest = read_manifest(target) if target.is_dir() else None
    if manifest is not None and manifest.shards:
        logger.info("%s already built", target)
        return target
    tokenizer = load_tokenizer(model)
    facts = (vocab_size(tokenizer), tokenizer_fingerprint(tokenizer))
    check_model(directory, facts[1], model)
    num_answer_tokens = sum(len(d) for d in documents)
    if sharegpt_records:
        records = tqdm(iter_sharegpt(0, sharegpt_records), total=sharegpt_records,
                       desc="tokenizing ShareGPT", unit="conv")
        build_datastore(target, iter_conversation_token_ids(tokenizer, records), *facts)
    build_datastore(target, documents, *facts, append=bool(sharegpt_records), origin="model")
    logger.info("built %s from %d answered conversations (%d tokens)%s", target, len(documents),
                num_answer_tokens, f" and ShareGPT records [0, {sharegpt_records})"
                if sharegpt_records else "")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sssd-self-outputs", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"where outputs.jsonl and datastores live (default {DEFAULT_DIR}, "
                        f"{DEFAULT_DIR}/<model> with --model)")
    parser.add_argument("--model", default=None,
                        help="a name of `sssd-models list`, a GGUF file or a model directory "
                        "(default: SmolLM2-135M-Instruct)")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="answer ShareGPT prompts (resumable)")
    gen.add_argument("--start", type=int, default=0, help="first ShareGPT record (default 0)")
    gen.add_argument("--stop", type=int, default=12000, help="one past the last (default 12000)")
    gen.add_argument("--max-tokens", type=int, default=256, help="answer length cap (256)")
    gen.add_argument("--batch-size", type=int, default=32, help="running sequences (32)")
    gen.add_argument("--max-prompt-tokens", type=int, default=512,
                     help="longer prompts are skipped (512)")
    gen.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    bld = commands.add_parser("build", help="build a datastore from the first N conversations")
    bld.add_argument("--conversations", type=int, required=True, help="N")
    bld.add_argument("--with-sharegpt", type=int, default=0, metavar="M",
                     help="also index ShareGPT records [0, M) as they are (default 0: no)")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    if args.dir is None:
        args.dir = Path(DEFAULT_DIR) if args.model is None else \
            Path(DEFAULT_DIR) / Path(args.model).name.removesuffix(".gguf")
    if args.command == "generate":
        if not 0 <= args.start < args.stop:
            parser.error("need 0 <= --start < --stop")

        try:
            added = generate(args.dir, load_causal_lm(args.model, args.dtype), args.start,
                             args.stop, args.max_tokens, args.batch_size, args.max_prompt_tokens)
        except KeyboardInterrupt:  # every finished answer is already on disk
            raise SystemExit("\nstopped; run the same command again to resume") from None
        print(json.dumps({"added": added, "file": str(args.dir / "outputs.jsonl")}))
    else:
        path = build(args.dir, args.conversations, args.with_sharegpt, args.model)
        print(json.dumps({"datastore": str(path)}))


if __name__ == "__main__":
    main()

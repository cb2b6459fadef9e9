"""The main job's check of a running server: what speculation does, measured, and whether it
changed a token.

1. The check prompt is answered with speculation, streamed; then the first steps are shown
   (budget, draft tokens accepted), so one sees speculation at work from the first step.
2. The same prompt is asked `rounds` times with speculation off and `rounds` times with it on,
   alternating, one request at a time; the speedup is the ratio of the median tokens per second.
3. Exactness. The server's bfloat16 outputs of two batch or tree shapes may differ where two
   logits are within rounding of each other, so the on/off answers are compared and the first
   difference, if any, is named. An exact check follows: the same model in float32, in this
   process, answers with drafts from the server's drafter service and without any, and the two
   must be identical token for token (float32 rounding also varies with the shape, but by
   about 1e-5 of a logit, which in every test so far never flipped an argmax).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from sssd.client import GenerationClient
from sssd.common.data.corpus import prompt_token_ids

FIRST_STEPS = 6  # steps shown after the streamed answer


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    tokens_per_second: float
    steps: list[tuple[int, int]]  # (budget, accepted draft tokens) per verification step


def ask(client, prompt: str, max_tokens: int, speculation: str, echo: bool = False) -> Answer:
    token_ids, steps, totals = [], [], None
    for chunk in client.stream(prompt, max_tokens=max_tokens, speculation=speculation):
        if echo:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        token_ids += chunk.token_ids
        if chunk.budget is not None:
            steps.append((chunk.budget, chunk.accepted_tokens))
        totals = chunk.totals or totals
    return Answer(token_ids, totals.tokens_per_second if totals else 0.0, steps)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two differ (a length difference counts), or None."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def run_check(target: str, prompt: str, max_tokens: int, rounds: int,
              drafting: tuple[str | None, str | None] | None, model: str | None) -> None:
    """`drafting`: (drafter service target, or None and the datastore an in-process drafter
    loads) for the float32 exactness check; None: no exactness check."""
    print(f"\n>>> {prompt}\n", flush=True)
    with GenerationClient(target) as client:
        first = ask(client, prompt, max_tokens, "auto", echo=True)
        steps = first.steps
        per_step = (len(first.token_ids) - 1) / len(steps) if steps else 0.0
        shown = ", ".join(f"budget {b}: {a} accepted" for b, a in steps[:FIRST_STEPS])
        print(f"\n\n[speculation: {len(first.token_ids)} tokens in {len(steps)} verification "
              f"steps, {per_step:.2f} tokens per step; first steps: {shown}]", flush=True)
        if steps and max(b for b, _ in steps) <= 1:
            print("[the measured budget policy ran this answer without drafts: on this machine "
                  "its profile (var/profiles/forward.json) prices a draft tree above the tokens "
                  "it is expected to add. Multi-row bfloat16 matmuls are slow on CPUs without "
                  "AVX512-BF16 or AMX; --dtype float32 or a GPU changes that]",
                  flush=True)
        on, off = [], []
        for _ in range(rounds):
            off.append(ask(client, prompt, max_tokens, "off"))
            on.append(ask(client, prompt, max_tokens, "auto"))
    on_rate = statistics.median(a.tokens_per_second for a in on)
    off_rate = statistics.median(a.tokens_per_second for a in off)
    if off_rate > 0:
        print(f"[speedup {on_rate / off_rate:.2f}x: median {on_rate:.1f} tokens/s with "
              f"speculation against {off_rate:.1f} without, {rounds} answers each to this prompt, "
              "alternating, one request at a time (the first, streamed answer not counted)]",
              flush=True)
    difference = first_difference(on[0].token_ids, off[0].token_ids)
    if difference is None:
        print(f"[outputs with and without speculation: identical, "
              f"{len(on[0].token_ids)} tokens]", flush=True)
    else:
        print(f"[outputs with and without speculation: first differ at token {difference} of "
              f"{len(off[0].token_ids)}: the server computes in bfloat16, whose rounding "
              "depends on the batch and tree shape and can flip a near-tie]", flush=True)
    if drafting is not None:
        exact_check(prompt, max_tokens, *drafting, model)


def exact_check(prompt: str, max_tokens: int, drafter_target: str | None,
                datastore_dir: str | None, model: str | None) -> None:
    """float32 in this process: drafts from the drafter service (or, without one, from the
    datastore in this process) against none, token for token."""
    # Here only: the rest of `sssd up`'s process never loads torch.
    from sssd.common.model.loader import load_causal_lm
    from sssd.verifier.engine import EngineConfig
    from sssd.verifier.factory import build_engine

    loaded = load_causal_lm(model, "float32")
    prompt_ids = prompt_token_ids(loaded.tokenizer, prompt)
    base = dict(dtype="float32", max_batch_size=1, max_len=len(prompt_ids) + max_tokens + 64,
                budget_policy="rule", drafter_target=drafter_target, datastore_dir=datastore_dir,
                drafter_timeout_s=5.0)
    outputs, engines = [], []
    for mode in ("sssd", "ar"):
        engine = build_engine(EngineConfig(mode=mode, model=model, **base), loaded)
        (output,) = engine.generate([prompt_ids], max_tokens)
        engine.close()
        outputs.append(output)
        engines.append(engine)
    accepted = engines[0].stats.num_accepted
    verdict = "identical" if outputs[0] == outputs[1] else \
        f"DIFFERENT from token {first_difference(outputs[0], outputs[1])}"
    source = "the drafter service" if drafter_target else "the datastore"
    print(f"[exact check, float32 in this process: with {accepted} draft tokens accepted from "
          f"{source}, the answer is {verdict} to plain greedy decoding ({len(outputs[1])} "
          "tokens)]", flush=True)

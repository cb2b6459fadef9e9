"""The baseline check: the engine's autoregressive mode against transformers' own generate().

Both decode the same MT-Bench prompts greedily, one prompt at a time (batch size 1), taking
turns prompt by prompt so that both see the same machine. Per prompt the ratio of tokens per
second (engine / generate) is recorded; the JSON line reports the median ratio, both medians of
tokens per second, and whether the outputs were identical.

    python bench/ar_vs_hf.py --prompts 20 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench import flags
from sssd.common.data.corpus import first_turns, prompt_token_ids, read_mt_bench
from sssd.common.model.loader import load_causal_lm
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.factory import build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    flags.add_prompts(parser, 20)
    flags.add_max_tokens(parser, 128)
    flags.add_dtype(parser)
    args = parser.parse_args()
    loaded = load_causal_lm(None, args.dtype)
    prompts = [prompt_token_ids(loaded.tokenizer, text)
               for text in first_turns(read_mt_bench())[: args.prompts]]
    engine = build_engine(EngineConfig(mode="ar", dtype=args.dtype, max_batch_size=1,
                                       max_len=max(map(len, prompts)) + args.max_tokens + 8),
                          loaded)
    model = loaded.model

    def hf(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=args.max_tokens)
        return out[0, len(prompt):].tolist()

    def ours(prompt: list[int]) -> list[int]:
        return engine.generate([prompt], args.max_tokens)[0]

    hf(prompts[0][:16]), ours(prompts[0][:16])  # warm-up
    rates: dict[str, list[float]] = {"hf": [], "engine": []}
    same = 0
    for prompt in prompts:
        outputs = {}
        for name, run in (("hf", hf), ("engine", ours)):
            start = time.perf_counter()
            outputs[name] = run(prompt)
            rates[name].append(len(outputs[name]) / (time.perf_counter() - start))
        same += outputs["hf"] == outputs["engine"]
    ratios = [e / h for e, h in zip(rates["engine"], rates["hf"])]
    print(json.dumps({
        "dtype": args.dtype, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "engine_over_generate_median": statistics.median(ratios),
        "engine_tok_s_median": statistics.median(rates["engine"]),
        "generate_tok_s_median": statistics.median(rates["hf"]),
        "identical_outputs": same,
    }))


if __name__ == "__main__":
    main()

"""Where a plain decode step's time goes at a long context: SmolLM2 in bfloat16, one sequence
of N random prompt tokens (argv[1]), 40 steps timed, then 40 under cProfile (the attention
kernel's calls are `_attend_fused`). Run from the repository root with .venv/bin/python."""
import cProfile
import json
import pstats
import random
import sys
import time

from sssd.common.model.loader import load_causal_lm
from sssd.verifier.engine import EngineConfig
from sssd.verifier.engine.request import GenerateRequest
from sssd.verifier.factory import build_engine

length = int(sys.argv[1])
engine = build_engine(EngineConfig(mode="ar", dtype="bfloat16"), load_causal_lm(None, "bfloat16"))
rng = random.Random(0)
seq = engine.add_request(GenerateRequest(tuple(rng.randrange(100, 30000) for _ in range(length)),
                                         200, ignore_eos=True))
while not seq.output_ids:
    engine.step()
for _ in range(10):
    engine.step()
start = time.perf_counter()
for _ in range(40):
    engine.step()
step_ms = (time.perf_counter() - start) / 40 * 1000
profile = cProfile.Profile()
profile.enable()
for _ in range(40):
    engine.step()
profile.disable()
stats = pstats.Stats(profile).stats
attention = sum(v[2] for k, v in stats.items() if k[2] == "_attend_fused") / 40 * 1000
linear = sum(v[2] for k, v in stats.items() if k[2] == "__call__" and k[0].endswith("linear.py"))
print(json.dumps({"context": length, "step_ms": step_ms, "attention_ms": attention,
                  "linear_ms": linear / 40 * 1000}))

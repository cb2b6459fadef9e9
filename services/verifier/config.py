"""Configuration of the verifier engine: one frozen object, built once at the entry point."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("ar", "prompt_lookup", "sssd")
BUDGET_POLICIES = ("rule", "measured")
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    # None: the default model (SmolLM2-135M-Instruct GGUF); else a .gguf path or a HF directory.
    model: str | None = None
    dtype: str = "bfloat16"  # measured 1.5-2x faster than float32 on these CPUs
    # ar: no speculation (the baseline); prompt_lookup: input trie only; sssd: trie + datastore.
    mode: str = "sssd"
    max_batch_size: int = 8  # running sequences (KV-cache slots)
    max_len: int = 4096  # cache positions per sequence: prompt + output + one draft tree
    # rule: s_q = knee_intensity / b (seeds/000 Section 3.2); measured: maximize expected
    # accepted tokens per second from a profile of the forward pass (DESIGN.md section 6).
    budget_policy: str = "rule"
    # I_knee for the rule in tokens: where the forward pass stops being flat in b * s_q. The
    # SmolLM2-135M profile on a 2-core CPU (DESIGN.md section 6) is near-flat up to about 16.
    knee_intensity: float = 16.0
    max_budget: int = 32  # draft-tree nodes per sequence, root included
    # Drafter: None runs the SSSD core in process; "host:port" uses the gRPC drafter service.
    drafter_target: str | None = None
    drafter_timeout_s: float = 0.5  # past this a step decodes without speculation
    datastore_dir: str | None = None  # in-process drafter's datastore (mode sssd)
    profile_path: str | None = None  # saved forward-pass profile for the measured policy

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}"),
            (self.budget_policy in BUDGET_POLICIES,
             f"budget_policy must be one of {BUDGET_POLICIES}, got {self.budget_policy!r}"),
            (1 <= self.max_batch_size <= 1024, "max_batch_size must be in [1, 1024]"),
            (self.max_len >= 16, "max_len must be >= 16"),
            (self.knee_intensity > 0, "knee_intensity must be > 0"),
            (1 <= self.max_budget <= 256, "max_budget must be in [1, 256]"),
            (self.drafter_timeout_s > 0, "drafter_timeout_s must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

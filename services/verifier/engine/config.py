"""Configuration of the verifier engine: one frozen object, built once at the entry point."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sssd.common.config.flags import option
from sssd.common.model.device import DEVICE_HELP, check_device
from sssd.common.model.impls import MODEL_IMPLS
from sssd.common.rpc.targets import parse_targets

# ar: no speculation (the baseline); prompt_lookup: input trie only; sssd: trie + datastore;
# ssd: the speculator service's draft model, SSSD for its fallback.
# sssd.verifier.proposers maps each mode to the proposer that drafts for it.
MODES = ("ar", "prompt_lookup", "sssd", "ssd")
BUDGET_POLICIES = ("rule", "measured")
DTYPES = ("bfloat16", "float32")
ATTENTIONS = ("sdpa", "eager")
# Where the measured policy keeps its profile and, beside it, its acceptance statistics, so that
# both persist across starts (relative to the working directory of the process that builds the
# configuration: made absolute there, so that Ray workers elsewhere find the same files).
SERVING_PROFILE_PATH = "var/profiles/forward.json"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None, "a .gguf file or Hugging Face model directory; unset: the default model "
        "(SmolLM2-135M-Instruct)")
    dtype: str = option("bfloat16", "weights and KV cache; bfloat16 halves the memory "
                        "traffic of a decode step, float32 breaks argmax ties exactly (and on "
                        "CPUs without bf16 instructions verifies draft trees far cheaper)",
                        choices=DTYPES)
    device: str = option(
        "auto", f"where the model, its KV cache and the step's tensors live: {DEVICE_HELP}. "
        "On a GPU the verifier's own forward pass runs as PyTorch operations (its fused CPU "
        "kernels and prepacked weights are CPU-only); under Ray each worker uses the GPU Ray "
        "gave it")
    model_impl: str = option(
        "auto", "the forward pass; sssd: the verifier's own (Llama and Qwen2 models: fused "
        "projections, prepacked weights, its own attention kernel; several times faster per "
        "step on a CPU, and bfloat16 answers that do not depend on the batch); transformers: the "
        "transformers model's forward over the same cache (every architecture; the tests' "
        "reference); auto: sssd where the architecture is implemented, else transformers, with "
        "a log line saying why", choices=MODEL_IMPLS)
    attention: str = option(
        "sdpa", "attention kernel of the transformers forward (model_impl transformers); sdpa: "
        "PyTorch's fused kernel (fastest); eager: slower (about 1.1-1.5x per step on a 2-core "
        "CPU), but a row's result no longer depends on the number of rows beside it, so "
        "bfloat16 plain decoding gives the same answer at every batch size on CPUs whose bf16 "
        "matmul allows it (bench/batch_invariance.py). The sssd forward is batch-invariant by "
        "construction",
        choices=ATTENTIONS)
    mode: str = option("sssd", "ar: no speculation; prompt_lookup: input trie only; sssd: "
                       "input trie + datastore; ssd: the speculator service (--speculator), "
                       "with SSSD drafting its misses above the critical batch size",
                       choices=MODES)
    max_batch_size: int = option(64, "the most sequences running at once (each holds KV "
                                 "blocks while it runs: memory bounds them too)")
    max_len: int | None = option(
        None, "a sequence's context window, prompt and output; unset: the model's whole window "
        "(max_position_embeddings), as far as the KV cache holds it")
    kv_cache_memory: str = option(
        "auto", "memory of the paged KV cache: bytes (4GiB, 512MiB, 2e9) or a fraction of the "
        "memory available now (0.25); auto: max_batch_size windows of max_len, at most a "
        "quarter of the memory available")
    kv_block_size: int = option(16, "positions a KV-cache block holds (a multiple of 16, at "
                                "most 128): the unit of allocation and of prefix caching")
    max_num_batched_tokens: int = option(
        512, "prompt tokens a step prefills at most (chunked prefill): a long prompt is "
        "prefilled in chunks between the running sequences' decode steps")
    enable_prefix_caching: bool = option(
        True, "reuse the KV cache of full blocks across requests (a shared system prompt, the "
        "earlier turns of a conversation); the output is the same with or without a hit")
    budget_policy: str = option(
        "measured", "measured: maximize expected accepted tokens per second from a profile of "
        "the forward pass, learned online; rule: s_q = knee_intensity / b (the SSSD paper, "
        "Section 3.2)", choices=BUDGET_POLICIES)
    knee_intensity: float = option(
        16.0, "I_knee of the rule, in tokens: where the forward pass stops being flat in "
        "b * s_q (SmolLM2-135M on 2 CPU cores: about 16)")
    max_budget: int = option(32, "largest draft tree per sequence, root included")
    drafter_target: str | None = option(
        None, "the drafter service: host:port, or several replicas with sticky routing "
        "(h1:p1,h2:p2,... or dns:///NAME:PORT, e.g. a headless Service); unset: the SSSD core "
        "runs in this process", aliases=("--drafter",))
    drafter_timeout_s: float = option(0.5, "past this a step decodes without speculation")
    speculator_target: str | None = option(
        None, "host:port of the speculator service (mode ssd)", aliases=("--speculator",))
    speculator_timeout_s: float = option(
        2.0, "past this a step decodes without the speculator (its first round of a sequence "
        "writes the prompt into the draft model's cache)")
    datastore_dir: str | None = option(
        None, "datastore of the in-process drafter (mode sssd)", aliases=("--datastore",))
    profile_path: str | None = option(
        SERVING_PROFILE_PATH, "saved forward-pass profile of the measured policy (made when "
        "missing); its acceptance statistics are kept beside it and are the next start's "
        "prior; empty: profile at every start, keep nothing")
    step_trace: str | None = option(
        None, "append one JSON line per engine step to this file: batch size, each row's budget "
        "and accepted drafts, seconds drafting, verifying and prefilling (what speculation did "
        "when it did not pay); a Ray decode worker writes FILE.<worker>")
    reuse_acceptance: bool = option(
        True, "start the measured policy from the acceptance statistics saved beside the "
        "profile (else from the built-in prior)")

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}"),
            (self.model_impl in MODEL_IMPLS,
             f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}"),
            (self.attention in ATTENTIONS,
             f"attention must be one of {ATTENTIONS}, got {self.attention!r}"),
            (self.budget_policy in BUDGET_POLICIES,
             f"budget_policy must be one of {BUDGET_POLICIES}, got {self.budget_policy!r}"),
            (1 <= self.max_batch_size <= 1024, "max_batch_size must be in [1, 1024]"),
            (self.max_len is None or self.max_len >= 16, "max_len must be >= 16"),
            (16 <= self.kv_block_size <= 128 and self.kv_block_size % 16 == 0,
             f"kv_block_size must be a multiple of 16 in [16, 128], got {self.kv_block_size}"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.knee_intensity > 0, "knee_intensity must be > 0"),
            (1 <= self.max_budget <= 256, "max_budget must be in [1, 256]"),
            (self.drafter_timeout_s > 0, "drafter_timeout_s must be > 0"),
            (self.speculator_timeout_s > 0, "speculator_timeout_s must be > 0"),
            (self.mode != "ssd" or self.speculator_target is not None,
             "mode ssd needs the speculator service: --speculator HOST:PORT"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_device(self.device)  # ValueError naming the settings allowed
        parse_memory(self.kv_cache_memory)  # ValueError naming the forms allowed
        if self.drafter_target is not None:
            parse_targets(self.drafter_target)  # ValueError naming the malformed part
        if self.profile_path:
            object.__setattr__(self, "profile_path", str(Path(self.profile_path).absolute()))


def parse_memory(text: str) -> float | int | None:
    """kv_cache_memory's value: None for auto, a fraction (0 < f <= 1) of the memory available,
    or bytes (an int). Raises ValueError naming the forms allowed."""
    value = text.strip()
    if value.lower() == "auto":
        return None
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3,
             "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    lowered = value.lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            number, multiplier = lowered[:-len(suffix)].strip(), scale
            break
    else:
        number, multiplier = lowered, None
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"kv_cache_memory must be auto, bytes (4GiB, 512MiB, 2e9) or a "
                         f"fraction of the memory available (0.25), got {text!r}") from None
    if multiplier is None and 0 < amount <= 1:
        return amount
    if multiplier is None:
        multiplier = 1
    if amount * multiplier < 1 << 20:
        raise ValueError(f"kv_cache_memory of {text!r} is under 1 MiB")
    return int(amount * multiplier)

"""Configuration of the speculator service: one frozen object, built once at the entry point."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sssd.common.config.flags import add_flags, from_args, option
from sssd.common.model.device import DEVICE_HELP, check_device
from sssd.common.model.impls import MODEL_IMPLS
from sssd.common.model.loader import ALLOWED_DTYPES as DTYPES
from sssd.common.rpc.ports import SPECULATOR_METRICS_PORT, SPECULATOR_PORT
from sssd.common.rpc.tls import add_tls_flags, tls_from_args
from sssd.speculator.fanout import FANOUTS

ENV_PREFIX = "SSSD_SPECULATOR_"


@dataclass(frozen=True)
class SpeculatorConfig:
    """Everything the speculator reads; invalid values raise ValueError here."""

    model: str | None = option(
        None, "draft model: a .gguf file or Hugging Face model directory with the target's "
        "tokenizer; unset: the default model (SmolLM2-135M-Instruct)")
    draft_layers: int = option(
        0, "keep only the first N decoder layers of the draft model (and its head): a cheap "
        "draft built from the target itself; 0 keeps all")
    dtype: str = option("bfloat16", "weights and KV cache of the draft model", choices=DTYPES)
    device: str = option("cpu", f"torch device of the draft model: {DEVICE_HELP}")
    model_impl: str = option(
        "auto", "the draft model's forward pass, as the verifier's: sssd, the project's own "
        "(Llama and Qwen2 models; on a CPU several times faster for a step of several nodes); "
        "transformers, the transformers model's forward; auto: sssd where the architecture is "
        "implemented", choices=MODEL_IMPLS)
    num_threads: int = option(1, "torch threads of the draft model on the CPU (0: torch's "
                              "default); keep the verifier's cores free")
    lookahead: int = option(3, "K: drafts per round (the write-up's K = 2-3 for small models)")
    fanout_budget: int = option(
        12, "B: predicted verification outcomes per sequence and round, split over k = 0..K")
    fanout: str = option("geometric", "split of the fan-out budget over outcomes: geometric "
                         "(Theorem 12, a and r estimated online) or uniform", choices=FANOUTS)
    saguaro_c: float = option(
        1.0, "Saguaro sampling constant C in (0, 1]: drafts at temperature > 0 are sampled "
        "with the top-F tokens' probability scaled by C (1: plain draft sampling)")
    speculate_ahead: bool = option(
        True, "draft ahead for the predicted outcomes while the verifier verifies (SSD); off: "
        "every round drafts just in time, which is ordinary speculative decoding with the same "
        "draft model (the benchmark's baseline)")
    critical_batch_size: int = option(
        -1, "b*: at most this many sequences in a round draft a miss just in time with the "
        "draft model; above it a miss falls back to the caller's SSSD drafter. -1: chosen "
        "from measured costs")
    max_batch_size: int = option(64, "sequences per Round call")
    max_sequences: int = option(64, "live sequences (KV-cache slots of the draft model)")
    max_len: int = option(4096, "positions per sequence in the draft model's KV cache")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(SPECULATOR_PORT, "gRPC port (0: any free port)")
    metrics_port: int = option(SPECULATOR_METRICS_PORT, "Prometheus endpoint on 127.0.0.1 "
                               "(cache hit rate, misses by kind, acceptance, fan-out, draft "
                               "latency); 0: off")
    max_workers: int = option(4, "gRPC handler threads")
    grace_s: float = option(5.0, "drain time for in-flight calls at shutdown")

    def __post_init__(self) -> None:
        check_device(self.device)
        checks = [
            (self.draft_layers >= 0, "draft_layers must be >= 0"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.model_impl in MODEL_IMPLS,
             f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}"),
            (self.num_threads >= 0, "num_threads must be >= 0"),
            (1 <= self.lookahead <= 16, "lookahead must be in [1, 16]"),
            (self.fanout in FANOUTS, f"fanout must be one of {FANOUTS}, got {self.fanout!r}"),
            (self.lookahead + 1 <= self.fanout_budget <= 256,
             f"fanout_budget must be in [lookahead + 1 = {self.lookahead + 1}, 256] (every "
             "outcome gets one prediction)"),
            (0 < self.saguaro_c <= 1, "saguaro_c must be in (0, 1]"),
            (self.critical_batch_size >= -1, "critical_batch_size must be >= -1"),
            (1 <= self.max_batch_size <= 1024, "max_batch_size must be in [1, 1024]"),
            (1 <= self.max_sequences <= 1024, "max_sequences must be in [1, 1024]"),
            (self.max_len >= 64, "max_len must be >= 64"),
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (0 <= self.metrics_port <= 65535, "metrics_port must be in [0, 65535]"),
            (self.max_workers >= 1, "max_workers must be >= 1"),
            (self.grace_s >= 0, "grace_s must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "SpeculatorConfig":
        """Flags override SSSD_SPECULATOR_* environment variables, which override defaults."""
        parser = argparse.ArgumentParser(
            prog="sssd-speculator",
            description="SSD / Saguaro speculator: a draft model that drafts ahead for the "
                        "likely verification outcomes while the target verifies (gRPC).")
        add_flags(parser, cls, env_prefix=ENV_PREFIX)
        add_tls_flags(parser)
        args = parser.parse_args(argv)
        try:
            tls_from_args(args)  # the server binds with it (sssd.common.rpc.tls)
            return from_args(cls, args)
        except ValueError as exc:
            parser.error(str(exc))

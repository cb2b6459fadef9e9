"""Builds an engine from its configuration: model, KV cache, budget policy and proposer."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from sssd.common.draft_tree import DraftTree
from sssd.common.model_loader import LoadedModel, load_causal_lm
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import Drafter
from sssd.verifier.budget_policy import (
    DEFAULT_BUDGETS,
    BudgetPolicy,
    FixedBudget,
    ForwardProfile,
    MeasuredBudget,
    RuleBudget,
)
from sssd.verifier.config import EngineConfig
from sssd.verifier.engine import Engine
from sssd.verifier.model_runner import ModelRunner

if TYPE_CHECKING:
    from sssd.indexer.sink import PublishConfig
    from sssd.verifier.loop import EngineLoop

logger = logging.getLogger(__name__)

PROFILE_CONTEXT = 256  # cached tokens per sequence while profiling the forward pass


def profile_forward(runner: ModelRunner, max_batch_size: int) -> ForwardProfile:
    """Times verification forwards of b sequences x s_q nodes on this model and device."""
    context = max(1, min(PROFILE_CONTEXT, runner.max_len - max(DEFAULT_BUDGETS) - 1))
    prompt = list(range(100, 100 + context))
    for slot in range(max_batch_size):
        runner.prefill(slot, prompt)

    def forward(batch_size: int, budget: int) -> float:
        tree = DraftTree(np.arange(200, 200 + budget, dtype=np.int32),
                         np.arange(-1, budget - 1, dtype=np.int32))
        start = time.perf_counter()
        runner.verify([tree] * batch_size)  # nothing is committed: the cache stays as it was
        return time.perf_counter() - start

    batches = profiled_batches(max_batch_size)
    return ForwardProfile.measure(forward, batches=batches)


def profiled_batches(max_batch_size: int) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch_size]


def make_budget_policy(config: EngineConfig, runner: ModelRunner) -> BudgetPolicy:
    if config.mode == "ar":
        return FixedBudget(1)
    if config.budget_policy == "rule":
        return RuleBudget(config.knee_intensity, config.max_budget)
    if config.profile_path:
        try:
            profile = ForwardProfile.load(config.profile_path)
        except FileNotFoundError:
            profile = None
        # A profile made with fewer KV slots lacks the larger batches: measure again.
        if profile is not None and \
                set(profiled_batches(config.max_batch_size)) <= set(profile.batches):
            logger.info("loaded forward profile %s", config.profile_path)
            return MeasuredBudget(profile, config.max_budget)
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        logger.warning("profiling the forward pass on a busy machine (load %.1f on %d cores): "
                       "its times, and so the budgets chosen, will be off", load, cores)
    start = time.perf_counter()
    profile = profile_forward(runner, config.max_batch_size)
    logger.info("profiled the forward pass in %.1f s", time.perf_counter() - start)
    if config.profile_path:
        profile.save(config.profile_path)
    return MeasuredBudget(profile, config.max_budget)


def make_proposer(config: EngineConfig, loaded: LoadedModel) -> object | None:
    if config.mode == "ar":
        return None
    if config.drafter_target is not None:
        from sssd.drafter.client import RemoteDrafter  # grpc only when a remote drafter is used

        return RemoteDrafter(config.drafter_target, timeout_s=config.drafter_timeout_s)
    datastore_dir = config.datastore_dir if config.mode == "sssd" else None
    drafter = Drafter(DrafterConfig(datastore_dir=datastore_dir, vocab_size=loaded.vocab_size,
                                    tokenizer_fingerprint=loaded.fingerprint))
    drafter.start()
    return drafter


def build_engine_loop(config: EngineConfig, loaded: LoadedModel, max_requests: int,
                      publish: "PublishConfig | None" = None, worker: str = "local",
                      ray_metrics: bool = False) -> "EngineLoop":
    """An engine and its serving loop, started. `publish`: completed conversations go to the
    live datastore's stream; `ray_metrics`: the loop reports through ray.util.metrics (inside
    a Ray worker). `EngineLoop.close` releases all of it."""
    from sssd.verifier.loop import EngineLoop, LoopObserver, Observers

    observers: list[LoopObserver] = []
    publisher = None
    if publish is not None:
        from sssd.indexer.sink import ConversationSink

        sink = ConversationSink(publish, loaded.fingerprint, worker=worker)
        publisher = sink.publisher
        observers.append(sink)
    if ray_metrics:
        from sssd.verifier.metrics import DecodeMetrics

        observers.append(DecodeMetrics(worker, publisher=publisher))
    tokenizer = loaded.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return EngineLoop(build_engine(config, loaded), decode, max_requests,
                      Observers(*observers)).start()


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> Engine:
    loaded = loaded or load_causal_lm(config.model, config.dtype)
    runner = ModelRunner(loaded.model, max_seqs=config.max_batch_size, max_len=config.max_len)
    return Engine(
        runner,
        eos_token_ids=loaded.eos_token_ids,
        budget_policy=make_budget_policy(config, runner),
        proposer=make_proposer(config, loaded),
        decode=loaded.tokenizer.decode,
        max_batch_size=config.max_batch_size,
    )

"""Builds an engine from its configuration: model, KV cache, budget policy and proposer."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

from sssd import _kernels
from sssd.common.model.device import processor_name, resolve_device
from sssd.common.model.loader import LoadedModel, load_causal_lm
from sssd.common.model.tree_batch import MAX_TREE_BITS_NODES
from sssd.verifier.engine.acceptance_estimates import DEFAULT_ACCEPTANCE_PRIOR, load_acceptance
from sssd.verifier.engine.budget_policy import BudgetPolicy, FixedBudget, MeasuredBudget, RuleBudget
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.engine.engine import Engine
from sssd.verifier.engine.forward_profile import ForwardProfile, profile_forward, profiled_batches
from sssd.verifier.engine.machine_probe import machine_load
from sssd.verifier.engine.model_runner import ModelRunner
from sssd.verifier.proposers import make_proposer

logger = logging.getLogger(__name__)


def acceptance_path(profile_path: str, mode: str) -> str:
    """Where the measured policy keeps its acceptance statistics: beside the profile, one file
    per drafting mode (what is accepted depends on who drafts)."""
    return f"{Path(profile_path).with_suffix('')}.{mode}.acceptance.json"


@functools.lru_cache(maxsize=1)
def kernels_build() -> str:
    """A fingerprint of the compiled kernels module: a rebuilt one (another pass structure, other
    compiler flags) may time differently, so a profile measured with another build is stale."""
    return hashlib.sha256(Path(_kernels.__file__).read_bytes()).hexdigest()[:16]


def make_budget_policy(config: EngineConfig, runner: ModelRunner,
                       speculates: bool = True, model_name: str = "") -> BudgetPolicy:
    """`speculates`: False for an engine without a proposer, which always decodes one token.

    The measured policy's profile is reused from `profile_path` when it was measured with the
    same model, dtype, forward pass (runner.impl), matrix products (runner.products), device
    type, processor (its name), kernels build and torch threads and covers the batch sizes; its
    prior is the acceptance saved beside it by an earlier server
    (serving.observers.AcceptanceSaver), else the built-in one."""
    if not speculates:
        return FixedBudget(1)
    if config.budget_policy == "rule":
        return RuleBudget(config.knee_intensity, config.max_budget)

    # A GPU's index does not change its speed: the profile is the device model's (its name).
    setting = {"model": model_name, "dtype": config.dtype, "model_impl": runner.impl,
               "products": runner.products, "device": runner.device.type,
               "processor": processor_name(runner.device), "kernels": kernels_build(),
               "torch_threads": torch.get_num_threads()}
    prior = DEFAULT_ACCEPTANCE_PRIOR
    load = None  # machine_load(), once it was measured
    if config.profile_path:
        stats_path = acceptance_path(config.profile_path, config.mode)
        saved = load_acceptance(stats_path) if config.reuse_acceptance else None
        if saved is not None:
            logger.info("acceptance prior from %s", stats_path)
            prior = saved
        profile = ForwardProfile.load(config.profile_path, setting)
        if profile is not None and profile.busy:
            load = machine_load()
            if not load[2]:
                # Its times are a busy machine's, too slow and unevenly so; the policy corrects
                # them online, but a quiet start can have the right ones at once.
                logger.info("forward profile %s was measured on a busy machine: measuring "
                            "again now that it is quiet", config.profile_path)
                profile = None
        # A profile made with fewer KV slots lacks the larger batches: measure again.
        if profile is not None and \
                set(profiled_batches(config.max_batch_size)) <= set(profile.batches):
            logger.info("loaded forward profile %s", config.profile_path)
            return MeasuredBudget(profile, config.max_budget, prior=prior)
    others, cores, busy = load or machine_load()  # measured once: it takes 0.3 s
    if busy:
        logger.warning("profiling the forward pass on a busy machine (other processes keep "
                       "%.1f of %d cores busy): "
                       "its times, and so the budgets chosen, will be off until the steps "
                       "correct them; the next start on a quiet machine measures again", others,
                       cores)
    start = time.perf_counter()
    profile = profile_forward(runner, config.max_batch_size)
    profile.busy = busy
    logger.info("profiled the forward pass in %.1f s", time.perf_counter() - start)
    if config.profile_path:
        Path(config.profile_path).parent.mkdir(parents=True, exist_ok=True)
        profile.save(config.profile_path, setting)
    return MeasuredBudget(profile, config.max_budget, prior=prior)


def check_loaded_device(config: EngineConfig, loaded: LoadedModel) -> None:
    """Raises ValueError when a model loaded elsewhere is not on the configured device (auto
    takes the model where it is: the caller chose)."""
    if config.device == "auto":
        return
    wanted = resolve_device(config.device)
    have = torch.device(loaded.device)
    if wanted.type != have.type or wanted.index not in (None, have.index):
        raise ValueError(f"the model was loaded on {loaded.device}, the engine is configured "
                         f"for {config.device}")


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None,
                 detokenize: bool = False) -> Engine:
    """The engine of `config` (its proposer started). `detokenize`: the engine tracks each
    answer's text (serving: streamed text and stop strings); off, it skips that work."""
    loaded = loaded or load_causal_lm(config.model, config.dtype, config.device)
    check_loaded_device(config, loaded)
    on_gpu = next(loaded.model.parameters()).device.type == "cuda"
    runner = ModelRunner(loaded.model, max_seqs=config.max_batch_size, max_len=config.max_len,
                         attention=config.attention, model_impl=config.model_impl,
                         # every verification at the shape of the largest tree (see ModelRunner)
                         fixed_nodes=min(config.max_budget, MAX_TREE_BITS_NODES) if on_gpu
                         else None)
    tokenizer = loaded.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    proposer = make_proposer(config, loaded)
    return Engine(
        runner,
        eos_token_ids=loaded.eos_token_ids,
        budget_policy=make_budget_policy(config, runner, speculates=proposer is not None,
                                         model_name=loaded.name),
        proposer=proposer,
        detokenize=decode if detokenize else None,
        max_batch_size=config.max_batch_size,
    )

"""Builds an engine from its configuration: model, KV cache, budget policy and proposer."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import psutil
import torch

from sssd import _kernels
from sssd.common.model.device import processor_name, resolve_device
from sssd.common.model.loader import LoadedModel, load_causal_lm
from sssd.common.model.tree_batch import MAX_TREE_BITS_NODES
from sssd.verifier.engine.acceptance_estimates import DEFAULT_ACCEPTANCE_PRIOR, load_acceptance
from sssd.verifier.engine.budget_policy import BudgetPolicy, FixedBudget, MeasuredBudget, RuleBudget
from sssd.verifier.engine.config import EngineConfig, parse_memory
from sssd.verifier.engine.constraint import GrammarCompiler
from sssd.verifier.engine.engine import Engine
from sssd.verifier.engine.forward_profile import ForwardProfile, profile_forward, profiled_batches
from sssd.verifier.engine.machine_probe import cgroup_room, machine_load
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
    runner = build_runner(config, loaded)
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
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        grammars=GrammarCompiler(tokenizer, runner.vocab_size, loaded.eos_token_ids),
    )


# The most slots of the runner's own (its profile's batch sizes; the engine never uses them).
PROFILE_SLOTS = 8


def build_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    """The model runner of `config`: its context window (`context_window`) and its KV cache
    sized by memory (`kv_cache_blocks`)."""
    on_gpu = next(loaded.model.parameters()).device.type == "cuda"
    max_len = context_window(config, loaded.model)
    block_size = config.kv_block_size
    num_blocks = kv_cache_blocks(config, loaded.model, max_len)
    return ModelRunner(loaded.model, max_seqs=min(config.max_batch_size, PROFILE_SLOTS),
                       max_len=max_len,
                       attention=config.attention, model_impl=config.model_impl,
                       # every verification at the shape of the largest tree (see ModelRunner)
                       fixed_nodes=min(config.max_budget, MAX_TREE_BITS_NODES) if on_gpu
                       else None, num_blocks=num_blocks, block_size=block_size)


def context_window(config: EngineConfig, model: torch.nn.Module) -> int:
    """A sequence's window: max_len, else the model's own (max_position_embeddings)."""
    if config.max_len is not None:
        return config.max_len
    return int(getattr(model.config, "max_position_embeddings", None) or 2048)


def kv_cache_blocks(config: EngineConfig, model: torch.nn.Module, max_len: int) -> int:
    """The KV cache's blocks for config.kv_cache_memory (engine/config.py's parse_memory):
    bytes, a fraction of the memory available, or auto (max_batch_size windows, at most a
    quarter of what is available). A cache of less than one window shortens the window (the
    engine's max_len), with a warning."""
    model_config = model.config
    head_dim = getattr(model_config, "head_dim", None) or \
        model_config.hidden_size // model_config.num_attention_heads
    element = next(model.parameters()).element_size()
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * \
        head_dim * element
    block_bytes = per_token * config.kv_block_size
    window_blocks = -(-(max_len + MAX_TREE_BITS_NODES) // config.kv_block_size)
    memory = parse_memory(config.kv_cache_memory)
    available = available_memory(next(model.parameters()).device)
    if memory is None:
        wanted = config.max_batch_size * window_blocks * block_bytes
        memory = min(wanted, int(AUTO_MEMORY_FRACTION * available))
    elif isinstance(memory, float):
        memory = int(memory * available)
    blocks = memory // block_bytes
    if blocks < window_blocks:
        logger.warning("a KV cache of %.2f GB holds %d positions, less than one window of %d: "
                       "sequences end there", memory / 1e9, blocks * config.kv_block_size,
                       max_len)
    return max(blocks, -(-(16 + MAX_TREE_BITS_NODES) // config.kv_block_size))


AUTO_MEMORY_FRACTION = 0.25  # of the memory available: kv_cache_memory auto's most


def available_memory(device: torch.device) -> int:
    """Bytes free for the cache now: the GPU's, or the machine's within the container's limit."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = int(psutil.virtual_memory().available)
    room = cgroup_room()
    return available if room is None else min(available, room)

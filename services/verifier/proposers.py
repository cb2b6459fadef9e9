"""The registry of drafting sources: engine mode -> the `Proposer` that drafts for it.

One table instead of if/elif chains on mode strings. Implementations are imported when built,
so an engine that drafts through a remote service never loads the C++ core, and one that does
not speculate loads neither grpc nor the core. A new source registers here.

Each proposer names its sources by the API's speculation modes ("sssd", "ssd"), so a request
may ask for any source its server has. Only mode ssd has two (the speculator, and the SSSD
drafter that is also its fallback): they go behind a `SourceRouter`, and `auto` picks the
cheapest by measured cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sssd.common.drafting.proposer import Proposer
from sssd.common.drafting.router import SourceRouter
from sssd.common.model.loader import LoadedModel
from sssd.verifier.engine.config import EngineConfig

logger = logging.getLogger(__name__)

# (config, model) -> the proposer, or None to decode without speculation.
ProposerFactory = Callable[[EngineConfig, LoadedModel], Proposer | None]


def _no_proposer(config: EngineConfig, loaded: LoadedModel) -> None:
    return None


def _sssd_drafter(use_datastore: bool) -> ProposerFactory:
    """SSSD drafting: the drafter service at `drafter_target` when set (one replica, or
    several with sticky routing; its datastore is its own), else the C++ core in this process,
    with the configured datastore or (prompt lookup) the input trie alone."""

    def build(config: EngineConfig, loaded: LoadedModel) -> Proposer:
        if config.drafter_target is not None:
            from sssd.drafter.replicas import connect

            remote = connect(config.drafter_target, timeout_s=config.drafter_timeout_s)
            _check_drafter_tokenizer(remote, config.drafter_target, loaded.fingerprint)
            return remote
        from sssd.common.config.flags import env_values
        from sssd.drafter.config import ENV_PREFIX, DrafterConfig, DraftParams
        from sssd.drafter.drafter import LocalDrafter

        datastore_dir = config.datastore_dir if use_datastore else None
        # The algorithm's constants as the drafter service reads them (SSSD_DRAFTER_*), so an
        # engine drafting in process can be tuned as a drafter service can.
        params = DraftParams(**env_values(DraftParams, ENV_PREFIX))
        return LocalDrafter(DrafterConfig(datastore_dir=datastore_dir,
                                          vocab_size=loaded.vocab_size,
                                          tokenizer_fingerprint=loaded.fingerprint,
                                          params=params)).start()

    return build


def _check_drafter_tokenizer(remote: Any, target: str, fingerprint: str) -> None:
    """`check_tokenizer`, except that a drafter that is down now is not waited for: steps
    decode without drafts until it is up, and each tree's token ids are checked against the
    model's vocabulary then."""
    from sssd.drafter.replicas import check_tokenizer

    try:
        check_tokenizer(remote, target, fingerprint)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a drafter that is down must not stop the server
        logger.warning("the drafter at %s did not answer (%s): its tokenizer is not checked",
                       target, exc)


def _ssd_speculator(config: EngineConfig, loaded: LoadedModel) -> Proposer:
    """SSD drafting by the speculator service; its misses above the critical batch size are
    drafted by SSSD (the drafter service or the in-process core, as for mode sssd). The
    tokenizer fingerprint is checked at connect: a draft model with another tokenizer is
    refused before any request is served."""
    # Imported on use: only mode ssd needs the speculator's client.
    from sssd.speculator.client import RemoteSpeculator, SpeculatorProposer

    assert config.speculator_target is not None  # EngineConfig checks it
    remote = RemoteSpeculator(config.speculator_target, timeout_s=config.speculator_timeout_s)
    try:
        info = remote.info()
    except Exception:
        remote.close()
        raise
    theirs = info["tokenizer_fingerprint"]
    if theirs and theirs != loaded.fingerprint:
        remote.close()
        raise ValueError(f"the speculator at {config.speculator_target} drafts with tokenizer "
                         f"{theirs}, the target's is {loaded.fingerprint}: refused")
    # One SSSD drafter serves the sequences routed to "sssd" and the speculator's fallback
    # (their sequence ids never collide: an id lives in one source); closing it twice is fine.
    drafter = _sssd_drafter(use_datastore=True)(config, loaded)
    return SourceRouter({"ssd": SpeculatorProposer(remote, drafter, fingerprint=loaded.fingerprint),
                         "sssd": drafter})


PROPOSERS: dict[str, ProposerFactory] = {
    "ar": _no_proposer,
    "prompt_lookup": _sssd_drafter(use_datastore=False),
    "sssd": _sssd_drafter(use_datastore=True),
    "ssd": _ssd_speculator,
}


def register_proposer(mode: str, factory: ProposerFactory) -> None:
    """Adds a drafting source under a new mode (the mode must also be an EngineConfig mode)."""
    if mode in PROPOSERS:
        raise ValueError(f"mode {mode!r} already has a proposer")
    PROPOSERS[mode] = factory


def make_proposer(config: EngineConfig, loaded: LoadedModel) -> Proposer | None:
    return PROPOSERS[config.mode](config, loaded)

"""One place that puts a serving loop together: the engine, its loop and the loop's observers
(metrics, the live datastore's conversation sink, the acceptance statistics on disk, the step
trace)."""

from __future__ import annotations

from sssd.common.conversations.publisher import PublishConfig
from sssd.common.model.loader import LoadedModel
from sssd.verifier.engine.budget_policy import MeasuredBudget
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.factory import acceptance_path, build_engine
from sssd.verifier.serving.loop import EngineLoop
from sssd.verifier.serving.metrics import DecodeMetrics
from sssd.verifier.serving.observers import (
    AcceptanceSaver,
    LoopObserver,
    Observers,
    StepTrace,
)
from sssd.verifier.serving.publish import ConversationSink


def build_engine_loop(config: EngineConfig, loaded: LoadedModel, max_requests: int,
                      publish: PublishConfig | None = None, worker: str = "local",
                      ray_metrics: bool = False) -> EngineLoop:
    """An engine (with its text tracked, for streaming) and its serving loop, started.
    `publish`: completed conversations go to the live datastore's stream; `ray_metrics`: the
    loop reports through ray.util.metrics (inside a Ray worker). `EngineLoop.close` releases
    all of it."""
    observers: list[LoopObserver] = []
    publisher = None
    if publish is not None:
        sink = ConversationSink(publish, loaded.fingerprint, worker=worker)
        publisher = sink.publisher
        observers.append(sink)
    engine = build_engine(config, loaded, detokenize=True)
    if isinstance(engine.budget_policy, MeasuredBudget) and config.profile_path:
        observers.append(AcceptanceSaver(engine.budget_policy,
                                         acceptance_path(config.profile_path, config.mode)))
    if ray_metrics:
        observers.append(DecodeMetrics(worker, publisher=publisher, proposer=engine.proposer))
    if config.step_trace:
        observers.append(StepTrace(config.step_trace if worker == "local"
                                   else f"{config.step_trace}.{worker}"))
    return EngineLoop(engine, max_requests, Observers(*observers)).start()

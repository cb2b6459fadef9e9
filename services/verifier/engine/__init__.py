"""sssd.verifier.engine: the target model's decoding engine, pure compute.

The model runner over the project's own forward pass for Llama and Qwen2 models
(sssd.common.model.decoder, with the C++ operations of common/model/kernels/, sssd._kernels),
acceptance, sampling, the scheduler, the budget policy and the step that ties them together.
No grpc, no Ray, no drafter: drafting sources meet the engine through
`sssd.common.drafting.proposer.Proposer` (drafting.py).

The names below are imported on first use, so `sssd.verifier.engine.config` and `.request`
stay free of torch for the processes that only configure or validate.
"""

import importlib

_EXPORTS = {
    "Engine": "engine", "EngineConfig": "config", "EngineStats": "output",
    "GenerateRequest": "request", "Grammar": "grammar", "InvalidRequest": "errors",
    "RequestLimits": "request",
    "RowOutput": "output", "SamplingParams": "request", "StepOutput": "output",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

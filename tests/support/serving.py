"""Frontend configurations the serving tests start from."""

from __future__ import annotations

from contextlib import contextmanager


def frontend_config(datastore, max_len: int, **overrides):
    """A float32 SSSD frontend on OS-picked ports (gRPC and HTTP) over `datastore`, with the
    rule budget policy; `overrides`: FrontendConfig fields."""
    from sssd.verifier.engine.config import EngineConfig
    from sssd.verifier.serving.config import FrontendConfig

    engine = EngineConfig(dtype="float32", mode="sssd", max_batch_size=4, max_len=max_len,
                          datastore_dir=datastore, budget_policy="rule")
    values = dict(engine=engine, port=0, http_port=0, max_requests=3, max_workers=8,
                  grace_s=5.0)
    values.update(overrides)
    return FrontendConfig(**values)


@contextmanager
def running_frontend(config, loaded):
    """A started frontend serving `loaded`, stopped on leaving."""
    from sssd.verifier.serving.frontend import start_frontend

    frontend = start_frontend(config)
    try:
        frontend.load(loaded)
        yield frontend
    finally:
        frontend.stop(0)

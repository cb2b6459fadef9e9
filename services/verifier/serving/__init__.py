"""sssd.verifier.serving: the engine behind the Generate API.

    backend.py      the `Backend` protocol, request handles and stream events, admission
    errors.py       error kinds of refused or failed requests
    loop.py         `EngineLoop`: one thread owns an engine and streams every request (a Backend)
    observers.py    the loop's observer hooks, and the saver of the policy's acceptance statistics
    publish.py      the loop observer that sends completed conversations to the live datastore
    metrics.py      the loop observer that reports through ray.util.metrics
    assembly.py     an engine, its loop and its observers, put together
    ray_auth.py     starting or joining a Ray cluster with token authentication
    ray_workers.py  prefill and decode workers (Ray actors)
    ray_backend.py  `RayBackend`: prefill/decode disaggregation behind the Backend protocol
    config.py       FrontendConfig, RayConfig
    frontend.py     the gRPC servicer of proto/sssd/v1/generate.proto, and the process that
                    serves it beside the HTTP API
    http_api/       the OpenAI-compatible HTTP API (schema, responses, endpoints, server)
    api_metrics.py  the HTTP API's Prometheus metrics, under vLLM's names too
    placement.py    how many prefill and decode workers a machine's cores take
"""

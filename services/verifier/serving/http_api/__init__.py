"""The OpenAI-compatible HTTP API, beside the gRPC API in the frontend process, on the same
backend (the engine in this process, or the Ray workers).

    POST /v1/chat/completions   messages -> the model's chat template -> an answer
    POST /v1/completions        a prompt (text or token ids), no template
    GET  /v1/models             the served model
    GET  /health                200 serving; 503 while loading or draining
    GET  /metrics               Prometheus text: sssd_api_* and vLLM's vllm:* names (api_metrics)
    POST /tokenize, /detokenize as vLLM's server has them

Streaming is server-sent events framed as OpenAI frames them: `data: {json}` lines and a last
`data: [DONE]`; with `stream_options.include_usage` a final chunk with empty `choices` carries
the usage. Log-probabilities, n choices, penalties, logit bias, min_p, min_tokens,
stop_token_ids and (on templates with a tool format) tools are served; a field the engine
cannot honour (response_format, echo, best_of, suffix) other than at its neutral value and a
field nobody defined are answered 400 naming the field, never ignored. With an API key every
endpoint but /health and /metrics needs it (401 otherwise). Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the status from the same error-kind
table as the gRPC API (STATUS_OF_KIND). A client that disconnects cancels its request: its KV
blocks and drafter sequence are freed at once.

Extension: the request field `speculation` (auto, off, sssd, ssd, as in the gRPC API) and the
reply's `speculation` object (verification steps, accepted draft tokens, tokens per step).

Starlette on uvicorn, run on a thread of its own with its own event loop; the backend's event
queues are read on a thread pool (one blocking read per live request, as the gRPC API does).

    errors.py      ApiError: a refusal in OpenAI's error shape
    schema.py      the request fields, their validation, and the parsed request
    structured.py  response_format and vLLM's guided_* fields as the engine's Grammar
    responses.py   whole replies, stream chunks and the server-sent event stream
    tool_calls.py  the model's tool-call format, parsed whole or while streaming
    app.py         the endpoints (`OpenAIApi`)
    server.py      uvicorn on a thread of its own, over TLS where configured (`HttpServer`)
"""

from sssd.verifier.serving.http_api.app import OpenAIApi
from sssd.verifier.serving.http_api.server import HttpServer

__all__ = ["HttpServer", "OpenAIApi"]


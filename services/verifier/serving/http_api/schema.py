"""The HTTP API's request schema: which fields each endpoint takes, how each is checked, and
the parsed request the backend runs. A field the engine cannot honour is accepted only at its
neutral value (NEUTRAL_ONLY) and a field nobody defined is refused, both by name, never
ignored; every refusal is an `ApiError` in OpenAI's error shape."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from starlette.responses import JSONResponse

from sssd.common.data.corpus import conversation_token_ids
from sssd.verifier.engine.request import GenerateRequest, InvalidRequest, SamplingParams
from sssd.verifier.serving.errors import ErrorKind

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) unread
MAX_MESSAGES = 1024
SPECULATION_MODES = {"auto": (True, ""), "off": (False, ""), "sssd": (True, "sssd"),
                     "ssd": (True, "ssd")}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}

# The one place an error kind becomes an HTTP status (the gRPC API's table: frontend.py).
STATUS_OF_KIND = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.DRAINING: 503,
    ErrorKind.STOPPED: 503,
    ErrorKind.INTERNAL: 500,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 413: "invalid_request_error",
               405: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

# Fields OpenAI defines that this engine cannot honour: accepted only at their neutral values.
_NONE, _FALSE, _ZERO, _ONE, _EMPTY = (None,), (None, False), (None, 0), (None, 1), (None, [], {})
NEUTRAL_ONLY = {
    "logprobs": _FALSE + (0,), "top_logprobs": _ZERO, "echo": _FALSE, "best_of": _ONE,
    "presence_penalty": _ZERO, "frequency_penalty": _ZERO, "repetition_penalty": _ONE,
    "logit_bias": _EMPTY, "suffix": (None, ""), "tools": _EMPTY, "functions": _EMPTY,
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "min_tokens": _ZERO, "min_p": _ZERO, "store": _FALSE, "service_tier": (None, "auto",
                                                                            "default"),
    "modalities": (None, ["text"]), "prediction": _NONE, "audio": _NONE,
    "reasoning_effort": _NONE, "web_search_options": _NONE, "include_stop_str_in_output": _FALSE,
    "skip_special_tokens": (None, True), "metadata": _EMPTY,
}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                 "ignore_eos", "stream", "stream_options", "user", "speculation"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def field_of(message: str, prompt_field: str) -> str | None:
    """The API field an InvalidRequest message starts with ("max_tokens: ..."), in this API's
    names (the engine says "prompt" for the token ids that the chat endpoint got as messages)."""
    name = message.split(":", 1)[0].strip()
    if not name or " " in name:
        return None
    return prompt_field if name in ("prompt", "resume") else name


@dataclass(frozen=True)
class ParsedRequest:
    request: GenerateRequest
    stream: bool
    include_usage: bool
    mode: str  # the speculation field
    continuous_usage: bool = False  # vLLM's extension: the usage so far in every chunk


class RequestParser:
    """Parses request bodies for one served model and tokenizer into `ParsedRequest`s."""

    def __init__(self, model_name: str, tokenizer, max_tokens_limit: int,
                 default_max_tokens: int) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise ApiError(400, "model: must be a string", "model")
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist: this server serves "
                           f"`{self.model_name}` (GET /v1/models)", "model", "model_not_found")

    def parse(self, body: dict, chat: bool) -> ParsedRequest:
        refuse_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        self.check_model(body)
        if chat:
            if "messages" not in body:
                raise ApiError(400, "messages: required", "messages")
            prompt_ids = self.chat_ids(chat_messages(body["messages"]), True)
        else:
            if "prompt" not in body:
                raise ApiError(400, "prompt: required", "prompt")
            prompt_ids = self.prompt_ids(body["prompt"])
        max_tokens = self.max_tokens(body, chat)
        n = body.get("n")
        if n is not None and n != 1:
            raise ApiError(400, f"n: only 1 choice per request is supported, got {n!r}", "n")
        stream = boolean(body, "stream", False)
        include_usage = continuous_usage = False
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise ApiError(400, "stream_options: only allowed when stream is true",
                               "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage",
                                                                 "continuous_usage_stats"}:
                raise ApiError(400, "stream_options: an object with include_usage",
                               "stream_options")
            include_usage = boolean(options, "include_usage", False, "stream_options")
            continuous_usage = boolean(options, "continuous_usage_stats", False,
                                     "stream_options")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ApiError(400, "stop: a string or a list of strings", "stop")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise ApiError(400, "user: must be a string", "user")
        mode = body.get("speculation", "auto")
        if mode not in SPECULATION_MODES:
            raise ApiError(400, f"speculation: one of {', '.join(SPECULATION_MODES)}, got "
                           f"{mode!r}", "speculation")
        speculate, source = SPECULATION_MODES[mode]
        temperature = number(body, "temperature", 1.0)
        top_k = body.get("top_k")
        if top_k is None or top_k == -1:  # vLLM's "off"
            top_k = 0
        seed = body.get("seed")
        try:
            sampling = SamplingParams(temperature=temperature, top_p=number(body, "top_p", 1.0),
                                      top_k=top_k, seed=seed)
            request = GenerateRequest(tuple(prompt_ids), max_tokens, sampling, tuple(stop),
                                      speculate=speculate, source=source,
                                      ignore_eos=boolean(body, "ignore_eos", False))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), field_of(str(exc), "messages" if chat
                                                    else "prompt")) from None
        return ParsedRequest(request, stream, include_usage, mode, continuous_usage)

    def max_tokens(self, body: dict, chat: bool) -> int:
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        for name in names:
            value = body.get(name)
            if value is None:
                continue
            if not is_int(value) or not 1 <= value <= self.max_tokens_limit:
                raise ApiError(400, f"{name}: an integer in [1, {self.max_tokens_limit}], got "
                               f"{value!r}", name)
            return value
        return self.default_max_tokens

    def prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt: must not be empty", "prompt")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            return prompt  # the backend's RequestLimits checks them against the vocabulary
        if isinstance(prompt, list) and len(prompt) > 1 and all(
                isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "prompt: one prompt per request (batches are not supported)",
                           "prompt")
        raise ApiError(400, "prompt: a non-empty string or a non-empty list of token ids",
                       "prompt")

    def token_ids(self, tokens: object) -> list[int]:
        """/detokenize's `tokens`: ids of the tokenizer (no backend checks them there)."""
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise ApiError(400, "tokens: a list of token ids", "tokens")
        vocab = len(self.tokenizer)
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})",
                           "tokens")
        return tokens

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            return conversation_token_ids(self.tokenizer, messages,
                                          add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # the template refuses this conversation (e.g. role order)
            raise ApiError(400, f"messages: the model's chat template refused them ({exc})",
                           "messages") from None


def refuse_unknown(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL_ONLY:
            if value in NEUTRAL_ONLY[name]:
                continue
            raise ApiError(400, f"{name}: not supported by this server (only its neutral value "
                           f"is accepted), got {json.dumps(value)[:80]}", name, "unsupported")
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)


def boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: must be true or false, got {json.dumps(value)[:40]}",
                       param or name)
    return value


def number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise ApiError(400, f"{name}: must be a number, got {json.dumps(value)[:40]}", name)
    return float(value)


def chat_messages(messages: object) -> list[dict[str, str]]:
    """OpenAI chat messages as {"role", "content"} with string content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list of messages", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages: at most {MAX_MESSAGES}", "messages")
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where}: must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"{where}.role: one of {', '.join(CHAT_ROLES)}, got "
                           f"{json.dumps(role)[:40]}", "messages")
        for name in message:
            if name not in ("role", "content", "name"):
                raise ApiError(400, f"{where}.{name}: not supported by this server",
                               "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
                    raise ApiError(400, f"{where}.content[{part_index}]: only text parts "
                                   "({\"type\": \"text\", \"text\": ...}) are supported",
                                   "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: a string or a list of text parts",
                           "messages")
        result.append({"role": CHAT_ROLES[role], "content": content})
    if not any(m["content"].strip() for m in result):
        raise ApiError(400, "messages: need at least one non-empty message", "messages")
    return result

"""The HTTP API's request schema: which fields each endpoint takes, how each is checked, and
the parsed request the backend runs. A field the engine cannot honour is accepted only at its
neutral value (NEUTRAL_ONLY) and a field nobody defined is refused, both by name, never
ignored; every refusal is an `ApiError` in OpenAI's error shape."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from sssd.common.data.corpus import conversation_token_ids
from sssd.verifier.engine.request import (
    MAX_TOP_LOGPROBS,
    GenerateRequest,
    InvalidRequest,
    SamplingParams,
)
from sssd.verifier.serving.errors import ErrorKind
from sssd.verifier.serving.http_api.errors import ApiError
from sssd.verifier.serving.http_api.structured import structured_output
from sssd.verifier.serving.http_api.tool_calls import (
    answer_grammar,
    forced_prefix,
    tool_format,
)

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) unread
MAX_MESSAGES = 1024
MAX_CHOICES = 16  # n: answers of one request
SPECULATION_MODES = {"auto": (True, ""), "off": (False, ""), "sssd": (True, "sssd"),
                     "ssd": (True, "ssd")}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}
MAX_TOOLS = 128

# The one place an error kind becomes an HTTP status (the gRPC API's table: frontend.py).
STATUS_OF_KIND = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.DRAINING: 503,
    ErrorKind.STOPPED: 503,
    ErrorKind.INTERNAL: 500,
}
# Fields OpenAI defines that this engine cannot honour: accepted only at their neutral values.
_NONE, _FALSE, _ZERO, _ONE, _EMPTY = (None,), (None, False), (None, 0), (None, 1), (None, [], {})
NEUTRAL_ONLY = {
    "echo": _FALSE, "best_of": _ONE,
    "suffix": (None, ""), "functions": _EMPTY, "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "store": _FALSE, "service_tier": (None, "auto",
                                                                            "default"),
    "modalities": (None, ["text"]), "prediction": _NONE, "audio": _NONE,
    "reasoning_effort": _NONE, "web_search_options": _NONE, "include_stop_str_in_output": _FALSE,
    "skip_special_tokens": (None, True), "metadata": _EMPTY,
}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                 "ignore_eos", "stream", "stream_options", "user", "speculation", "logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "min_tokens", "min_p", "stop_token_ids", "response_format", "guided_json",
                 "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                               "tool_choice"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}


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
    n: int = 1  # answers to the prompt, choices 0..n-1
    parses_tools: bool = False  # the answers' <tool_call> blocks become tool_calls
    tool_prefix: str = ""  # the text the prompt forces each answer to start with (tool_choice)
    tool_names: tuple[str, ...] = ()  # the request's tools


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
        tools, tool_choice, prefix = None, "none", ""
        if chat:
            if "messages" not in body:
                raise ApiError(400, "messages: required", "messages")
            tools, tool_choice = self.tools(body)
            prefix = forced_prefix(tool_choice) if tools else ""
            prompt_ids = self.chat_ids(chat_messages(body["messages"]), True,
                                       tools if tool_choice != "none" else None)
            if prefix:
                prompt_ids += list(self.tokenizer.encode(prefix, add_special_tokens=False))
        else:
            if "prompt" not in body:
                raise ApiError(400, "prompt: required", "prompt")
            prompt_ids = self.prompt_ids(body["prompt"])
        max_tokens = self.max_tokens(body, chat)
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"n: an integer in [1, {MAX_CHOICES}], got {json.dumps(n)[:40]}",
                           "n")
        stream = boolean(body, "stream", False)
        include_usage, continuous_usage = stream_options(body, stream)
        stop = stop_strings(body)
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
        grammar, grammar_field = structured_output(body)
        try:
            grammar = answer_grammar(tools, tool_choice, grammar, grammar_field)
            sampling = SamplingParams(
                temperature=temperature, top_p=number(body, "top_p", 1.0), top_k=top_k,
                seed=seed, presence_penalty=number(body, "presence_penalty", 0.0),
                frequency_penalty=number(body, "frequency_penalty", 0.0),
                repetition_penalty=number(body, "repetition_penalty", 1.0),
                logit_bias=logit_bias(body.get("logit_bias")), min_p=number(body, "min_p", 0.0),
                logprobs=logprobs(body, chat))
            request = GenerateRequest(tuple(prompt_ids), max_tokens, sampling, tuple(stop),
                                      speculate=speculate, source=source,
                                      ignore_eos=boolean(body, "ignore_eos", False),
                                      stop_token_ids=token_list(body, "stop_token_ids"),
                                      min_tokens=integer(body, "min_tokens", 0),
                                      grammar=grammar)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), field_of(str(exc), "messages" if chat
                                                    else "prompt")) from None
        return ParsedRequest(request, stream, include_usage, mode, continuous_usage, n,
                             bool(tools) and tool_choice != "none", prefix,
                             tuple(t["function"]["name"] for t in tools or ()))

    def tools(self, body: dict) -> tuple[list[dict] | None, object]:
        """The request's tools (None: none) and its tool_choice, checked."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if tools in (None, []):
            if choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice: needs tools", "tool_choice")
            return None, "none"
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise ApiError(400, f"tools: a list of at most {MAX_TOOLS} tools", "tools")
        names = []
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not (isinstance(tool, dict) and tool.get("type") == "function"
                    and set(tool) <= {"type", "function"} and isinstance(function, dict)
                    and isinstance(function.get("name"), str) and function["name"]
                    and set(function) <= {"name", "description", "parameters", "strict"}
                    and isinstance(function.get("parameters", {}), dict)
                    and isinstance(function.get("description", ""), str)):
                raise ApiError(400, f"tools[{index}]: {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"description\": ..., \"parameters\": "
                               "{JSON schema}}}", "tools")
            names.append(function["name"])
        if tool_format(self.tokenizer) is None:
            raise ApiError(400, f"tools: the chat template of {self.model_name} has no "
                           "tool-call format this server parses (it parses Qwen2.5's / "
                           "Hermes' <tool_call> blocks; serve such a model for tools)", "tools",
                           "unsupported")
        if choice is None:
            choice = "auto"
        if isinstance(choice, dict):
            function = choice.get("function")
            if not (choice.get("type") == "function" and isinstance(function, dict)
                    and function.get("name") in names):
                raise ApiError(400, "tool_choice: none, auto, required, or {\"type\": "
                               "\"function\", \"function\": {\"name\": one of the tools}}",
                               "tool_choice")
        elif choice not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice: none, auto, required or a named function, got "
                           f"{json.dumps(choice)[:40]}", "tool_choice")
        return tools, choice

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

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool,
                 tools: list[dict] | None = None) -> list[int]:
        try:
            return conversation_token_ids(self.tokenizer, messages,
                                          add_generation_prompt=add_generation_prompt,
                                          tools=tools)
        except Exception as exc:  # the template refuses this conversation (e.g. role order)
            raise ApiError(400, f"messages: the model's chat template refused them ({exc})",
                           "messages") from None


def choice_requests(parsed: ParsedRequest) -> list[GenerateRequest]:
    """The engine requests of a request's n choices. Choice i samples with seed + i (mod
    2^64), so a seeded request of n choices is reproducible and its choices differ; they share
    the prompt's KV blocks through the prefix cache."""
    request = parsed.request
    if parsed.n == 1:
        return [request]
    seed = request.sampling.seed
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    return [replace(request, sampling=replace(request.sampling, seed=(seed + i) % (1 << 64)))
            for i in range(parsed.n)]


def stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of the request's stream_options."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage",
                                                         "continuous_usage_stats"}:
        raise ApiError(400, "stream_options: an object with include_usage", "stream_options")
    return (boolean(options, "include_usage", False, "stream_options"),
            boolean(options, "continuous_usage_stats", False, "stream_options"))


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop: a string or a list of strings", "stop")
    return stop


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


def integer(body: dict, name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise ApiError(400, f"{name}: must be an integer, got {json.dumps(value)[:40]}", name)
    return value


def token_list(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise ApiError(400, f"{name}: a list of token ids", name)
    return tuple(value)


def logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias: an object of token id -> bias", "logit_bias")
    bias = []
    for key, amount in value.items():
        if not (isinstance(key, str) and key.strip().isdigit()) or not is_number(amount):
            raise ApiError(400, f"logit_bias: keys are token ids, values numbers in [-100, 100]; "
                           f"got {json.dumps(key)[:20]}: {json.dumps(amount)[:20]}", "logit_bias")
        bias.append((int(key), float(amount)))
    return tuple(bias)


def logprobs(body: dict, chat: bool) -> int | None:
    """The number of alternatives to report per token, or None for no log-probabilities.
    Chat: `logprobs` true and `top_logprobs` k; completions: `logprobs` k (OpenAI's shapes)."""
    value = body.get("logprobs")
    if chat:
        wanted = boolean(body, "logprobs", False)
        top = body.get("top_logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise ApiError(400, f"top_logprobs: an integer in [0, {MAX_TOP_LOGPROBS}], got "
                           f"{json.dumps(top)[:40]}", "top_logprobs")
        if top and not wanted:
            raise ApiError(400, "top_logprobs: needs logprobs true", "top_logprobs")
        return (top or 0) if wanted else None
    if value is None or value is False:
        return None
    if not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"logprobs: an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives "
                       f"per token), got {json.dumps(value)[:40]}", "logprobs")
    return value


def chat_messages(messages: object) -> list[dict]:
    """OpenAI chat messages as the chat template takes them: {"role", "content"} with string
    content (text parts joined); an assistant's `tool_calls` with their arguments as objects; a
    tool result's `tool_call_id`."""
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
        allowed = {"role", "content", "name"} | ({"tool_calls", "refusal"} if role == "assistant"
                                                 else {"tool_call_id"} if role == "tool"
                                                 else set())
        for name in message:
            if name not in allowed:
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
        if content is None and message.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: a string or a list of text parts",
                           "messages")
        entry = {"role": CHAT_ROLES[role], "content": content}
        if message.get("tool_calls"):
            entry["tool_calls"] = template_tool_calls(message["tool_calls"], where)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"{where}.tool_call_id: required (the id of the call this "
                               "answers)", "messages")
            entry["tool_call_id"] = call_id
        result.append(entry)
    if not any(m["content"].strip() or m.get("tool_calls") for m in result):
        raise ApiError(400, "messages: need at least one non-empty message", "messages")
    return result


def template_tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant's tool_calls as chat templates take them: arguments as an object."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls: a list of calls", "messages")
    result = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(parsed, dict)):
            raise ApiError(400, f"{where}.tool_calls[{index}]: {{\"id\": ..., \"type\": "
                           "\"function\", \"function\": {\"name\": ..., \"arguments\": a "
                           "JSON object as a string}}", "messages")
        result.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": parsed}})
    return result

"""The OpenAI-compatible HTTP API over real HTTP on 127.0.0.1, through the official `openai` SDK
(sync and async, streaming and not, chat and completions) and raw sockets: exactness against
the gRPC API and plain greedy decoding, SSE framing, usage, refused fields, errors, the queue
limit, disconnects, concurrency, health, metrics, tokenize/detokenize."""

import asyncio
import http.client
import json
import re
import threading
import urllib.request

import jsonschema
import openai
import pytest

from sssd.client import GenerationClient, RetryPolicy
from sssd.verifier.serving.frontend import start_frontend

from support.serving import frontend_config, running_frontend

MAX_LEN = 1024


def make_config(datastore, **overrides):
    values = dict(max_requests=20, max_workers=40, max_tokens_limit=600) | overrides
    return frontend_config(datastore, MAX_LEN, **values)


@pytest.fixture(scope="module")
def frontend(target_model_fp32, warm_datastore):
    with running_frontend(make_config(warm_datastore), target_model_fp32) as frontend:
        yield frontend


@pytest.fixture(scope="module")
def model_name(frontend):
    return frontend.http.api.model_name


@pytest.fixture(scope="module")
def sdk(frontend):
    with openai.OpenAI(base_url=frontend.http_url + "/v1", api_key="unused",
                       max_retries=0) as client:
        yield client


def post(frontend, path, body, raw: bytes | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", frontend.http.port, timeout=60)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        connection.request("POST", path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def get(frontend, path) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(frontend.http_url + path, timeout=30) as response:
            return response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers["Content-Type"]


def sse_events(frontend, body) -> tuple[str, list[bytes]]:
    """The raw events of a streamed answer (each `data: ...` without its blank line)."""
    connection = http.client.HTTPConnection("127.0.0.1", frontend.http.port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions" if "messages" in body
                           else "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        raw = response.read()
        return response.headers["Content-Type"], raw
    finally:
        connection.close()


def test_completion_of_token_ids_equals_plain_greedy_decoding(sdk, model_name, target_model_fp32,
                                                              mt_bench_prompts, greedy_references):
    tokenizer = target_model_fp32.tokenizer
    for prompt, reference in zip(mt_bench_prompts[:3], greedy_references):
        reply = sdk.completions.create(model=model_name, prompt=prompt, max_tokens=40,
                                       temperature=0)
        assert reply.choices[0].text == tokenizer.decode(reference[:40],
                                                         skip_special_tokens=True)
        assert reply.usage.completion_tokens == 40 and reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.total_tokens == 40 + len(prompt)
        assert reply.choices[0].finish_reason == "length" and reply.object == "text_completion"
    # The warm datastore holds this answer: the extension object shows speculation at work.
    extension = reply.model_extra["speculation"]
    assert extension["mode"] == "auto" and extension["accepted_draft_tokens"] > 0
    assert extension["tokens_per_step"] > 1.0


def test_chat_over_http_equals_the_grpc_answer(frontend, sdk, model_name, target_model_fp32):
    question = "What is the capital of France? Answer in one sentence."
    reply = sdk.chat.completions.create(model=model_name, temperature=0, max_tokens=32,
                                        messages=[{"role": "user", "content": question}])
    with GenerationClient(f"127.0.0.1:{frontend.port}", RetryPolicy(attempts=1)) as client:
        expected = client.generate(question, max_tokens=32)
    message = reply.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert reply.usage.completion_tokens == expected.totals.completion_tokens
    assert reply.usage.prompt_tokens == expected.totals.prompt_tokens
    assert reply.choices[0].finish_reason == expected.totals.finish_reason
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    # Content as a list of text parts, and a system message: the same template path.
    parts = sdk.chat.completions.create(model=model_name, temperature=0, max_tokens=32, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France? "},
                                     {"type": "text", "text": "Answer in one sentence."}]}])
    assert parts.choices[0].message.content == expected.text
    messages = [{"role": "system", "content": "You answer in French."},
                {"role": "user", "content": "Hello!"}]
    system = sdk.chat.completions.create(model=model_name, temperature=0, max_tokens=8,
                                         messages=messages)
    status, tokens = post(frontend, "/tokenize", {"messages": messages})
    assert status == 200 and system.usage.prompt_tokens == tokens["count"]
    assert "You answer in French." in target_model_fp32.tokenizer.decode(tokens["tokens"])


def test_streaming_equals_the_whole_answer_sync_and_async(sdk, frontend, model_name):
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = sdk.chat.completions.create(model=model_name, messages=messages, max_tokens=24,
                                        temperature=0).choices[0].message.content
    chunks = list(sdk.chat.completions.create(model=model_name, messages=messages,
                                              max_tokens=24, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    async def run():
        async with openai.AsyncOpenAI(base_url=frontend.http_url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            stream = await client.completions.create(model=model_name, prompt="Roses are red,",
                                                     max_tokens=16, temperature=0, stream=True)
            streamed = "".join([c.choices[0].text async for c in stream])
            reply = await client.completions.create(model=model_name, prompt="Roses are red,",
                                                    max_tokens=16, temperature=0)
            chat = await client.chat.completions.create(model=model_name, messages=messages,
                                                        max_tokens=24, temperature=0)
            return streamed, reply.choices[0].text, chat.choices[0].message.content

    streamed, reply, chat = asyncio.run(run())
    assert streamed == reply and reply and chat == whole


def test_sse_framing_and_usage_only_when_asked(frontend):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    content_type, raw = sse_events(frontend, body)
    assert content_type.startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert all("usage" not in p for p in payloads)
    assert all(p["object"] == "chat.completion.chunk" and len(p["choices"]) == 1
               for p in payloads)

    _, raw = sse_events(frontend, body | {"stream_options": {"include_usage": True}})
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n")[:-2]]
    *chunks, last = payloads
    assert all(p["usage"] is None and p["choices"] for p in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in chunks)
    whole = post(frontend, "/v1/chat/completions", body | {"stream": False})[1]
    assert text == whole["choices"][0]["message"]["content"]
    assert last["usage"] == whole["usage"]
    # vLLM's continuous_usage_stats (GuideLLM asks for it): the usage so far in every chunk.
    _, raw = sse_events(frontend, body | {"stream_options": {"include_usage": True,
                                                             "continuous_usage_stats": True}})
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n")[:-2]]
    counts = [p["usage"]["completion_tokens"] for p in payloads]
    assert counts == sorted(counts) and counts[-1] == 6 and payloads[-1]["choices"] == []


@pytest.mark.parametrize("endpoint,field,value", [
    ("chat", "logprobs", "yes"),
    ("chat", "top_logprobs", 21),
    ("chat", "top_logprobs", 3),  # without logprobs true
    ("chat", "presence_penalty", 2.5),
    ("chat", "frequency_penalty", -3),
    ("chat", "repetition_penalty", 0),
    ("chat", "logit_bias", {"fifty": 10}),
    ("chat", "logit_bias", {"50": 101}),
    ("chat", "logit_bias", {"10000000": 1}),
    ("chat", "min_p", 1.5),
    ("chat", "min_tokens", 3),  # more than max_tokens 2
    ("chat", "stop_token_ids", [-1]),
    ("chat", "stop_token_ids", [10**7]),
    # The default model's chat template has no tool format: refused by name.
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "response_format", {"type": "xml"}),
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}),
    ("chat", "guided_regex", "a(b"),
    ("chat", "guided_choice", "yes"),
    ("chat", "guided_json", "{not json"),
    ("chat", "structured_outputs", {"regex": "x", "choice": ["y"]}),
    ("completions", "guided_grammar", "root ::= ("),
    ("chat", "n", 0),
    ("chat", "n", 17),
    ("chat", "a_field_nobody_defined", 1),
    ("completions", "logprobs", 21),
    ("completions", "logprobs", True),
    ("completions", "echo", True),
    ("completions", "best_of", 3),
    ("completions", "suffix", "tail"),
    ("completions", "n", "3"),
])
def test_unsupported_fields_and_bad_values_are_400_naming_the_field(frontend, endpoint, field,
                                                                     value):
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" \
        else {"prompt": "hi"}
    status, reply = post(frontend, f"/v1/{endpoint.replace('chat', 'chat/completions')}",
                         body | {"max_tokens": 2, field: value})
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"
    assert frontend.backend.num_requests == 0


def test_neutral_values_of_unsupported_fields_are_accepted(frontend, model_name):
    status, reply = post(frontend, "/v1/chat/completions", {
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0,
        "repetition_penalty": 1.0, "n": 1, "logit_bias": None, "tools": [], "user": "u1",
        "seed": 3, "top_k": -1, "response_format": {"type": "text"}})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    status, reply = post(frontend, "/v1/completions", {
        "prompt": ["hi"], "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1,
        "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 10**7]}, "prompt"),
    ({"prompt": [1] * MAX_LEN}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": 2.5}, "top_k"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stop": ["x"] * 20}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "hi", "speculation": "turbo"}, "speculation"),
    ({"prompt": "hi", "speculation": "ssd"}, "speculation"),  # no speculator here
    ({"prompt": "hi", "model": 7}, "model"),
])
def test_bad_requests_are_400_naming_the_field(frontend, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, reply = post(frontend, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert frontend.backend.num_requests == 0


def test_bodies_that_are_not_requests(frontend):
    for raw in (b"", b"{", b"[1, 2]", b"null", b"\xff\xfe", b'"text"'):
        status, reply = post(frontend, "/v1/chat/completions", None, raw=raw)
        assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    status, reply = post(frontend, "/v1/completions", None, raw=b"{" + b" " * (5 << 20) + b"}")
    assert status == 413
    status, body, content_type = get(frontend, "/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["message"]
    status, body, _ = get(frontend, "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(body)


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="gpt-4o", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"


def test_models_health_tokenize_detokenize(frontend, sdk, model_name, target_model_fp32):
    (model,) = sdk.models.list().data
    assert model.id == model_name and model.model_extra["max_model_len"] == MAX_LEN
    status, body, _ = get(frontend, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, reply = post(frontend, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and reply["tokens"] == target_model_fp32.tokenizer.encode("Hello world")
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == MAX_LEN
    status, chat = post(frontend, "/tokenize",
                        {"messages": [{"role": "user", "content": "Hello world"}]})
    assert status == 200 and chat["count"] > reply["count"]  # the template's markers
    status, text = post(frontend, "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and text["prompt"] == "Hello world"
    status, error = post(frontend, "/detokenize", {"tokens": [1, -5]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = post(frontend, "/tokenize", {"prompt": "a", "messages": []})
    assert status == 400


def test_metrics_under_our_names_and_vllms(frontend, sdk, model_name, mt_bench_prompts):
    def scrape() -> dict[str, float]:
        status, body, content_type = get(frontend, "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    label = f'{{model_name="{model_name}"}}'
    before = scrape()
    sdk.completions.create(model=model_name, prompt=mt_bench_prompts[0], max_tokens=24,
                           temperature=0)
    after = scrape()

    def delta(name):
        return after.get(name + label, 0) - before.get(name + label, 0)

    for prefix in ("vllm:", "sssd_api_"):
        assert delta(prefix + "spec_decode_num_drafts_total") > 0
        accepted = delta(prefix + "spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= delta(prefix + "spec_decode_num_draft_tokens_total")
        position_0 = f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{model_name=' \
            f'"{model_name}",position="0"}}'
        assert 0 < after[position_0] - before.get(position_0, 0) <= accepted
        assert delta(prefix + "generation_tokens_total") == 24
        assert delta(prefix + "time_to_first_token_seconds_count") == 1
        assert delta(prefix + "e2e_request_latency_seconds_count") == 1
        assert delta(prefix + "inter_token_latency_seconds_count") == 23
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{model_name}"}}'
    assert after[success] - before.get(success, 0) == 1
    # The gRPC API's requests are counted in the same place.
    with GenerationClient(f"127.0.0.1:{frontend.port}", RetryPolicy(attempts=1)) as client:
        client.generate("hi", max_tokens=3)
    assert scrape()["vllm:generation_tokens_total" + label] == \
        after["vllm:generation_tokens_total" + label] + 3


def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(frontend, sdk,
                                                                          model_name):
    """The second request of one long prompt takes its full blocks from the prefix cache:
    usage.prompt_tokens_details.cached_tokens says how many, the vLLM-named counters count
    them, and the answer is the first one's."""
    def scrape() -> dict[str, float]:
        _, body, _ = get(frontend, "/metrics")
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in body.decode().splitlines() if line and not line.startswith("#")}

    label = f'{{model_name="{model_name}"}}'
    prompt = " ".join(f"item {i}: the value is {i * 7 % 13}." for i in range(60))
    first = sdk.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                   temperature=0, extra_body={"speculation": "off"})
    before = scrape()
    second = sdk.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                    temperature=0, extra_body={"speculation": "off"})
    after = scrape()
    num_prompt = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert num_prompt > 300
    # Every full block but the one holding the last prompt token (its logits are computed).
    assert num_prompt - 32 <= cached < num_prompt and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    for prefix in ("vllm:", "sssd_api_"):
        assert after[prefix + "prefix_cache_queries_total" + label] - \
            before[prefix + "prefix_cache_queries_total" + label] == num_prompt
        assert after[prefix + "prefix_cache_hits_total" + label] - \
            before[prefix + "prefix_cache_hits_total" + label] == cached
    usage = after["vllm:kv_cache_usage_perc" + label]
    assert 0 <= usage <= 1  # idle between requests: nothing held but by running ones
    assert after["vllm:num_requests_running" + label] == 0
    assert after["vllm:num_requests_waiting" + label] == 0
    assert "vllm:num_preemptions_total" + label in after


def test_speculation_field(sdk, model_name, mt_bench_prompts, greedy_references,
                           target_model_fp32):
    text = target_model_fp32.tokenizer.decode(greedy_references[0][:24], skip_special_tokens=True)
    for mode in ("off", "sssd", "auto"):
        reply = sdk.completions.create(model=model_name, prompt=mt_bench_prompts[0],
                                       max_tokens=24, temperature=0,
                                       extra_body={"speculation": mode})
        assert reply.choices[0].text == text
        extension = reply.model_extra["speculation"]
        assert extension["mode"] == mode
        if mode == "off":
            assert extension["accepted_draft_tokens"] == 0 and extension["tokens_per_step"] == 1
        else:
            assert extension["tokens_per_step"] > 1


def test_stop_strings_and_ignore_eos(sdk, model_name):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = sdk.chat.completions.create(model=model_name, messages=messages, max_tokens=24,
                                        temperature=0)
    text = whole.choices[0].message.content
    stop = text.split()[len(text.split()) // 2]
    stopped = sdk.chat.completions.create(model=model_name, messages=messages, max_tokens=24,
                                          temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert text.startswith(stopped.choices[0].message.content) and \
        stop not in stopped.choices[0].message.content
    # A short answer ends at EOS; with ignore_eos it runs to max_tokens.
    short = sdk.chat.completions.create(model=model_name, max_tokens=200, temperature=0,
                                        messages=[{"role": "user", "content": "Say yes."}])
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 200
    longer = sdk.chat.completions.create(model=model_name, max_tokens=short.usage.completion_tokens
                                         + 5, temperature=0, extra_body={"ignore_eos": True},
                                         messages=[{"role": "user", "content": "Say yes."}])
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage.completion_tokens == short.usage.completion_tokens + 5


def test_sampling_with_a_seed_is_reproducible(sdk, model_name):
    replies = [sdk.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16,
                                      temperature=0.9, top_p=0.95, seed=7).choices[0].text
               for _ in range(2)]
    assert replies[0] == replies[1] and replies[0]


def test_disconnected_stream_frees_its_slot_and_drafter_sequence(frontend, sdk, model_name,
                                                                  mt_bench_prompts, wait_until):
    drafter = frontend.backend.engine.proposer
    assert wait_until(lambda: frontend.backend.num_requests == 0, timeout=10)
    live_before = drafter.info()["num_sequences"]
    connection = http.client.HTTPConnection("127.0.0.1", frontend.http.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(
        {"prompt": mt_bench_prompts[3], "max_tokens": 500, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event arrived: the sequence runs
    assert frontend.backend.num_requests == 1
    connection.sock.close()  # the client goes away mid-answer
    connection.close()
    assert wait_until(lambda: frontend.backend.num_requests == 0 and
                      not frontend.backend.engine.num_running, timeout=10)
    assert wait_until(lambda: drafter.info()["num_sequences"] <= live_before, timeout=10)
    # The next request is served.
    reply = sdk.completions.create(model=model_name, prompt="hi", max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_a_non_streaming_client_that_disconnects_frees_its_slot(frontend, mt_bench_prompts,
                                                               wait_until):
    connection = http.client.HTTPConnection("127.0.0.1", frontend.http.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(
        {"prompt": mt_bench_prompts[4], "max_tokens": 500}).encode(),
        {"Content-Type": "application/json"})
    assert wait_until(lambda: frontend.backend.num_requests == 1, timeout=10)
    connection.sock.close()
    connection.close()
    assert wait_until(lambda: frontend.backend.num_requests == 0, timeout=10)


def test_sixteen_concurrent_streams_all_complete(frontend, model_name):
    async def run():
        async with openai.AsyncOpenAI(base_url=frontend.http_url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            async def one(index):
                stream = await client.chat.completions.create(
                    model=model_name, max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": f"Count to {index + 3}."}])
                chunks = [chunk async for chunk in stream]
                return chunks[-1].usage.completion_tokens, "".join(
                    c.choices[0].delta.content or "" for c in chunks if c.choices)

            return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(run())
    assert len(results) == 16 and all(0 < count <= 8 and text for count, text in results)


def test_full_queue_is_429_and_health_follows_loading_and_draining(target_model_fp32,
                                                                   warm_datastore,
                                                                   mt_bench_prompts, wait_until):
    frontend = start_frontend(make_config(warm_datastore, max_requests=1, max_workers=4))
    try:
        status, body, _ = get(frontend, "/health")
        assert status == 503 and json.loads(body)["status"] == "loading"
        status, reply = post(frontend, "/v1/completions", {"prompt": "hi"})
        assert status == 503 and reply["error"]["code"] == "loading"
        frontend.load(target_model_fp32)
        assert get(frontend, "/health")[0] == 200
        connection = http.client.HTTPConnection("127.0.0.1", frontend.http.port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": mt_bench_prompts[3], "max_tokens": 500, "stream": True}).encode(),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.fp.readline()  # admitted: the queue (1 request) is full
        status, reply = post(frontend, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 429 and reply["error"]["type"] == "rate_limit_error"
        assert "1 concurrent requests" in reply["error"]["message"]
        with openai.OpenAI(base_url=frontend.http_url + "/v1", api_key="unused",
                           max_retries=0) as client, pytest.raises(openai.RateLimitError):
            client.completions.create(model=frontend.http.api.model_name, prompt="hi",
                                      max_tokens=2)
        # Draining: /health says so, new requests are 503, the running one goes on.
        stopper = threading.Thread(target=frontend.stop, args=(30.0,))
        stopper.start()
        assert wait_until(lambda: get(frontend, "/health")[0] == 503, timeout=10)
        assert json.loads(get(frontend, "/health")[1])["status"] == "draining"
        status, reply = post(frontend, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503
        connection.sock.close()  # the running request is cancelled: the drain ends
        connection.close()
        stopper.join(30)
        assert not stopper.is_alive()
    finally:
        frontend.stop(0)


def test_logprobs_over_http_are_the_same_with_and_without_speculation(sdk, model_name):
    messages = [{"role": "user", "content": "List the first five prime numbers."}]
    replies = [sdk.chat.completions.create(
        model=model_name, messages=messages, max_tokens=24, temperature=0, logprobs=True,
        top_logprobs=4, extra_body={"speculation": mode}) for mode in ("off", "auto")]
    plain, speculated = (r.choices[0].logprobs.content for r in replies)
    assert len(plain) == replies[0].usage.completion_tokens == len(speculated)
    # Every emitted token has its entry, the EOS that ended the answer included.
    assert "".join(e.token for e in plain).startswith(replies[0].choices[0].message.content)
    for entry, spec_entry in zip(plain, speculated):
        assert entry.token == spec_entry.token and len(entry.top_logprobs) == 4
        assert spec_entry.logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert entry.bytes == list(entry.token.encode())
    assert replies[1].model_extra["speculation"]["verification_steps"] > 0
    completion = sdk.completions.create(model=model_name, prompt="The capital of France is",
                                        max_tokens=6, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == 6 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])


def test_n_choices_with_a_seed_are_reproducible_and_differ(sdk, model_name):
    def ask(stream=False):
        options = dict(model=model_name, messages=[{"role": "user", "content": "Tell a joke."}],
                       max_tokens=12, temperature=1.0, seed=42, n=4)
        if not stream:
            reply = sdk.chat.completions.create(**options)
            assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
            return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
        texts = [""] * 4
        for chunk in sdk.chat.completions.create(stream=True, **options):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts

    first = ask()
    assert ask() == first and ask(stream=True) == first
    assert len(set(first)) > 1  # each choice samples with its own seed
    single = sdk.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Tell a joke."}], max_tokens=12,
        temperature=1.0, seed=42)
    assert single.choices[0].message.content == first[0]  # choice 0 is the seed's own answer


def test_penalties_over_http_change_the_answer_and_not_with_speculation(sdk, model_name):
    messages = [{"role": "user", "content": "Write a list of ten fruits, one per line."}]

    def ask(mode, **options):
        return sdk.chat.completions.create(
            model=model_name, messages=messages, max_tokens=32, temperature=0,
            extra_body={"speculation": mode} | options.pop("extra", {}), **options
        ).choices[0].message.content

    plain = ask("off")
    for options in (dict(frequency_penalty=1.5), dict(presence_penalty=1.0),
                    dict(extra={"repetition_penalty": 1.4}), dict(logit_bias={"198": -100}),
                    dict(extra={"min_p": 0.2, "min_tokens": 8})):
        adjusted = ask("off", **dict(options))
        assert ask("auto", **dict(options)) == adjusted, options
        if "min_p" not in str(options):  # greedy: min_p and min_tokens (no EOS by 8) are inert
            assert adjusted != plain, options
    # stop_token_ids: the answer ends at the first such token.
    tokens = sdk.chat.completions.create(model=model_name, messages=messages, max_tokens=32,
                                         temperature=0, logprobs=True).choices[0].logprobs
    stop_text = tokens.content[3].token
    stopped = sdk.chat.completions.create(
        model=model_name, messages=messages, max_tokens=32, temperature=0,
        extra_body={"stop_token_ids": [int(stop_id(sdk, stop_text))]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens <= 4


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_structured_output_matches_and_is_the_same_with_and_without_speculation(sdk,
                                                                               model_name):
    messages = [{"role": "user", "content": "Here is a person: {\"name\": \"Grace Hopper\", "
                 "\"age\": 85}. Repeat the person as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person",
                                                              "schema": PERSON}}

    def ask(mode, stream=False):
        options = dict(model=model_name, messages=messages, max_tokens=48, temperature=0,
                       response_format=response_format, extra_body={"speculation": mode})
        if not stream:
            return sdk.chat.completions.create(**options).choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in
                       sdk.chat.completions.create(stream=True, **options) if chunk.choices)

    plain = ask("off")
    assert ask("auto") == plain and ask("auto", stream=True) == plain
    jsonschema.validate(json.loads(plain), PERSON)
    # vLLM's names for the other kinds, on both endpoints.
    for extra, check in (({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": r"[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{4}", t)),
                         ({"structured_outputs": {"json_object": True}},
                          lambda t: isinstance(json.loads(t), dict))):
        chat = sdk.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "When was Python born?"}],
            max_tokens=40, temperature=0, extra_body=extra).choices[0].message.content
        assert check(chat), (extra, chat)
    completion = sdk.completions.create(model=model_name, prompt="Is the sky blue? Answer:",
                                        max_tokens=4, temperature=0,
                                        extra_body={"guided_choice": [" yes", " no"]})
    assert completion.choices[0].text in (" yes", " no")


def stop_id(sdk, text):
    return sdk.post("/../tokenize", cast_to=object,
                    body={"prompt": text, "add_special_tokens": False})["tokens"][0]

"""Tool calling through the openai SDK against a real server of Qwen2.5-Coder-0.5B (a chat
template with tools): a multi-turn tool conversation, streamed and not, its parsed calls equal
to the model's raw output; tool_choice required and named, held to the tools' schemas;
refusals by name. The same over gRPC, with the client and `sssd chat --demo-tools`."""

import io
import json

import grpc
import openai
import pytest

from sssd.cli.main import main as sssd_main
from sssd.client import GenerationClient, RetryPolicy, build_request
from sssd.v1 import generate_pb2_grpc
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.serving.config import FrontendConfig
from sssd.verifier.serving.http_api.tool_calls import ToolCallParser

from support.serving import running_frontend

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "system", "content": "You are a helpful assistant. Call a tool when you "
             "need its data. Once a tool has answered, reply to the user in one sentence."},
            {"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def frontend(qwen_coder_05b):
    engine = EngineConfig(model="qwen-coder-0.5b", dtype="bfloat16", mode="sssd",
                          max_batch_size=4, max_len=2048, budget_policy="rule")
    config = FrontendConfig(engine=engine, port=0, http_port=0, max_requests=8, max_workers=16,
                            grace_s=1.0)
    with running_frontend(config, qwen_coder_05b) as frontend:
        yield frontend


@pytest.fixture(scope="module")
def sdk(frontend):
    with openai.OpenAI(base_url=frontend.http_url + "/v1", api_key="unused",
                       max_retries=0) as client:
        yield client


def ask(sdk, frontend, messages, **options):
    options = {"temperature": 0, "max_tokens": 80} | options
    return sdk.chat.completions.create(model=frontend.http.api.model_name, messages=messages,
                                       **options)


def test_a_tool_conversation_streamed_and_not(sdk, frontend):
    reply = ask(sdk, frontend, QUESTION, tools=[WEATHER, CLOCK])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    assert call.id.startswith("call_")
    # The parsed call is the model's own output: the same prompt's raw text, through the
    # completions endpoint, parses to the same call (and speculation off gives it too).
    prompt_ids = frontend.http.api.parser.parse(
        {"messages": QUESTION, "tools": [WEATHER, CLOCK]}, True).request.prompt_ids
    raw = sdk.completions.create(model=frontend.http.api.model_name, prompt=list(prompt_ids),
                                 temperature=0, max_tokens=80).choices[0].text
    content, calls = ToolCallParser(names=("get_weather", "get_time")).parse_whole(raw)
    assert content is None and len(calls) == 1
    assert (calls[0].name, calls[0].arguments) == (call.function.name, call.function.arguments)
    off = ask(sdk, frontend, QUESTION, tools=[WEATHER, CLOCK], extra_body={"speculation": "off"})
    assert off.choices[0].message.tool_calls[0].function.arguments == call.function.arguments

    # Streamed: deltas with the call's index, id and name, then its arguments; the same call.
    stream = sdk.chat.completions.create(model=frontend.http.api.model_name, messages=QUESTION,
                                         tools=[WEATHER, CLOCK], temperature=0, max_tokens=80,
                                         stream=True)
    name, arguments, ids, finish = "", "", set(), None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or ():
            assert delta_call.index == 0
            ids.add(delta_call.id) if delta_call.id else None
            name += delta_call.function.name or ""
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and arguments == call.function.arguments
    assert len(ids) == 1 and finish == "tool_calls"

    # The tool's result goes back; the model answers in words.
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"})}]
    # (tool_choice none: the 0.5B model tends to call again after a result; agents end the
    # loop the same way.)
    final = ask(sdk, frontend, history, tools=[WEATHER, CLOCK], tool_choice="none")
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    assert "18" in answer.message.content
    # With tools in the prompt (auto) the same history is longer by their description.
    with_tools = ask(sdk, frontend, history, tools=[WEATHER, CLOCK], max_tokens=1)
    assert with_tools.usage.prompt_tokens > final.usage.prompt_tokens + 50


def test_tool_choice_required_and_named_force_a_call(sdk, frontend):
    chat = [{"role": "user", "content": "Hello! How are you today?"}]
    auto = ask(sdk, frontend, chat, tools=[WEATHER, CLOCK])
    assert auto.choices[0].finish_reason == "stop" and auto.choices[0].message.content
    required = ask(sdk, frontend, chat, tools=[WEATHER, CLOCK], tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather",
                                                                        "get_time")
    named = ask(sdk, frontend, QUESTION, tools=[WEATHER, CLOCK],
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["city"], str)  # held to its schema
    # A strict schema: the grammar admits no argument the tool does not declare, and the
    # grammar-masked drafts change nothing.
    strict = {"type": "function", "function": {**CLOCK["function"], "parameters": {
        **CLOCK["function"]["parameters"], "additionalProperties": False}}}
    calls = [ask(sdk, frontend, QUESTION, tools=[WEATHER, strict], tool_choice="required",
                 extra_body={"speculation": mode}).choices[0].message.tool_calls
             for mode in ("off", "auto")]
    assert [(c.function.name, c.function.arguments) for c in calls[0]] == \
        [(c.function.name, c.function.arguments) for c in calls[1]]
    for call in calls[0]:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_time":
            assert set(arguments) == {"city"}
    none = ask(sdk, frontend, QUESTION, tools=[WEATHER, CLOCK], tool_choice="none")
    assert not none.choices[0].message.tool_calls


@pytest.mark.parametrize("options, field", [
    (dict(tools=[{"type": "function"}]), "tools"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    # A schema no call can be held to, where the call is forced.
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}], tool_choice="required"), "tools"),
    # A forced call has its own grammar: another one beside it is refused.
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
])
def test_bad_tool_fields_are_400_naming_the_field(sdk, frontend, options, field):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(sdk, frontend, QUESTION, **options)
    assert caught.value.body["param"] == field


def test_a_tool_message_needs_its_call_id(sdk, frontend):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(sdk, frontend, QUESTION + [{"role": "tool", "content": "18 C"}], tools=[WEATHER])
    assert "tool_call_id" in caught.value.body["message"]


# --- over gRPC -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpc_client(frontend):
    with GenerationClient(f"127.0.0.1:{frontend.port}", RetryPolicy(attempts=1)) as client:
        yield client


def test_a_tool_conversation_over_grpc_equals_the_http_one(grpc_client, sdk, frontend):
    by_http = ask(sdk, frontend, QUESTION, tools=[WEATHER, CLOCK]).choices[0].message
    result = grpc_client.generate(QUESTION, tools=[WEATHER, CLOCK], max_tokens=80)
    assert result.totals.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in result.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in by_http.tool_calls]
    assert result.text == (by_http.content or "")  # the call's block is not in the text
    assert result.tool_calls[0].id.startswith("call_")
    # The call and its result go back as proto messages; the answer is the HTTP API's.
    weather = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"})
    history = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [result.tool_calls[0].message()]},
        {"role": "tool", "tool_call_id": result.tool_calls[0].id, "content": weather}]
    final = grpc_client.generate(history, tools=[WEATHER, CLOCK], tool_choice="none",
                                 max_tokens=80)
    by_http = ask(sdk, frontend, history, tools=[WEATHER, CLOCK], tool_choice="none")
    assert final.text == by_http.choices[0].message.content and "18" in final.text
    assert final.totals.finish_reason == "stop" and not final.tool_calls
    # A named call, streamed: only the last chunk carries it.
    chunks = list(grpc_client.stream(QUESTION, tools=[WEATHER, CLOCK], tool_choice="get_time",
                                     max_tokens=60))
    assert all(not c.tool_calls for c in chunks[:-1])
    assert [c.name for c in chunks[-1].tool_calls] == ["get_time"]
    assert "".join(c.text for c in chunks) == ""


@pytest.mark.parametrize("fields, details", [
    (dict(tool_choice="nope"), "tool_choice"),
    (dict(tool_choice="get_weather", grammar={"json_object": True}),
     "grammar: cannot be combined"),
    (dict(tool_choice="required", tools=[]), "tool_choice: needs tools"),
    (dict(tools=[{"name": "f", "parameters": "x"}]), "tools[0].parameters_json"),
    (dict(prompt=[1, 2, 3]), "tools: need a text or chat prompt"),
    (dict(prompt=QUESTION + [{"role": "tool", "content": "18 C"}]), "tool_call_id"),
    (dict(prompt=QUESTION + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "get_weather", "arguments": "{oops"}}]}]),
     "tool_calls[0]"),
])
def test_bad_tool_fields_over_grpc_are_invalid_argument(frontend, fields, details):
    fields = {"prompt": QUESTION, "tools": [WEATHER]} | fields
    request = build_request(fields.pop("prompt"), **fields)
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in info.value.details()


def test_sssd_chat_runs_the_demo_tool_loop(frontend, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Use the calculate tool: what is 1234 * 5678?\n"))
    code = sssd_main(["chat", "--target", f"127.0.0.1:{frontend.port}", "--demo-tools",
                      "--max-tokens", "60"])
    out, err = capsys.readouterr()
    assert code == 0, err
    # The call ran here and its result went back: the model's answer quotes it.
    assert "[calculate(" in err and "-> 7006652]" in err
    assert "7006652" in out.replace(",", "")

"""The Generate API over real gRPC on 127.0.0.1: streaming, exactness, bad input, limits,
cancellation, deadlines, health, draining and client retries."""

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.client import GenerationClient, RetryPolicy, build_request
from sssd.v1 import generate_pb2, generate_pb2_grpc
from sssd.verifier.serving.frontend import SERVICE_NAME, start_frontend

from support.serving import frontend_config, running_frontend

MAX_LEN = 1024


def make_config(datastore, **overrides):
    return frontend_config(datastore, MAX_LEN, **overrides)


@pytest.fixture(scope="module")
def frontend(target_model_fp32, warm_datastore):
    with running_frontend(make_config(warm_datastore), target_model_fp32) as frontend:
        yield frontend


@pytest.fixture(scope="module")
def client(frontend):
    with GenerationClient(f"127.0.0.1:{frontend.port}", RetryPolicy(attempts=1)) as client:
        yield client


def test_streamed_greedy_answer_equals_plain_decoding(client, target_model_fp32,
                                                      mt_bench_prompts, greedy_references):
    chunks = list(client.stream(mt_bench_prompts[0], max_tokens=40))
    token_ids = [t for chunk in chunks for t in chunk.token_ids]
    assert token_ids == greedy_references[0][:40]
    text = "".join(chunk.text for chunk in chunks)
    assert text == target_model_fp32.tokenizer.decode(token_ids, skip_special_tokens=True)
    totals = chunks[-1].totals
    assert totals.completion_tokens == 40 and totals.finish_reason == "length"
    assert totals.prompt_tokens == len(mt_bench_prompts[0])
    assert 0 < totals.time_to_first_token_s < totals.total_s and totals.tokens_per_second > 0
    assert all(chunk.totals is None for chunk in chunks[:-1])
    steps = [chunk for chunk in chunks if chunk.accepted_tokens is not None]
    assert steps and all(chunk.budget >= 1 and chunk.verify_ms > 0 for chunk in steps)
    # The warm datastore holds this answer: speculation pays off.
    assert totals.mean_accepted_length > 1.5 and sum(c.accepted_tokens for c in steps) > 0


def test_speculation_off_gives_the_same_answer_without_drafts(client, mt_bench_prompts,
                                                              greedy_references):
    chunks = list(client.stream(mt_bench_prompts[0], max_tokens=16, speculation="off"))
    assert [t for c in chunks for t in c.token_ids] == greedy_references[0][:16]
    steps = [c for c in chunks if c.accepted_tokens is not None]
    assert all(c.accepted_tokens == 0 and c.budget == 1 for c in steps)
    assert chunks[-1].totals.mean_accepted_length == pytest.approx(1.0)


def test_text_and_chat_prompts_and_stop_strings(client, target_model_fp32, mt_bench_prompts):
    by_text = client.generate("What is the capital of France?", max_tokens=24)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    by_chat = client.generate(chat, max_tokens=24)
    assert by_text.token_ids == by_chat.token_ids and by_text.text
    # Stop at a word from the middle of the answer: the text ends right before it.
    words = by_text.text.split()
    stop = words[len(words) // 2]
    stopped = client.generate("What is the capital of France?", max_tokens=24, stop=[stop])
    assert stopped.totals.finish_reason == "stop"
    assert stop not in stopped.text and by_text.text.startswith(stopped.text)
    assert by_text.text[len(stopped.text):].startswith(stop)


@pytest.mark.parametrize("fields,field_name", [
    (dict(prompt=""), "prompt.text"),
    (dict(prompt="   "), "prompt.text"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="hi", max_tokens=100000), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt=[{"role": "robot", "content": "hi"}]), "role"),
    (dict(prompt=[{"role": "user", "content": " "}]), "prompt.chat.messages"),
    (dict(prompt=[1, 2, 10**6]), "outside the vocabulary"),
    (dict(prompt=[1] * MAX_LEN), "context window"),
    (dict(prompt="hi", stop=["x" * 300]), "stop"),
    (dict(prompt="hi", speculation="ssd"), "--speculator"),  # this server has no speculator
    (dict(prompt="hi", grammar={"json_schema": {"type": "foo"}}), "response_format.json_schema"),
    (dict(prompt="hi", grammar={"regex": "a(b"}), "guided_regex"),
    (dict(prompt="hi", grammar={"choice": []}), "guided_choice"),
])
def test_bad_requests_are_invalid_argument(frontend, fields, field_name):
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    prompt = fields.pop("prompt")
    request = build_request(prompt, **fields) if prompt != [] else generate_pb2.GenerateRequest()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in info.value.details()
    assert frontend.backend.num_requests == 0  # nothing was admitted


def test_a_grammar_shapes_the_answer_over_grpc(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    prompt = "Name the capital of France as JSON."
    answers = [client.generate(prompt, max_tokens=32, speculation=mode,
                               grammar={"json_schema": schema}) for mode in ("off", "auto")]
    assert answers[0].token_ids == answers[1].token_ids
    assert set(json.loads(answers[0].text)) == {"city"}
    assert answers[0].totals.finish_reason == "stop"
    choice = client.generate(prompt, max_tokens=8, grammar={"choice": ["Paris", "Lyon"]})
    assert choice.text in ("Paris", "Lyon")


def test_unknown_speculation_mode_is_invalid_argument(frontend):
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    request = build_request("hi", max_tokens=4)
    request.speculation = 7  # a mode from a newer client
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculation" in info.value.details()


def test_speculation_sssd_names_the_servers_source(client, mt_bench_prompts, greedy_references):
    chunks = list(client.stream(mt_bench_prompts[0], max_tokens=16, speculation="sssd"))
    assert [t for c in chunks for t in c.token_ids] == greedy_references[0][:16]


def test_cancel_frees_the_sequence_at_once(frontend, mt_bench_prompts, wait_until):
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    call = stub.Generate(build_request(mt_bench_prompts[3], max_tokens=500))
    next(call)  # the first tokens arrived: the sequence is running
    assert frontend.backend.num_requests == 1
    call.cancel()
    assert wait_until(lambda: frontend.backend.num_requests == 0 and
                      not frontend.backend.engine.num_running, timeout=5)


def test_deadline_ends_the_request(frontend, mt_bench_prompts, wait_until):
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    request = build_request(mt_bench_prompts[4], max_tokens=500)
    # The deadline is a third of this (greedy, so repeatable) answer's own time: a fixed one
    # outlived the whole answer on a faster machine.
    start = time.perf_counter()
    list(stub.Generate(request))
    answer_s = time.perf_counter() - start
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=answer_s / 3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: frontend.backend.num_requests == 0, timeout=5)


def test_concurrency_limit_is_resource_exhausted(frontend, mt_bench_prompts, wait_until):
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    calls = [stub.Generate(build_request(mt_bench_prompts[i], max_tokens=500)) for i in range(3)]
    try:
        for call in calls:
            next(call)  # all three admitted (the limit is 3)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(build_request("hi", max_tokens=4), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 concurrent requests" in info.value.details()
    finally:
        for call in calls:
            call.cancel()
    assert wait_until(lambda: frontend.backend.num_requests == 0, timeout=5)


def test_health_loading_serving_and_drain(target_model_fp32, warm_datastore, mt_bench_prompts,
                                          greedy_references, wait_until):
    frontend = start_frontend(make_config(warm_datastore, grace_s=30.0))
    target = f"127.0.0.1:{frontend.port}"
    health_stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))

    def status():
        return health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                 timeout=5).status

    try:
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        # A client started while the model loads is answered UNAVAILABLE and retries.
        loader = threading.Timer(0.5, frontend.load, args=(target_model_fp32,))
        loader.start()
        with GenerationClient(target, RetryPolicy(attempts=20, initial_backoff_s=0.1,
                                                  max_backoff_s=0.5)) as client:
            result = client.generate(mt_bench_prompts[2], max_tokens=8)
        loader.join()
        assert result.token_ids == greedy_references[2][:8]
        assert status() == health_pb2.HealthCheckResponse.SERVING

        # Drain: a running request finishes, new ones are refused, health says NOT_SERVING.
        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(target))
        running = stub.Generate(build_request(mt_bench_prompts[5], max_tokens=24))
        first = next(running)
        stopper = threading.Thread(target=frontend.stop, args=(30.0,))
        stopper.start()
        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(build_request("hi", max_tokens=4), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(running)
        tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert tokens == greedy_references[5][:24]
        assert rest[-1].totals.finish_reason == "length"
        stopper.join(30)
    finally:
        frontend.stop(0)


def test_logprobs_over_grpc_carry_token_texts_and_match_without_speculation(
        client, target_model_fp32, mt_bench_prompts):
    answers = [client.generate(mt_bench_prompts[1], max_tokens=16, top_logprobs=3,
                               speculation=mode) for mode in ("off", "auto")]
    assert answers[0].token_ids == answers[1].token_ids
    tokenizer = target_model_fp32.tokenizer
    for off, auto in zip(answers[0].logprobs, answers[1].logprobs, strict=True):
        assert off.token_id == auto.token_id and off.logprob == pytest.approx(auto.logprob,
                                                                              abs=1e-4)
        assert [t for t, _ in off.top] == [t for t, _ in auto.top] and len(off.top) == 3
        assert off.token == tokenizer.decode([off.token_id])
        assert list(off.top_tokens) == [tokenizer.decode([t]) for t, _ in off.top]
    assert [e.token_id for e in answers[0].logprobs] == answers[0].token_ids


def test_cli_generate_takes_every_request_option(frontend, capsys):
    from sssd.cli.main import main

    target = f"127.0.0.1:{frontend.port}"
    code = main(["generate", "Describe Paris as a JSON object.", "--target", target,
                 "--max-tokens", "40", "--json", "--logprobs", "2", "--presence-penalty", "0.5",
                 "--logit-bias", "1=-5", "--min-tokens", "2", "--stats"])
    out, err = capsys.readouterr()
    assert code == 0, err
    answer = out.strip()
    table = [line for line in err.splitlines() if line.startswith(("'", '"'))]
    stats = next(line for line in err.splitlines()  # --stats: "[N tokens, reason; ..."
                 if line.startswith("[") and " tokens, " in line)
    reported = int(stats[1:].split()[0])
    assert len(table) == reported and reported >= 2
    if "length" not in stats:  # a whole answer is one JSON object (--json)
        assert isinstance(json.loads(answer), dict)
    assert answer.startswith("{")


@pytest.mark.parametrize("options, message", [
    (["--logit-bias", "12"], "--logit-bias: TOKEN_ID=BIAS"),
    (["--json-schema", "no/such/schema.json"], "--json-schema"),
    (["--json-schema", "{not json"], "--json-schema: not JSON"),
    (["--logprobs", "21"], "top_logprobs"),  # the server's range, answered INVALID_ARGUMENT
])
def test_cli_refuses_a_bad_option_in_one_line(frontend, capsys, options, message):
    from sssd.cli.main import main

    code = main(["generate", "hi", "--target", f"127.0.0.1:{frontend.port}", *options])
    err = capsys.readouterr().err
    assert code in (1, 2) and message in err and "Traceback" not in err


def test_tools_on_a_model_without_a_tool_format_are_refused(frontend):
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{frontend.port}"))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(build_request("hi", tools=[tool]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools: the chat template" in info.value.details()

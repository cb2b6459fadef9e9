"""Property-based fuzzing (hypothesis) of every RPC of every service, each a real process on
127.0.0.1: the drafter, the speculator, the Generate API (one process, SSSD through the
drafter) and the indexer's health service (with its Redis).

Requests are built from the protos' descriptors: every field set or left out, integers at and
around their bounds, NaN and infinite floats, unknown enum values, long strings, repeated fields
from empty to hundreds of thousands of entries, and field values that make sense to the service
(its tokenizer fingerprint, token ids inside the vocabulary, a few sequence ids) mixed in, so
the fuzzing reaches past the first check. Then raw frames: random bytes and fields with the
wrong wire type as the request payload, and garbage on the TCP port itself.

Each call must end in a clear status (never UNKNOWN, which an uncaught exception in a handler
gives, and INTERNAL only as gRPC's own answer to a payload that does not parse); no process
dies; a refused call changes no state (checked where a service reports it: the drafter's and
the speculator's live-sequence counts); and afterwards a valid request is served exactly as
before the fuzzing (the Generate API: the greedy reference).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sssd.v1 import drafter_pb2, generate_pb2, speculator_pb2

VOCAB = 49152
# Statuses a service may answer to a bad request; OK where the request happens to be valid.
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED}
UNPARSABLE = "Exception deserializing request!"  # gRPC's INTERNAL for a payload it cannot parse
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

I32, I64 = (-2**31, 2**31 - 1), (-2**63, 2**63 - 1)
U32, U64 = (0, 2**32 - 1), (0, 2**64 - 1)
INT_BOUNDS = {FieldDescriptor.TYPE_INT32: I32, FieldDescriptor.TYPE_SINT32: I32,
              FieldDescriptor.TYPE_SFIXED32: I32, FieldDescriptor.TYPE_INT64: I64,
              FieldDescriptor.TYPE_SINT64: I64, FieldDescriptor.TYPE_SFIXED64: I64,
              FieldDescriptor.TYPE_UINT32: U32, FieldDescriptor.TYPE_FIXED32: U32,
              FieldDescriptor.TYPE_UINT64: U64, FieldDescriptor.TYPE_FIXED64: U64}


def scalar(field, hints, hinted=True):
    """Values for one field (an element of a repeated one): its type's range and edges, plus
    the field's hint when `hinted`."""
    kind = field.type
    if kind in INT_BOUNDS:
        low, high = INT_BOUNDS[kind]
        values = st.one_of(st.sampled_from(sorted({low, high, 0, 1, max(low, -1)})),
                           st.integers(low, high), st.integers(max(low, -4), min(high, 70000)))
    elif kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        values = st.floats(width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64)
    elif kind == FieldDescriptor.TYPE_BOOL:
        values = st.booleans()
    elif kind == FieldDescriptor.TYPE_STRING:
        values = st.one_of(st.text(max_size=40), st.just("x" * 200_000),
                           st.just("\x00\ufffd\u202e" * 50))
    elif kind == FieldDescriptor.TYPE_BYTES:
        values = st.binary(max_size=64)
    elif kind == FieldDescriptor.TYPE_ENUM:
        values = st.integers(-3, 12)  # proto3 enums are open: unknown numbers parse
    else:
        values = message(field.message_type, hints)
    hint = hints.get(field.name) if hinted else None
    return st.one_of(values, hint) if hint is not None else values


def is_map(field) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def value(field, hints):
    if not field.is_repeated:
        return scalar(field, hints)
    if is_map(field):  # keys and values of the entry's types, a few or thousands of them
        entry = field.message_type.fields_by_name
        keys = scalar(entry["key"], hints, hinted=False)
        values = scalar(entry["value"], hints, hinted=False)
        return st.one_of(st.dictionaries(keys, values, max_size=6),
                         st.integers(1_000, 20_000).map(lambda n: dict.fromkeys(range(n), 1)))
    element = scalar(field, hints, hinted=False)
    if field.message_type is not None:
        huge = st.integers(300, 6_000).map(lambda n: [message_class(field.message_type)()] * n)
    else:  # one small value, up to hundreds of thousands of times
        small = {FieldDescriptor.TYPE_STRING: "a", FieldDescriptor.TYPE_BYTES: b"a",
                 FieldDescriptor.TYPE_BOOL: True}.get(field.type, 1)
        huge = st.integers(1_000, 300_000).map(lambda n: [small] * n)
    hint = hints.get(field.name)  # for a repeated field: a strategy of whole lists
    return st.one_of(st.lists(element, max_size=6), huge, *([hint] if hint is not None else []))


def message(descriptor, hints, depth=0):
    """A strategy of messages of `descriptor`, every field present or absent; a hint under
    the message's own name (a strategy of whole valid messages) is mixed in half the time."""
    cls = message_class(descriptor)
    if depth > 2:
        return st.just(cls())
    hint = hints.get(descriptor.name)
    if hint is not None:
        return st.one_of(message(descriptor, {k: v for k, v in hints.items()
                                              if k != descriptor.name}, depth), hint)
    fields = {f.name: st.one_of(st.none(), value(f, hints)) for f in descriptor.fields}

    def build(values):
        msg = cls()
        for name, field_value in values.items():
            if field_value is None:
                continue
            field = descriptor.fields_by_name[name]
            if field.is_repeated:
                if is_map(field):
                    getattr(msg, name).update(field_value)
                elif field.message_type is not None:
                    getattr(msg, name).extend(field_value)
                else:
                    getattr(msg, name)[:] = field_value
            elif field.message_type is not None:
                getattr(msg, name).CopyFrom(field_value)
            else:
                try:
                    setattr(msg, name, field_value)
                except ValueError:  # e.g. a closed enum; the wire-level fuzzing covers it
                    pass
        return msg

    return st.fixed_dictionaries(fields).map(build)


def message_class(descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def wrong_wire_types(descriptor):
    """Raw payloads whose fields carry a wire type other than their own, or truncated data."""
    numbers = [f.number for f in descriptor.fields] or [1]

    def frame(number, wire, payload):
        tag = (number << 3) | wire
        out = bytearray()
        while True:
            byte, tag = tag & 0x7F, tag >> 7
            out.append(byte | (0x80 if tag else 0))
            if not tag:
                break
        return bytes(out) + payload

    return st.builds(frame, st.sampled_from(numbers), st.integers(0, 7), st.binary(max_size=12))


def call(channel, service, method, payload: bytes, streaming: bool):
    """Sends raw request bytes; returns (status, responses)."""
    path = f"/{service.full_name}/{method.name}"
    identity = lambda b: b  # noqa: E731
    try:
        if streaming:
            # Health.Watch never ends by itself: a short deadline ends it.
            timeout = 0.2 if method.name == "Watch" else 60
            responses = list(channel.unary_stream(path, request_serializer=identity,
                                                  response_deserializer=identity)(
                payload, timeout=timeout))
        else:
            responses = [channel.unary_unary(path, request_serializer=identity,
                                             response_deserializer=identity)(payload,
                                                                             timeout=60)]
        return grpc.StatusCode.OK, responses
    except grpc.RpcError as error:
        return error.code(), error.details()


def assert_clear(status, details, payload_parses, method_name=""):
    assert status != grpc.StatusCode.UNKNOWN, f"uncaught exception in a handler: {details}"
    if method_name == "Watch" and status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return  # the stream was open until the deadline: what Watch does
    if status == grpc.StatusCode.INTERNAL:
        assert not payload_parses and details == UNPARSABLE, details
    else:
        assert status in CLEAR, (status, details)


def parses(descriptor, payload):
    try:
        message_class(descriptor).FromString(payload)
        return True
    except Exception:  # noqa: BLE001 - DecodeError and friends
        return False


def garbage_on_the_socket(port):
    """Not even HTTP/2: random bytes straight to the port, then a half-open connection."""
    rng = np.random.default_rng(0)
    for size in (1, 24, 4096):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
            try:
                sock.recv(1024)
            except (TimeoutError, ConnectionError):
                pass
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # the preface, then silence


def fuzz_service(channel, service, hints, counts=None, examples=60):
    """Every method of `service`: fuzzed messages, then wrong wire types and random bytes.
    `counts()` is the service's live state (None: it reports none); a refused call must leave
    it as it was. Returns
    {method name: Counter of the statuses its fuzzed messages got}."""
    from collections import Counter

    seen = {}
    for method in service.methods:
        statuses = seen[method.name] = Counter()
        streaming = method.server_streaming
        descriptor = method.input_type

        @settings(FUZZ, max_examples=examples)
        @given(message(descriptor, hints))
        def typed(msg):
            before = counts() if counts else None
            status, details = call(channel, service, method, msg.SerializeToString(), streaming)
            statuses[status.name] += 1
            assert_clear(status, details, True, method.name)
            if status != grpc.StatusCode.OK and counts:
                assert counts() == before, f"{method.name} refused ({status}) yet changed state"

        @settings(FUZZ, max_examples=max(10, examples // 3))
        @given(st.one_of(wrong_wire_types(descriptor), st.binary(max_size=64)))
        def raw(payload):
            before = counts() if counts else None
            status, details = call(channel, service, method, payload, streaming)
            assert_clear(status, details, parses(descriptor, payload), method.name)
            if status != grpc.StatusCode.OK and counts:
                assert counts() == before

        typed()
        raw()
    return seen


def tokens(size):
    return st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=size)


@pytest.fixture(scope="module")
def fingerprint(tokenizer):
    from sssd.common.model.tokenizer import tokenizer_fingerprint

    return tokenizer_fingerprint(tokenizer)


@pytest.fixture(scope="module")
def datastore(tmp_path_factory, fingerprint):
    from sssd.datastore.build import build_datastore

    directory = tmp_path_factory.mktemp("fuzz-datastore")
    rng = np.random.default_rng(1)
    build_datastore(directory, [rng.integers(0, 500, 300) for _ in range(20)], VOCAB,
                    fingerprint, shard_tokens=8000)
    return directory


def console(name):
    return str(Path(sys.executable).with_name(name))


def health_serving(port, timeout_s=120.0):
    """True once the server's health check says SERVING (a model may be loading first)."""
    import time

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=60,
                                wait_for_ready=True).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return True
            time.sleep(0.2)
    return False


def test_the_drafter_answers_every_fuzzed_call_clearly(spawn_service, datastore, fingerprint):
    from sssd.drafter.client import RemoteDrafter

    process, port = spawn_service([console("sssd-drafter"), "--datastore-dir", str(datastore),
                                   "--vocab-size", str(VOCAB), "--tokenizer-fingerprint",
                                   fingerprint, "--port", "0", "--num-threads", "1"],
                                  drain=True)
    context = np.arange(10, 40, dtype=np.int32)
    with RemoteDrafter(f"127.0.0.1:{port}", timeout_s=30) as client:
        from sssd.common.drafting.proposer import DraftRequest

        (expected,) = client.propose([DraftRequest("probe", context, 16, is_start=True)])
        client.end(["probe"])
        valid = st.builds(drafter_pb2.SequenceDraftRequest, seq_id=st.sampled_from(["a", "b"]),
                          new_token_ids=tokens(40), budget=st.integers(2, 64),
                          is_start=st.just(True))
        hints = {"seq_id": st.sampled_from(["a", "b", "probe"]), "new_token_ids": tokens(40),
                 "budget": st.integers(0, 300), "seq_ids": st.lists(st.sampled_from(["a", "b"])),
                 "ProposeRequest": st.builds(drafter_pb2.ProposeRequest,
                                             sequences=st.lists(valid, min_size=1, max_size=1))}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            service = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]
            seen = fuzz_service(channel, service, hints,
                                lambda: client.info()["num_sequences"], examples=120)
        # Not vacuous: valid proposals were served and bad ones refused as such.
        assert seen["Propose"]["OK"] > 0 and seen["Propose"]["INVALID_ARGUMENT"] > 0, seen
        garbage_on_the_socket(port)
        assert process.poll() is None
        client.end(["a", "b"])
        (tree,) = client.propose([DraftRequest("probe-2", context, 16, is_start=True)])
        assert tree == expected  # served exactly as before the fuzzing
        assert client.info()["num_sequences"] == 1


def test_the_speculator_answers_every_fuzzed_call_clearly(spawn_service, fingerprint):
    from sssd.speculator.client import RemoteSpeculator

    process, port = spawn_service([sys.executable, "-m", "sssd.speculator.service", "--port", "0",
                                   "--metrics-port", "0", "--draft-layers", "2", "--dtype",
                                   "float32", "--max-sequences", "16"], drain=True)
    remote = RemoteSpeculator(f"127.0.0.1:{port}", timeout_s=30)
    try:
        valid = st.builds(speculator_pb2.SequenceRound, seq_id=st.sampled_from(["a", "b"]),
                          is_start=st.just(True), token_ids=tokens(30),
                          budget=st.integers(1, 16), temperature=st.just(0.0))
        hints = {"RoundRequest": st.builds(speculator_pb2.RoundRequest,
                                           sequences=st.lists(valid, min_size=1, max_size=1),
                                           tokenizer_fingerprint=st.just(fingerprint)),
                 "tokenizer_fingerprint": st.just(fingerprint),
                 "seq_id": st.sampled_from(["a", "b"]), "token_ids": tokens(30),
                 "budget": st.integers(0, 64), "num_accepted": st.integers(0, 8),
                 "temperature": st.sampled_from([0.0, 0.7]),
                 "seq_ids": st.lists(st.sampled_from(["a", "b"]))}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            service = speculator_pb2.DESCRIPTOR.services_by_name["Speculator"]
            seen = fuzz_service(channel, service, hints,
                                lambda: remote.info()["num_sequences"])
        assert seen["Round"]["OK"] > 0 and seen["Round"]["INVALID_ARGUMENT"] > 0, seen
        garbage_on_the_socket(port)
        assert process.poll() is None
        remote.end(["a", "b"])
        assert remote.info()["num_sequences"] == 0
        assert health_serving(port)
    finally:
        remote.close()


def test_the_generate_api_answers_every_fuzzed_call_clearly(spawn_service, datastore,
                                                            fingerprint, free_port,
                                                            greedy_references,
                                                            mt_bench_prompts, wait_until):
    from sssd.client import GenerationClient, RetryPolicy

    _, drafter_port = spawn_service([console("sssd-drafter"), "--datastore-dir", str(datastore),
                                     "--vocab-size", str(VOCAB), "--tokenizer-fingerprint",
                                     fingerprint, "--port", "0", "--num-threads", "1"],
                                    drain=True)
    port, http_port = free_port(), free_port()
    process, _ = spawn_service([console("sssd"), "serve", "--port", str(port), "--http-port",
                                str(http_port), "--dtype",
                                "float32", "--mode", "sssd", "--drafter-target",
                                f"127.0.0.1:{drafter_port}", "--max-tokens-limit", "8",
                                "--default-max-tokens", "4", "--max-requests", "4",
                                "--max-batch-size", "2"], drain=True)
    assert health_serving(port)
    with GenerationClient(f"127.0.0.1:{port}", RetryPolicy(attempts=1)) as client:
        hints = {"GenerateRequest": st.builds(
                     generate_pb2.GenerateRequest, max_tokens=st.integers(1, 8),
                     tokens=st.builds(generate_pb2.TokenPrompt, token_ids=tokens(20))),
                 "token_ids": tokens(20), "max_tokens": st.integers(0, 10),
                 "role": st.sampled_from(["user", "system", "assistant", "tool"])}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            service = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
            seen = fuzz_service(channel, service, hints, examples=40)
        assert seen["Generate"]["OK"] > 0 and seen["Generate"]["INVALID_ARGUMENT"] > 0, seen
        garbage_on_the_socket(port)
        assert process.poll() is None
        answer = client.generate(mt_bench_prompts[0], max_tokens=8)
        assert answer.token_ids == greedy_references[0][:8]
    # The HTTP API of the same process: a client's mistake is never a 500.
    statuses = fuzz_http(http_port)
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
    assert all(status < 500 for status in statuses), statuses
    garbage_on_the_socket(http_port)
    assert process.poll() is None
    status, reply = http_call(http_port, "/v1/completions", json_body={
        "prompt": mt_bench_prompts[0], "max_tokens": 8, "temperature": 0})
    assert status == 200
    assert reply["usage"]["completion_tokens"] == 8 and reply["choices"][0]["text"]
    with GenerationClient(f"127.0.0.1:{port}", RetryPolicy(attempts=1)) as client:
        assert client.generate(mt_bench_prompts[0], max_tokens=8).token_ids == \
            greedy_references[0][:8]


JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False), st.text(max_size=40),
                        st.sampled_from(["", "x" * 100_000, "user", "auto", "off", "text"]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda children: st.one_of(
    st.lists(children, max_size=6), st.dictionaries(st.text(max_size=12), children,
                                                    max_size=6)), max_leaves=20)
HTTP_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "top_k", "seed", "stop", "n", "ignore_eos", "stream",
               "stream_options", "user", "speculation", "logprobs", "presence_penalty", "tools",
               "tokens", "add_special_tokens", "add_generation_prompt", "top_logprobs",
               "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p",
               "stop_token_ids", "tool_choice", "response_format", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]
VALID_MESSAGES = [{"role": "user", "content": "hi"}]


def http_call(port, path, json_body=None, raw=None, method="POST"):
    """(status, parsed JSON or the raw text) of one request on a fresh connection."""
    import http.client
    import json

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = raw if raw is not None else (
            None if json_body is None else json.dumps(json_body).encode())
        connection.request(method, path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode(errors="replace")
    finally:
        connection.close()


def fuzz_http(port) -> dict[int, int]:
    """Random bodies on every POST endpoint (sometimes starting from a valid request), random
    bytes, wrong methods and paths: the count of each status seen."""
    import json

    statuses: dict[int, int] = {}
    paths = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
    valid = {"/v1/chat/completions": {"messages": VALID_MESSAGES, "max_tokens": 2},
             "/v1/completions": {"prompt": "hi", "max_tokens": 2},
             "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}

    @FUZZ
    @given(path=st.sampled_from(paths), base=st.booleans(),
           fields=st.dictionaries(st.one_of(st.sampled_from(HTTP_FIELDS), st.text(max_size=8)),
                                  JSON_VALUES, max_size=5),
           top=st.one_of(st.none(), JSON_VALUES))
    def bodies(path, base, fields, top):
        body = (dict(valid[path]) if base else {}) | fields
        if top is not None and not fields:
            body = top  # not even an object, sometimes
        status, reply = http_call(port, path, json_body=body)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (path, json.dumps(body)[:300], reply)
        if status != 200:
            assert set(reply["error"]) == {"message", "type", "param", "code"}, reply

    @FUZZ
    @given(path=st.sampled_from(paths), raw=st.binary(max_size=200))
    def raw_bodies(path, raw):
        status, reply = http_call(port, path, raw=raw)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (path, raw, reply)

    bodies()
    raw_bodies()
    for method, path in (("GET", "/v1/completions"), ("DELETE", "/v1/models"),
                         ("GET", "/nothing"), ("POST", "/health")):
        status, _ = http_call(port, path, method=method)
        assert status in (404, 405), (method, path, status)
    return statuses


def test_the_indexer_health_service_answers_fuzzed_calls_clearly(spawn_service, tmp_path,
                                                                 fingerprint, free_port):
    import subprocess

    from sssd.common.conversations.redis_server import RedisServer

    port = free_port()
    with RedisServer(tmp_path / "redis") as redis_server:
        process = subprocess.Popen(
            [console("sssd-indexer"), "run", "--datastore-dir", str(tmp_path / "live"),
             "--redis-url", redis_server.url, "--vocab-size", str(VOCAB),
             "--tokenizer-fingerprint", fingerprint, "--port", str(port), "--metrics-port",
             "0"], stderr=subprocess.DEVNULL, env={**os.environ})
        try:
            assert health_serving(port)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                service = health_pb2.DESCRIPTOR.services_by_name["Health"]
                fuzz_service(channel, service, {"service": st.sampled_from(["", "sssd"])},
                             examples=30)
            garbage_on_the_socket(port)
            assert process.poll() is None and health_serving(port)
        finally:
            process.terminate()
            process.wait(30)

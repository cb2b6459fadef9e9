"""A server started with an API key, over real HTTP (the openai SDK, raw requests) and gRPC:
401 / UNAUTHENTICATED without the key or with a wrong one, 200 with it; health and metrics
open by default, closed with open_health off; gRPC health always open."""

import http.client
import json

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.client import GenerationClient, RetryPolicy

from support.serving import frontend_config, running_frontend

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def frontend(target_model_fp32, warm_datastore):
    config = frontend_config(warm_datastore, 512, api_key=KEY, open_health=False)
    with running_frontend(config, target_model_fp32) as frontend:
        yield frontend


def request(frontend, method, path, body=None, headers=()):
    connection = http.client.HTTPConnection("127.0.0.1", frontend.http.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, data, {"Content-Type": "application/json"} |
                           dict(headers))
        response = connection.getresponse()
        return response.status, response.read(), dict(response.getheaders())
    finally:
        connection.close()


def test_sdk_with_the_key_works_and_without_it_is_401(frontend):
    url = frontend.http_url + "/v1"
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0) as client:
        reply = client.completions.create(model=frontend.http.api.model_name, prompt="Hello",
                                          max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    for wrong in ("wrong-key", KEY + "x"):
        with openai.OpenAI(base_url=url, api_key=wrong, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as caught:
                client.models.list()
        assert caught.value.status_code == 401
        assert caught.value.body["code"] == "invalid_api_key"


def test_every_guarded_path_is_401_in_openai_shape(frontend):
    for method, path, body in (("POST", "/v1/chat/completions", {"messages": []}),
                               ("POST", "/v1/completions", {"prompt": "x"}),
                               ("GET", "/v1/models", None),
                               ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/v1/no-such-route", None),
                               ("GET", "/health", None), ("GET", "/metrics", None)):
        status, raw, headers = request(frontend, method, path, body)
        assert status == 401, (path, raw)
        error = json.loads(raw)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert headers["www-authenticate"] == "Bearer"
    auth = {"Authorization": f"Bearer {KEY}"}
    assert request(frontend, "GET", "/health", headers=auth)[0] == 200
    assert request(frontend, "GET", "/metrics", headers=auth)[0] == 200
    status, raw, _ = request(frontend, "POST", "/tokenize", {"prompt": "Hello"}, auth)
    assert status == 200 and json.loads(raw)["count"] >= 1
    assert b"unauthenticated" in request(frontend, "GET", "/metrics", headers=auth)[1]


def test_grpc_needs_the_key_as_metadata(frontend):
    target = f"127.0.0.1:{frontend.port}"
    with GenerationClient(target, RetryPolicy(attempts=1), api_key=KEY) as client:
        assert client.generate("Hello", max_tokens=3).totals.completion_tokens == 3
    for wrong in (None, "wrong-key"):
        with GenerationClient(target, RetryPolicy(attempts=1), api_key=wrong) as client:
            client._metadata = () if wrong is None else client._metadata
            with pytest.raises(grpc.RpcError) as caught:
                client.generate("Hello", max_tokens=3)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in caught.value.details()
    with grpc.insecure_channel(target) as channel:  # probes need no key
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_and_metrics_stay_open_by_default(target_model_fp32, warm_datastore):
    config = frontend_config(warm_datastore, 512, api_key=KEY)
    with running_frontend(config, target_model_fp32) as frontend:
        assert request(frontend, "GET", "/health")[0] == 200
        assert request(frontend, "GET", "/metrics")[0] == 200
        assert request(frontend, "GET", "/v1/models")[0] == 401

"""gRPC TLS on every service (drafter, speculator, Generate API, indexer health) and the Redis
password, each with real processes on 127.0.0.1. The CAs and certificates are made by the `pki`
fixture (tests/conftest.py)."""

import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.common.drafting.proposer import DraftRequest
from sssd.common.rpc import tls
from sssd.common.rpc.tls import TlsFiles
from sssd.drafter.client import RemoteDrafter


def server_flags(pki):
    cert, key = pki["ours"]["server"]
    return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ours"]["ca"]]


def client_tls(pki, ca="ours", with_cert=True):
    cert, key = pki["ours"]["client"] if with_cert else (None, None)
    return TlsFiles(cert=cert, key=key, ca=pki[ca]["ca"])


def health_status(port, files, timeout=5.0):
    """The health status over a channel made with `files`, or the gRPC status code."""
    with tls.channel(f"127.0.0.1:{port}", files) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=timeout).status
        except grpc.RpcError as err:
            return err.code()


def assert_only_mutual_tls_gets_in(port, pki):
    assert health_status(port, client_tls(pki)) in (health_pb2.HealthCheckResponse.SERVING,
                                                    health_pb2.HealthCheckResponse.NOT_SERVING)
    assert health_status(port, TlsFiles(), timeout=2) == grpc.StatusCode.UNAVAILABLE  # plaintext
    # No client certificate, or a server certificate from a CA the client does not trust.
    assert health_status(port, client_tls(pki, with_cert=False), timeout=2) == \
        grpc.StatusCode.UNAVAILABLE
    assert health_status(port, client_tls(pki, ca="theirs"), timeout=2) == \
        grpc.StatusCode.UNAVAILABLE


def test_tls_files_are_checked_with_clear_errors(tmp_path, pki):
    with pytest.raises(ValueError, match="both a certificate and its key"):
        TlsFiles(cert=pki["ours"]["server"][0])
    with pytest.raises(ValueError, match="missing.pem"):
        TlsFiles(ca=str(tmp_path / "missing.pem")).channel_credentials()
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(ValueError, match="not PEM"):
        TlsFiles(cert=str(tmp_path / "junk.crt"), key=pki["ours"]["server"][1]) \
            .server_credentials()
    env = {"SSSD_TLS_CA": "ca.pem", "SSSD_TLS_SERVER_NAME": "drafter.internal"}
    files = TlsFiles.from_env(env)
    assert files == TlsFiles(ca="ca.pem", server_name="drafter.internal") and files.dials_tls
    assert files.channel_options() == [("grpc.ssl_target_name_override", "drafter.internal")]
    assert not TlsFiles.from_env({}).dials_tls and not TlsFiles.from_env({}).serves_tls
    # A service refuses to start on unusable files, and says which.
    result = subprocess.run([str(Path(sys.executable).with_name("sssd-drafter")), "--port", "0",
                             "--tls-cert", str(tmp_path / "junk.crt"), "--tls-key",
                             pki["ours"]["server"][1]], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "junk.crt is not PEM" in result.stderr


def test_drafter_serves_mutual_tls_and_its_client_drafts_through_it(spawn_service, pki):
    _, port = spawn_service([str(Path(sys.executable).with_name("sssd-drafter")), "--port", "0",
                             "--vocab-size", "1000", "--num-threads", "1"] + server_flags(pki),
                            drain=True)
    assert_only_mutual_tls_gets_in(port, pki)
    remote = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=5, tls_files=client_tls(pki))
    try:
        prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
        (tree,) = remote.propose([DraftRequest("a", prompt, budget=8, is_start=True)])
        assert tree.token_ids.tolist()[:2] == [7, 8]  # the root, then the repeat's next token
    finally:
        remote.close()
    plain = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=2, tls_files=TlsFiles())
    try:
        with pytest.raises(Exception) as failure:
            plain.propose([DraftRequest("b", [1, 2, 3], budget=4, is_start=True)])
        assert "UNAVAILABLE" in str(failure.value) or "unavailable" in str(failure.value)
    finally:
        plain.close()


def test_speculator_and_generate_api_serve_mutual_tls(spawn_service, pki, free_port):
    _, port = spawn_service([sys.executable, "-m", "sssd.speculator.service", "--port", "0",
                             "--metrics-port", "0", "--draft-layers", "1", "--dtype",
                             "float32"] + server_flags(pki), drain=True)
    assert_only_mutual_tls_gets_in(port, pki)
    # The Generate API binds its port before loading the model (health NOT_SERVING meanwhile):
    # the handshake is what is tested here; the process is killed at teardown.
    http_port = free_port()
    _, port = spawn_service([str(Path(sys.executable).with_name("sssd")), "serve", "--port", "0",
                             "--http-port", str(http_port), "--dtype", "float32"]
                            + server_flags(pki), drain=True)
    assert_only_mutual_tls_gets_in(port, pki)
    # The HTTP API serves TLS with the same files, and also wants a client certificate.
    assert https_status(http_port, pki) == 503  # loading: its /health says so

    for context in (https_context(pki, with_cert=False), https_context(pki, ca="theirs")):
        with pytest.raises(OSError):
            urllib.request.urlopen(f"https://127.0.0.1:{http_port}/health", context=context,
                                   timeout=5)
    with pytest.raises(OSError):  # plaintext
        urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5)


def https_context(pki, ca="ours", with_cert=True):
    context = ssl.create_default_context(cafile=pki[ca]["ca"])
    context.check_hostname = False  # the chain is what is checked; the name is the test's own
    if with_cert:
        context.load_cert_chain(*pki["ours"]["client"])
    return context


def https_status(port, pki):
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health",
                                    context=https_context(pki), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_indexer_health_serves_tls_and_redis_requires_the_configured_password(
        tmp_path, pki, free_port, wait_until):
    from sssd.common.conversations.record import Conversation
    from sssd.common.conversations.redis_server import RedisServer, ensure_password_file

    password_file = ensure_password_file(tmp_path / "redis-password")
    assert oct(password_file.stat().st_mode & 0o777) == "0o600"
    password = password_file.read_text().strip()
    server = RedisServer(tmp_path / "redis", password=password).start()
    port = free_port()
    process = None
    try:
        assert password not in " ".join(server.process.args)  # not on the command line
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        command = [str(Path(sys.executable).with_name("sssd-indexer")), "run",
                   "--datastore-dir", str(tmp_path / "datastore"), "--redis-url", server.url,
                   "--redis-password-file", str(password_file), "--vocab-size", "100",
                   "--tokenizer-fingerprint", "f" * 64, "--build-tokens", "1",
                   "--port", str(port), "--metrics-port", "0"] + server_flags(pki)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SSSD_")}
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=env)
        assert wait_until(lambda: health_status(port, client_tls(pki), timeout=1) ==
                          health_pb2.HealthCheckResponse.SERVING, timeout=60)
        assert_only_mutual_tls_gets_in(port, pki)
        # The indexer authenticated with the file's password: it indexes what is published.
        client = redis.Redis.from_url(server.url, password=password)
        client.xadd("sssd:conversations", Conversation([1, 2], [3], "f" * 64, "stop")
                    .to_fields())
        assert wait_until(lambda: (tmp_path / "datastore" / "manifest.json").is_file(),
                          timeout=30)
        assert wait_until(lambda: client.xlen("sssd:conversations") == 0, timeout=30)
    finally:
        if process is not None:
            process.terminate()
            process.wait(20)
        server.stop()


def test_a_missing_password_file_is_a_clear_error(tmp_path):
    result = subprocess.run([str(Path(sys.executable).with_name("sssd-indexer")), "run",
                             "--datastore-dir", str(tmp_path / "d"), "--redis-password-file",
                             str(tmp_path / "nope"), "--vocab-size", "100",
                             "--tokenizer-fingerprint", "f" * 64], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "nope" in result.stderr, result.stderr


def test_health_probe_checks_a_tls_service_the_way_the_charts_exec_probe_runs_it(
        pki, monkeypatch, capsys):
    """`sssd-health-probe` (the chart's exec probe under TLS): 0 for SERVING over mutual TLS with
    the expected server name; 1 and one line naming the reason for NOT_SERVING, a name the
    certificate does not hold, a CA that did not sign it, and a port where nothing listens."""
    from concurrent import futures

    from grpc_health.v1 import health

    from sssd.common.rpc.health_probe import main as probe

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    cert, key = pki["ours"]["server"]
    port = tls.bind(server, "127.0.0.1:0", TlsFiles(cert=cert, key=key, ca=pki["ours"]["ca"]))
    server.start()
    try:
        client_cert, client_key = pki["ours"]["client"]
        monkeypatch.setenv("SSSD_TLS_CERT", client_cert)
        monkeypatch.setenv("SSSD_TLS_KEY", client_key)
        monkeypatch.setenv("SSSD_TLS_CA", pki["ours"]["ca"])
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe(["--port", str(port)]) == 0
        assert probe(["--port", str(port), "--server-name", "localhost"]) == 0
        capsys.readouterr()

        assert probe(["--port", str(port), "--server-name", "demo-sssd-serve-drafter",
                      "--timeout", "1"]) == 1
        assert capsys.readouterr().err.startswith(f"unhealthy: 127.0.0.1:{port}: UNAVAILABLE")
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe(["--port", str(port)]) == 1
        assert capsys.readouterr().err == f"unhealthy: 127.0.0.1:{port}: NOT_SERVING\n"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        monkeypatch.setenv("SSSD_TLS_CA", pki["theirs"]["ca"])
        assert probe(["--port", str(port), "--timeout", "1"]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        server.stop(None)
    monkeypatch.setenv("SSSD_TLS_CA", pki["ours"]["ca"])
    assert probe(["--port", str(port), "--timeout", "1"]) == 1  # nothing listens any more
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.setenv("SSSD_TLS_CA", "/nonexistent/ca.crt")
    assert probe(["--port", str(port)]) == 1
    assert "/nonexistent/ca.crt" in capsys.readouterr().err

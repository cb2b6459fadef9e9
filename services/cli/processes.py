"""The local stack's child processes: services started as console scripts, waited on until
their gRPC health check says SERVING, and stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.common.rpc import tls


def start_service(name: str, command: list[str], host: str, port: int,
                  timeout_s: float = 120.0) -> subprocess.Popen:
    """A child process with a gRPC health service; returns once it says SERVING."""
    # Its own session: Ctrl-C reaches only `sssd up`, which stops the children in order (the API
    # drains and publishes before the indexer and Redis go).
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    with tls.channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the {name} exited with {process.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return process
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                process.terminate()
                raise SystemExit(f"the {name} did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.2)


def console_script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def start_drafter(datastore: Path, vocab_size: int, fingerprint: str, host: str,
                  port: int) -> subprocess.Popen:
    """The drafter service as a child process, once healthy."""
    return start_service("drafter service", [
        console_script("sssd-drafter"), "--datastore-dir", str(datastore), "--vocab-size",
        str(vocab_size), "--tokenizer-fingerprint", fingerprint, "--host", host, "--port",
        str(port)], host, port)


def start_speculator(model: str | None, draft_layers: int, host: str, port: int,
                     metrics_port: int) -> subprocess.Popen:
    """The speculator service as a child process, once healthy (its draft model loaded)."""
    command = [console_script("sssd-speculator"), "--draft-layers", str(draft_layers),
               "--host", host, "--port", str(port), "--metrics-port", str(metrics_port)]
    if model is not None:
        command += ["--model", model]
    return start_service("speculator", command, host, port)


def start_indexer(datastore: Path, redis_url: str, vocab_size: int, fingerprint: str,
                  port: int, metrics_port: int, build_tokens: int,
                  build_interval_s: float) -> subprocess.Popen:
    """The indexer service as a child process, once healthy."""
    return start_service("indexer", [
        console_script("sssd-indexer"), "run", "--datastore-dir", str(datastore),
        "--redis-url", redis_url, "--vocab-size", str(vocab_size), "--tokenizer-fingerprint",
        fingerprint, "--port", str(port), "--metrics-port", str(metrics_port),
        "--build-tokens", str(build_tokens), "--build-interval-s", str(build_interval_s)],
        "127.0.0.1", port)


def stop_process(process: subprocess.Popen | None) -> None:
    if process is None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()

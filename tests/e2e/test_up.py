"""`sssd up --once`, the README's main job: the whole local stack answers through the API."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sssd.cli.up import describe_workers
from sssd.verifier.serving.config import RayConfig

pytest.importorskip("ray")


def test_sssd_up_once_serves_a_prompt_and_stops(tmp_path, warm_datastore, free_port, pki):
    """The whole stack, the SSD speculator included (a 2-layer cut of the model as its cheap
    draft; one run covers both, for CI time), every gRPC hop on mutual TLS (the services, the
    Ray workers' clients, the check's client) and Redis behind a password: the check prompt is
    answered through the API, identical with and without speculation and to plain greedy
    decoding."""
    sssd = Path(sys.executable).with_name("sssd")
    http_port = free_port()
    command = [str(sssd), "up", "--once", "--datastore", warm_datastore, "--http-port",
               str(http_port),
               "--speculator", "--speculator-draft-layers", "2",
               "--speculator-port", str(free_port()),
               "--speculator-metrics-port", str(free_port()),
               "--port", str(free_port()), "--drafter-port", str(free_port()),
               "--dashboard-port", "0", "--metrics-port", str(free_port()),
               "--max-batch-size", "2", "--max-len", "512", "--max-tokens", "12",
               "--prompt", "Name a colour.", "--check-rounds", "1",
               "--redis-port", str(free_port()),
               "--indexer-port", str(free_port()), "--indexer-metrics-port", str(free_port()),
               "--build-tokens", "1", "--build-interval-s", "1",
               "--tls-cert", pki["ours"]["server"][0], "--tls-key", pki["ours"]["server"][1],
               "--tls-ca", pki["ours"]["ca"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SSSD_"))}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for step in ("[1/5] live datastore var/live/datastore (seeded from ",
                 "[2/5] drafter service on 127.0.0.1:",
                 # 0 prefill workers on this 2-core machine, 1 from 4 cores on
                 f"[3/5] starting Ray ({describe_workers(RayConfig())}, auth token)",
                 "[4/5] serving the Generate API on 127.0.0.1:", ">>> Name a colour.",
                 # HTTPS with the stack's TLS files, and how to call it
                 f"OpenAI-compatible HTTP API on https://127.0.0.1:{http_port}/v1",
                 f"curl https://127.0.0.1:{http_port}/v1/chat/completions",
                 f'OpenAI(base_url="https://127.0.0.1:{http_port}/v1"'):
        assert step in out, out
    assert "[speculation: " in out and "tokens per step; first steps: budget " in out
    assert "[speedup " in out and "answers each to this prompt, alternating" in out
    assert "[outputs with and without speculation: " in out
    assert "[exact check, float32 in this process: " in out
    assert "to plain greedy decoding" in out and "DIFFERENT" not in out
    assert "speculator service on 127.0.0.1:" in out
    match = re.search(r"\[speculator \(.*\): (\d+) rounds, (\d+) cache hits", out)
    assert match and int(match.group(1)) > 0, out  # the first answer (auto) drafted with SSD
    # The three answers (streamed, off, on) were published, and the indexer put them into the
    # live datastore.
    from sssd.datastore.build import read_documents

    live = read_documents(tmp_path / "var" / "live" / "datastore")
    seeded = read_documents(warm_datastore)
    assert live[: len(seeded)] == seeded and len(live) == len(seeded) + 3
    password_file = tmp_path / "var" / "redis" / "password"  # made by sssd up, private
    assert password_file.stat().st_mode & 0o777 == 0o600
    token_file = tmp_path / "var" / "ray" / "auth_token"
    assert f"token in {token_file}" in out
    assert token_file.stat().st_mode & 0o777 == 0o600


def test_sssd_up_refuses_auth_disabled_off_loopback(tmp_path):
    sssd = Path(sys.executable).with_name("sssd")
    done = subprocess.run([str(sssd), "up", "--once", "--ray-auth", "disabled", "--host",
                           "0.0.0.0"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "loopback" in done.stderr


def test_sssd_up_refuses_a_public_host_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("SSSD_API_KEY", raising=False)
    monkeypatch.delenv("SSSD_API_KEY_FILE", raising=False)
    sssd = Path(sys.executable).with_name("sssd")
    done = subprocess.run([str(sssd), "up", "--once", "--host", "0.0.0.0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--host 0.0.0.0 is reachable from other machines: set an API key" in done.stderr
    assert not (tmp_path / "var").exists()  # refused before anything started


def test_sssd_up_names_a_taken_port_before_starting_anything(tmp_path, free_port):
    sssd = Path(sys.executable).with_name("sssd")
    with socket.socket() as other:  # another process's server on the metrics port
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        drafter_port = free_port()
        done = subprocess.run(
            [str(sssd), "up", "--once", "--metrics-port", str(taken), "--drafter-service",
             "--drafter-port", str(drafter_port), "--indexer-port", str(drafter_port)],
            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"port {taken} (--metrics-port) is in use by another process; pick another with " \
        "--metrics-port PORT" in done.stderr
    assert f"port {drafter_port} is given to both --drafter-port and --indexer-port" \
        in done.stderr
    assert not (tmp_path / "var").exists()  # nothing was started or written


def test_sssd_up_no_ray_serves_from_its_own_process(tmp_path, warm_datastore, free_port):
    """`--no-ray --drafter-service`: the engine in the API's process (no Ray cluster),
    drafting through the drafter service, the same check."""
    sssd = Path(sys.executable).with_name("sssd")
    http_port = free_port()
    done = subprocess.run(
        [str(sssd), "up", "--once", "--no-ray", "--no-live", "--drafter-service", "--datastore",
         warm_datastore, "--port", str(free_port()), "--http-port", str(http_port),
         "--drafter-port", str(free_port()), "--max-batch-size", "2", "--max-len", "512",
         "--max-tokens", "12",
         "--prompt", "Name a colour.", "--check-rounds", "1"],
        cwd=tmp_path, env={k: v for k, v in os.environ.items()
                           if not k.startswith(("RAY_", "SSSD_"))},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "[2/5] drafter service on 127.0.0.1:" in out
    assert "[3/5] loading the model into this process (--no-ray)" in out
    assert "the engine runs in this process (--no-ray)" in out and "Ray dashboard" not in out
    assert f"OpenAI-compatible HTTP API on http://127.0.0.1:{http_port}/v1" in out
    assert "[outputs with and without speculation: identical" in out
    assert "to plain greedy decoding" in out and "DIFFERENT" not in out
    assert not (tmp_path / "var" / "ray").exists()


def test_sssd_up_drafter_in_process_drafts_from_the_live_datastore(tmp_path, warm_datastore,
                                                                   free_port):
    """The default on this machine (fewer than 4 cores; stated, so that a bigger machine runs it
    too): the Ray decode worker drafts in its own process (no drafter service, its port left
    alone), the live datastore still grows from the answers, and the exact check drafts from
    the same datastore."""
    sssd = Path(sys.executable).with_name("sssd")
    with socket.socket() as other:  # the drafter's port is not needed: another server holds it
        other.bind(("127.0.0.1", 0))
        other.listen()
        done = subprocess.run(
            [str(sssd), "up", "--once", "--drafter-in-process", "--datastore",
             warm_datastore, "--port", str(free_port()), "--http-port", str(free_port()),
             "--dashboard-port", "0", "--metrics-port", str(free_port()),
             "--drafter-port", str(other.getsockname()[1]), "--redis-port", str(free_port()),
             "--indexer-port", str(free_port()), "--indexer-metrics-port", str(free_port()),
             "--build-tokens", "1", "--build-interval-s", "1", "--max-batch-size", "2",
             "--max-len", "512", "--max-tokens", "12", "--prompt", "Name a colour.",
             "--check-rounds", "1"],
            cwd=tmp_path, env={k: v for k, v in os.environ.items()
                               if not k.startswith(("RAY_", "SSSD_"))},
            capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "[2/5] drafting in the engine's process from var/live/datastore" in out, out
    assert out.index("[1/5]") < out.index("[2/5]") < out.index("[3/5]"), out  # in their order
    assert "drafter service" not in out
    assert re.search(r"\[speculation: .* tokens per step; first steps: budget ", out), out
    assert "[outputs with and without speculation: identical" in out
    assert "accepted from the datastore, the answer is identical to plain greedy decoding" in out
    from sssd.datastore.build import read_documents

    live = read_documents(tmp_path / "var" / "live" / "datastore")
    assert len(live) == len(read_documents(warm_datastore)) + 3


def test_sssd_serve_names_a_taken_http_port(tmp_path):
    sssd = Path(sys.executable).with_name("sssd")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        done = subprocess.run([str(sssd), "serve", "--port", "0", "--http-port", str(taken)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"port {taken} (--http-port) is in use by another process" in done.stderr


def test_sssd_up_refuses_a_live_datastore_of_another_model(tmp_path, warm_datastore, free_port):
    """A live datastore grown by another model's conversations (another tokenizer) would draft
    other tokens: refused before anything starts, naming the flag."""
    from sssd.datastore.build import build_datastore

    other = tmp_path / "other-live"
    build_datastore(other, [[1, 2, 3, 4]], 100, "e" * 64)
    sssd = Path(sys.executable).with_name("sssd")
    ports = [free_port() for _ in range(4)]
    done = subprocess.run(
        [str(sssd), "up", "--once", "--no-ray", "--datastore", warm_datastore, "--live-dir",
         str(other), "--port", str(ports[0]), "--drafter-port", str(ports[1]),
         "--redis-port", str(ports[2]), "--http-port", str(ports[3])],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the live datastore" in done.stderr and "built with another tokenizer" in \
        done.stderr and "--live-dir" in done.stderr
    assert "[1/5]" not in done.stdout  # nothing was started

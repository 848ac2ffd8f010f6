"""The Kubernetes manifests (``deploy/kubernetes``): what can be proven without a cluster. Each overlay renders
with ``kubectl kustomize``; every object validates against the Kubernetes API schemas (offline, the PyPI
package ``kubernetes-validate``); every Conveyor container's command parses with the real CLI, and its
ports, probes, peers, scrape annotations and secrets agree with it and with each other, as the compose
test does for ``docker-compose.yml``."""

from __future__ import annotations

import json
import shlex
import subprocess

import kubernetes_validate
import pytest
import yaml
from helpers import ROOT

from conveyor.cli import build_parser

K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.32.0"
SERVICE_OF = {"frontend": "conveyor.v1.Conveyor", "scheduler": "conveyor.v1.Scheduler", "worker": "conveyor.v1.Worker",
              "detokenizer": "conveyor.v1.Detokenizer"}
POD_ENV = {"$(POD_NAME)": "engine-0", "$(POD_IP)": "10.0.0.7"}  # what Kubernetes substitutes


def render(overlay: str) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def objects(request) -> list[dict]:
    return render(request.param)


def _by_kind(objects, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _pods(objects):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, o["spec"]["template"]


def _conveyor_containers(objects):
    """(workload, pod template, container, parsed args) of every container running the Conveyor image."""
    parser = build_parser()
    for workload, pod in _pods(objects):
        for c in pod["spec"]["containers"]:
            if c["image"].split(":")[0] == "conveyor":
                args = [POD_ENV.get(a, a).replace("$(POD_IP)", POD_ENV["$(POD_IP)"]) for a in c["args"]]
                yield workload, pod, c, parser.parse_args(args)


def test_every_object_validates_against_the_kubernetes_schemas(objects):
    kinds = sorted({o["kind"] for o in objects})
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "ConfigMap", "NetworkPolicy"} <= set(kinds)
    for o in objects:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)  # raises on any unknown or wrong field


def test_commands_ports_and_probes_match_the_cli(objects):
    services = _by_kind(objects, "Service")
    seen = set()
    for workload, pod, c, args in _conveyor_containers(objects):
        seen.add(args.service)
        ports = {p["containerPort"]: p["name"] for p in c["ports"]}
        assert args.port in ports and args.metrics_port in ports, c["name"]
        if args.service in ("worker", "detokenizer", "frontend"):  # a fixed link port, named for the policies
            assert args.link_port in ports, c["name"]
        assert args.host == "0.0.0.0" and args.metrics_host == "0.0.0.0"  # the kubelet probes the pod IP
        for probe in ("readinessProbe", "livenessProbe"):
            grpc = c[probe]["grpc"]
            assert grpc["port"] in ports, (c["name"], probe)
            expected = "conveyor.v1.Frontend" if (args.service, probe) == ("frontend", "livenessProbe") else SERVICE_OF[args.service]
            assert grpc["service"] == expected, (c["name"], probe)
            assert grpc["port"] == (args.internal_port if expected == "conveyor.v1.Frontend" else args.port)
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        metrics_ports = {a.metrics_port for _, p, _, a in _conveyor_containers([workload]) if p is pod}
        assert int(annotations["prometheus.io/port"]) in metrics_ports
        env = {e["name"]: e for e in c.get("env", [])}
        if args.service != "worker":  # Redis: the URL from the Secret's password, never on the command line
            url = env[f"CONVEYOR_{args.service.upper()}_REDIS_URL"]["value"]
            assert url == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "conveyor-secrets", "key": "redis-password"}
            assert not any("redis://" in a for a in c["args"])
        if args.service == "scheduler":
            worker = next(a for _, p, _, a in _conveyor_containers([workload]) if p is pod and a.service == "worker")
            assert args.worker == f"127.0.0.1:{worker.port}"  # its own worker, in the same pod
            assert args.engine == POD_ENV["$(POD_NAME)"] and args.advertise == f"{POD_ENV['$(POD_IP)']}:{args.port}"
            assert workload["kind"] == "StatefulSet"  # stable names: a restarted engine takes back its requests
        if args.service in ("scheduler", "frontend"):
            host, port = args.detokenizer.split(":")
            detokenizer = next(a for _, _, _, a in _conveyor_containers(objects) if a.service == "detokenizer")
            assert {p["port"] for p in services[host]["spec"]["ports"]} == {int(port), detokenizer.link_port}
        if args.service == "frontend":
            assert args.advertise == f"{POD_ENV['$(POD_IP)']}:{args.internal_port}"
            public = {p["port"] for p in services["frontend"]["spec"]["ports"]}
            assert public == {args.port, args.http_port}
            assert env["CONVEYOR_FRONTEND_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "conveyor-secrets"
    assert seen == set(SERVICE_OF)


def test_frontends_autoscale_and_redis_keeps_an_append_only_file_on_a_volume(objects):
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "frontend"}
    frontend = _by_kind(objects, "Deployment")["frontend"]["spec"]["template"]["spec"]["containers"][0]
    assert "cpu" in frontend["resources"]["requests"]  # the HPA's utilization needs a request
    redis = _by_kind(objects, "StatefulSet")["redis"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--dir") + 1] == "/data"
    assert [v["metadata"]["name"] for v in redis["spec"]["volumeClaimTemplates"]] == ["data"]
    assert not any("requirepass" in a for a in args)  # the password comes from the Secret, through a file


def test_the_dashboards_config_map_is_the_shipped_dashboards(objects):
    maps = _by_kind(objects, "ConfigMap")
    dashboards = maps["conveyor-dashboards"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = {p.name: json.loads(p.read_text()) for p in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")}
    assert {name: json.loads(text) for name, text in dashboards["data"].items()} == shipped


def test_the_gpu_overlay_gives_each_engine_a_gpu_and_the_cpu_one_none():
    for overlay, device in (("cpu", "cpu"), ("gpu", "cuda")):
        engine = _by_kind(render(overlay), "StatefulSet")["engine"]
        worker = next(c for c in engine["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
        assert shlex.join(worker["args"]).count(f"--device {device}") == 1
        assert ("nvidia.com/gpu" in worker["resources"].get("limits", {})) == (overlay == "gpu")


def _allowed(policy: dict, port: int) -> list[set[str] | None]:
    """Who may reach ``port`` of the pods ``policy`` selects: per matching rule, the app names it allows
    (None: anyone)."""
    out = []
    for rule in policy["spec"]["ingress"]:
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        if "from" not in rule:
            out.append(None)
            continue
        names = set()
        for peer in rule["from"]:
            selector = peer["podSelector"]
            names |= {selector["matchLabels"]["app.kubernetes.io/name"]} if "matchLabels" in selector else \
                set(selector["matchExpressions"][0]["values"])
        out.append(names)
    return out


def test_each_internal_port_is_open_to_its_callers_alone(objects):
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: p
                for p in _by_kind(objects, "NetworkPolicy").values()}
    assert _allowed(policies["engine"], 50053) == []  # the worker: only its own scheduler, inside the pod
    assert _allowed(policies["engine"], 50058) == []  # its link too
    assert _allowed(policies["detokenizer"], 50056) == [{"engine"}]  # the token batches' link: schedulers alone
    assert _allowed(policies["frontend"], 50057) == [{"detokenizer"}]  # the deltas' link
    assert _allowed(policies["engine"], 50052) == [{"frontend", "detokenizer"}]
    assert _allowed(policies["redis"], 6379) == [{"frontend", "detokenizer", "engine"}]
    assert _allowed(policies["detokenizer"], 50054) == [{"frontend", "engine"}]
    assert _allowed(policies["frontend"], 50055) == [{"detokenizer"}]
    assert _allowed(policies["frontend"], 8000) == [None] and _allowed(policies["engine"], 9103) == [None]
    redis = _by_kind(objects, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert redis[redis.index("--maxmemory-policy") + 1] == "noeviction" and "--maxmemory" in redis


def test_compose_keeps_monitoring_on_loopback_and_secrets_in_files():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), services[name]["ports"]
    grafana = services["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/secrets/grafana_password"
    assert "--grafana-uid" in services["credentials"]["command"]
    frontend = services["frontend"]
    args = build_parser().parse_args(frontend["command"])
    assert args.api_keys_file == "/run/secrets/api_keys" and frontend["secrets"] == ["api_keys"]
    assert not any("API_KEYS" in name and not name.endswith("_FILE") for name in frontend["environment"])
    assert compose["secrets"]["api_keys"]["file"].endswith("deploy/api-keys.empty}")


def _compose_containers():
    """(service, command) of every Conveyor service in ``docker-compose.yml``."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if service.get("image", "").split(":")[0] == "conveyor" and service["command"][0] == "serve":
            yield name, service["command"]


def test_compose_and_kubernetes_commands_are_what_conveyor_up_renders_for_their_configs(objects):
    """Each Conveyor container's command, parsed with the real CLI into its service's config, is rendered back
    by the function ``conveyor up`` starts its children with (``to_argv``) to a command line that gives the same
    config: the three deployments speak one mapping of settings to flags."""
    from conveyor.cli import config_class
    from conveyor.config import from_args, to_argv

    commands = [["serve", *c["args"]] if c["args"][0] != "serve" else c["args"]
                for _, _, c, _ in _conveyor_containers(objects)]
    commands += [command for _, command in _compose_containers()]
    assert len(commands) >= 8
    parser = build_parser()
    for command in commands:
        args = parser.parse_args([POD_ENV.get(a, a) for a in command])
        cls = config_class(args.service)[0]
        config = from_args(cls, args)
        rendered = to_argv(config)
        assert from_args(cls, parser.parse_args(["serve", args.service, *rendered])) == config, command
        assert set(rendered) <= set(command) | {"--no-" + a[2:] for a in command}, command  # nothing it did not say

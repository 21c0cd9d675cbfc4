"""deploy/k8s: every object valid for the Kubernetes versions we claim, and the manifests agree
with the services themselves (modules, flags behind env names, ports, probes, drain times)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml

from shared.model_entry import read_entry
from shared.model_paths import default_model_path
from shared.runtime.mesh_token import ENV as MESH_TOKEN_ENV
from tests.k8s_render import render

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")  # the oldest and newest we claim
OVERLAY_NAMES = ["dev", "prod", "prod-tls", "disaggregated"]
TLS_ENV = set(
    re.findall(r"KVMESH_TLS_[A-Z_]+", (ROOT / "shared" / "runtime" / "tls.py").read_text())
)


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(OVERLAYS / overlay)


def by_name(overlay: str, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in rendered(overlay) if (o["kind"], o["metadata"]["name"]) == (kind, name))


def kvmesh_containers(overlay: str) -> list[dict[str, Any]]:
    return [
        container
        for obj in rendered(overlay)
        if obj["kind"] in ("Deployment", "StatefulSet")
        for container in obj["spec"]["template"]["spec"]["containers"]
        if container["image"].startswith("kvmesh:")
    ]


def probe_target(probe: dict[str, Any]) -> tuple[int, str]:
    """(port, health service) of a grpc probe, or of an exec probe running
    shared.runtime.healthcheck (what the TLS overlay uses: kubelet's grpc probes cannot speak
    TLS)."""
    if "grpc" in probe:
        return probe["grpc"]["port"], probe["grpc"].get("service", "")
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "shared.runtime.healthcheck"], command
    return int(command[3].rsplit(":", 1)[1]), command[4] if len(command) > 4 else ""


@functools.cache
def compose_image() -> str:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return str(compose["x-kvmesh"]["image"])


@functools.cache
def flags_of(module: str) -> set[str]:
    help_text = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", help_text))


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_every_object_is_valid_for_the_versions_we_claim(overlay: str) -> None:
    objects = rendered(overlay)
    assert len(objects) >= 10
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    broken = by_name(overlay, "Deployment", "gateway")
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)
    rendered.cache_clear()


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_containers_agree_with_the_services(overlay: str) -> None:
    for container in kvmesh_containers(overlay):
        command = container["command"]
        module = command[command.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
        flags = flags_of(module)
        for env in container["env"]:
            if env["name"] in TLS_ENV or env["name"] == MESH_TOKEN_ENV:
                continue  # read by shared/runtime in every service, not a flag
            if env["name"].startswith("KVMESH_"):
                flag = "--" + env["name"].removeprefix("KVMESH_").lower().replace("_", "-")
                assert flag in flags, f"{container['name']}: {env['name']} is no flag of {module}"
        port = int(command[command.index("--port") + 1])
        grpc_ports = [p for p in container["ports"] if p["name"].startswith("grpc-")]
        assert [p["containerPort"] for p in grpc_ports] == [port], container["name"]
        for probe, service in (("readinessProbe", ""), ("livenessProbe", "liveness")):
            assert probe_target(container[probe]) == (port, service), (container["name"], probe)
        assert container["image"] == compose_image()


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_grace_periods_cover_the_drain(overlay: str) -> None:
    for obj in rendered(overlay):
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            drain = float(env["KVMESH_DRAIN_SECONDS"])
            pause = 0.0
            if "lifecycle" in container:
                pause = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
            assert pod["terminationGracePeriodSeconds"] >= drain + pause, obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_services_name_their_ports_and_the_gateway_finds_every_worker(overlay: str) -> None:
    for obj in rendered(overlay):
        if obj["kind"] == "Service":
            for port in obj["spec"]["ports"]:
                assert port["name"].split("-")[0] in ("grpc", "http", "tcp"), port
    gateway = by_name(overlay, "Deployment", "gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
    found = set()
    for spec in env["KVMESH_SCHEDULER"].split(","):  # each a headless Service of worker pods
        host, port = spec.rpartition("=dns:///")[2].rsplit(":", 1)
        name, namespace = host.removesuffix(".svc.cluster.local").split(".")
        service = by_name(overlay, "Service", name)
        assert service["spec"]["clusterIP"] == "None"  # headless: one DNS answer per pod
        assert namespace == service["metadata"]["namespace"]
        assert int(port) == service["spec"]["ports"][0]["port"]
        found.add(name)
    pools = {o["metadata"]["name"] for o in rendered(overlay) if o["kind"] == "Deployment"}
    assert found == {name for name in pools if name.startswith("worker")}  # every pool found


def test_the_model_repository_entry_matches_the_image_model(tmp_path: Path) -> None:
    config_map = by_name("dev", "ConfigMap", "kvmesh-models")
    entry_toml = config_map["data"]["kvmesh.toml"]
    directory = tmp_path / "smollm2" / "1"
    directory.mkdir(parents=True)
    (directory / "kvmesh.toml").write_text(entry_toml)
    model = tomllib.loads(entry_toml)["model"]
    os.symlink(default_model_path(), directory / model["artifact"])
    read_entry(str(directory)).verify()  # the digest is the installed GGUF's
    worker = by_name("dev", "Deployment", "worker")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in worker["containers"][0]["env"]}
    assert env["KVMESH_MODEL"] == "/models/smollm2/1" and env["KVMESH_KV_MEMORY"] == "256MiB"


def test_prod_requires_api_keys_and_scales_on_queue_time() -> None:
    gateway = by_name("prod", "Deployment", "gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in gateway["containers"][0]["env"]}
    assert env["KVMESH_API_KEYS_FILE"]["value"] == "/secrets/api-keys.toml"
    assert env["KVMESH_REDIS"]["valueFrom"]["secretKeyRef"]["name"] == "kvmesh-redis"
    hpa = by_name("prod", "HorizontalPodAutoscaler", "worker")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "worker"
    published = (ROOT / "services" / "scheduler" / "metrics.py").read_text()
    for metric in hpa["spec"]["metrics"]:
        assert f'"{metric["pods"]["metric"]["name"]}"' in published


def test_prod_gives_every_service_the_mesh_token_from_its_secret() -> None:
    """The internal ports refuse a caller without it: a service left out could reach none."""
    for overlay, expected in (("dev", False), ("prod", True), ("prod-tls", True)):
        for container in kvmesh_containers(overlay):
            env = {e["name"]: e for e in container["env"]}
            assert (MESH_TOKEN_ENV in env) is expected, (overlay, container["name"])
            if expected:
                secret = env[MESH_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
                assert secret == {"name": "kvmesh-mesh-token", "key": "token"}


def test_tls_is_all_or_nothing() -> None:
    """kvmesh's mTLS needs every service on it: one plaintext service would cut the mesh."""
    for overlay, expected in (("prod", False), ("prod-tls", True)):
        for container in kvmesh_containers(overlay):
            names = {e["name"] for e in container["env"]}
            has = {"KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA"} <= names
            assert has is expected, (overlay, container["name"])


def test_worker_pods_start_from_what_the_prepare_job_stored() -> None:
    """The Job writes prepared artifacts to a shared claim; every worker pod, an added one
    too, reads that claim at the folder it searches first."""
    job = by_name("prod", "Job", "prepare-models")["spec"]["template"]["spec"]
    (prepare,) = job["containers"]
    out = prepare["command"][prepare["command"].index("--out") + 1]
    assert prepare["command"][:4] == ["python", "-m", "kvmesh", "prepare"]
    claims = {
        v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in job["volumes"]
    }
    written = next(m for m in prepare["volumeMounts"] if m["mountPath"] == out)
    pod = by_name("prod", "Deployment", "worker")["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "engine-worker")
    env = {e["name"]: e.get("value") for e in worker["env"]}
    read = next(m for m in worker["volumeMounts"] if m["mountPath"] == env["KVMESH_PREPARED_DIR"])
    pod_claims = {
        v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]
    }
    assert claims[written["name"]] == pod_claims[read["name"]] == "prepared-models"
    assert read.get("readOnly") and not written.get("readOnly")


def test_the_split_overlay_runs_a_prefill_and_a_decode_pool_each_scaled_on_its_own() -> None:
    roles = {}
    for name in ("worker", "worker-prefill"):
        pod = by_name("disaggregated", "Deployment", name)["spec"]["template"]["spec"]
        scheduler = next(c for c in pod["containers"] if c["name"] == "scheduler")
        env = {e["name"]: e.get("value") for e in scheduler["env"]}
        roles[name] = env["KVMESH_ROLE"]
        if roles[name] == "prefill":  # what decode pods pull from: this pod's worker port
            assert env["KVMESH_WORKER_ADVERTISE"] == "$(POD_IP):50061"
    assert roles == {"worker": "decode", "worker-prefill": "prefill"}
    scaled = {
        o["spec"]["scaleTargetRef"]["name"]: o["spec"]["metrics"][0]["pods"]["metric"]["name"]
        for o in rendered("disaggregated")
        if o["kind"] == "HorizontalPodAutoscaler"
    }
    assert scaled == {
        "worker-prefill": "kvmesh_queue_time_estimate_seconds",
        "worker": "kvmesh_kv_cache_usage_ratio",
    }


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _source_matches(peer: dict[str, Any], source: tuple[str, dict[str, str]]) -> bool:
    """`source`: ("pod", its labels) in the namespace, ("namespace", {}) a pod in another,
    ("outside", {}) beyond the cluster."""
    kind, labels = source
    if "namespaceSelector" in peer:  # {} here: every namespace, this one included
        return kind in ("pod", "namespace")
    return kind == "pod" and _selects(peer["podSelector"], labels)


def reachable(source: tuple[str, dict[str, str]], target: str, port: str) -> bool:
    """Whether prod's NetworkPolicies let `source` open `port` (a container port's name) on a
    pod of app `target`: a policy selecting the pod has a rule naming both, else denied."""
    policies = [o for o in rendered("prod") if o["kind"] == "NetworkPolicy"]
    labels = {"app.kubernetes.io/name": target}
    for policy in (p for p in policies if _selects(p["spec"]["podSelector"], labels)):
        for rule in policy["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            peers = rule.get("from")
            if ports and port not in ports:
                continue
            if peers is None or any(_source_matches(peer, source) for peer in peers):
                return True
    return False


def test_prod_network_policies_let_each_port_be_reached_by_its_callers_alone() -> None:
    def pod(app: str) -> tuple[str, dict[str, str]]:
        return "pod", {"app.kubernetes.io/name": app}

    outside, prometheus = ("outside", {}), ("namespace", {})
    allowed = [
        (outside, "gateway", "grpc-public"),
        (outside, "gateway", "http-openai"),
        (pod("gateway"), "worker", "grpc-scheduler"),
        (pod("gateway"), "tokenizer", "grpc-tokenizer"),
        (pod("worker"), "worker", "grpc-worker"),  # a decode pod pulls prefilled blocks
        (pod("worker"), "trace-collector", "grpc-otlp"),
        (prometheus, "worker", "http-metrics-s"),
        (prometheus, "tokenizer", "http-metrics"),
    ]
    denied = [
        (outside, "worker", "grpc-scheduler"),
        (prometheus, "worker", "grpc-scheduler"),
        (pod("tokenizer"), "worker", "grpc-scheduler"),
        (pod("redis-client"), "tokenizer", "grpc-tokenizer"),
        (pod("gateway"), "worker", "grpc-worker"),
        (outside, "trace-collector", "grpc-otlp"),
        (outside, "gateway", "http-metrics"),
    ]
    for source, target, port in allowed:
        assert reachable(source, target, port), (source, target, port)
    for source, target, port in denied:
        assert not reachable(source, target, port), (source, target, port)
    # Every port a kvmesh pod opens is named by some policy: none is shut by omission.
    for obj in rendered("prod"):
        if obj["kind"] != "Deployment":
            continue
        app = obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for container in obj["spec"]["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                callers = [pod("gateway"), pod("worker"), prometheus, outside]
                assert any(reachable(c, app, port["name"]) for c in callers), (app, port)

"""docker-compose.yml: valid against the compose-spec, and every command names a real module."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvmesh.mesh.service_process import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
SPLIT = ROOT / "deploy" / "compose" / "split.yml"  # the prefill/decode split, over COMPOSE
MESH_SERVICES = {"trace-collector", "tokenizer", "engine-worker", "scheduler", "gateway"}


def compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def python_modules(command: list[str]) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "-m"]


def test_compose_file_matches_the_compose_spec() -> None:
    beside_python = Path(sys.executable).parent / "check-jsonschema"
    checker = str(beside_python) if beside_python.exists() else shutil.which("check-jsonschema")
    assert checker, "check-jsonschema is not installed (pip install -e '.[test]')"
    result = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE), str(SPLIT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_command_and_health_check_names_a_module_that_exists() -> None:
    services = compose()["services"]
    assert set(services) >= MESH_SERVICES
    checked = 0
    for name, service in services.items():
        commands = [service.get("command", []), service.get("healthcheck", {}).get("test", [])]
        for command in commands:
            for module in python_modules(command):
                assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
                checked += 1
    assert checked >= 2 * len(MESH_SERVICES)


def test_each_mesh_service_has_a_health_check_and_redis_is_the_official_image() -> None:
    services = compose()["services"]
    for name in MESH_SERVICES:
        assert "shared.runtime.healthcheck" in services[name]["healthcheck"]["test"], name
        assert python_modules(services[name]["command"]) == [f"services.{name.replace('-', '_')}"]
    assert services["redis"]["image"].startswith("redis:")


def test_the_split_override_adds_a_prefill_pair_the_gateway_and_decode_pair_know() -> None:
    base, split = compose()["services"], compose(SPLIT)["services"]
    assert set(split) - set(base) == {"engine-worker-prefill", "scheduler-prefill"}
    for name in ("engine-worker-prefill", "scheduler-prefill"):
        module = python_modules(split[name]["command"])[0]
        assert importlib.util.find_spec(module) is not None
        assert "shared.runtime.healthcheck" in split[name]["healthcheck"]["test"]
    prefill = split["scheduler-prefill"]["environment"]
    assert prefill["KVMESH_ROLE"] == "prefill" and split["scheduler"]["environment"] == {
        "KVMESH_ROLE": "decode"
    }
    assert prefill["KVMESH_WORKER"] == prefill["KVMESH_WORKER_ADVERTISE"]
    schedulers = split["gateway"]["environment"]["KVMESH_SCHEDULER"].split(",")
    assert sorted(schedulers) == ["scheduler-prefill:50071", "scheduler:50071"]


def test_the_gateway_and_tokenizer_counts_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.gateway.config import build_parser

    services = compose()["services"]
    assert services["gateway"]["environment"]["KVMESH_PROCESSES"] == "${KVMESH_GATEWAYS:-1}"
    assert services["tokenizer"]["deploy"]["replicas"] == "${KVMESH_TOKENIZERS:-1}"
    monkeypatch.setenv("KVMESH_PROCESSES", "4")  # what the container's gateway then reads
    assert build_parser().parse_args([]).processes == 4


def _shell(line: str) -> str:
    """A compose command's shell text as the container's sh sees it ($$ is compose's $)."""
    return line.replace("$$", "$")


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server")
@pytest.mark.parametrize("password", ["", "s3cret-for-compose"])
def test_compose_redis_wants_the_password_when_one_is_set(password: str) -> None:
    redis = compose()["services"]["redis"]
    env = {**os.environ, "KVMESH_REDIS_PASSWORD": password}
    port = free_port("127.0.0.1")
    script = _shell(redis["command"][2]) + f" --port {port} --bind 127.0.0.1"
    server = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        health = _shell(redis["healthcheck"]["test"][1]).replace(
            "redis-cli", f"redis-cli -p {port}"
        )
        deadline = time.monotonic() + 10
        while subprocess.run(["sh", "-c", health], env=env, check=False).returncode:
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.05)
        anyone = subprocess.run(
            ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, check=False
        )
        assert ("NOAUTH" in anyone.stdout) is bool(password), anyone.stdout
    finally:
        server.terminate()
        server.wait(10)

"""Clients other than the tests' own: the kvmesh CLI and a Node.js @grpc/grpc-js program."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvmesh.mesh.launcher import Mesh

NODE_CLIENT = Path(__file__).resolve().parents[2] / "examples" / "node-client"


def test_cli_generate_streams_from_a_running_mesh(mesh: Mesh) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "generate",
            "What is 2 + 2?",
            "--addr",
            mesh.gateway_address,
            "--max-tokens",
            "16",
            "--stop",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "4" not in result.stdout  # cut before the stop string
    assert "[stop_string;" in result.stderr


def test_cli_chat_keeps_the_conversation_across_turns(mesh: Mesh) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "chat",
            "--addr",
            mesh.gateway_address,
            "--max-tokens",
            "12",
            "--temperature",
            "0",
        ],
        input="My name is Ada.\nWhat is my name?\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    answers = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(answers) == 2
    # The second turn carried the first turn and its answer: its prompt is that much longer.
    with open(mesh.service("gateway").log_path) as log:
        prompts = [json.loads(line) for line in log]
    first, second = [line["prompt_tokens"] for line in prompts if line["msg"] == "accepted"][-2:]
    assert second > first + 10


def test_cli_reports_a_refusal_with_its_reason(mesh: Mesh) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "generate",
            "Hi",
            "--addr",
            mesh.gateway_address,
            "--temperature",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "INVALID_SAMPLING_PARAMS" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("npm") is None, reason="needs Node.js and npm")
def test_node_client_streams_a_completion(mesh: Mesh) -> None:
    if not (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=NODE_CLIENT,
            check=True,
            capture_output=True,
            timeout=300,
        )
    result = subprocess.run(  # a prompt whose answer is no near-tie (test_cli.py)
        ["node", "client.js", mesh.gateway_address, "Name the capital of France.", "24"],
        cwd=NODE_CLIENT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    *text, terminal_line = result.stdout.strip().split("\n")
    terminal = json.loads(terminal_line)
    assert terminal["kind"] == "completed"
    assert int(terminal["body"]["usage"]["completion_tokens"]) > 0
    assert "Paris" in "\n".join(text)


def test_kvmesh_up_stops_every_process_it_started_on_ctrl_c(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "up",
            "--port",
            "0",
            "--log-dir",
            str(tmp_path),
            "--kv-memory",
            "128MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = up.stdout.readline().strip()  # printed once every service is ready
        assert address.startswith("127.0.0.1:"), up.stderr.read()
        children = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for module in ("gateway", "scheduler", "engine_worker", "tokenizer", "trace_collector"):
            assert f"services.{module}" in names
        assert "redis-server" in names
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        time.sleep(0.2)
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if up.poll() is None:
            up.kill()
    logs = {p.name for p in tmp_path.iterdir()}
    assert {"gateway.log", "scheduler-0.log", "engine-worker-0.log"} <= logs

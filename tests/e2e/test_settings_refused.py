"""A bad setting is refused before anything starts, in one line naming the flag, the value
and what is allowed, with argparse's status 2: by `kvmesh up` for every service it starts and
every repository entry it serves, and by each `python -m services.NAME`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.model_entry import ServingConfig
from shared.model_repository import ModelRepository


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def assert_refused(result: subprocess.CompletedProcess[str], prefix: str, words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(prefix), result.stderr
    assert words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # no traceback


def up_refuses(tmp_path: Path, flags: list[str], words: str, env=None) -> None:
    logs = tmp_path / "logs"
    started = time.perf_counter()
    result = run(["kvmesh", "up", "--log-dir", str(logs), *flags, "--prompt", "hi"], env)
    assert_refused(result, "kvmesh up: error: ", words)
    assert time.perf_counter() - started < 5  # about a second: nothing was started
    assert not logs.exists()  # no service was started to write there


@pytest.mark.parametrize(
    ("flags", "words"),
    [  # the engine-worker's: a choice, a size, a number, a path, a URL, a folder, a pairing
        (["--kv-tiers", "dsk"], "argument --kv-tiers: 'dsk' is not one of host, disk, redis"),
        (["--kv-memory", "12XB"], "argument --kv-memory: cannot parse a size from '12XB'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is below 1, the least allowed"),
        (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
        (["--model", "/no/such/model.gguf"], "no model file or directory at /no/such/model.gguf"),
        (
            ["--kv-tiers", "redis", "--kv-redis", "localhost:6379"],
            "--kv-redis must be a redis://, rediss:// or unix:// URL, got 'localhost:6379'",
        ),
        (["--kv-tiers", "disk", "--kv-disk-dir", "/proc/kv"], "--kv-disk-dir '/proc/kv': "),
        (["--quantize", "int8", "--weights", "float32"], "--quantize int8 needs --weights packed"),
        # the scheduler's
        (["--chunk-size", "-5"], "argument --chunk-size: -5 is below 0, the least allowed"),
        (["--plan-ahead", "sometimes"], "argument --plan-ahead: invalid choice: 'sometimes'"),
        (["--handover-lease-s", "soon"], "argument --handover-lease-s: 'soon' is not a number"),
        # the gateway's
        (["--routing", "random"], "argument --routing: invalid choice: 'random'"),
        (["--max-in-flight", "0"], "argument --max-in-flight: 0 is below 1, the least allowed"),
        (["--api-keys-file", "/no/keys.toml"], "argument --api-keys-file: no file at"),
        # the launcher's own
        (["--port", "99999"], "argument --port: 99999 is not a port (0-65535, or -1 for off)"),
        (["--redis", "not-a-url"], "argument --redis: 'not-a-url' is not a redis://, rediss://"),
    ],
)
def test_up_refuses_a_bad_flag_before_starting_anything(tmp_path, flags, words) -> None:
    up_refuses(tmp_path, flags, words)


def test_up_refuses_a_bad_environment_value_as_it_would_the_flag(tmp_path) -> None:
    env = {"KVMESH_KV_WRITE": "sometimes"}
    up_refuses(tmp_path, [], "argument --kv-write: invalid choice: 'sometimes'", env)


@pytest.mark.parametrize(
    ("serving", "words"),
    [
        ({"kv_memory": "12XB"}, "[serving] kv_memory = '12XB': cannot parse a size from '12XB'"),
        ({"kv_memroy": "1GiB"}, "[serving] kv_memroy: not a setting a model sets ("),
        ({"chunk_size": -1}, "[serving] chunk_size = -1: -1 is below 0, the least allowed"),
        ({"quantize": "int8", "weights": "float32"}, "tiny@1: --quantize int8 needs --weights"),
    ],
)
def test_up_refuses_a_repository_entrys_bad_serving_value(
    tmp_path, tiny_llama_dir: str, serving, words
) -> None:
    repo = ModelRepository(str(tmp_path / "repo"))
    repo.add("tiny", tiny_llama_dir, serving=ServingConfig(serving))
    up_refuses(tmp_path, ["--model-repo", repo.root], words)


@pytest.mark.parametrize(
    ("service", "flags", "env", "words"),
    [
        ("engine_worker", ["--kv-memory", "12XB"], {}, "argument --kv-memory: cannot parse"),
        ("scheduler", [], {"KVMESH_MAX_NUM_SEQS": "0"}, "argument --max-num-seqs: 0 is below 1"),
        ("gateway", ["--routing", "random"], {}, "argument --routing: invalid choice: 'random'"),
        ("tokenizer", ["--port", "http"], {}, "argument --port: 'http' is not a whole number"),
        ("scheduler", [], {"KVMESH_REDIS": "localhost:6379"}, "argument --redis: 'localhost"),
        ("gateway", ["--redis", "http://r"], {}, "argument --redis: 'http://r' is not a redis"),
        ("trace_collector", ["--max-memory", "lots"], {}, "argument --max-memory: cannot parse"),
    ],
)
def test_a_service_refuses_a_bad_value_in_one_line(service, flags, env, words) -> None:
    result = run([f"services.{service}", *flags], env)
    assert_refused(result, f"services.{service}: error: ", words)

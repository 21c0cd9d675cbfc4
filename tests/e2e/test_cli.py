"""The `kvmesh` command as a user runs it: a subprocess on the default model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest


def kvmesh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_generate_file_writes_one_line_per_input_in_order(tmp_path: Path) -> None:
    inputs = [
        {"prompt": "The capital of France is"},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"token_ids": [504, 3575, 282, 4649, 314]},  # "The capital of France is"
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in inputs))
    target = tmp_path / "out.jsonl"
    result = kvmesh(
        "generate",
        "--prompts-file",
        str(source),
        "--output",
        str(target),
        "--max-tokens",
        "8",
        "--threads",
        "2",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 3
    for record in records:
        assert set(record) == {"token_ids", "text", "finish_reason", "usage"}
        assert record["finish_reason"] in ("stop", "length")
        assert record["usage"]["completion_tokens"] == len(record["token_ids"]) > 0
    # Text and token-id forms of the same prompt give the same greedy answer.
    assert records[0]["token_ids"] == records[2]["token_ids"]
    assert records[0]["usage"]["prompt_tokens"] == 5
    assert "Paris" in records[0]["text"]


def test_generate_prompt_streams_an_answer() -> None:
    # No near-tie: "What is the capital of France?" starts 0.08 nats from French in float32.
    result = kvmesh(
        "generate", "Name the capital of France.", "--max-tokens", "20", "--threads", "2"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_under_a_json_schema_prints_valid_json(tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    result = kvmesh(
        "generate",
        "Name the capital of France as JSON.",
        "--json-schema",
        str(schema_file),
        "--max-tokens",
        "60",
        "--threads",
        "2",
    )
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "MODEL_NOT_FOUND"),
        (["generate", "hi", "--temperature", "-1"], "INVALID_SAMPLING_PARAMS"),
        (["generate", "hi", "--json-schema", '{"type": "objekt"}'], "INVALID_SCHEMA"),
    ],
)
def test_bad_input_gives_a_stable_reason_and_exit_code(args: list[str], message: str) -> None:
    result = kvmesh(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr

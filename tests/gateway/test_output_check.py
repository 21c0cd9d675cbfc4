"""The gateway's last check of a finished JSON output against its response format."""

from __future__ import annotations

import json

import pytest

from services.gateway.request.output_check import check_output, output_problem
from shared.errors import KvmeshError, Reason
from shared.sampling import ResponseFormat

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
    "required": ["name"],
}


def schema_format() -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(SCHEMA))


def test_a_valid_output_passes() -> None:
    assert output_problem(schema_format(), '{"name": "Ada", "tags": [1, 2]}') is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "Ada", "tags": [1, -2]}', "at tags/1"),
        ('{"name": "Ada Lovelace"}', "at name"),
        ('{"tags": []}', "at (root)"),
        ('{"name": "Ada"', "not JSON"),
    ],
)
def test_an_invalid_output_names_where(text: str, expected: str) -> None:
    problem = output_problem(schema_format(), text)
    assert problem is not None and expected in problem
    with pytest.raises(KvmeshError) as raised:
        check_output(schema_format(), text)
    assert raised.value.reason is Reason.INVALID_OUTPUT and not raised.value.retryable


def test_json_object_needs_an_object_and_other_kinds_are_left_to_the_mask() -> None:
    json_object = ResponseFormat("json_object")
    assert output_problem(json_object, '{"a": 1}') is None
    assert "not an object" in (output_problem(json_object, "[1]") or "")
    regex = ResponseFormat("regex", "[0-9]+")
    assert output_problem(regex, "anything") is None

"""Response formats through the in-process engine on the default model: sampled at
temperature 1.0, every finished output parses and validates; regex and Lark grammars hold;
a free request in the same batch is untouched; a bad schema is refused up front."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig
from shared.errors import KvmeshError, Reason
from shared.sampling import ResponseFormat, SamplingParams

SCHEMAS: list[dict] = [
    {  # flat, required, no extras
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # numbers with bounds
        "type": "object",
        "properties": {
            "celsius": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["celsius", "humidity"],
        "additionalProperties": False,
    },
    {  # enum and boolean
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "bright": {"type": "boolean"},
        },
        "required": ["colour", "bright"],
        "additionalProperties": False,
    },
    {  # string pattern
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {  # array with bounds on items and length
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    {  # nested object
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "email": {"type": "string", "maxLength": 20},
                },
                "required": ["id", "email"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {  # optional fields
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 15},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {  # array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 6},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # nullable and const
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["version", "note"],
        "additionalProperties": False,
    },
    {  # strings with max lengths in an array, and an enum of numbers
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
]
SAMPLES_PER_SCHEMA = 3
PROMPT = {"messages": [{"role": "user", "content": "Answer with one JSON value."}]}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(cache=CacheConfig(kv_memory_bytes=256 << 20)))


def test_sampled_outputs_of_ten_schemas_all_validate(engine: Engine) -> None:
    params = [
        SamplingParams(
            max_tokens=160,
            temperature=1.0,
            seed=seed,
            response_format=ResponseFormat("json_schema", json.dumps(schema)),
        )
        for schema in SCHEMAS
        for seed in range(SAMPLES_PER_SCHEMA)
    ]
    completions = engine.generate([PROMPT] * len(params), params)
    finished = 0
    for index, completion in enumerate(completions):
        if completion.finish_reason != "stop":
            continue  # max_tokens cut it: nothing to validate
        finished += 1
        schema = SCHEMAS[index // SAMPLES_PER_SCHEMA]
        jsonschema.validate(json.loads(completion.text), schema)
    assert finished >= 0.8 * len(params), f"only {finished} of {len(params)} finished"


def test_regex_and_lark_formats_hold(engine: Engine) -> None:
    regex = ResponseFormat("regex", r"[0-9]{3}-[0-9]{4}")
    lark = ResponseFormat("lark", 'start: answer "."\nanswer: "yes" | "no"')
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=seed, response_format=fmt)
        for fmt in (regex, lark)
        for seed in range(3)
    ]
    completions = engine.generate([PROMPT] * len(params), params)
    for completion in completions[:3]:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", completion.text), completion.text
    for completion in completions[3:]:
        assert completion.text in ("yes.", "no."), completion.text


def test_a_free_request_in_the_same_batch_is_untouched(engine: Engine) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = engine.generate([PROMPT], free)[0]
    constrained = SamplingParams(
        max_tokens=40, temperature=1.0, seed=1, response_format=ResponseFormat("json_object")
    )
    mixed = engine.generate([PROMPT, PROMPT], [constrained, free])
    assert mixed[1].token_ids == alone.token_ids
    assert alone.text != mixed[0].text and mixed[0].text.startswith("{")


def test_ignore_eos_runs_past_a_finished_format(engine: Engine) -> None:
    regex = ResponseFormat("regex", "(yes|no)")
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, response_format=regex
    )
    [completion] = engine.generate([PROMPT], params)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 8
    assert completion.text.startswith(("yes", "no"))


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ('{"type": "object", "properties": ', "not JSON"),
        ('{"type": "objekt"}', "objekt"),
        ('{"type": "string", "pattern": "(unclosed"}', "unclosed"),
    ],
)
def test_an_invalid_schema_is_refused_before_queueing(
    engine: Engine, spec: str, named: str
) -> None:
    bad = SamplingParams(response_format=ResponseFormat("json_schema", spec))
    with pytest.raises(KvmeshError) as refused:
        engine.add_request(PROMPT, bad)
    assert refused.value.reason == Reason.INVALID_SCHEMA
    assert named in refused.value.message
    assert not engine.has_unfinished()

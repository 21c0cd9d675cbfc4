"""The last check before `completed`: a finished JSON response format's text parses and
validates against its schema.

llguidance already constrains every token, so a failure here is a bug (a grammar the schema
compiler got wrong, a tokenizer mismatch), reported as INVALID_OUTPUT rather than handed to a
client as valid. Regex and Lark formats are left to the mask: Python's `re` and Lark dialects
differ from llguidance's, and a second opinion in another dialect would refuse good output.
"""

from __future__ import annotations

import functools
import json

import jsonschema

from shared.errors import KvmeshError, Reason
from shared.sampling import ResponseFormat

# Schema text -> its validator; a schema is checked by the worker's compiler before it runs.
_MAX_CACHED_SCHEMAS = 256


@functools.lru_cache(maxsize=_MAX_CACHED_SCHEMAS)
def _validator(schema_text: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_text)
    return jsonschema.validators.validator_for(schema)(schema)


def output_problem(response_format: ResponseFormat, text: str) -> str | None:
    """Why `text` does not satisfy the format, or None when it does (or is not checked here)."""
    if response_format.kind not in ("json_schema", "json_object"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return f"the output is not JSON: {error}"
    if response_format.kind == "json_object":
        return None if isinstance(value, dict) else "the output is JSON but not an object"
    problem = schema_problem(response_format.spec, value)
    return None if problem is None else f"the output {problem}"


def schema_problem(schema_text: str, value: object) -> str | None:
    """Where and how `value` fails the schema, or None when it is valid."""
    mismatch = jsonschema.exceptions.best_match(_validator(schema_text).iter_errors(value))
    if mismatch is None:
        return None
    where = "/".join(str(part) for part in mismatch.absolute_path) or "(root)"
    return f"does not match the schema at {where}: {mismatch.message}"


def check_output(response_format: ResponseFormat, text: str) -> None:
    problem = output_problem(response_format, text)
    if problem is not None:
        raise KvmeshError(Reason.INVALID_OUTPUT, problem)

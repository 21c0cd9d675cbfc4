"""Chat templates rendered as transformers renders them: sandboxed jinja2, trimmed blocks."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import KvmeshError, Reason


def _raise_exception(message: str) -> NoReturn:
    raise KvmeshError(Reason.INVALID_ARGUMENT, f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=16)
def _compile(source: str) -> Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> str:
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, "each message needs a 'role' and a 'content'"
            )
    try:
        return _compile(source).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise KvmeshError(Reason.INVALID_ARGUMENT, f"chat template failed: {error}") from None

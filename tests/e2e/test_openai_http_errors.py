"""The HTTP front's errors on a gateway with API keys and room for one request: the statuses,
OpenAI error objects and retry headers the official client acts on. Runs on the tiny random
Llama (token-id prompts): this is about the gateway."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from tests.e2e.mesh_helpers import keys_file

KEYS = """
[tenants.acme]
keys = ["sk-acme"]

[tenants.limited]
keys = ["sk-limited"]
requests_per_second = 0.5

[tenants.ops]
keys = ["sk-ops"]
admin = true
"""
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = keys_file(tmp_path_factory, KEYS)
    config = MeshConfig(
        model=tiny_llama_dir,
        worker_threads=1,
        worker_args=["--kv-memory", "16MiB"],
        gateway_args=["--api-keys-file", keys, "--max-in-flight", "1"],
        log_dir=str(tmp_path_factory.mktemp("openai-errors-logs")),
        drain_seconds=2,
    )
    with Mesh(config) as running:
        yield running


def client(mesh: Mesh, key: str = "sk-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.http_url, api_key=key, max_retries=0)


async def complete(mesh: Mesh, key: str = "sk-acme", **extra: object) -> object:
    async with client(mesh, key) as c:
        return await c.completions.create(
            model="", prompt=PROMPT, max_tokens=4, temperature=0, **extra
        )


async def test_a_missing_or_wrong_key_is_401(mesh: Mesh) -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        await complete(mesh, "sk-wrong")
    assert raised.value.status_code == 401 and raised.value.code == "UNAUTHENTICATED"
    # No key at all (the official client insists on one): a plain request.
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    keyless = urllib.request.Request(f"{mesh.http_url}/completions", body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyless, timeout=10)
    assert refused.value.code == 401
    assert json.load(refused.value)["error"]["code"] == "UNAUTHENTICATED"
    async with client(mesh, "sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()
    answer = await complete(mesh)
    assert answer.usage.completion_tokens == 4  # type: ignore[attr-defined]


async def test_a_tenant_over_its_rate_gets_429_with_retry_after(mesh: Mesh) -> None:
    await complete(mesh, "sk-limited")
    with pytest.raises(openai.RateLimitError) as raised:
        await complete(mesh, "sk-limited")
    error = raised.value
    assert error.status_code == 429 and error.code == "RATE_LIMITED"
    assert error.body["retryable"] is True  # type: ignore[index]
    assert 1 <= int(error.response.headers["Retry-After"]) <= 2
    assert 0 < int(error.response.headers["retry-after-ms"]) <= 2000


async def test_a_full_gateway_is_503_with_retry_after(mesh: Mesh) -> None:
    async with client(mesh) as holder:
        stream = await holder.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=100_000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _chunk in stream:
            break  # the gateway's only slot is taken
        with pytest.raises(openai.APIStatusError) as raised:
            await complete(mesh)
        await stream.close()
    error = raised.value
    assert error.status_code == 503 and error.code == "OVERLOADED"
    assert int(error.response.headers["Retry-After"]) >= 1
    # The holder hung up: its slot comes back (the gateway notices within moments).
    deadline = time.monotonic() + 10
    while True:
        try:
            await complete(mesh)
            break
        except openai.APIStatusError as refused:
            assert refused.status_code == 503 and time.monotonic() < deadline
            await asyncio.sleep(0.05)


async def test_a_deadline_that_passes_is_504(mesh: Mesh) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        await complete(
            mesh, extra_body={"timeout_ms": 1, "ignore_eos": True, "max_tokens": 100_000}
        )
    assert raised.value.status_code == 504 and raised.value.code == "DEADLINE_EXCEEDED"


def get(url: str, key: str | None = None, body: dict | None = None) -> int:
    """The status of a GET (or, with a body, a POST)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_health_needs_no_key_and_metrics_an_admins(mesh: Mesh) -> None:
    root = mesh.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=10) as response:
        assert response.status == 200 and json.load(response) == {"status": "serving"}
    assert get(f"{root}/metrics") == 401
    assert get(f"{root}/metrics", "sk-acme") == 403  # every tenant's series: admins only
    request = urllib.request.Request(f"{root}/metrics", headers={"Authorization": "Bearer sk-ops"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    assert "kvmesh_time_to_first_token_seconds_bucket" in text
    assert "kvmesh_requests_total{" in text


def test_no_key_is_401_before_any_model_is_looked_up(mesh: Mesh) -> None:
    """Without a key an unknown model and a real one answer alike: names cannot be probed."""
    assert get(f"{mesh.http_url}/models/no-such-model") == 401
    assert get(f"{mesh.http_url}/models/no-such-model", "sk-acme") == 404
    chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    assert get(f"{mesh.http_url}/chat/completions", body=chat) == 401
    assert get(f"{mesh.http_url}/chat/completions", "sk-acme", chat) == 404
    root = mesh.http_url.removesuffix("/v1")
    # Past auth, the tiny model (which ships no tokenizer) cannot encode text.
    for path, body, status in (
        ("/tokenize", {"prompt": "hi"}, 400),
        ("/detokenize", {"tokens": [1]}, 200),
    ):
        assert get(root + path, body=body) == 401
        assert get(root + path, "sk-acme", body) == status


async def test_extreme_sampling_values_run_finite_or_are_400(mesh: Mesh) -> None:
    """What once made NaN probabilities and a 500 (and counted toward the worker's breaker):
    a vanishing temperature samples at the floor; a vanishing repetition penalty is refused."""
    async with client(mesh) as c:
        answer = await c.completions.create(
            model="", prompt=PROMPT, max_tokens=4, temperature=1e-320, seed=1
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError) as raised:
            await c.completions.create(
                model="", prompt=PROMPT, max_tokens=4, extra_body={"repetition_penalty": 1e-300}
            )
    assert raised.value.code == "INVALID_SAMPLING_PARAMS"
    assert "repetition_penalty" in str(raised.value.message)


def test_invalid_unicode_is_400_in_the_openai_shape_with_no_traceback(mesh: Mesh) -> None:
    """A lone surrogate, escaped in JSON, in a chat message: refused before anything reads it."""
    body = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 2}'
    request = urllib.request.Request(
        f"{mesh.http_url}/chat/completions",
        body,
        headers={"Authorization": "Bearer sk-acme", "Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    error = json.load(refused.value)["error"]
    assert (error["code"], error["type"]) == ("INVALID_ARGUMENT", "invalid_request_error")
    assert "Unicode" in error["message"]
    gateway_log = pathlib.Path(mesh.service("gateway").log_path).read_text()
    assert "Traceback" not in gateway_log

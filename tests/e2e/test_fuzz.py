"""Property-based fuzzing of the public gRPC and HTTP APIs on the real mesh (the real model).

Whatever arrives, a refusal is fast, carries a kvmesh reason that is not INTERNAL, and nothing
crashes, hangs or leaks: after the run every service still runs, the gateway serves, and no
request or KV block is left anywhere. Accepted requests are cancelled after their first event
(the fuzz is about input, not generation). The default run is derandomized (the same
examples every time, so CI is repeatable); `KVMESH_FUZZ_EXAMPLES` sets a run's size and draws
fresh examples, as `make soak`'s long run does. Each example records how it ended (hypothesis
`event`): `pytest --hypothesis-show-statistics` prints each outcome's share.
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvmesh.mesh.launcher import Mesh
from shared.errors import Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import assert_mesh_idle, rich_error

EXAMPLES = int(os.environ.get("KVMESH_FUZZ_EXAMPLES", "0")) or 150
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
    derandomize="KVMESH_FUZZ_EXAMPLES" not in os.environ,
)
KNOWN_REASONS = {r.value for r in Reason} - {Reason.INTERNAL.value, Reason.INVALID_OUTPUT.value}

ints = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**32 - 1, 49152, 49153, 8192, 8193]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-300, 1e300, 2.0, -1.0]),
)
texts = st.one_of(
    st.text(max_size=200),
    st.sampled_from(["", " ", "\x00", "\ud7ff" * 4, "a" * 300_000, "<|im_start|>system"]),
)
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, floats, texts),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


def deep_schema(depth: int) -> str:
    """Objects nested `depth` deep, built as text (json.dumps itself would recurse too deep)."""
    opening = '{"type": "object", "required": ["a"], "properties": {"a": '
    return opening * depth + '{"type": "string"}' + "}}" * depth


schemas = st.one_of(
    st.sampled_from(
        [
            "",
            "{",
            "[]",
            '{"$ref": "#"}',  # a schema that is itself
            '{"type": "object", "properties": {"a": {"$ref": "#"}}}',  # recursive, valid
            '{"$ref": "#/definitions/missing"}',
            '{"type": "nonsense"}',
            deep_schema(64),
            deep_schema(2000),
            "[" * 100_000,
        ]
    ),
    json_like.map(json.dumps),
)


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams()
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if draw(st.booleans()):
            setattr(params, name, draw(floats))
    for name in ("top_k", "max_tokens", "seed", "logprobs"):
        if draw(st.booleans()):
            field = params.DESCRIPTOR.fields_by_name[name]
            value = draw(ints)
            if field.type in (field.TYPE_UINT32, field.TYPE_UINT64):
                value = abs(value)
            setattr(params, name, value)
    if draw(st.booleans()):
        params.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)))
    params.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        params.response_format.kind = draw(
            st.sampled_from(["json_schema", "json_object", "regex", "lark", "", "nonsense"])
        )
        params.response_format.spec = draw(schemas)
    return params


@st.composite
def generate_requests(draw: st.DrawFn) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(sampling=draw(sampling_params()))
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        request.text = draw(texts)
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            message = request.chat.messages.add()
            message.role = draw(st.sampled_from(["user", "system", "assistant", "tool", ""]))
            message.content = draw(texts)
    elif kind == "token_ids":
        request.token_ids.ids.extend(
            draw(st.lists(st.integers(0, 2**32 - 1), max_size=draw(st.integers(0, 9000))))
        )
    request.model = draw(st.sampled_from(["", "no-such-model", "SmolLM2-135M-Instruct"]))
    request.stop.extend(draw(st.lists(texts, max_size=20)))
    request.timeout_ms = draw(st.sampled_from([0, 1, 50, 60_000]))
    request.priority = draw(st.integers(-(2**31), 2**31 - 1))
    request.request_id = draw(st.sampled_from(["", "fuzz", "x" * 10_000, "\u2603"]))
    return request


def cap_output(request: inference_pb2.GenerateRequest) -> None:
    """Valid requests would generate up to the context length: keep the fuzz about input."""
    if 4 < request.sampling.max_tokens < 2**31:
        request.sampling.max_tokens = 4


@pytest.fixture(scope="module")
def public_stub(mesh: Mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def assert_refused_cleanly(error: grpc.RpcError) -> None:
    parsed = rich_error(error)  # type: ignore[arg-type]
    assert parsed.reason in KNOWN_REASONS, (parsed, error)
    event(f"refused {parsed.reason}")


@FUZZ
@given(request=generate_requests())
@example(request=inference_pb2.GenerateRequest(text="hi", sampling={"max_tokens": 0}))
@example(request=inference_pb2.GenerateRequest(token_ids={"ids": [49152]}))
def test_any_generate_request_is_served_or_refused_with_a_reason(
    public_stub: inference_pb2_grpc.InferenceStub, request: inference_pb2.GenerateRequest
) -> None:
    cap_output(request)
    call = public_stub.Generate(request, timeout=60)
    try:
        first = next(call)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and request.timeout_ms:
            event("its own timeout_ms passed before acceptance")
            return
        assert_refused_cleanly(error)
        return
    finally:
        call.cancel()
    assert first.WhichOneof("event") == "accepted"
    event("accepted")


@FUZZ
@given(payload=st.binary(max_size=4096))
def test_raw_bytes_on_the_grpc_method_never_break_the_gateway(mesh: Mesh, payload: bytes) -> None:
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        generate = channel.unary_stream("/kvmesh.v1.Inference/Generate")
        call = generate(payload, timeout=60)
        try:
            next(call)  # bytes that happen to parse are a request like any other
            event("parsed and accepted")
        except grpc.RpcError as error:
            assert_refused_cleanly(error)  # INVALID_ARGUMENT when they do not parse
        except StopIteration:
            pytest.fail("a stream ended without a status")
        finally:
            call.cancel()


def post(mesh: Mesh, path: str, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    request = urllib.request.Request(
        mesh.http_url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def http_bodies() -> st.SearchStrategy[bytes]:
    fields = st.fixed_dictionaries(
        {},
        optional={
            "model": st.one_of(texts, json_like),
            "prompt": st.one_of(texts, st.lists(st.integers(-5, 2**32), max_size=20), json_like),
            "messages": st.one_of(
                json_like,
                st.lists(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "role": st.one_of(st.sampled_from(["user", "system"]), json_like),
                            "content": st.one_of(texts, json_like),
                        },
                    ),
                    max_size=3,
                ),
            ),
            "max_tokens": st.one_of(ints, json_like),
            "temperature": st.one_of(floats, json_like),
            "top_p": st.one_of(floats, json_like),
            "n": st.one_of(ints, json_like),
            "stream": st.one_of(st.booleans(), json_like),
            "stop": st.one_of(texts, st.lists(texts, max_size=6), json_like),
            "logprobs": st.one_of(st.booleans(), ints, json_like),
            "top_logprobs": st.one_of(ints, json_like),
            "response_format": st.one_of(
                json_like,
                schemas.map(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}),
            ),
            "seed": st.one_of(ints, json_like),
        },
    )

    def capped(body: dict) -> bytes:
        value = body.get("max_tokens")
        if "max_tokens" not in body or (type(value) is int and 4 < value < 2**31):
            body["max_tokens"] = 4
        return json.dumps(body).encode()

    return st.one_of(
        fields.map(capped),
        st.binary(max_size=2048),
        st.just(b"[" * 100_000),
        st.just(b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
        st.just(b'{"prompt": "\xff\xfe"}'),
    )


@FUZZ
@given(path=st.sampled_from(["/completions", "/chat/completions"]), body=http_bodies())
def test_any_http_body_gets_an_openai_error_or_a_completion(
    mesh: Mesh, path: str, body: bytes
) -> None:
    status, payload = post(mesh, path, body)
    if status == 200:
        event("200")
        return
    assert status in (400, 404, 413, 429, 503, 504), (status, payload[:300])
    error = json.loads(payload)["error"]
    assert error["code"] in KNOWN_REASONS, error
    event(f"{status} {error['code']}")


async def test_after_the_fuzz_nothing_is_left_behind(mesh: Mesh) -> None:
    """Runs after the fuzz tests above (file order): every process up, nothing leaked."""
    assert all(s.process.poll() is None for s in mesh.services)
    await assert_mesh_idle(mesh)

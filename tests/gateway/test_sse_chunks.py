"""A streamed chunk encoded from its choice's template is byte for byte the one built as a
dict and serialized, for every shape of text and request the template serves."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_front.protocol import parse_chat, parse_completion
from services.gateway.openai_front.responses import ResponseBuilder
from services.gateway.openai_front.sse import PLACEHOLDER, sse
from shared.pb.kvmesh.v1 import inference_pb2

TEXTS = ["Hel", 'a "quoted"\\ line\n', "ünïcødé 🙂", "\x00\x1f\t", PLACEHOLDER, "", " end"]
BODIES = [
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, True),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}, False),
    ({"prompt": "hi", "stream": True, "n": 2}, False),
    ({"prompt": "hi", "stream": True, "echo": True}, False),
    ({"prompt": "hi", "stream": True, "logprobs": 1}, False),
    (
        {
            "prompt": "hi",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        False,
    ),
]


def builder(body: dict, chat: bool) -> ResponseBuilder:
    parsed = parse_chat(body, lambda model: 2048) if chat else parse_completion(body)
    built = ResponseBuilder(parsed)
    built.accepted(inference_pb2.Accepted(request_id="r1", model="m", model_version="v1"))
    return built


@pytest.mark.parametrize(("body", "chat"), BODIES)
def test_templated_chunks_equal_serialized_ones(body: dict, chat: bool) -> None:
    templated, built = builder(body, chat), builder(body, chat)
    sent = []
    for number, text in enumerate(TEXTS * 2):
        index = number % 2 if body.get("n") else 0
        delta = inference_pb2.Delta(text=text, token_ids=[number])
        if body.get("echo") and number == 0:
            delta.prompt_logprobs.add(token_id=1)
        chunk = built.delta_chunk(delta, index)
        expected = None if chunk is None else sse(chunk)
        assert templated.delta_sse(delta, index) == expected
        sent.append(expected)
    payloads = [json.loads(event[6:]) for event in sent if event is not None]
    assert [p["id"] for p in payloads] == ["chatcmpl-r1" if chat else "cmpl-r1"] * len(payloads)
    assert templated.streamed_tokens == built.streamed_tokens == len(TEXTS) * 2


def test_template_keeps_text_exact() -> None:
    stream = builder({"prompt": "hi", "stream": True}, chat=False)
    for text in TEXTS:
        encoded = stream.delta_sse(inference_pb2.Delta(text=text, token_ids=[1]))
        if text:
            assert encoded is not None
            assert json.loads(encoded[6:])["choices"][0]["text"] == text

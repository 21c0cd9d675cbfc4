"""OpenAI bodies -> GenerateRequest, and events -> OpenAI chunks: the shapes, without a mesh."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_front.protocol import parse_body, parse_chat, parse_completion
from services.gateway.openai_front.responses import ResponseBuilder
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

HI = [{"role": "user", "content": "hi"}]


def context_of(model: str) -> int:
    return {"": 2048, "small": 512}[model]


def test_chat_fields_become_the_grpc_request() -> None:
    parsed = parse_chat(
        {
            "model": "small",
            "messages": [
                {"role": "system", "content": None},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "END",
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 4,
            "top_k": 7,
            "disable_speculation": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_object"},
        },
        context_of,
    )
    request, sampling = parsed.generate, parsed.generate.sampling
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", ""), ("user", "ab")]
    assert (request.model, list(request.stop)) == ("small", ["END"])
    assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.top_k) == (0, 0.5, 3, 7)
    assert (sampling.max_tokens, sampling.logprobs) == (9, 4)
    assert sampling.response_format.kind == "json_object"
    assert sampling.disable_speculation
    assert parsed.stream and parsed.include_usage and parsed.logprobs and parsed.chat


def test_chat_without_a_limit_may_fill_the_context() -> None:
    assert parse_chat({"messages": HI}, context_of).generate.sampling.max_tokens == 2048
    assert (
        parse_chat({"model": "small", "messages": HI}, context_of).generate.sampling.max_tokens
        == 512
    )


@pytest.mark.parametrize(
    ("prompt", "field"),
    [("text", "text"), (["text"], "text"), ([1, 2, 3], "token_ids"), ([[1, 2]], "token_ids")],
)
def test_completion_prompts(prompt: object, field: str) -> None:
    parsed = parse_completion({"prompt": prompt, "logprobs": 2})
    assert parsed.generate.WhichOneof("input") == field
    assert parsed.generate.sampling.logprobs == 2 and not parsed.generate.sampling.HasField(
        "max_tokens"
    )


@pytest.mark.parametrize(
    ("body", "reason", "words"),
    [
        ({"messages": HI, "n": 0}, Reason.INVALID_ARGUMENT, "'n'"),
        ({"messages": HI, "max_tokens": -1}, Reason.INVALID_ARGUMENT, "'max_tokens'"),
        ({"messages": HI, "max_tokens": 0}, Reason.INVALID_ARGUMENT, "in [1, "),  # as refused
        ({"messages": HI, "max_completion_tokens": 0}, Reason.INVALID_ARGUMENT, "in [1, "),
        ({"messages": HI, "temperature": True}, Reason.INVALID_ARGUMENT, "'temperature'"),
        ({"messages": HI, "top_logprobs": 2}, Reason.INVALID_ARGUMENT, "needs 'logprobs'"),
        (
            {"messages": HI, "stream_options": {"include_usage": True}},
            Reason.INVALID_ARGUMENT,
            "stream",
        ),
        ({"messages": [{"content": "x"}]}, Reason.INVALID_ARGUMENT, "'role'"),
        ({"messages": HI, "response_format": {"type": "yaml"}}, Reason.INVALID_SCHEMA, "yaml"),
        (
            {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {}}},
            Reason.INVALID_SCHEMA,
            "schema",
        ),
    ],
)
def test_bad_bodies_name_the_field(body: dict, reason: Reason, words: str) -> None:
    with pytest.raises(KvmeshError) as raised:
        parse_chat(body, context_of)
    assert raised.value.reason is reason and words in raised.value.message


def test_top_p_zero_is_the_most_probable_token_alone() -> None:
    """OpenAI's range for top_p includes 0; ours is (0, 1]: the same as top_k 1."""
    for body in ({"messages": HI, "top_p": 0}, {"messages": HI, "top_p": 0.0, "top_k": 40}):
        sampling = parse_chat(body, context_of).generate.sampling
        assert (sampling.top_p, sampling.top_k) == (1.0, 1)
    assert parse_completion({"prompt": "a", "top_p": 0}).generate.sampling.top_k == 1
    assert parse_chat({"messages": HI, "top_p": 0.5}, context_of).generate.sampling.top_k == 0


def test_zero_max_tokens_says_what_it_takes() -> None:
    with pytest.raises(KvmeshError, match="at least 1 \\(0 only with 'echo': true\\)"):
        parse_completion({"prompt": "a", "max_tokens": 0})
    echoed = parse_completion({"prompt": "a", "max_tokens": 0, "echo": True})
    assert echoed.echo_only


def test_bodies_that_are_not_objects() -> None:
    for raw in (b"{", b"[1]", b"\xff"):
        with pytest.raises(KvmeshError):
            parse_body(raw)
    with pytest.raises(KvmeshError, match="prompt"):
        parse_completion({"prompt": [["a"], ["b"]]})


def test_kvmesh_formats_beside_openais() -> None:
    regex = parse_completion({"prompt": "x", "response_format": {"type": "regex", "regex": "a+"}})
    assert (
        regex.generate.sampling.response_format.kind,
        regex.generate.sampling.response_format.spec,
    ) == ("regex", "a+")
    text = parse_completion({"prompt": "x", "response_format": {"type": "text"}})
    assert not text.generate.sampling.HasField("response_format")


def builder(body: dict, chat: bool = True) -> ResponseBuilder:
    parsed = parse_chat(body, context_of) if chat else parse_completion(body)
    built = ResponseBuilder(parsed)
    built.accepted(inference_pb2.Accepted(request_id="r1", model="m", model_version="v1"))
    return built


def delta(index: int = 0, **fields) -> inference_pb2.GenerateEvent:
    return inference_pb2.GenerateEvent(delta=inference_pb2.Delta(**fields), index=index)


def completed(reason: int) -> inference_pb2.GenerateEvent:
    return inference_pb2.GenerateEvent(completed=inference_pb2.Completed(finish_reason=reason))


def test_chat_stream_chunks() -> None:
    stream = builder({"messages": HI, "stream": True, "stream_options": {"include_usage": True}})
    first = stream.delta_chunk(inference_pb2.Delta(text="Hel"))
    assert first is not None and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "Hel",
    }
    assert first["usage"] is None and first["id"] == "chatcmpl-r1"
    assert first["system_fingerprint"] == "kvmesh-v1"
    assert stream.delta_chunk(inference_pb2.Delta(text="", token_ids=[5])) is None  # held back
    usage = inference_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    stream.choice(0).usage = usage
    last, usage = stream.finish_chunks(completed(common_pb2.FINISH_REASON_STOP_STRING))
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    json.dumps(usage)  # plain JSON throughout


def test_whole_completion_with_logprobs() -> None:
    whole = builder({"prompt": "x", "logprobs": 1}, chat=False)
    entry = common_pb2.TokenLogprobs(
        token_id=1,
        logprob=-0.5,
        token_bytes=b"ab",
        top=[common_pb2.TopLogprob(token_id=1, logprob=-0.5, token_bytes=b"ab")],
    )
    whole.collect(delta(text="ab", logprobs=[entry]))
    whole.collect(
        delta(text="c", logprobs=[common_pb2.TokenLogprobs(logprob=-1, token_bytes=b"c")])
    )
    whole.collect(completed(common_pb2.FINISH_REASON_LENGTH))
    assert whole.finished
    answer = whole.response()
    choice = answer["choices"][0]
    assert answer["object"] == "text_completion" and choice["text"] == "abc"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["ab", "c"]
    assert choice["logprobs"]["text_offset"] == [0, 2]
    assert choice["logprobs"]["top_logprobs"][0] == {"ab": -0.5}
    cancelled = inference_pb2.GenerateEvent(cancelled=inference_pb2.Cancelled(reason="abort"))
    whole.collect(cancelled)
    assert whole.response()["choices"][0]["finish_reason"] == "abort"


def test_n_completions_are_choices_by_index_with_usage_summed() -> None:
    stream = builder(
        {"messages": HI, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    )
    second = stream.delta_chunk(inference_pb2.Delta(text="B"), index=1)
    first = stream.delta_chunk(inference_pb2.Delta(text="A"), index=0)
    assert second is not None and second["choices"][0]["index"] == 1
    assert first is not None and first["choices"][0]["delta"]["role"] == "assistant"
    for index, tokens in ((0, 4), (1, 6)):
        stream.choice(index).usage = inference_pb2.Usage(prompt_tokens=3, completion_tokens=tokens)
    one = completed(common_pb2.FINISH_REASON_STOP)
    one.index = 1
    assert len(stream.finish_chunks(one)) == 1  # the usage waits for the last completion
    last, usage = stream.finish_chunks(completed(common_pb2.FINISH_REASON_LENGTH))
    assert last["choices"][0]["index"] == 0 and last["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["prompt_tokens"] == 3 and usage["usage"]["completion_tokens"] == 10

    whole = builder({"prompt": "x", "n": 2}, chat=False)
    for index, text in ((1, "b"), (0, "a")):
        whole.collect(delta(text=text, index=index))
        finished = completed(common_pb2.FINISH_REASON_STOP)
        finished.index = index
        whole.collect(finished)
    assert [c["text"] for c in whole.response()["choices"]] == ["a", "b"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [2**32]},
        {"prompt": "x", "stop_token_ids": [2**32]},
        {"prompt": "x", "max_tokens": 2**32},
        {"prompt": "x", "seed": 2**64},
        {"prompt": "x", "priority": 2**31},
        {"prompt": "x", "timeout_ms": -1},
    ],
)
def test_numbers_outside_the_wire_ranges_are_invalid_arguments(body) -> None:
    with pytest.raises(KvmeshError) as raised:
        parse_completion(body)
    assert raised.value.reason is Reason.INVALID_ARGUMENT


def test_logit_bias_and_user_are_parsed() -> None:
    parsed = parse_chat(
        {"messages": HI, "logit_bias": {"42": 100, "7": -3.5}, "user": "u1"}, context_of
    )
    assert dict(parsed.generate.sampling.logit_bias) == {42: 100.0, 7: -3.5}
    assert parsed.generate.user == "u1"
    for bad in ({"x": 1}, {"1": "high"}, [1, 2], {"-1": 1}):
        with pytest.raises(KvmeshError) as raised:
            parse_chat({"messages": HI, "logit_bias": bad}, context_of)
        assert (
            raised.value.reason is Reason.INVALID_ARGUMENT and "logit_bias" in raised.value.message
        )


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_CALL_FUNCTION = {"name": "f", "arguments": '{"x": 1}'}


def test_tools_choice_and_earlier_calls_are_parsed() -> None:
    parsed = parse_chat(
        {
            "messages": [
                *HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": TOOL_CALL_FUNCTION}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            ],
            "tools": [TOOL, {"type": "function", "function": {"name": "g"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
        },
        context_of,
    )
    chat, choice = parsed.generate.chat, parsed.generate.tool_choice
    assert [(t.name, t.parameters_json) for t in chat.tools] == [
        ("f", '{"type": "object"}'),
        ("g", ""),
    ]
    assert (choice.mode, choice.function, choice.single_call) == (
        inference_pb2.ToolChoice.MODE_FUNCTION,
        "f",
        True,
    )
    call = chat.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "f", '{"x": 1}')
    assert chat.messages[2].tool_call_id == "call_1"
    required = parse_chat({"messages": HI, "tools": [TOOL], "tool_choice": "required"}, context_of)
    assert required.generate.tool_choice.mode == inference_pb2.ToolChoice.MODE_REQUIRED
    assert not required.generate.tool_choice.single_call


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tools": {}}, "'tools'"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [TOOL], "tool_choice": "always"}, "'tool_choice'"),
        ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "'parallel_tool_calls'"),
        ({"functions": [TOOL["function"]]}, "'functions'"),
    ],
)
def test_bad_tool_fields_name_the_field(extra: dict, words: str) -> None:
    with pytest.raises(KvmeshError) as raised:
        parse_chat({"messages": HI, **extra}, context_of)
    assert raised.value.reason is Reason.INVALID_ARGUMENT and words in raised.value.message


def test_a_call_whose_arguments_are_not_an_object_is_refused() -> None:
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}
    with pytest.raises(KvmeshError, match="JSON object"):
        parse_chat({"messages": [*HI, bad]}, context_of)


def test_tool_calls_in_chunks_and_in_the_whole_answer() -> None:
    call = common_pb2.ToolCall(id="call_a", name="f", arguments='{"x": 1}')
    second = common_pb2.ToolCall(id="call_b", name="f", arguments="{}")
    stream = builder({"messages": HI, "stream": True})
    chunk = stream.delta_chunk(inference_pb2.Delta(tool_calls=[call]))
    later = stream.delta_chunk(inference_pb2.Delta(tool_calls=[second]))
    assert chunk is not None and later is not None
    assert chunk["choices"][0]["delta"] == {
        "role": "assistant",
        "tool_calls": [
            {
                "index": 0,
                "id": "call_a",
                "type": "function",
                "function": {"name": "f", "arguments": '{"x": 1}'},
            }
        ],
    }
    assert later["choices"][0]["delta"]["tool_calls"][0]["index"] == 1
    [last] = stream.finish_chunks(completed(common_pb2.FINISH_REASON_TOOL_CALLS))
    assert last["choices"][0]["finish_reason"] == "tool_calls"

    whole = builder({"messages": HI})
    whole.collect(delta(tool_calls=[call]))
    whole.collect(completed(common_pb2.FINISH_REASON_TOOL_CALLS))
    message = whole.response()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }


def test_unknown_fields_are_ignored_and_logged_once_per_name(caplog) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "shiny_new_field": 1}
    with caplog.at_level("WARNING", logger="kvmesh.gateway.http"):
        for _ in range(3):
            parsed = parse_chat(dict(body), lambda model: 100)
    assert parsed.generate.chat.messages[0].content == "hi"
    ignored = [r for r in caplog.records if getattr(r, "field", None) == "shiny_new_field"]
    assert len(ignored) == 1 and ignored[0].route == "chat"


def test_a_batch_of_prompts_is_one_request_each_with_the_same_fields() -> None:
    parsed = parse_completion(
        {"prompt": ["a", "b", "c"], "max_tokens": 3, "n": 2, "temperature": 0.5, "stop": ["."]}
    )
    assert [r.text for r in parsed.batch] == ["a", "b", "c"] and parsed.batch[0] is parsed.generate
    for request in parsed.batch:
        assert request.n == 2 and request.sampling.max_tokens == 3 and list(request.stop) == ["."]
        assert request.sampling.temperature == 0.5
    ids = parse_completion({"prompt": [[1, 2], [3]]})
    assert [list(r.token_ids.ids) for r in ids.batch] == [[1, 2], [3]]


@pytest.mark.parametrize("prompt", [[], ["a", 1], [[1], []], [["a"]], ["a"] * 65, 5])
def test_bad_prompt_batches_are_refused(prompt: object) -> None:
    with pytest.raises(KvmeshError) as raised:
        parse_completion({"prompt": prompt})
    assert raised.value.reason == Reason.INVALID_ARGUMENT and "'prompt'" in raised.value.message

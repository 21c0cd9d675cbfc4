"""Tool use at the gateway: the checks on a request's tools, the grammar `required` compiles to
(accepting exactly what the tool prompt teaches), and the streaming call parser."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from services.gateway.request.tool_calls import ToolCallParser
from services.gateway.request.tools import MAX_CALLS, ToolUse, constrain_to_calls, tool_use
from shared.errors import KvmeshError, Reason
from shared.model_paths import default_model_path
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2
from shared.sampling import ResponseFormat, SamplingParams
from shared.text_tokenizer import load_tokenizer
from shared.tool_prompt import call_block

Mode = inference_pb2.ToolChoice.Mode
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": CITY, "ping": {"type": "object", "properties": {}}}


def request_with(tools: dict[str, dict], mode: int = 0, function: str = ""):
    request = inference_pb2.GenerateRequest(
        chat=common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    )
    request.chat.tools.extend(
        common_pb2.Tool(name=name, parameters_json=json.dumps(schema))
        for name, schema in tools.items()
    )
    request.tool_choice.mode, request.tool_choice.function = mode, function
    return request


@pytest.fixture(scope="module")
def matcher_for():
    text = load_tokenizer(default_model_path())
    assert text is not None
    tokenizer = llguidance.LLTokenizer(text.tokenizer.to_str(), n_vocab=49152, eos_token=[2])

    def accepts(grammar: ResponseFormat, output: str) -> bool:
        matcher = llguidance.LLMatcher(
            tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.spec), log_level=0
        )
        ids = text.encode(output, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    return accepts


def test_required_grammar_accepts_the_prompted_syntax_and_nothing_else(matcher_for) -> None:
    use = tool_use(request_with(SCHEMAS, Mode.MODE_REQUIRED))
    assert use is not None
    grammar = use.grammar()
    paris = call_block("get_weather", {"city": "Paris"})
    ping = call_block("ping", {})
    assert matcher_for(grammar, paris)
    assert matcher_for(grammar, f"{paris}\n{ping}")
    assert matcher_for(grammar, "\n".join([ping] * MAX_CALLS))
    assert not matcher_for(grammar, "\n".join([ping] * (MAX_CALLS + 1)))  # bounded
    assert not matcher_for(grammar, call_block("get_weather", {"town": "Paris"}))  # schema
    assert not matcher_for(grammar, call_block("other", {}))  # not a tool
    assert not matcher_for(grammar, "Sure! " + paris)  # calls only
    assert not matcher_for(grammar, "")  # at least one


def test_a_named_function_or_single_call_allows_one_call(matcher_for) -> None:
    named = tool_use(request_with(SCHEMAS, Mode.MODE_FUNCTION, "ping"))
    assert named is not None
    assert matcher_for(named.grammar(), call_block("ping", {}))
    assert not matcher_for(named.grammar(), call_block("get_weather", {"city": "Oslo"}))
    assert not matcher_for(named.grammar(), "\n".join([call_block("ping", {})] * 2))
    single = ToolUse(SCHEMAS, Mode.MODE_REQUIRED, single_call=True)
    assert not matcher_for(single.grammar(), "\n".join([call_block("ping", {})] * 2))


def test_required_becomes_the_response_format_and_auto_leaves_sampling_alone() -> None:
    sampling = SamplingParams()
    required = tool_use(request_with(SCHEMAS, Mode.MODE_REQUIRED))
    constrained = constrain_to_calls(required, sampling)
    assert constrained.response_format is not None and constrained.response_format.kind == "lark"
    auto = tool_use(request_with(SCHEMAS))
    assert constrain_to_calls(auto, sampling) is sampling and auto is not None and auto.parsed
    assert constrain_to_calls(None, sampling) is sampling
    with pytest.raises(KvmeshError, match="response_format"):
        constrain_to_calls(required, SamplingParams(response_format=ResponseFormat("json_object")))


@pytest.mark.parametrize(
    ("request_", "reason", "named"),
    [
        (request_with({}, Mode.MODE_REQUIRED), Reason.INVALID_ARGUMENT, "needs tools"),
        (request_with(SCHEMAS, Mode.MODE_FUNCTION, "x"), Reason.INVALID_ARGUMENT, "'x'"),
        (request_with({"a b": CITY}), Reason.INVALID_ARGUMENT, "'a b'"),
        (request_with({"f" * 65: CITY}), Reason.INVALID_ARGUMENT, "64"),
    ],
)
def test_bad_tools_are_refused_naming_the_problem(
    request_: inference_pb2.GenerateRequest, reason: Reason, named: str
) -> None:
    with pytest.raises(KvmeshError) as refused:
        tool_use(request_)
    assert refused.value.reason == reason and named in refused.value.message


def test_parameters_that_are_not_a_schema_object_are_invalid_schema() -> None:
    request = request_with({})
    request.chat.tools.add(name="f", parameters_json="[1]")
    with pytest.raises(KvmeshError) as refused:
        tool_use(request)
    assert refused.value.reason == Reason.INVALID_SCHEMA


def stream(parser: ToolCallParser, text: str, piece: int) -> tuple[str, list]:
    """`text` pushed `piece` characters at a time, then finished."""
    content, calls = [], []
    for start in range(0, len(text), piece):
        out, found = parser.push(text[start : start + piece])
        content.append(out)
        calls.extend(found)
    tail, last = parser.finish()
    return "".join(content) + tail, calls + last


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_calls_parse_out_of_any_split_of_the_stream(piece: int) -> None:
    text = (
        "Let me check. "
        + call_block("get_weather", {"city": "Paris"})
        + "\n"
        + call_block("ping", {})
        + "\n"
    )
    content, calls = stream(ToolCallParser(ToolUse(SCHEMAS, Mode.MODE_AUTO)), text, piece)
    assert content == "Let me check."  # the whitespace around calls is the syntax's
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("ping", {}),
    ]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_auto_leaves_what_is_not_a_call_as_text() -> None:
    parser = ToolCallParser(ToolUse(SCHEMAS, Mode.MODE_AUTO))
    not_a_tool = call_block("launch", {"now": True})
    broken = "<tool_call>\n{not json}\n</tool_call>"
    written = f"a < b <tool_ {not_a_tool} \n{broken}"
    content, calls = stream(parser, written + ' <tool_call>\n{"name": "ping" \n', 2)
    assert content == written + " " and calls == []  # the unclosed block dropped at the finish


def test_a_string_of_arguments_is_read_as_its_object() -> None:
    parser = ToolCallParser(ToolUse(SCHEMAS, Mode.MODE_AUTO))
    body = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Rome"})})
    _, calls = parser.push(f"<tool_call>{body}</tool_call>")
    assert json.loads(calls[0].arguments) == {"city": "Rome"}


def test_a_constrained_call_that_fails_its_schema_is_invalid_output() -> None:
    parser = ToolCallParser(ToolUse(SCHEMAS, Mode.MODE_REQUIRED))
    with pytest.raises(KvmeshError) as failed:
        parser.push(call_block("get_weather", {"city": 7}))
    assert failed.value.reason == Reason.INVALID_OUTPUT and "city" in failed.value.message


def parsed(use: ToolUse, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser = ToolCallParser(use)
    content, calls = [], []
    for piece in pieces:
        out, found = parser.push(piece)
        content.append(out)
        calls.extend(found)
    tail, last = parser.finish()
    return "".join(content) + tail, [(c.name, json.loads(c.arguments)) for c in calls + last]


# Arguments a grammar allows inside a JSON string, the tags and escapes included.
TRICKY_CITIES = [
    "Paris",
    "</tool_call>",
    'a "quoted" </tool_call> <tool_call>',
    "back\\slash\\",
    "</tool_call",
    "\\u003c/tool_call>",
    "",
]


@pytest.mark.parametrize("mode", [Mode.MODE_AUTO, Mode.MODE_REQUIRED])
def test_every_split_of_grammar_valid_calls_parses_the_same(mode: int) -> None:
    """The closing tag counts only outside a JSON string, wherever the stream is cut."""
    rng = random.Random(0)
    use = ToolUse(SCHEMAS, mode)
    for city in TRICKY_CITIES:
        blocks = [call_block("get_weather", {"city": city}), call_block("ping", {})]
        text = "\n".join(blocks)
        expected = [("get_weather", {"city": city}), ("ping", {})]
        assert parsed(use, [text]) == ("", expected)
        for cut in range(len(text) + 1):  # every split in two
            assert parsed(use, [text[:cut], text[cut:]]) == ("", expected), (city, cut)
        for _ in range(50):  # and random splits into many
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 12)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert parsed(use, pieces) == ("", expected), (city, cuts)


@pytest.mark.parametrize("mode", [Mode.MODE_AUTO, Mode.MODE_REQUIRED])
def test_a_call_cut_short_never_leaks_its_markup(mode: int) -> None:
    use = ToolUse(SCHEMAS, mode)
    paris = call_block("get_weather", {"city": "Paris </tool_call>"})
    second = call_block("get_weather", {"city": "Oslo"})
    text = paris + "\n" + second
    start = len(paris) + 1
    for cut in range(start + 1, len(text)):  # every cut inside the second block
        content, calls = parsed(use, [text[:cut]])
        body = text[start + len("<tool_call>") : cut]
        try:  # cut where the JSON is already whole, before the closing tag: a call
            whole = json.loads(body)["arguments"] == {"city": "Oslo"}
        except (json.JSONDecodeError, KeyError, TypeError):
            whole = False
        assert "<tool" not in content and "{" not in content, cut
        expected = [("get_weather", {"city": "Paris </tool_call>"})]
        assert calls == expected + ([("get_weather", {"city": "Oslo"})] if whole else []), cut


def test_text_before_a_cut_call_stays_content() -> None:
    content, calls = parsed(
        ToolUse(SCHEMAS, Mode.MODE_AUTO), ['Let me look. <tool_call>\n{"name": "get_wea']
    )
    assert content.strip() == "Let me look." and calls == []

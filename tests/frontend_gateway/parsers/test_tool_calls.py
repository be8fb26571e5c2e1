"""Tool-call parsers find each format's calls the same way however the text is cut, and give back as
content whatever does not parse as a call."""

import json
import random

import pytest

from frontend_gateway.parsers.tool_calls import TOOL_CALL_PARSERS, tool_call_parser


def parse(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    parser = tool_call_parser(name)
    content, calls = [], []
    for piece in pieces:
        text, found = parser.feed(piece)
        content.append(text)
        calls += found
    text, found = parser.flush()
    calls += found
    return "".join([*content, text]), [(call.name, json.loads(call.arguments)) for call in calls]


def cuts(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    ways = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        places = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(1, 6))))
        ways.append([text[a:b] for a, b in zip([0, *places], [*places, len(text)], strict=True)])
    return ways


WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"zone": "CET"})


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [WEATHER]),
        (
            "hermes",
            'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n',
            "Checking.\n",
            [WEATHER, TIME],
        ),
        ("hermes", "No tools needed: 4 < 5.", "No tools needed: 4 < 5.", []),
        (
            "hermes",
            'A<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n The result is near.',
            "AThe result is near.",
            [WEATHER],
        ),
        ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),  # unclosed
        ("hermes", "<tool_ca", "<tool_ca", []),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "arguments": {"zone": "CET"}}',
            "",
            [WEATHER, TIME],
        ),
        ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
        ("llama3_json", "Here: {not a call}", "Here: {not a call}", []),
        ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [WEATHER]),
        (
            "mistral",
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"zone": "CET"}}]',
            "Sure. ",
            [WEATHER, TIME],
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
            "",
            [WEATHER, TIME],
        ),
        ("mistral", "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
        ("mistral", "Plain [TOOL answer", "Plain [TOOL answer", []),
    ],
)
def test_calls_are_found_however_the_text_arrives(
    name: str, text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    for pieces in cuts(text):
        assert parse(name, pieces) == (content, calls), pieces


def test_hermes_streams_the_text_before_a_call_and_holds_the_call_until_it_closes() -> None:
    parser = tool_call_parser("hermes")
    assert parser.feed("Let me look.<tool") == ("Let me look.", [])
    assert parser.feed('_call>{"name": "get_weather", ') == ("", [])
    text, calls = parser.feed('"arguments": {"city": "Paris"}}</tool_call>')
    assert text == ""
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Paris"}')]
    assert calls[0].id.startswith("call_")


def test_each_call_has_its_own_id_and_openais_shape() -> None:
    parser = tool_call_parser("llama3_json")
    parser.feed('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    _, calls = parser.flush()
    assert len({call.id for call in calls}) == 2
    assert calls[1].as_openai(3) == {
        "index": 3,
        "id": calls[1].id,
        "type": "function",
        "function": {"name": "b", "arguments": '{"x": 1}'},
    }


def test_the_parsers_have_vllms_names() -> None:
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}

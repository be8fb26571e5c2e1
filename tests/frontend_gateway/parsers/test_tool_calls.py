"""Tool-call parsers find each format's calls the same way however the text is cut, and give back as
content whatever does not parse as a call."""

import json
import random

import pytest

from frontend_gateway.parsers.calls import CallPiece
from frontend_gateway.parsers.tool_calls import TOOL_CALL_PARSERS, tool_call_parser


def assemble(pieces: list[CallPiece]) -> list[tuple[str, str]]:
    """The calls that ``pieces`` make, as a client puts them together: (name, arguments)."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.id is not None:
            assert piece.index not in calls and piece.name is not None, "a call is announced once"
            calls[piece.index] = [piece.name, piece.arguments]
        else:
            calls[piece.index][1] += piece.arguments
    return [(name, arguments) for name, arguments in calls.values()]


def parse(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    parser = tool_call_parser(name)
    content, found = [], []
    for piece in pieces:
        text, more = parser.feed(piece)
        content.append(text)
        found += more
    text, more = parser.flush()
    found += more
    return "".join([*content, text]), [(call, json.loads(arguments)) for call, arguments in assemble(found)]


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
        (
            "hermes",
            '<tool_call>{"name": "search", "arguments": {"q": "a\\"}]{b"}}</tool_call>',
            "",
            [("search", {"q": 'a"}]{b'})],
        ),  # brackets and an escaped quote inside a string do not end the arguments
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


def test_hermes_streams_the_text_before_a_call_then_the_call_as_it_is_written() -> None:
    parser = tool_call_parser("hermes")
    assert parser.feed("Let me look.<tool") == ("Let me look.", [])
    assert parser.feed('_call>{"name": "get_weather", ') == ("", [])
    text, [first] = parser.feed('"arguments": {"ci')
    assert text == "" and first.index == 0 and first.name == "get_weather" and first.arguments == '{"ci'
    assert first.id is not None and first.id.startswith("call_")
    assert parser.feed('ty": "Paris"}') == ("", [CallPiece(0, 'ty": "Paris"}')])
    assert parser.feed("}</tool_call>") == ("", [])  # the object's end is not the arguments'


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}</tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'),
    ],
)
def test_every_format_streams_a_calls_arguments_in_the_pieces_the_model_writes(name: str, text: str) -> None:
    parser = tool_call_parser(name)
    pieces = [piece for char in text for piece in parser.feed(char)[1]] + parser.flush()[1]
    assert assemble(pieces) == [("get_weather", '{"city": "Paris", "days": [1, 2]}')]
    assert pieces[0].id is not None and len(pieces) > 10  # announced once, then a piece per character


def test_a_call_written_arguments_first_comes_whole_when_its_object_closes() -> None:
    parser = tool_call_parser("hermes")
    text = '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"'
    assert [piece for char in text for piece in parser.feed(char)[1]] == []
    _, [piece] = parser.feed("}")
    assert (piece.name, piece.arguments) == ("get_weather", '{"city": "Paris"}')


def test_a_call_cut_off_keeps_the_arguments_written_so_far() -> None:
    parser = tool_call_parser("hermes")
    _, pieces = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert parser.flush() == ("", [])
    assert assemble(pieces) == [("get_weather", '{"city": "Pa')]


def test_each_call_has_its_own_id_and_openais_shape() -> None:
    parser = tool_call_parser("llama3_json")
    _, pieces = parser.feed('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    pieces += parser.flush()[1]
    assert len({piece.id for piece in pieces if piece.id is not None}) == 2
    assert pieces[-1].as_openai() == {
        "index": 1,
        "id": pieces[-1].id,
        "type": "function",
        "function": {"name": "b", "arguments": '{"x": 1}'},
    }
    assert CallPiece(1, "1}").as_openai() == {"index": 1, "function": {"arguments": "1}"}}


def test_the_parsers_have_vllms_names() -> None:
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}

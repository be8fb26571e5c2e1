"""A forced call's answer (JSON held to a schema by the engine) is read back into tool calls, however
the text arrives; what is not the JSON (cut off) is given back as content."""

import json

import pytest

from frontend_gateway.parsers.forced_calls import (
    NamedCallParser,
    RequiredCallsParser,
    named_call_schema,
    required_calls_schema,
)
from frontend_gateway.parsers.tool_calls import ToolCallParser


def parse(parser: ToolCallParser, text: str, size: int) -> tuple[str, list[tuple[str, object]]]:
    content = []
    for start in range(0, len(text), size):
        shown, calls = parser.feed(text[start : start + size])
        assert (shown, calls) == ("", [])  # everything is held until the end
        content.append(shown)
    shown, calls = parser.flush()
    return "".join([*content, shown]), [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_named_calls_answer_is_its_arguments(size: int) -> None:
    text = '{"city": "Paris", "unit": "celsius"}'
    assert parse(NamedCallParser("get_weather"), text, size) == (
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    )


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_required_answer_is_a_list_of_calls(size: int) -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    assert parse(RequiredCallsParser(), text, size) == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (NamedCallParser("f"), '{"city": "Par'),  # cut off by max_tokens
        (NamedCallParser("f"), "[1, 2]"),
        (RequiredCallsParser(), "[]"),
        (RequiredCallsParser(), '[{"parameters": {}}]'),
    ],
)
def test_what_is_not_the_expected_json_is_content(parser: ToolCallParser, text: str) -> None:
    assert parse(parser, text, 2) == (text, [])


def test_the_schemas_ask_for_the_offered_calls_and_no_more() -> None:
    assert named_call_schema(None) == {"type": "object"}
    parameters = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = required_calls_schema([("f", parameters), ("g", None)], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"] for option in schema["items"]["anyOf"]]
    assert names == [{"enum": ["f"]}, {"enum": ["g"]}]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == parameters
    assert "maxItems" not in required_calls_schema([("f", None)], parallel=True)

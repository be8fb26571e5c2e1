"""vLLM's guided decoding fields (``guided_*``, ``structured_outputs``): the one constraint a request asks for,
as the engine request carries it; a 400 naming the field for two at once, for one with another that holds the
same answer, and on an engine that does not follow it (llama.cpp and vLLM answers: tests/engines/)."""

from typing import Any

import msgspec
import pytest

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.openai_api.guided import Constraint, guided_constraint
from frontend_gateway.openai_api.types import chat_decoder, completion_decoder
from runtime.protocol import GUIDED_KINDS, GuidedDecoding, PreprocessedRequest, SamplingOptions, StopConditions
from tests.frontend_gateway.test_http_errors import CHAT, assert_error, post
from tests.servers import Server

LLAMACPP = ["json", "choice", "grammar"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_TEXT = msgspec.json.encode(SCHEMA).decode()


def constraint(fields: dict[str, Any], follows: list[str] = LLAMACPP, *, chat: bool = True) -> Constraint:
    """The constraint of a chat (or completion) request with ``fields``, on an engine that follows ``follows``."""
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        return guided_constraint(chat_decoder.decode(msgspec.json.encode(body)), model="m", follows=follows)
    body = {"model": "m", "prompt": "hi", **fields}
    return guided_constraint(completion_decoder.decode(msgspec.json.encode(body)), model="m", follows=follows)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"guided_json": SCHEMA}, Constraint(SCHEMA_TEXT)),
        ({"guided_json": SCHEMA_TEXT}, Constraint(SCHEMA_TEXT)),  # a JSON string, as vLLM takes it too
        ({"structured_outputs": {"json": SCHEMA}}, Constraint(SCHEMA_TEXT)),
        ({"structured_outputs": {"json_object": True}}, Constraint('{"type": "object"}')),
        ({"guided_choice": ["yes", "no"]}, Constraint(guided=GuidedDecoding(choice=["yes", "no"]))),
        ({"structured_outputs": {"choice": ["a"]}}, Constraint(guided=GuidedDecoding(choice=["a"]))),
        ({"guided_grammar": 'root ::= "x"'}, Constraint(guided=GuidedDecoding(grammar='root ::= "x"'))),
        ({"guided_choice": ["a"], "guided_decoding_backend": "auto"}, Constraint(guided=GuidedDecoding(choice=["a"]))),
        ({}, Constraint()),
    ],
)
def test_each_spelling_of_a_constraint_becomes_what_the_engine_is_sent(
    fields: dict[str, Any], expected: Constraint
) -> None:
    assert constraint(fields) == expected
    assert constraint(fields, chat=False) == expected


def test_vllm_is_sent_the_json_options_with_the_schema() -> None:
    vllm = list(GUIDED_KINDS)
    assert constraint({"guided_regex": "[0-9]+"}, vllm) == Constraint(guided=GuidedDecoding(regex="[0-9]+"))
    assert constraint({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, vllm) == Constraint(
        SCHEMA_TEXT, GuidedDecoding(whitespace_pattern=" ?")
    )
    options = {"json": SCHEMA, "disable_any_whitespace": True, "disable_additional_properties": True}
    assert constraint({"structured_outputs": options}, vllm) == Constraint(
        SCHEMA_TEXT, GuidedDecoding(disable_any_whitespace=True, disable_additional_properties=True)
    )


@pytest.mark.parametrize(
    ("fields", "param", "contains"),
    [
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one kind"),
        ({"guided_json": SCHEMA, "guided_grammar": 'root ::= "x"'}, "guided_grammar", "only one kind"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "only one kind"),
        ({"guided_choice": ["a"], "structured_outputs": {"choice": ["a"]}}, "guided_choice", "two spellings"),
        ({"structured_outputs": {}}, "structured_outputs", "needs one constraint"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format", "both constrain"),
        ({"guided_json": "[1, 2]"}, "guided_json", "a JSON object"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_grammar": ""}, "guided_grammar", "must not be empty"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "per request"),
        # What llama.cpp does not follow: a regex (its conversion is partial), the JSON options.
        ({"guided_regex": "[0-9]+"}, "guided_regex", "use a grammar"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs.regex", "cannot follow"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern", "cannot follow"),
    ],
)
def test_what_cannot_be_followed_as_asked_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, contains: str
) -> None:
    with pytest.raises(InvalidRequest, match=contains) as refused:
        constraint(fields)
    assert refused.value.param == param


def test_json_options_without_a_json_constraint_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="shapes a JSON answer") as refused:
        constraint({"guided_choice": ["a"], "guided_whitespace_pattern": " "}, list(GUIDED_KINDS))
    assert refused.value.param == "guided_whitespace_pattern"


def test_a_forced_tool_call_and_a_constraint_are_refused_together() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidRequest, match="tool call") as refused:
        constraint({"guided_choice": ["a"], "tools": [tool], "tool_choice": "required"})
    assert refused.value.param == "tool_choice"


def test_the_constraint_crosses_the_network_in_the_engine_request() -> None:
    sent = PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=[1],
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=4),
        guided=GuidedDecoding(choice=["yes", "no"]),
    )
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=PreprocessedRequest)
    assert received.guided == GuidedDecoding(choice=["yes", "no"])


# --- engines that follow no guided decoding: a 400 naming the field, before any generation --------------


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"guided_choice": ["yes", "no"]}, "guided_choice"),
        (CHAT, {"guided_json": SCHEMA}, "guided_json"),
        (CHAT, {"structured_outputs": {"grammar": 'root ::= "x"'}}, "structured_outputs.grammar"),
        ("/v1/completions", {"guided_regex": "[0-9]+"}, "guided_regex"),
    ],
)
def test_an_engine_without_guided_decoding_refuses_it_naming_the_field(
    echo_core_server: Server, echo_full_server: Server, path: str, fields: dict[str, Any], param: str
) -> None:
    for server, model in ((echo_core_server, "SmolLM2-135M-Instruct.Q4_1"), (echo_full_server, "echo")):
        body = {"model": model, **fields}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
        assert_error(post(server, path, body), 400, param=param, contains="has no guided decoding")

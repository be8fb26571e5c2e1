"""Bad input gets an OpenAI error envelope with the right 4xx status, and the server keeps serving."""

from typing import Any

import httpx
import pytest

from tests.servers import Server

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def post(server: Server, path: str, body: bytes | dict[str, Any], **headers: str) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.base_url + path, json=body, headers=headers, timeout=10)
    return httpx.post(
        server.base_url + path,
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=10,
    )


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, contains: str | None = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert (contains or "").lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"", None, "empty"),
        (b"[1, 2]", None, "Expected `object`"),
        ({"messages": [{"role": "user", "content": "hi"}]}, None, "missing required field `model`"),
        ({"model": "echo"}, None, "missing required field `messages`"),
        ({"model": "echo", "messages": []}, "messages", "length >= 1"),
        ({"model": "echo", "messages": "hi"}, "messages", "Expected `array`"),
        ({"model": "echo", "messages": [{"content": "hi"}]}, "messages[0]", "role"),
        ({"model": "echo", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "wizard"),
        ({"model": "echo", "messages": [{"role": "", "content": "hi"}]}, "messages[0].role", "Invalid enum"),
        ({"model": "echo", "messages": [{"role": "user"}]}, "messages[0].content", "needs content"),
        ({"model": "echo", "messages": [{"role": "assistant"}]}, "messages[0].content", "content or tool_calls"),
        (
            {"model": "echo", "messages": [{"role": "tool", "content": "42"}]},
            "messages[0].tool_call_id",
            "tool_call_id",
        ),
        (
            {"model": "echo", "messages": [{"role": "user", "content": "hi", "tool_calls": [TOOL_CALL]}]},
            "messages[0].tool_calls",
            "only assistant",
        ),
        (
            {"model": "echo", "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages[0].tool_calls",
            "function",
        ),
        (
            {
                "model": "echo",
                "messages": [
                    {"role": "assistant", "tool_calls": [{**TOOL_CALL, "function": {"name": "f", "arguments": "{c"}}]}
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
            "must be JSON text",
        ),
        ({**GOOD_CHAT, "tools": []}, "tools", "length >= 1"),
        ({**GOOD_CHAT, "tools": [{"type": "retrieval"}]}, "tools[0].type", "Invalid enum"),
        ({**GOOD_CHAT, "tools": [{"type": "function", "function": {}}]}, "tools[0].function", "`name`"),
        ({**GOOD_CHAT, "tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({**GOOD_CHAT, "tool_choice": "sometimes"}, "tool_choice", None),
        (
            {**GOOD_CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
            "not among tools",
        ),
        ({**GOOD_CHAT, "modalities": ["text", "audio"]}, "modalities", "only text output"),
        ({**GOOD_CHAT, "audio": {"voice": "alloy", "format": "mp3"}}, "audio", "only text output"),
        ({**GOOD_CHAT, "web_search_options": {}}, "web_search_options", "web search"),
        (
            {"model": "echo", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content",
            "needs its text",
        ),
        ({**GOOD_CHAT, "functions": [{"name": "f"}]}, "functions", "deprecated"),
        ({**GOOD_CHAT, "function_call": "auto"}, "function_call", "deprecated"),
        ({**GOOD_CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({**GOOD_CHAT, "max_tokens": "ten"}, "max_tokens", "Expected `int | null`, got `str`"),
        ({**GOOD_CHAT, "max_tokens": 0}, "max_tokens", ">= 1"),
        ({**GOOD_CHAT, "temperature": 5}, "temperature", "<= 2.0"),
        ({**GOOD_CHAT, "top_p": 0}, "top_p", "> 0.0"),
        ({**GOOD_CHAT, "stream": "yes"}, "stream", "Expected `bool`"),
        ({**GOOD_CHAT, "n": 129}, "n", "<= 128"),
        ({**GOOD_CHAT, "stop": [1, 2]}, "stop[0]", "Expected `str`"),
        ({**GOOD_CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens", "exceeds max_tokens"),
        ({**GOOD_CHAT, "logprobs": True}, "logprobs", "does not report log probabilities"),
        ({**GOOD_CHAT, "logprobs": 3}, "logprobs", "boolean in chat"),
        ({**GOOD_CHAT, "top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        ({**GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20"),
        ({**GOOD_CHAT, "response_format": {"type": "json_object"}}, "response_format", "cannot constrain"),
        ({**GOOD_CHAT, "response_format": {"type": "json_schema"}}, "response_format", "cannot constrain"),
        ({**GOOD_CHAT, "response_format": {"type": "yaml"}}, "response_format.type", "Invalid enum value 'yaml'"),
        (
            {"model": "echo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
            "takes text only",
        ),
    ],
)
def test_malformed_chat_requests_are_400_with_the_field_named(
    echo_full_server: Server, body: bytes | dict[str, Any], param: str | None, contains: str | None
) -> None:
    response = post(echo_full_server, CHAT, body)
    assert_error(response, 400, param=param, contains=contains)
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_model_not_found(echo_full_server: Server) -> None:
    response = post(echo_full_server, CHAT, {**GOOD_CHAT, "model": "gpt-9"})
    assert_error(response, 404, param="model", contains="gpt-9")
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_body_over_the_limit_is_413(echo_full_server: Server) -> None:
    huge = {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_error(post(echo_full_server, CHAT, huge), 413, contains="limit")


def test_a_chunked_body_over_the_limit_is_413(echo_full_server: Server) -> None:
    def chunks() -> Any:
        yield b'{"model": "echo", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}]}'

    response = httpx.post(echo_full_server.base_url + CHAT, content=chunks(), timeout=10)
    assert_error(response, 413, contains="limit")


def test_unknown_path_is_404_and_wrong_method_is_405(echo_full_server: Server) -> None:
    assert_error(httpx.get(echo_full_server.base_url + "/v1/nothing"), 404, contains="no route")
    assert_error(httpx.get(echo_full_server.base_url + CHAT), 405, contains="POST")


def test_the_server_still_serves_after_bad_input(echo_full_server: Server) -> None:
    for body in (b"\xff\xfe", b"{" * 10_000, b'{"model": null}', b"null"):
        assert post(echo_full_server, CHAT, body).status_code == 400
    response = post(echo_full_server, CHAT, GOOD_CHAT)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "hi"


def test_a_prompt_longer_than_the_context_is_400(echo_core_server: Server) -> None:
    long_prompt = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "word " * 400}],
    }
    response = post(echo_core_server, CHAT, long_prompt)
    assert_error(response, 400, param="messages", contains="maximum context length is 256")
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_past_the_context_is_400(echo_core_server: Server) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5000,
    }
    assert_error(post(echo_core_server, CHAT, body), 400, param="max_tokens", contains="lower max_tokens")


@pytest.mark.parametrize(
    ("prompt", "contains"),
    [
        ([1, 2, 10_000_000], "token id 10000000 is outside the vocabulary"),
        ([5, -3, 7], "token id -3 is outside the vocabulary"),
        ([[1, 2, 49_152]], "token id 49152 is outside the vocabulary"),
        ([1, "two"], "list of token ids"),  # ints mixed with a string
        ([1, [2]], "list of token ids"),  # ints mixed with a list
    ],
)
def test_bad_token_id_prompts_are_400_with_what_is_wrong(
    echo_core_server: Server, prompt: list[Any], contains: str
) -> None:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt}
    assert_error(post(echo_core_server, "/v1/completions", body), 400, param="prompt", contains=contains)


@pytest.mark.parametrize(
    ("field", "value", "contains"),
    [
        ("seed", 2**63, "<= 9223372036854775807"),
        ("seed", -(2**63) - 1, ">= -9223372036854775808"),
        ("seed", 2**200, "<= 9223372036854775807"),
        ("top_k", 2**31, "<= 2147483647"),
        ("max_tokens", 2**40, "<= 2147483647"),
        ("min_tokens", 2**64, "<= 2147483647"),
        ("n", 2**64, "<= 128"),
    ],
)
def test_integers_beyond_their_wire_type_are_400(
    echo_full_server: Server, field: str, value: int, contains: str
) -> None:
    assert_error(post(echo_full_server, CHAT, {**GOOD_CHAT, field: value}), 400, param=field, contains=contains)


def test_the_widest_accepted_seed_is_served(echo_full_server: Server) -> None:
    for seed in (2**63 - 1, -(2**63)):
        assert post(echo_full_server, CHAT, {**GOOD_CHAT, "seed": seed}).status_code == 200


def test_tool_calls_holding_an_integer_beyond_64_bits_are_400(echo_full_server: Server) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 2**64}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "hi"}]
    response = post(echo_full_server, CHAT, {**GOOD_CHAT, "messages": messages})
    assert_error(response, 400, param="messages[0].tool_calls", contains="beyond 64 bits")


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"logit_bias": {"50256": -100}}, "logit_bias"),
        (CHAT, {"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        (
            CHAT,
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
        ),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": 0}, "logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "logprobs"),  # the prompt's: a text engine has none
        ("/v1/completions", {"suffix": "tail"}, "suffix"),
        ("/v1/completions", {"best_of": 2}, "best_of"),  # echo reports no logprobs to pick by
        ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ],
)
def test_fields_that_would_not_be_honoured_are_refused(
    echo_full_server: Server, path: str, fields: dict[str, Any], param: str
) -> None:
    base = GOOD_CHAT if path == CHAT else {"model": "echo", "prompt": "hi"}
    assert_error(post(echo_full_server, path, {**base, **fields}), 400, param=param)


def test_their_harmless_values_are_accepted(echo_full_server: Server) -> None:
    harmless = {
        "logit_bias": {},
        "logprobs": False,
        "stream_options": None,
        "response_format": {"type": "text"},
        "modalities": ["text"],
    }
    assert post(echo_full_server, CHAT, {**GOOD_CHAT, **harmless}).status_code == 200
    completion = {"model": "echo", "prompt": "hi", "echo": False, "best_of": 1, "suffix": ""}
    assert post(echo_full_server, "/v1/completions", completion).status_code == 200


@pytest.mark.parametrize(
    ("body", "contains"),
    [
        (b'{"model": "echo", "user": "\xff"}', "not valid UTF-8"),
        (b'{"model": "echo", "response_format": {"a": ' + b"[" * 50_000, "too deeply"),
    ],
)
def test_bodies_msgspec_cannot_read_are_400(echo_full_server: Server, body: bytes, contains: str) -> None:
    assert_error(post(echo_full_server, CHAT, body), 400, contains=contains)


def test_a_huge_unknown_model_name_is_not_echoed_whole(echo_full_server: Server) -> None:
    response = post(echo_full_server, CHAT, {**GOOD_CHAT, "model": "m" * 50_000})
    assert_error(response, 404, param="model")
    assert len(response.content) < 1000

"""A request field Flotilla does not act on is a 400 naming it, never silently dropped; the few fields
known to be harmless to ignore pass (docs/openai-api.md)."""

from typing import Any

import openai
import pytest

from frontend_gateway.openai_api.unknown_fields import HARMLESS
from tests.frontend_gateway.test_http_errors import CHAT, GOOD_CHAT, assert_error, post
from tests.servers import Server

COMPLETION = {"model": "echo", "prompt": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param", "contains"),
    [
        (CHAT, {**GOOD_CHAT, "use_beam_search": True}, "use_beam_search", "refused rather than ignored"),
        (CHAT, {**GOOD_CHAT, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", ""),
        (
            CHAT,
            {"model": "echo", "messages": [{"role": "user", "content": "hi", "prefix": True}]},
            "messages[0].prefix",
            "leave it out",
        ),
        (
            CHAT,
            {**GOOD_CHAT, "stream": True, "stream_options": {"chunk_size": 4}},
            "stream_options.chunk_size",
            "",
        ),
        (CHAT, {**GOOD_CHAT, "nvext": {"greed_sampling": True}}, "nvext.greed_sampling", ""),
        (
            CHAT,
            {"model": "echo", "messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
            "messages[0].function_call",
            "deprecated",
        ),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True}, "use_beam_search", ""),
        (
            "/v1/completions",
            {**COMPLETION, "structured_outputs": {"choice": ["a"], "structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "",
        ),
        ("/v1/embeddings", {"model": "echo", "input": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", ""),
        ("/v1/responses", {"model": "echo", "input": "hi", "reasoning": {"effort": "low"}}, "reasoning", ""),
    ],
)
def test_a_field_flotilla_does_not_act_on_is_a_400_naming_it(
    echo_full_server: Server, path: str, body: dict[str, Any], param: str, contains: str
) -> None:
    assert_error(post(echo_full_server, path, body), 400, param=param, contains=contains)


def test_the_openai_client_sees_the_refused_field_named(echo_full_server: Server) -> None:
    client = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "yes or no?"}], extra_body={"use_beam_search": True}
        )
    assert refused.value.param == "use_beam_search"


def test_the_fields_known_to_be_harmless_are_accepted_and_ignored(echo_full_server: Server) -> None:
    harmless = {
        "store": True,
        "metadata": {"team": "search"},
        "service_tier": "auto",
        "prompt_cache_key": "conversation-7",
        "safety_identifier": "user-42",
        "prediction": {"type": "content", "content": "hi"},
        "user": "user-42",
    }
    # An earlier answer sent back whole, as the openai client's message objects carry it.
    earlier = {"role": "assistant", "content": "Hello.", "refusal": None, "annotations": [], "audio": None}
    messages = [{"role": "user", "content": "Hi"}, earlier, {"role": "user", "content": "hi"}]
    body = {**GOOD_CHAT, **harmless, "messages": messages, "stream": True}
    response = post(echo_full_server, CHAT, {**body, "stream_options": {"include_obfuscation": False}})
    assert response.status_code == 200, response.text
    assert '"content":"h"' in response.text
    assert post(echo_full_server, "/v1/completions", {**COMPLETION, **harmless}).status_code == 200
    responses = {"model": "echo", "input": "hi", "store": False, "service_tier": "auto", "prompt_cache_key": "k"}
    assert post(echo_full_server, "/v1/responses", responses).status_code == 200
    assert set(HARMLESS["chat and completions"]) >= set(harmless)


def test_a_megabyte_long_unknown_field_name_is_not_echoed_whole(echo_full_server: Server) -> None:
    response = post(echo_full_server, CHAT, {**GOOD_CHAT, "x" * 50_000: 1})
    assert_error(response, 400)
    assert len(response.content) < 1000

"""Fuzzing the OpenAI routes of one process: hundreds of odd requests at once, never a 5xx, every 4xx
in the OpenAI envelope, every stream finished; and the server still answers properly afterwards."""

import httpx
import pytest

from tests.frontend_gateway.fuzz import CHAT, COMPLETIONS, check_answer, fire, request_bodies
from tests.servers import Server

CORE_MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_a_token_model_survives_the_fuzzer(echo_core_server: Server, route: str) -> None:
    answers = await fire(echo_core_server.base_url, route, request_bodies(route, CORE_MODEL, seed=6, count=300))
    for answer in answers:
        check_answer(answer)
    assert {answer.status for answer in answers} >= {200, 400}
    assert_still_serves(echo_core_server, CORE_MODEL)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_a_text_model_survives_the_fuzzer(echo_full_server: Server, route: str) -> None:
    answers = await fire(echo_full_server.base_url, route, request_bodies(route, "echo", seed=7, count=300))
    for answer in answers:
        check_answer(answer)
    assert {answer.status for answer in answers} >= {200, 400}
    assert_still_serves(echo_full_server, "echo")


def assert_still_serves(server: Server, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "still here?"}], "max_tokens": 3}
    response = httpx.post(server.base_url + CHAT, json=body, timeout=30)
    assert response.status_code == 200, response.text

"""`flotilla up --engine mistralrs`: the control plane deploys a pipeline whose worker runs mistral.rs on the
SmolLM2 GGUF; its instance becomes ready and the gateway answers through it."""

import importlib.util
from pathlib import Path

import httpx
import pytest

from tests.launcher.test_stack import MODEL, Up, chat, stop_stack

pytestmark = [
    pytest.mark.mistralrs,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("mistralrs") is None, reason="mistralrs is not installed (`make install`)"
    ),
]


def test_a_pipeline_deployed_with_engine_mistralrs_becomes_ready_and_answers(tmp_path: Path) -> None:
    # A later --engine overrides Up's default mocker.
    stack = Up(tmp_path / "data", tmp_path / "up.log", "--engine", "mistralrs")
    try:
        stack.wait_until_up()
        with stack.admin() as api:
            pipelines = api.get("pipelines/").json()["results"]
            assert [(p["name"], p["groups"][0]["engine"]) for p in pipelines] == [(MODEL, "mistralrs")]
            ready = api.get("instances/", params={"state": "ready"}).json()["results"]
            assert [(i["pipeline_name"], i["node"]) for i in ready] == [(MODEL, "local")]
        reply = chat(stack)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        assert reply.json()["usage"]["completion_tokens"] > 0
        completion = httpx.post(
            f"{stack.gateway}/v1/completions",
            json={"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 4},
            headers=stack.api_key_header(),
            timeout=60,
        )
        assert completion.status_code == 200, completion.text
        assert "Paris" in completion.json()["choices"][0]["text"]
    finally:
        stop_stack(stack)

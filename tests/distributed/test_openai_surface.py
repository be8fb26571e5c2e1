"""What a worker's card says reaches every ingress: its parsers (reasoning, tool calls) and what its
engine can do (structured output, logprobs, the prompt's logprobs) are honoured through an ingress as in one
process."""

import json
from typing import Any

import openai
import pytest

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.servers import llama_cpp_available, smollm2_path

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}}},
}


def test_a_workers_parsers_split_reasoning_and_tool_calls_at_the_ingress(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker(
        "dyn://qwen",
        "out=echo_full",
        "--model-name",
        "qwen",
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
    )
    wait_until(lambda: served_models(ingress) == ["qwen"], 15, "the model did not appear")
    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0)
    text = '<think>Weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    reply: Any = client.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": text}], tools=[WEATHER_TOOL]
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "Weather."
    assert [call.function.name for call in message.tool_calls or []] == ["get_weather"]
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.llamacpp
@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)")
def test_a_llamacpp_worker_holds_answers_to_a_schema_and_reports_logprobs(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    args = ["out=llamacpp", str(smollm2_path()), "--model-name", "smol", "--threads", "1", "--context-length", "1024"]
    cluster.start_worker("dyn://smol", *args)
    wait_until(lambda: served_models(ingress) == ["smol"], 30, "the model did not appear")
    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced: Any = client.chat.completions.create(
        model="smol",
        messages=messages,
        temperature=0,
        max_tokens=30,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = forced.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {})
    reply = client.chat.completions.create(
        model="smol", messages=messages, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2, stream=True
    )
    entries = [
        entry
        for chunk in reply
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for entry in chunk.choices[0].logprobs.content
    ]
    assert len(entries) == 4 and all(len(entry.top_logprobs) == 2 for entry in entries)
    # The prompt's log probabilities (echo, as evaluation harnesses ask) travel from the worker too.
    echoed = client.completions.create(
        model="smol", prompt="The capital of France is", echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    logprobs = echoed.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and echoed.usage is not None
    assert echoed.choices[0].text == "The capital of France is"
    assert len(logprobs.token_logprobs) == echoed.usage.prompt_tokens and logprobs.token_logprobs[0] is None
    assert all(value is not None and value < 0 for value in logprobs.token_logprobs[1:])

"""Engines written in Python by users (out=pystr:FILE.py, out=pytok:FILE.py), through a real server."""

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.python_file import PyStrEngine, PyTokEngine
from runtime.engine import RequestContext
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions, TextRequest
from tests.servers import Server, start_server

FILES = Path(__file__).parent / "python_files"
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """One server per user file, started once for the module."""
    directory = tmp_path_factory.mktemp("python_engines")
    started: dict[str, Server] = {}
    arguments = {
        "shout": [f"out=pystr:{EXAMPLES / 'pystr_shout.py'}"],
        "countdown": [f"out=pytok:{EXAMPLES / 'pytok_countdown.py'}"],
        "raises": [f"out=pystr:{FILES / 'raises.py'}"],
        "runaway": [f"out=pystr:{FILES / 'runaway.py'}"],
        "request_echo": [f"out=pystr:{FILES / 'request_echo.py'}", "--model-name", "echoer"],
        "pytok_raises": [f"out=pytok:{FILES / 'pytok_raises.py'}", "--model-name", "broken"],
    }
    try:
        for name, args in arguments.items():
            started[name] = start_server(args, directory / f"{name}.log")
        yield started
    finally:
        for server in started.values():
            server.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def test_pystr_is_served_under_the_files_name(servers: dict[str, Server]) -> None:
    assert [model.id for model in client(servers["shout"]).models.list()] == ["pystr_shout"]


def test_model_name_overrides_the_files_name(servers: dict[str, Server]) -> None:
    assert [model.id for model in client(servers["request_echo"]).models.list()] == ["echoer"]


def test_pystr_answers_a_chat(servers: dict[str, Server]) -> None:
    reply = client(servers["shout"]).chat.completions.create(
        model="pystr_shout",
        messages=[
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "FIRST QUESTION"},
            {"role": "user", "content": "hello there, world"},
        ],
    )
    assert reply.choices[0].message.content == "HELLO THERE, WORLD"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_pystr_answers_a_completion_within_max_tokens(servers: dict[str, Server]) -> None:
    reply = client(servers["shout"]).completions.create(
        model="pystr_shout", prompt="one two three four five", max_tokens=2
    )
    assert reply.choices[0].text == "ONE TWO"
    assert reply.choices[0].finish_reason == "length"


def test_pystr_streams_word_by_word(servers: dict[str, Server]) -> None:
    stream = client(servers["shout"]).chat.completions.create(
        model="pystr_shout", messages=[{"role": "user", "content": "stream these words"}], stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices[0].delta.content]
    assert pieces == ["STREAM", " THESE", " WORDS"]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_pystr_gets_a_plain_dict_with_the_sampling_fields_that_are_set(servers: dict[str, Server]) -> None:
    reply = client(servers["request_echo"]).chat.completions.create(
        model="echoer", messages=[{"role": "user", "content": "hi"}], temperature=0.5, seed=7, max_tokens=9
    )
    assert reply.choices[0].message.content is not None
    assert json.loads(reply.choices[0].message.content) == {
        "model": "echoer",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.5,
        "seed": 7,
        "max_tokens": 9,
        "stop": [],
    }


def test_a_runaway_pystr_function_is_stopped_at_max_tokens(servers: dict[str, Server]) -> None:
    reply = client(servers["runaway"]).completions.create(model="runaway", prompt="go", max_tokens=5)
    assert reply.choices[0].text == "xxxxx"
    assert reply.choices[0].finish_reason == "length"


def test_pytok_answers_with_the_reversed_prompt_tokens(servers: dict[str, Server]) -> None:
    model = client(servers["countdown"]).models.list().data[0].id
    reply = client(servers["countdown"]).completions.create(model=model, prompt="one two three four five")
    assert reply.choices[0].text == " five four three twoone"
    assert reply.choices[0].finish_reason == "stop"


def test_pytok_respects_max_tokens(servers: dict[str, Server]) -> None:
    model = client(servers["countdown"]).models.list().data[0].id
    reply = client(servers["countdown"]).completions.create(model=model, prompt="one two three four five", max_tokens=3)
    assert reply.choices[0].text == " five four three"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_pytok_chat_goes_through_the_chat_template(servers: dict[str, Server]) -> None:
    model = client(servers["countdown"]).models.list().data[0].id
    reply = client(servers["countdown"]).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "one two three"}]
    )
    content = reply.choices[0].message.content
    # The reversed template: "assistant" and "user" read backwards token by token, special tokens skipped.
    assert content is not None and content.startswith("\nistantass\n three twoone\nuser\n")


def test_a_failing_pystr_function_is_a_500_with_its_message_and_the_server_keeps_serving(
    servers: dict[str, Server],
) -> None:
    server = servers["raises"]
    response = httpx.post(
        server.api_url + "/chat/completions",
        json={"model": "raises", "messages": [{"role": "user", "content": "please fail"}]},
        timeout=10,
    )
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error"
    assert "ValueError: the user function gave up on purpose" in error["message"]
    assert "Traceback" not in error["message"]
    with pytest.raises(openai.InternalServerError, match="gave up on purpose"):
        client(server).completions.create(model="raises", prompt="fail again")
    assert client(server).completions.create(model="raises", prompt="still here").choices[0].text == "still here"


def test_a_failing_pytok_function_is_a_500_with_its_message(servers: dict[str, Server]) -> None:
    with pytest.raises(openai.InternalServerError, match="RuntimeError: token function broke"):
        client(servers["pytok_raises"]).completions.create(model="broken", prompt="hello")


async def test_the_user_function_is_stopped_and_closed_when_the_context_stops() -> None:
    closed: list[bool] = []

    async def generate(request: dict[str, Any]) -> AsyncIterator[str]:
        try:
            while True:
                yield "x"
        finally:
            closed.append(True)

    engine = PyStrEngine(generate, "endless.py")
    context = RequestContext("r1")
    request = TextRequest(
        request_id="r1",
        model="m",
        prompt="go",
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=100),
    )
    outputs = []
    async for output in engine.generate(request, context):
        outputs.append(output)
        if len(outputs) == 3:
            context.stop()
    assert [output.text for output in outputs] == ["x", "x", "x"]
    assert closed == [True]


async def test_pytok_cuts_a_step_that_goes_past_max_tokens() -> None:
    async def generate(request: dict[str, Any]) -> AsyncIterator[list[int]]:
        yield request["token_ids"] * 3

    engine = PyTokEngine(generate, "triple.py")
    request = PreprocessedRequest(
        request_id="r1",
        model="m",
        token_ids=[1, 2],
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=5),
    )
    outputs = [output async for output in engine.generate(request, RequestContext("r1"))]
    assert [(output.token_ids, output.finish_reason) for output in outputs] == [([1, 2, 1, 2, 1], "length")]


def flotilla(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", *args],
        input="",
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


@pytest.mark.parametrize(
    ("file", "message"),
    [
        ("missing.py", "missing.py: no such file"),
        ("no_generate.py", "defines no `generate`; add `async def generate(request):`"),
        ("not_async_generator.py", "`generate` must be an async generator function"),
        ("import_error.py", "importing it failed: ModuleNotFoundError: No module named 'flotilla_no_such_module'"),
    ],
)
@pytest.mark.parametrize("engine", ["pystr", "pytok"])
def test_a_bad_file_exits_2_with_what_to_fix(engine: str, file: str, message: str) -> None:
    result = flotilla(f"out={engine}:{FILES / file}")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_syntax_error_exits_2_with_its_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("async def generate(request)\n    yield 'never'\n")
    result = flotilla(f"out=pystr:{broken}")
    assert result.returncode == 2
    assert f"{broken}: importing it failed: SyntaxError:" in result.stderr
    assert "(line 1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_file_that_is_not_python_exits_2(tmp_path: Path) -> None:
    text = tmp_path / "engine.txt"
    text.write_text("async def generate(request): yield 'x'\n")
    result = flotilla(f"out=pystr:{text}")
    assert result.returncode == 2
    assert "engine.txt: not a .py file" in result.stderr


@pytest.mark.parametrize("engine", ["pystr", "pytok"])
def test_an_engine_without_a_file_is_a_usage_error(engine: str) -> None:
    result = flotilla(f"out={engine}:")
    assert result.returncode == 2
    assert f"out='{engine}:' needs a file: out={engine}:FILE.py" in result.stderr


def test_help_lists_the_python_engines() -> None:
    result = flotilla("--help")
    assert "out=pystr:FILE.py" in result.stdout
    assert "out=pytok:FILE.py" in result.stdout

"""`flotilla run in=http out=mistralrs` on the SmolLM2 GGUF: the official openai client, streamed and not,
cancellation reaching mistral.rs, and its settings and absence refused with one line (exit 2)."""

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.servers import Server, smollm2_path, start_server

pytestmark = [
    pytest.mark.mistralrs,
    pytest.mark.skipif(
        importlib.util.find_spec("mistralrs") is None, reason="mistralrs is not installed (`make install`)"
    ),
]

MODEL = "smol"
PARIS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One sequence at a time: a request waits for the one before it to end in mistral.rs, which is how
    # the cancellation test sees that a client gone ended its sequence there.
    log = tmp_path_factory.mktemp("mistralrs") / "server.log"
    args = ["out=mistralrs", str(smollm2_path()), "--model-name", MODEL, "--extra-engine-args", '{"max_seqs": 1}']
    running = start_server(args, log)
    yield running
    running.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def test_a_chat_answer_streams_the_same_text_as_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=12)
    text = whole.choices[0].message.content or ""
    assert text and whole.usage is not None
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    # SmolLM2's template adds its default system prompt: more tokens than the question.
    assert whole.usage.prompt_tokens > 10

    stream = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == text
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_a_completion_continues_the_prompt_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert "Paris" in whole.choices[0].text
    assert whole.usage is not None and whole.usage.prompt_tokens == 5 and whole.usage.completion_tokens == 6
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole.choices[0].text


def test_a_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6)
    cut = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6, stop=["Paris"]
    )
    assert cut.choices[0].text == whole.choices[0].text.split("Paris")[0]
    assert cut.choices[0].finish_reason == "stop"


def test_a_client_that_goes_away_ends_its_sequence_in_mistralrs(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.api_url + "/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(lines)
    # With one sequence slot, this request runs only once the story's sequence has ended in mistral.rs:
    # 4,000 tokens would take minutes here, far past this request's timeout.
    reply = httpx.post(
        server.api_url + "/chat/completions",
        json={"model": MODEL, "messages": PARIS, "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_seed_per_request_is_refused_naming_the_engine_setting(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="extra-engine-args"):
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, seed=7)


def run_flotilla(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom launcher.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "run", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_an_unknown_engine_setting_is_refused_naming_it() -> None:
    result = run_flotilla("out=mistralrs", str(smollm2_path()), "--extra-engine-args", '{"max_seqs": 2, "bogus": 1}')
    assert result.returncode == 2, result.stderr
    assert "unknown key 'bogus'" in result.stderr and "max_seqs" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_engine_setting_value_is_refused_naming_it(tmp_path: Path) -> None:
    settings = tmp_path / "mistralrs.json"
    settings.write_text(json.dumps({"max_seqs": 0}))
    result = run_flotilla("out=mistralrs", str(smollm2_path()), "--extra-engine-args", str(settings))
    assert result.returncode == 2, result.stderr
    assert "max_seqs" in result.stderr and "Traceback" not in result.stderr


def test_a_node_without_mistralrs_says_which_extra_to_install() -> None:
    # A None in sys.modules makes the package look absent, to the import system and to find_spec alike.
    result = run_flotilla("out=mistralrs", str(smollm2_path()), prelude="import sys; sys.modules['mistralrs'] = None")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("pip install 'flotilla[mistralrs]'")
    assert "Traceback" not in result.stderr
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['mistralrs'] = None\n"
            "from runtime.fleet_contract.engine_names import engines_on_this_node\n"
            "print(sorted(engines_on_this_node()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "mistralrs" not in listed.stdout


def test_an_installed_mistralrs_is_an_engine_of_this_node() -> None:
    from runtime.fleet_contract.engine_names import engines_on_this_node

    assert "mistralrs" in engines_on_this_node()

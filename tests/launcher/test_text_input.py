"""``in=text``: one piped prompt, or a chat on a terminal."""

import asyncio
import io
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TextIO

import pytest

from engines.echo import EchoFullEngine
from frontend_gateway.errors import EngineFailed, InvalidRequest
from frontend_gateway.models.pipeline import Generation, TextModel
from frontend_gateway.openai_api.types import ChatCompletionRequest, CompletionRequest
from launcher.inputs.text import run_text

unix_signals = pytest.mark.skipif(sys.platform == "win32", reason="Ctrl-C is delivered as SIGINT")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class RecordingModel:
    """echo_full that keeps each chat request, with a few prompts that misbehave on purpose.

    "boom" is refused; "crash" fails after one piece; "long" sends Ctrl-C to this process after one
    piece and then waits to be stopped.
    """

    def __init__(self) -> None:
        self.inner = TextModel("echo", EchoFullEngine(delay_seconds=0.0))
        self.name = self.inner.name
        self.created = self.inner.created
        self.context_length = self.inner.context_length
        self.requests: list[ChatCompletionRequest] = []
        self.generations: list[Generation] = []

    async def prepare_chat(self, request: ChatCompletionRequest) -> Generation:
        self.requests.append(request)
        last = request.messages[-1].content
        if last == "boom":
            raise InvalidRequest("refused: boom")
        generation = await self.inner.prepare_chat(request)
        if last == "crash":
            generation.bind(_one_piece_then(EngineFailed("the engine crashed")))
        elif last == "long":
            generation.bind(_one_piece_then_ctrl_c())
        self.generations.append(generation)
        return generation

    async def prepare_completion(self, request: CompletionRequest) -> Generation:
        raise AssertionError("in=text sends chat requests only")


async def _one_piece_then(error: Exception) -> AsyncIterator[str]:
    yield "par"
    raise error


async def _one_piece_then_ctrl_c() -> AsyncIterator[str]:
    yield "lo"
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.Event().wait()  # until Ctrl-C cancels the answer
    yield "never shown"


def conversation(request: ChatCompletionRequest) -> list[tuple[str, object]]:
    return [(message.role, message.content) for message in request.messages]


async def test_a_piped_prompt_is_answered_once() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=io.StringIO("What is 2+2?\n"), stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "What is 2+2?\n"
    assert [conversation(request) for request in model.requests] == [[("user", "What is 2+2?")]]


async def test_max_tokens_and_temperature_reach_the_request() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=io.StringIO("What is 2+2?"), stdout=stdout, max_tokens=4, temperature=0.5)

    assert code == 0
    assert stdout.getvalue() == "What\n"
    assert (model.requests[0].max_tokens, model.requests[0].temperature) == (4, 0.5)


async def test_empty_piped_input_is_an_error_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=io.StringIO(" \n"), stdout=stdout)

    assert code == 2
    assert "no prompt on stdin" in capsys.readouterr().err
    assert stdout.getvalue() == ""
    assert model.requests == []


async def test_a_refused_piped_prompt_is_reported_on_stderr_with_exit_code_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = await run_text(RecordingModel(), stdin=io.StringIO("boom"), stdout=io.StringIO())

    assert code == 1
    assert capsys.readouterr().err == "error: refused: boom\n"


async def test_a_chat_sends_the_whole_conversation_each_turn() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=FakeTerminal("hello\nworld\n"), stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "> hello\n> world\n> \n"
    assert [conversation(request) for request in model.requests] == [
        [("user", "hello")],
        [("user", "hello"), ("assistant", "hello"), ("user", "world")],
    ]


async def test_empty_lines_are_ignored_and_exit_ends_the_chat() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=FakeTerminal("\n   \nhi\n/exit\nnot read\n"), stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "> > > hi\n> "
    assert len(model.requests) == 1


async def test_a_refused_turn_is_reported_and_forgotten_and_the_chat_goes_on() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=FakeTerminal("boom\nhi\n"), stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "> error: refused: boom\n> hi\n> \n"
    assert conversation(model.requests[1]) == [("user", "hi")]


async def test_a_failure_mid_answer_is_reported_on_its_own_line() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=FakeTerminal("crash\nhi\n"), stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "> par\nerror: the engine crashed\n> hi\n> \n"
    assert conversation(model.requests[1]) == [("user", "hi")]


@unix_signals
async def test_ctrl_c_during_an_answer_stops_it_and_returns_to_the_prompt() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=FakeTerminal("long\nnext\n"), stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "> lo\n> next\n> \n"
    assert model.generations[0].context.stopped
    # What was shown of the interrupted answer stays in the conversation.
    assert conversation(model.requests[1]) == [("user", "long"), ("assistant", "lo"), ("user", "next")]


class CtrlCOnSecondLine(FakeTerminal):
    """Answers the first read with a line; during the second, the user presses Ctrl-C."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.released = threading.Event()

    def readline(self, size: int | None = -1, /) -> str:  # type: ignore[override]  # typeshed: _IOBase -> bytes
        self.reads += 1
        if self.reads == 1:
            return "hi\n"
        os.kill(os.getpid(), signal.SIGINT)
        self.released.wait(timeout=10)  # a real terminal read stays blocked too
        return ""


@unix_signals
async def test_ctrl_c_at_the_prompt_ends_the_chat_cleanly() -> None:
    model = RecordingModel()
    stdin = CtrlCOnSecondLine()
    stdout = io.StringIO()
    try:
        code = await run_text(model, stdin=stdin, stdout=stdout)
    finally:
        stdin.released.set()

    assert code == 0
    assert stdout.getvalue() == "> hi\n> \n"
    assert len(model.requests) == 1


@pytest.fixture
def terminal() -> Iterator[tuple[int, TextIO]]:
    """A pseudo-terminal: the fd that types into it, and the terminal as a text stream."""
    if not hasattr(os, "openpty"):
        pytest.skip("needs a pseudo-terminal")
    controller, terminal_fd = os.openpty()
    try:
        with open(terminal_fd, encoding="utf-8") as stream:
            yield controller, stream
    finally:
        os.close(controller)


async def test_a_real_terminal_is_read_until_ctrl_d(terminal: tuple[int, TextIO]) -> None:
    controller, stream = terminal
    model = RecordingModel()
    stdout = io.StringIO()
    assert stream.isatty()
    os.write(controller, "héllo\n".encode() + b"\x04")  # a line, then Ctrl-D

    code = await run_text(model, stdin=stream, stdout=stdout)

    assert code == 0
    assert stdout.getvalue() == "> héllo\n> \n"
    assert [conversation(request) for request in model.requests] == [[("user", "héllo")]]


async def test_clear_starts_a_fresh_conversation() -> None:
    model = RecordingModel()
    stdout = io.StringIO()

    code = await run_text(model, stdin=FakeTerminal("hello\n/clear\nworld\n"), stdout=stdout)

    assert code == 0
    assert "(conversation cleared)" in stdout.getvalue()
    assert [conversation(request) for request in model.requests] == [[("user", "hello")], [("user", "world")]]

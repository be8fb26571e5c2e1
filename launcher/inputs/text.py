"""``in=text``: chat with a model in the terminal, or answer one prompt piped on stdin.

On a terminal this is a chat loop: the whole conversation is sent each turn and the answer is
streamed as it comes. Ctrl-C during an answer stops that answer and returns to the prompt; Ctrl-C at
the prompt, Ctrl-D or ``/exit`` ends the chat. Piped input is read whole, as one prompt.
"""

import asyncio
import codecs
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Final, TextIO, TypeVar

from frontend_gateway.errors import GatewayError
from frontend_gateway.models.pipeline import ServedModel
from frontend_gateway.openai_api.types import ChatCompletionRequest, ChatMessage

PROMPT: Final = "> "
EXIT_COMMAND: Final = "/exit"
CLEAR_COMMAND: Final = "/clear"

_T = TypeVar("_T")


async def run_text(
    model: ServedModel,
    *,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    max_tokens: int | None = None,
    temperature: float | None = None,
) -> int:
    """Chat on a terminal, or answer the prompt piped on stdin once.

    Returns the exit code: 0 when done, 1 when the piped prompt could not be answered, 2 when
    nothing was piped. Errors of the piped mode go to stderr; in a chat they are shown inline.
    """
    sampling = _Sampling(max_tokens, temperature)
    if stdin.isatty():
        return await _chat(model, stdin, stdout, sampling)
    return await _answer_once(model, stdin, stdout, sampling)


@dataclass(frozen=True, slots=True)
class _Sampling:
    max_tokens: int | None
    temperature: float | None


async def _stream_answer(
    model: ServedModel, messages: list[ChatMessage], stdout: TextIO, sampling: _Sampling, shown: list[str]
) -> None:
    """Stream the answer to ``messages`` onto stdout, appending each piece to ``shown`` as it is written.

    Raises GatewayError when the request is refused or the engine fails; a cancellation (Ctrl-C)
    stops the generation before it propagates.
    """
    request = ChatCompletionRequest(
        model=model.name,
        messages=list(messages),
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
    )
    generation = await model.prepare_chat(request)
    pieces = generation.pieces()
    finished = False
    try:
        async for piece in pieces:
            stdout.write(piece)
            stdout.flush()
            shown.append(piece)
        finished = True
    finally:
        if not finished:
            generation.context.stop()
            aclose = getattr(pieces, "aclose", None)
            if aclose is not None:
                await aclose()


async def _answer_once(model: ServedModel, stdin: TextIO, stdout: TextIO, sampling: _Sampling) -> int:
    prompt = (await asyncio.to_thread(stdin.read)).strip()
    if not prompt:
        print("error: no prompt on stdin", file=sys.stderr)
        return 2
    shown: list[str] = []
    try:
        await _stream_answer(model, [ChatMessage(role="user", content=prompt)], stdout, sampling, shown)
    except GatewayError as exc:
        if shown:
            stdout.write("\n")
            stdout.flush()
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    stdout.write("\n")
    stdout.flush()
    return 0


async def _chat(model: ServedModel, stdin: TextIO, stdout: TextIO, sampling: _Sampling) -> int:
    reader = _LineReader(stdin)
    interrupts = _Interrupts()
    conversation: list[ChatMessage] = []
    with _sigint_calls(interrupts.fire):
        while True:
            stdout.write(PROMPT)
            stdout.flush()
            line = await interrupts.run(reader.readline())
            if isinstance(line, _Interrupted) or not line:
                # Ctrl-C or Ctrl-D at the prompt: end the line the prompt is on, and the chat.
                stdout.write("\n")
                stdout.flush()
                return 0
            text = line.strip()
            if not text:
                continue
            if text == EXIT_COMMAND:
                return 0
            if text == CLEAR_COMMAND:
                # A fresh start, e.g. when the conversation no longer fits the context.
                conversation.clear()
                stdout.write("(conversation cleared)\n")
                stdout.flush()
                continue
            conversation.append(ChatMessage(role="user", content=text))
            shown: list[str] = []
            try:
                await interrupts.run(_stream_answer(model, conversation, stdout, sampling, shown))
            except GatewayError as exc:
                stdout.write(f"\nerror: {exc.message}\n" if shown else f"error: {exc.message}\n")
                stdout.flush()
                # A refused or failed turn is forgotten, so the conversation stays well formed.
                conversation.pop()
                continue
            stdout.write("\n")
            stdout.flush()
            answer = "".join(shown)
            if answer:
                # An interrupted answer is kept as far as it went: that is what the user saw.
                conversation.append(ChatMessage(role="assistant", content=answer))
            else:
                # Nothing to reply to: drop the turn rather than send two user messages in a row.
                conversation.pop()


class _Interrupted:
    """Marks a step that Ctrl-C cut short."""


_INTERRUPTED: Final = _Interrupted()


class _Interrupts:
    """Routes Ctrl-C to the step the chat is waiting on (reading a line, or streaming an answer)."""

    def __init__(self) -> None:
        self._step: asyncio.Task[Any] | None = None
        self._pending = False

    def fire(self) -> None:
        if self._step is not None and not self._step.done():
            self._step.cancel()
        else:
            # Between steps: the next one is interrupted as soon as it starts.
            self._pending = True

    async def run(self, step: Coroutine[Any, Any, _T]) -> _T | _Interrupted:
        """Run ``step``; return its result, or _INTERRUPTED if Ctrl-C cancelled it.

        Exceptions from the step propagate; cancelling the caller cancels the step too.
        """
        if self._pending:
            self._pending = False
            step.close()
            return _INTERRUPTED
        task = asyncio.ensure_future(step)
        self._step = task
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            self._step = None
        if task.cancelled():
            return _INTERRUPTED
        return task.result()


@contextlib.contextmanager
def _sigint_calls(callback: Callable[[], None]) -> Iterator[None]:
    """Make Ctrl-C call ``callback`` on the running loop instead of raising KeyboardInterrupt.

    Where the loop cannot take signals (not the main thread, or Windows), Ctrl-C keeps its usual
    meaning: asyncio cancels the program's main task.
    """
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGINT)
    try:
        loop.add_signal_handler(signal.SIGINT, callback)
    except (NotImplementedError, RuntimeError, ValueError):
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if previous is not None:
            # Give the handler back to whoever had it (asyncio.run installs its own).
            signal.signal(signal.SIGINT, previous)


class _LineReader:
    """Reads lines from a terminal without blocking the event loop.

    A real terminal is watched with ``loop.add_reader`` so that a pending read can be abandoned (on
    Ctrl-C) without leaving a thread blocked in ``readline``. Streams without a file descriptor, or
    loops that cannot watch one, are read in a worker thread instead.
    """

    _CHUNK = 65536

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._fd: int | None
        try:
            self._fd = stream.fileno()
        except (OSError, ValueError):
            self._fd = None
        self._decoder = codecs.getincrementaldecoder(getattr(stream, "encoding", None) or "utf-8")(errors="replace")
        self._buffer = ""
        self._eof = False

    async def readline(self) -> str:
        """The next line, with its newline if it had one; "" at end of input."""
        if self._fd is not None:
            try:
                return await self._readline_fd(self._fd)
            except NotImplementedError:
                self._fd = None
        return await asyncio.to_thread(self._stream.readline)

    async def _readline_fd(self, fd: int) -> str:
        while True:
            end = self._buffer.find("\n")
            if end >= 0:
                line, self._buffer = self._buffer[: end + 1], self._buffer[end + 1 :]
                return line
            if self._eof:
                line, self._buffer = self._buffer, ""
                return line
            await _readable(fd)
            data = os.read(fd, self._CHUNK)  # ready: this does not block
            if data:
                self._buffer += self._decoder.decode(data)
            else:
                self._buffer += self._decoder.decode(b"", final=True)
                self._eof = True


async def _readable(fd: int) -> None:
    """Wait until ``fd`` can be read. Raises NotImplementedError where the loop cannot watch it."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    try:
        loop.add_reader(fd, wake)
    except PermissionError as exc:
        # epoll refuses regular files; they are never "not ready" anyway.
        raise NotImplementedError from exc
    try:
        await ready
    finally:
        loop.remove_reader(fd)

"""Engines written in Python by users: ``out=pystr:FILE.py`` and ``out=pytok:FILE.py``.

FILE.py defines ``async def generate(request)``, an async generator function, loaded once at start-up.

* ``pystr`` (a text engine): ``request`` is a plain dict ``{"model", "messages"}`` (chat) or
  ``{"model", "prompt"}`` (completion), plus ``"max_tokens"``, ``"stop"`` and the sampling fields the
  client set (``"temperature"``, ``"top_p"``, ...). It yields ``str`` pieces (one token each) or dicts
  ``{"text": str, "finish_reason": "stop" | "length" | None}``.
* ``pytok`` (a token engine): ``request`` is the preprocessed request as plain data (``"token_ids"``,
  ``"sampling"``, ``"stop_conditions"``, ``"eos_token_ids"``, ...). It yields lists of token ids or
  dicts ``{"token_ids": [...], "finish_reason": ...}``. Stopping at EOS is the function's choice.

Both wrappers stop the function at ``max_tokens`` (finish reason "length") and when the client goes
away, and turn its exceptions into EngineError (a 500 with the message, the server keeps serving).
The function runs on the server's event loop: it must await, not block.
"""

import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError
from runtime.protocol import EngineOutput, FinishReason, PreprocessedRequest, TextOutput, TextRequest

log = logging.getLogger(__name__)

PYTHON_ENGINES = ("pystr", "pytok")

#: ``async def generate(request)``; load_generate checks that it is an async generator function.
UserGenerate = Callable[[dict[str, Any]], AsyncIterator[Any]]


class _TokenStep(msgspec.Struct):
    """What a pytok function may yield as a dict (a bare list of ints means ``token_ids``)."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None


def python_engine_file(output: str) -> tuple[Literal["pystr", "pytok"], str] | None:
    """Split ``pystr:FILE`` / ``pytok:FILE`` into kind and file (FILE may be empty); None for other engines."""
    kind, sep, file = output.partition(":")
    if sep and kind == "pystr":
        return "pystr", file
    if sep and kind == "pytok":
        return "pytok", file
    return None


def load_generate(path: Path) -> UserGenerate:
    """Import FILE.py and return its ``generate``. Raises ConfigError saying what to fix."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; out=pystr:FILE.py / out=pytok:FILE.py need a Python file")
    if path.suffix != ".py":
        raise ConfigError(f"{path}: not a .py file; give the Python file that defines `async def generate(request)`")
    # A name of its own, so that the user's module cannot shadow (or be shadowed by) an installed one.
    module_name = "flotilla_user_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"{path}: importing it failed: {_describe(exc)}") from exc
    generate = getattr(module, "generate", None)
    if generate is None:
        raise ConfigError(f"{path}: defines no `generate`; add `async def generate(request):` that yields outputs")
    if not inspect.isasyncgenfunction(generate):
        raise ConfigError(
            f"{path}: `generate` must be an async generator function: `async def generate(request):` that uses `yield`"
        )
    try:
        inspect.signature(generate).bind({})
    except TypeError:
        raise ConfigError(f"{path}: `generate` must take one argument, the request") from None
    result: UserGenerate = generate
    return result


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


class _PythonEngineBase:
    """The user's function, and nothing to start or close."""

    def __init__(self, generate: UserGenerate, source: str) -> None:
        self.user_generate = generate
        self.source = source  # the file, for error messages

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def _user_outputs(self, request: dict[str, Any], context: RequestContext) -> AsyncIterator[Any]:
        """The user's items until it ends or ``context`` stops; its exceptions become EngineError."""
        outputs = self.user_generate(request)
        try:
            while not context.stopped:
                try:
                    item = await anext(outputs)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    log.warning("generate in %s failed on request %s", self.source, context.request_id, exc_info=True)
                    raise EngineError(f"generate in {self.source} failed: {_describe(exc)}") from exc
                yield item
        finally:
            # Runs the user's `finally` blocks now, not whenever the generator is collected.
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()

    def _bad_item(self, item: object, expected: str) -> EngineError:
        return EngineError(f"generate in {self.source} yielded {item!r:.200}; expected {expected}")


def text_request_dict(request: TextRequest) -> dict[str, Any]:
    """The plain dict a pystr function receives."""
    data: dict[str, Any] = {"model": request.model}
    if request.messages is not None:
        data["messages"] = request.messages
    else:
        data["prompt"] = request.prompt
    data.update(msgspec.to_builtins(request.sampling))
    data["max_tokens"] = request.stop_conditions.max_tokens
    data["stop"] = list(request.stop_conditions.stop)
    if request.chat_template_kwargs:
        data["chat_template_kwargs"] = request.chat_template_kwargs
    return data


class PyStrEngine(_PythonEngineBase):
    """A user function answering OpenAI-level requests with text pieces."""

    kind: Literal["text"] = "text"

    async def generate(self, request: TextRequest, context: RequestContext) -> AsyncIterator[TextOutput]:
        limit = request.stop_conditions.max_tokens
        count = 0
        async for item in self._user_outputs(text_request_dict(request), context):
            output = self._text_output(item)
            count += 1
            if count >= limit and output.finish_reason is None:
                output.finish_reason = "length"  # stop a function that would go on
            yield output
            if output.finish_reason is not None:
                return

    def _text_output(self, item: object) -> TextOutput:
        if isinstance(item, str):
            return TextOutput(text=item)
        if isinstance(item, dict):
            try:
                return msgspec.convert(item, TextOutput)
            except msgspec.ValidationError as exc:
                raise self._bad_item(item, f'a str or {{"text": str, "finish_reason": ...}} ({exc})') from None
        raise self._bad_item(item, 'a str or {"text": str, "finish_reason": ...}')


class PyTokEngine(_PythonEngineBase):
    """A user function answering preprocessed requests with token ids."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        left = request.stop_conditions.max_tokens
        async for item in self._user_outputs(msgspec.to_builtins(request), context):
            step = self._token_step(item)
            token_ids, finish = step.token_ids, step.finish_reason
            if len(token_ids) >= left:
                # Cut at max_tokens; a function that ends exactly there keeps its own finish reason.
                if len(token_ids) > left or finish is None:
                    finish = "length"
                token_ids = token_ids[:left]
            left -= len(token_ids)
            yield EngineOutput(token_ids, finish)
            if finish is not None:
                return

    def _token_step(self, item: object) -> _TokenStep:
        expected = 'a list of token ids or {"token_ids": [...], "finish_reason": ...}'
        try:
            if isinstance(item, list):
                return _TokenStep(msgspec.convert(item, list[int]))
            if isinstance(item, dict):
                return msgspec.convert(item, _TokenStep)
        except msgspec.ValidationError as exc:
            raise self._bad_item(item, f"{expected} ({exc})") from None
        raise self._bad_item(item, expected)

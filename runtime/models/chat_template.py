"""Chat templates rendered exactly as Hugging Face ``transformers`` renders them.

Models ship their prompt format as a Jinja template (``tokenizer_config.json`` or a GGUF's
``tokenizer.chat_template``). Clients expect the prompt that ``apply_chat_template`` would build, so
the environment here copies transformers' own: a sandbox (templates come from model files, which we do
not trust), ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not escape HTML, and the ``raise_exception``/``strftime_now`` globals.

One step comes before it, as in vLLM: an assistant message's ``tool_calls`` carry their ``arguments`` as
JSON text in the OpenAI API, and templates expect the object (Llama 3.1's ``arguments | tojson`` would
encode the text a second time, ``arguments | items`` fails on it), so the text is parsed first.
"""

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.errors import TemplateError

__all__ = ["ChatTemplate", "TemplateError"]


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """``raise_exception`` called by the template itself: its message is meant for the user as is."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes <, >, & and ' for HTML; transformers replaces it with plain
    # json.dumps, and tool schemas in prompts must be byte-identical to what the model was trained on.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}…{% endgeneration %}`` and render its body unchanged.

    transformers marks assistant text with this tag to build training masks; templates that use it must
    still compile here, and for inference the tag has no effect.
    """

    tags = {"generation"}  # noqa: RUF012  # jinja2 declares it a plain set attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    filters: dict[str, Callable[..., Any]] = env.filters
    filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to.

    Raises TemplateError when ``source`` is not a valid Jinja template.
    """

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Return the prompt for ``messages``; ``extra`` becomes template variables (e.g. ``documents``).

        Raises TemplateError when the template rejects the conversation or fails while rendering.
        """
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,  # transformers always defines it; RAG templates test it
            **extra,
            "messages": with_parsed_arguments(messages),
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except _TemplateRaised as exc:
            raise TemplateError(str(exc)) from exc
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # Templates index and concatenate message fields freely; a request with an unexpected shape
            # (content as a list, a missing role) surfaces here and is the client's error.
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each tool call's ``function.arguments`` as the JSON value its text holds (an empty
    text: ``{}``), as vLLM gives templates. The messages given are not changed; text that is not JSON is
    left as it is (the gateway refuses it before templating, naming the field)."""
    result = messages
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not isinstance(calls, list) or not any(_needs_parsing(call) for call in calls):
            continue
        if result is messages:
            result = list(messages)
        result[index] = {**message, "tool_calls": [_parsed_call(call) for call in calls]}
    return result


def _needs_parsing(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("arguments"), str)


def _parsed_call(call: Any) -> Any:
    if not _needs_parsing(call):
        return call
    function = call["function"]
    text = function["arguments"]
    try:
        arguments = json.loads(text) if text.strip() else {}
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}

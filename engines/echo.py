"""Echo engines: no model weights, for testing and benchmarking everything around an engine.

``echo_core`` is a token engine that echoes the templated prompt's tokens (so the response shows the
chat template); ``echo_full`` is a text engine that echoes the prompt text, needing no model at all.
Both wait ``FLOTILLA_TOKEN_ECHO_DELAY_MS`` between tokens (default 10).
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Literal

from runtime.config import env_float
from runtime.engine import RequestContext
from runtime.protocol import EngineOutput, FinishReason, PreprocessedRequest, TextOutput, TextRequest


def echo_delay_seconds() -> float:
    """The configured delay between echoed tokens, in seconds."""
    return env_float("FLOTILLA_TOKEN_ECHO_DELAY_MS", 10.0, minimum=0.0) / 1000.0


class _EchoBase:
    """What both echo engines share: a delay between tokens, and nothing to start or close."""

    def __init__(self, delay_seconds: float) -> None:
        self.delay = delay_seconds

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class EchoCoreEngine(_EchoBase):
    """Echoes the prompt's token ids one by one; stops at max_tokens, never at EOS."""

    kind: Literal["token"] = "token"
    # The point of echo_core is to show the templated prompt, special tokens included.
    skip_special_tokens = False

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        # After a migration the prompt ends with what was already echoed: echo the rest of the original.
        migrated = request.migrated_tokens
        original = request.token_ids[: len(request.token_ids) - migrated] if migrated else request.token_ids
        remaining = original[migrated:]
        tokens = remaining[: request.stop_conditions.max_tokens]
        last = len(tokens) - 1
        finish: FinishReason = "length" if len(remaining) > len(tokens) else "stop"
        for index, token in enumerate(tokens):
            if context.stopped:
                return
            if self.delay:
                await asyncio.sleep(self.delay)
            yield EngineOutput([token], finish if index == last else None)


def echo_text(request: TextRequest) -> str:
    """What echo_full echoes: the completion prompt, or the last message of a chat."""
    if request.prompt is not None:
        return request.prompt
    content = (request.messages or [{}])[-1].get("content")
    return content if isinstance(content, str) else ""


class EchoFullEngine(_EchoBase):
    """Echoes the prompt text one character at a time; each character counts as one token."""

    kind: Literal["text"] = "text"

    async def generate(self, request: TextRequest, context: RequestContext) -> AsyncIterator[TextOutput]:
        text = echo_text(request)
        limit = request.stop_conditions.max_tokens
        shown = text[:limit]
        finish: FinishReason = "length" if len(text) > len(shown) else "stop"
        last = len(shown) - 1
        if last < 0:
            yield TextOutput(text="", finish_reason="stop", completion_tokens=0, prompt_tokens=0)
            return
        delay = self.delay
        for index, char in enumerate(shown):
            if context.stopped:
                return
            if delay:
                await asyncio.sleep(delay)
            yield TextOutput(
                text=char,
                finish_reason=finish if index == last else None,
                prompt_tokens=len(text) if index == 0 else None,
            )

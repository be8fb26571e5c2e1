"""A chat-level engine in one Python file: it answers the last user message in upper case, word by word.

    flotilla run in=http out=pystr:examples/pystr_shout.py      # served as "pystr_shout"

Flotilla imports this file once and calls ``generate`` for every request. ``request`` is a plain dict:
``{"model": ..., "messages": [...]}`` for /v1/chat/completions or ``{"model": ..., "prompt": ...}``
for /v1/completions, plus ``"max_tokens"``, ``"stop"`` and whatever sampling fields the client set
(``"temperature"``, ``"top_p"``, ``"seed"``, ...).

Yield ``str`` pieces (each counts as one token) or dicts ``{"text": str, "finish_reason": ...}``.
Flotilla stops the function at ``max_tokens`` (finish reason "length"), applies stop strings, and
stops asking for pieces when the client goes away.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Any


def last_user_text(request: dict[str, Any]) -> str:
    """The completion prompt, or the text of the chat's last user message."""
    if "prompt" in request:
        return str(request["prompt"])
    for message in reversed(request["messages"]):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            # Content parts: [{"type": "text", "text": ...}, ...]
            return " ".join(part.get("text", "") for part in content or [] if isinstance(part, dict))
    return ""


async def generate(request: dict[str, Any]) -> AsyncIterator[str | dict[str, Any]]:
    words = last_user_text(request).upper().split()
    if not words:
        yield {"text": "...", "finish_reason": "stop"}
        return
    for index, word in enumerate(words):
        # Await between pieces like a real model would: the function runs on the server's event loop,
        # so it must never block it (use asyncio.to_thread for blocking work).
        await asyncio.sleep(0.01)
        piece = word if index == 0 else " " + word
        if index == len(words) - 1:
            yield {"text": piece, "finish_reason": "stop"}
        else:
            yield piece

"""Tokens' log probabilities in OpenAI's two shapes: chat's list of entries, completions' parallel lists.

Only requests that ask for them pay for them: the pipeline collects a ``LogprobEntry`` per generated
token (the engine's numbers, the token decoded alone), and these functions shape them per answer or
per stream chunk.
"""

from dataclasses import dataclass
from typing import Any

__all__ = ["CompletionLogprobs", "LogprobEntry", "chat_logprobs"]


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """A token's text and log probability, and its likeliest alternatives (text, logprob). A prompt's first
    token (``echo``) has neither: None, shown as null, as in OpenAI's and vLLM's answers."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``."""
    # Chat has no echo: every entry is a generated token's, with its numbers.
    content = [
        _token(entry.token, entry.logprob or 0.0)
        | {"top_logprobs": [_token(text, value) for text, value in entry.top or ()]}
        for entry in entries
    ]
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """A completion's ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset), chunk by chunk:
    the offsets run on across the chunks of one stream."""

    __slots__ = ("_offset",)

    def __init__(self) -> None:
        self._offset = 0

    def shape(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry.token)
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [None if entry.top is None else dict(entry.top) for entry in entries],
            "text_offset": offsets,
        }

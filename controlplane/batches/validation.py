"""A batch's input file checked before it runs: JSONL, one request per line, as OpenAI takes it:

``{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``

Every line's ``url`` must be the batch's endpoint and its ``custom_id`` unique; errors are reported as
OpenAI reports them (``{code, message, line, param}``, lines counted from 1), at most ``MAX_REPORTED``.
"""

from typing import Any

import msgspec

#: What a batch may run: the fleet's generation and embedding endpoints.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_REQUESTS = 50_000  # OpenAI's limit per batch
MAX_REPORTED = 100


class Line(msgspec.Struct, frozen=True):
    custom_id: str
    url: str
    body: dict[str, Any]
    method: str = "POST"


class Request(msgspec.Struct, frozen=True):
    """One request of a batch, as the runner sends it."""

    custom_id: str
    body: bytes


class Invalid(Exception):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} error(s)")
        self.errors = errors


def parse(content: bytes, endpoint: str) -> list[Request]:
    """The requests of an input file for a batch on ``endpoint``. Raises Invalid with every error found."""
    errors: list[dict[str, Any]] = []
    requests: list[Request] = []
    seen: set[str] = set()

    def error(code: str, message: str, line: int, param: str | None = None) -> None:
        if len(errors) < MAX_REPORTED:
            errors.append({"code": code, "message": message, "line": line, "param": param})

    lines = [(number, text) for number, text in enumerate(content.splitlines(), start=1) if text.strip()]
    if not lines:
        raise Invalid(
            [{"code": "empty_file", "message": "the input file has no requests", "line": None, "param": None}]
        )
    if len(lines) > MAX_REQUESTS:
        raise Invalid(
            [
                {
                    "code": "too_many_requests",
                    "message": f"the input file has {len(lines)} requests; a batch takes at most {MAX_REQUESTS}",
                    "line": None,
                    "param": None,
                }
            ]
        )
    for number, text in lines:
        try:
            line = msgspec.json.decode(text, type=Line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error("invalid_json_line", f"not a batch request: {exc}", number)
            continue
        if line.method != "POST":
            error("invalid_method", f"method {line.method!r}: batches send POST requests", number, "method")
        elif line.url != endpoint:
            error("mismatched_endpoint", f"url {line.url!r} is not the batch's endpoint {endpoint}", number, "url")
        elif line.custom_id in seen:
            error("duplicate_custom_id", f"custom_id {line.custom_id!r} appears twice", number, "custom_id")
        elif not isinstance(line.body.get("model"), str):
            error("missing_model", "the request body names no model", number, "body.model")
        elif line.body.get("stream"):
            error("invalid_request", "a batch's requests cannot be streamed (stream: true)", number, "body.stream")
        else:
            seen.add(line.custom_id)
            requests.append(Request(line.custom_id, msgspec.json.encode(line.body)))
    if errors:
        raise Invalid(errors)
    return requests

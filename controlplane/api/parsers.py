"""The API's one body format, JSON, read with a size limit and without the ways json can crash a view."""

import json
from typing import Any

from django.conf import settings
from rest_framework import exceptions, parsers, status


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "the request body is too large"
    default_code = "payload_too_large"


class LimitedJSONParser(parsers.JSONParser):
    """JSON bodies up to ``settings.API_MAX_BODY_BYTES``; anything unreadable is a 400, too large a 413.

    DRF reads the request stream itself, past Django's own upload limit, so the limit is kept here.
    NaN and Infinity are refused (strict JSON); so are nesting deep enough to exhaust the parser's
    recursion, which DRF's own parser would let through as a 500.
    """

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        limit: int = settings.API_MAX_BODY_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
        encoding = parsers.get_encoding(parser_context or {})  # refuses bytes-to-bytes codecs like bz2
        try:
            text = raw.decode(encoding)
        except (LookupError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"the body cannot be decoded as {encoding}") from exc
        try:
            return json.loads(text, parse_constant=_refuse_constant)
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error: {exc}") from exc
        except RecursionError as exc:
            raise exceptions.ParseError("JSON parse error: nested too deeply") from exc


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")

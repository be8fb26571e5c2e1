"""What the control plane's OpenAI-shaped endpoints share (``/v1/files``, ``/v1/batches``, stored
``/v1/responses``): the API key checked against the database, OpenAI's error body, and OpenAI's lists.

The gateway passes these requests on (frontend_gateway/control_plane_proxy.py). A revoked, expired or
suspended key is a 401 here as at the gateway; each key sees only what it made.
"""

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from controlplane.apikeys.models import ApiKey
from runtime.fleet_contract.api_keys import key_hash

View = Callable[..., HttpResponse]


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JsonResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JsonResponse(body, status=self.status)


def openai_view(methods: dict[str, View]) -> View:
    """A view answering ``methods`` for a key's holder: the key checked first, errors in OpenAI's shape."""

    @csrf_exempt
    def view(request: HttpRequest, **kwargs: str) -> HttpResponse:
        try:
            handler = methods.get(request.method or "")
            if handler is None:
                allowed = ", ".join(methods)
                raise OpenAIError(
                    HTTPStatus.METHOD_NOT_ALLOWED, f"{request.path} takes {allowed}, not {request.method}"
                )
            return handler(request, key_of(request), **kwargs)
        except OpenAIError as exc:
            return exc.response()

    return view


def key_of(request: HttpRequest) -> ApiKey:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise OpenAIError(
            HTTPStatus.UNAUTHORIZED,
            "You didn't provide an API key (Authorization: Bearer sk-flt-...).",
            code="invalid_api_key",
        )
    key = ApiKey.objects.select_related("owner").filter(key_hash=key_hash(token.strip())).first()
    if key is None or key.revoked or key.suspended or (key.expires_at is not None and key.expires_at <= timezone.now()):
        why = "unknown" if key is None else "revoked" if key.revoked else "suspended" if key.suspended else "expired"
        raise OpenAIError(HTTPStatus.UNAUTHORIZED, f"Incorrect API key provided ({why}).", code="invalid_api_key")
    return key


def page_limit(request: HttpRequest) -> int:
    """A list's ``limit`` (1-100, default 20), as OpenAI takes it. Raises OpenAIError (400) for another."""
    try:
        limit = int(request.GET.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "limit is a whole number from 1 to 100", param="limit")
    return limit


def page(request: HttpRequest, rows: "QuerySet[Any]", shape: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """One page of ``rows`` (newest first) as OpenAI lists them: ``limit`` (1-100, default 20) rows after
    the row ``after``."""
    limit = page_limit(request)
    if after := request.GET.get("after"):
        anchor = rows.filter(pk=after).first()
        if anchor is None:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST, f"after={after[:100]!r} names nothing in this list", param="after"
            )
        rows = rows.filter(created_at__lte=anchor.created_at).exclude(created_at=anchor.created_at, id__lte=anchor.pk)
    page = list(rows.order_by("-created_at", "id")[: limit + 1])
    data = [shape(row) for row in page[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(page) > limit,
    }

"""Stored responses, in OpenAI's shapes: ``GET``/``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``; and the gateway's two routes, ``POST /v1/responses/{id}/store`` (as it
answers) and ``GET /v1/responses/{id}/conversation`` (for a request naming it in ``previous_response_id``).

Everything is scoped to the key: another key's response is a 404, as if it did not exist, and a
response id cannot be stored twice (409), so one key cannot overwrite another's.
"""

import datetime
import secrets
from http import HTTPStatus
from typing import Any

import msgspec
from django.conf import settings
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from controlplane.apikeys.models import ApiKey
from controlplane.openai_views import OpenAIError, openai_view, page_limit
from controlplane.stored_responses.models import StoredResponse

_MAX_ID = 100


class _Store(msgspec.Struct, forbid_unknown_fields=True):
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]


def _own(key: ApiKey, response_id: str) -> StoredResponse:
    stored = StoredResponse.objects.filter(api_key=key, pk=response_id, expires_at__gt=timezone.now()).first()
    if stored is None:
        raise OpenAIError(
            HTTPStatus.NOT_FOUND, f"Response with id '{response_id[:_MAX_ID]}' not found.", param="response_id"
        )
    return stored


def _store(request: HttpRequest, key: ApiKey, response_id: str) -> HttpResponse:
    try:
        asked = msgspec.json.decode(request.body, type=_Store)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"not a stored response: {exc}") from exc
    if len(response_id) > _MAX_ID or asked.response.get("id") != response_id:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "the response's id is not the one in the path", param="id")
    keep = datetime.timedelta(seconds=settings.RESPONSES_KEEP_S)
    try:
        with transaction.atomic():
            StoredResponse.objects.create(
                id=response_id,
                api_key=key,
                response=asked.response,
                input_items=[_with_id(item) for item in asked.input_items],
                conversation=asked.conversation,
                expires_at=timezone.now() + keep,
            )
    except IntegrityError as exc:
        raise OpenAIError(HTTPStatus.CONFLICT, f"a response {response_id} is stored already") from exc
    return JsonResponse({"id": response_id, "stored": True})


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id (a client's own items may have none)."""
    return item if item.get("id") else {"id": "msg_" + secrets.token_hex(16), **item}


def _retrieve(request: HttpRequest, key: ApiKey, response_id: str) -> HttpResponse:
    return JsonResponse(_own(key, response_id).response)


def _delete(request: HttpRequest, key: ApiKey, response_id: str) -> HttpResponse:
    _own(key, response_id).delete()
    return JsonResponse({"id": response_id, "object": "response", "deleted": True})


def _input_items(request: HttpRequest, key: ApiKey, response_id: str) -> HttpResponse:
    """OpenAI's list of a response's input items: ``order`` (desc, the default, or asc), ``limit`` (1-100,
    20), ``after`` (an item id)."""
    items = list(_own(key, response_id).input_items)
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "order is asc or desc", param="order")
    if order == "desc":
        items.reverse()
    limit = page_limit(request)
    if after := request.GET.get("after"):
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"after={after[:_MAX_ID]!r} names no item of it", param="after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return JsonResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None,
            "has_more": len(items) > limit,
        }
    )


def _conversation(request: HttpRequest, key: ApiKey, response_id: str) -> HttpResponse:
    return JsonResponse({"items": _own(key, response_id).conversation})


response = openai_view({"GET": _retrieve, "DELETE": _delete})
store = openai_view({"POST": _store})
input_items = openai_view({"GET": _input_items})
conversation = openai_view({"GET": _conversation})

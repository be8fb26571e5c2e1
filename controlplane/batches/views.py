"""OpenAI's ``/v1/files`` and ``/v1/batches``, in OpenAI's shapes, for the holder of an API key.

The gateway passes these requests on (frontend_gateway/control_plane_proxy.py), so the official client's
``files.create``, ``batches.create`` and ``batches.retrieve`` work against the gateway's base URL. The key
is checked here against the database (a revoked, expired or suspended key is a 401), and each key sees
only its own files and batches: another key's id is a 404, as if it did not exist.
"""

import datetime
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import ProtectedError, QuerySet
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from controlplane.apikeys.models import ApiKey
from controlplane.batches import storage, validation
from controlplane.batches.models import Batch, StoredFile
from controlplane.celery_app import send_batch_slice
from runtime.fleet_contract.api_keys import key_hash

View = Callable[..., HttpResponse]

_PURPOSES = ("batch",)
_WINDOWS = {"24h": datetime.timedelta(hours=24)}
_MAX_METADATA = 16


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
            return handler(request, _key(request), **kwargs)
        except OpenAIError as exc:
            return exc.response()

    return view


def _key(request: HttpRequest) -> ApiKey:
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


# --- files -----------------------------------------------------------------------------------------


def file_object(file: StoredFile) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": int(file.created_at.timestamp()),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def _upload(request: HttpRequest, key: ApiKey) -> HttpResponse:
    purpose = request.POST.get("purpose")
    if purpose not in _PURPOSES:
        raise OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"purpose {purpose!r} is not one this server takes; it keeps files for batches: purpose=batch",
            param="purpose",
        )
    uploaded = request.FILES.get("file")
    if uploaded is None:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "no file: send it as the multipart field 'file'", param="file")
    file = StoredFile(api_key=key, purpose=purpose, filename=(uploaded.name or "upload.jsonl")[:255])
    file.bytes = storage.save(file.id, uploaded.chunks())
    file.save()
    return JsonResponse(file_object(file))


def _list_files(request: HttpRequest, key: ApiKey) -> HttpResponse:
    files = StoredFile.objects.filter(api_key=key)
    if purpose := request.GET.get("purpose"):
        files = files.filter(purpose=purpose)
    return JsonResponse(_page(request, files, file_object))


def _own_file(key: ApiKey, file_id: str) -> StoredFile:
    file = StoredFile.objects.filter(api_key=key, pk=file_id).first()
    if file is None:
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"No such File object: {file_id[:100]}", param="id")
    return file


def _retrieve_file(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponse:
    return JsonResponse(file_object(_own_file(key, file_id)))


def _delete_file(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponse:
    file = _own_file(key, file_id)
    try:
        file.delete()
    except ProtectedError as exc:
        users = ", ".join(sorted(batch.pk for batch in exc.protected_objects))
        raise OpenAIError(
            HTTPStatus.CONFLICT, f"{file_id} is the input file of {users}; delete it once they are over"
        ) from exc
    storage.delete(file_id)
    return JsonResponse({"id": file_id, "object": "file", "deleted": True})


def _file_content(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponse:
    file = _own_file(key, file_id)
    try:
        content = storage.path_of(file.id).open("rb")
    except FileNotFoundError as exc:
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"the content of {file_id} is gone from the server") from exc
    return FileResponse(content, content_type="application/jsonl", as_attachment=True, filename=file.filename)


# --- batches ---------------------------------------------------------------------------------------


class _Create(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def batch_object(batch: Batch) -> dict[str, Any]:
    def at(value: datetime.datetime | None) -> int | None:
        return None if value is None else int(value.timestamp())

    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None if not batch.errors else {"object": "list", "data": batch.errors},
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": at(batch.created_at),
        "in_progress_at": at(batch.in_progress_at),
        "expires_at": at(batch.expires_at),
        "finalizing_at": at(batch.finalizing_at),
        "completed_at": at(batch.completed_at),
        "failed_at": at(batch.failed_at),
        "expired_at": at(batch.expired_at),
        "cancelling_at": at(batch.cancelling_at),
        "cancelled_at": at(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata,
    }


def _create_batch(request: HttpRequest, key: ApiKey) -> HttpResponse:
    try:
        asked = msgspec.json.decode(request.body, type=_Create)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"not a batch request: {exc}") from exc
    if asked.endpoint not in validation.ENDPOINTS:
        raise OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"endpoint {asked.endpoint[:100]!r} cannot be batched; use one of {', '.join(validation.ENDPOINTS)}",
            param="endpoint",
        )
    window = _WINDOWS.get(asked.completion_window)
    if window is None:
        raise OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"completion_window {asked.completion_window[:20]!r}: only 24h is supported",
            param="completion_window",
        )
    if asked.metadata is not None and (
        len(asked.metadata) > _MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in asked.metadata.items())
    ):
        raise OpenAIError(
            HTTPStatus.BAD_REQUEST,
            "metadata holds at most 16 pairs, keys of 64 characters, values of 512",
            param="metadata",
        )
    file = StoredFile.objects.filter(api_key=key, pk=asked.input_file_id).first()
    if file is None:
        raise OpenAIError(
            HTTPStatus.NOT_FOUND, f"No such File object: {asked.input_file_id[:100]}", param="input_file_id"
        )
    if file.purpose != "batch":
        raise OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"{file.id} was uploaded with purpose {file.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    if not settings.BATCH_GATEWAY_URL:
        raise OpenAIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            "this control plane runs no batches: it has no gateway to send them to (FLOTILLA_GATEWAY_URL)",
        )
    batch = Batch.objects.create(
        api_key=key,
        endpoint=asked.endpoint,
        input_file=file,
        completion_window=asked.completion_window,
        metadata=asked.metadata,
        expires_at=timezone.now() + window,
    )
    transaction.on_commit(lambda: send_batch_slice(batch.id), robust=True)
    return JsonResponse(batch_object(batch))


def _own_batch(key: ApiKey, batch_id: str) -> Batch:
    batch = Batch.objects.filter(api_key=key, pk=batch_id).first()
    if batch is None:
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"No such Batch object: {batch_id[:100]}", param="id")
    return batch


def _list_batches(request: HttpRequest, key: ApiKey) -> HttpResponse:
    return JsonResponse(_page(request, Batch.objects.filter(api_key=key), batch_object))


def _retrieve_batch(request: HttpRequest, key: ApiKey, batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(_own_batch(key, batch_id)))


def _cancel_batch(request: HttpRequest, key: ApiKey, batch_id: str) -> HttpResponse:
    batch = _own_batch(key, batch_id)
    cancellable = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)
    if Batch.objects.filter(pk=batch.pk, status__in=cancellable).update(
        status=Batch.Status.CANCELLING, cancelling_at=timezone.now()
    ):
        # A runner that holds it stops sending within a second; one that does not is started to end it.
        transaction.on_commit(lambda: send_batch_slice(batch.id), robust=True)
    else:
        batch.refresh_from_db()
        if batch.status not in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
            raise OpenAIError(
                HTTPStatus.CONFLICT, f"{batch_id} is {batch.status}: only a batch in progress can be cancelled"
            )
    batch.refresh_from_db()
    return JsonResponse(batch_object(batch))


def _page(request: HttpRequest, rows: "QuerySet[Any]", shape: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """One page of ``rows`` (newest first) as OpenAI lists them: ``limit`` (1-100, default 20) rows after
    the row ``after``."""
    try:
        limit = int(request.GET.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "limit is a whole number from 1 to 100", param="limit")
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


files = openai_view({"GET": _list_files, "POST": _upload})
file = openai_view({"GET": _retrieve_file, "DELETE": _delete_file})
file_content = openai_view({"GET": _file_content})
batches = openai_view({"GET": _list_batches, "POST": _create_batch})
batch = openai_view({"GET": _retrieve_batch})
cancel = openai_view({"POST": _cancel_batch})

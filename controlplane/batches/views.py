"""OpenAI's ``/v1/files`` and ``/v1/batches``, in OpenAI's shapes, for the holder of an API key.

The gateway passes these requests on (frontend_gateway/control_plane_proxy.py), so the official client's
``files.create``, ``batches.create`` and ``batches.retrieve`` work against the gateway's base URL. The key
is checked here against the database (a revoked, expired or suspended key is a 401), and each key sees
only its own files and batches: another key's id is a 404, as if it did not exist.
"""

import datetime
from http import HTTPStatus
from typing import Any

import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import ProtectedError, Sum
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from controlplane.apikeys.models import ApiKey
from controlplane.batches import storage, validation
from controlplane.batches.models import Batch, StoredFile
from controlplane.celery_app import send_batch_slice
from controlplane.openai_views import OpenAIError, openai_view, page

_PURPOSES = ("batch",)
_WINDOWS = {"24h": datetime.timedelta(hours=24)}
_MAX_METADATA = 16


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
    file = _reserve(key, purpose, (uploaded.name or "upload.jsonl")[:255], uploaded.size or 0)
    try:
        file.bytes = storage.save(file.id, uploaded.chunks())
    except BaseException:
        file.delete()  # the room it held is the key's again
        raise
    file.save(update_fields=["bytes"])
    return JsonResponse(file_object(file))


@transaction.atomic
def _reserve(key: ApiKey, purpose: str, filename: str, size: int) -> StoredFile:
    """The row of a file of ``size`` bytes the key may keep; a 413 when its files (uploads and batches' outputs)
    would hold more than ``FLOTILLA_FILES_MAX_BYTES_PER_KEY`` with it. The row is written before the file, in
    a transaction that holds the key's row, so two uploads at once cannot both take the last room."""
    ApiKey.objects.select_for_update().filter(pk=key.pk).exists()
    held = StoredFile.objects.filter(api_key=key).aggregate(total=Sum("bytes"))["total"] or 0
    limit = settings.FILES_MAX_BYTES_PER_KEY
    if held + size > limit:
        raise OpenAIError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"this key's files would hold {held + size:,} bytes with this one, over its limit of {limit:,} "
            f"(it holds {held:,}): delete files it no longer needs (DELETE /v1/files/{{id}})",
            code="storage_limit_exceeded",
            param="file",
        )
    return StoredFile.objects.create(api_key=key, purpose=purpose, filename=filename, bytes=size)


def _list_files(request: HttpRequest, key: ApiKey) -> HttpResponse:
    files = StoredFile.objects.filter(api_key=key)
    if purpose := request.GET.get("purpose"):
        files = files.filter(purpose=purpose)
    return JsonResponse(page(request, files, file_object))


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
    return JsonResponse(page(request, Batch.objects.filter(api_key=key), batch_object))


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


files = openai_view({"GET": _list_files, "POST": _upload})
file = openai_view({"GET": _retrieve_file, "DELETE": _delete_file})
file_content = openai_view({"GET": _file_content})
batches = openai_view({"GET": _list_batches, "POST": _create_batch})
batch = openai_view({"GET": _retrieve_batch})
cancel = openai_view({"POST": _cancel_batch})

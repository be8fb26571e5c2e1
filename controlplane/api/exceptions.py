"""One place that turns the control plane's errors into DRF responses (field errors keep DRF's shape)."""

from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.errors import Conflict, ControlPlaneError, Forbidden, Invalid, InvalidDocument, Missing


class ConflictError(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "the record is not in a state that allows this"
    default_code = "conflict"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, after translating the control plane's errors and Django's validation errors.

    ``Invalid`` becomes a 400 whose body names the field (``{"replicas": ["..."]}``), like a serializer's.
    """
    translated = _translate(exc)
    return drf_exception_handler(translated, context)


def _translate(exc: Exception) -> Exception:
    if isinstance(exc, InvalidDocument):
        fields: dict[str, list[str]] = {}
        for path, message in exc.problems:
            fields.setdefault(path or "non_field_errors", []).append(message)
        return exceptions.ValidationError(fields)
    if isinstance(exc, Invalid):
        detail: Any = {exc.field: [exc.message]} if exc.field else {"non_field_errors": [exc.message]}
        return exceptions.ValidationError(detail)
    if isinstance(exc, Conflict):
        return ConflictError(str(exc))
    if isinstance(exc, Forbidden):
        return exceptions.PermissionDenied(str(exc))
    if isinstance(exc, Missing):
        return exceptions.NotFound(str(exc))
    if isinstance(exc, ControlPlaneError):
        return exceptions.ValidationError({"non_field_errors": [str(exc)]})
    if isinstance(exc, ObjectDoesNotExist):
        # An action reads its row again under a lock: a row deleted between the view's lookup and that read
        # (a DELETE racing a PATCH) is gone, not a server error.
        return exceptions.NotFound(f"{exc} (deleted meanwhile)")
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "error_dict"):
            return exceptions.ValidationError(exc.message_dict)
        return exceptions.ValidationError({"non_field_errors": exc.messages})
    return exc

"""Serializer fields for free-form JSON that still cannot carry what would break storage or memory."""

import json
import re
from typing import Any

from rest_framework import serializers

# Label keys as Kubernetes writes them: "gpu", "zone", "example.com/tier".
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")


class JsonObjectField(serializers.JSONField):
    """A JSON object of at most ``max_bytes`` (as JSON) and ``max_depth`` levels, with no NUL characters.

    PostgreSQL refuses NUL in JSON text, so it would otherwise surface as a 500 there.
    """

    default_error_messages = {  # noqa: RUF012 - DRF merges this class attribute
        "not_object": "Expected a JSON object.",
        "too_large": "The object is over {max_bytes} bytes as JSON.",
        "too_deep": "The object is nested more than {max_depth} levels deep.",
        "nul": "Strings may not contain NUL characters.",
    }

    def __init__(self, *, max_bytes: int = 16 * 1024, max_depth: int = 8, **kwargs: Any) -> None:
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        if not isinstance(value, dict):
            self.fail("not_object")
        _check_nested(value, self.max_depth, self)
        if len(json.dumps(value)) > self.max_bytes:
            self.fail("too_large", max_bytes=self.max_bytes)
        return value


class LabelsField(serializers.DictField):
    """``{"key": "value"}`` labels of a node: up to 64, keys like Kubernetes label keys, values ≤ 255 chars."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.CharField(max_length=255, allow_blank=True), **kwargs)

    def to_internal_value(self, data: Any) -> dict[str, str]:
        value: dict[str, str] = super().to_internal_value(data)
        if len(value) > 64:
            raise serializers.ValidationError("At most 64 labels.")
        for key in value:
            if not _LABEL_KEY.match(key):
                raise serializers.ValidationError(f"{key[:70]!r} is not a label key (letters, digits, . _ / -).")
        return value


def _check_nested(value: Any, depth_left: int, field: JsonObjectField) -> None:
    if depth_left < 0:
        field.fail("too_deep", max_depth=field.max_depth)
    if isinstance(value, str):
        if "\x00" in value:
            field.fail("nul")
    elif isinstance(value, dict):
        for key, item in value.items():
            if "\x00" in key:
                field.fail("nul")
            _check_nested(item, depth_left - 1, field)
    elif isinstance(value, list):
        for item in value:
            _check_nested(item, depth_left - 1, field)

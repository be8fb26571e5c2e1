"""The OpenAPI schema documents the error answers the API really gives: every operation is called without a
token, on a record that does not exist, and with a body of the wrong shape, and each answer's status must be
one its schema lists (and none a 5xx but a documented 503)."""

import re
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db
METHODS = ("get", "post", "patch", "put", "delete")


def operations() -> list[tuple[str, str, frozenset[str]]]:
    schema: dict[str, Any] = SchemaGenerator().get_schema(request=None, public=True)
    return [
        (path, method, frozenset(operation["responses"]))
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if method in METHODS
    ]


OPERATIONS = operations()


def url(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "999999", path)


def call(client: APIClient, method: str, path: str, body: Any = None) -> int:
    response = getattr(client, method)(url(path), body, format="json") if body is not None else None
    if response is None:
        response = getattr(client, method)(url(path))
    return int(response.status_code)


@pytest.mark.parametrize(("path", "method", "documented"), OPERATIONS, ids=[f"{m} {p}" for p, m, _ in OPERATIONS])
def test_every_answer_is_documented(admin: APIClient, path: str, method: str, documented: frozenset[str]) -> None:
    answers = {
        "without a token": call(APIClient(), method, path),
        "on a record that does not exist": call(admin, method, path),
    }
    if method in ("post", "patch", "put"):
        answers["with a body that is no object"] = call(admin, method, path, body=["not", "an", "object"])
        answers["with fields of the wrong type"] = call(admin, method, path, body={"name": 7, "replicas": "x"})
    undocumented = {why: status for why, status in answers.items() if str(status) not in documented}
    assert not undocumented, f"{method.upper()} {path} documents {sorted(documented)}"
    # A 5xx only where the operation says it (the health check's 503 when Redis or the reconciler is down).
    assert all(status < 500 or status == 503 for status in answers.values()), answers

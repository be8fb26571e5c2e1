"""``/v1/files`` bounds what one API key keeps (FLOTILLA_FILES_MAX_BYTES_PER_KEY): an upload past it is a 413 saying
what the key holds and what to do, nothing of it is kept, and deleting a file makes room again; another key is not
touched. (The whole Batch API, over a real fleet: tests/distributed/test_openai_control_plane.py.)"""

from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from controlplane.apikeys import actions as key_actions
from controlplane.batches import storage
from controlplane.batches.models import StoredFile
from tests.controlplane.factories import TEST_ACTOR, make_user

pytestmark = pytest.mark.django_db

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def upload(key: str, size: int) -> Any:
    content = (LINE * (size // len(LINE) + 1))[:size]
    file = SimpleUploadedFile("input.jsonl", content, content_type="application/jsonl")
    return Client().post("/v1/files", {"purpose": "batch", "file": file}, HTTP_AUTHORIZATION=f"Bearer {key}")


def test_an_upload_past_the_keys_room_is_a_413_and_a_deleted_file_makes_room(settings: Any) -> None:
    settings.FILES_MAX_BYTES_PER_KEY = 3000
    owner = make_user("owen")
    _, key = key_actions.create_key(TEST_ACTOR, owner, "batches")
    _, other = key_actions.create_key(TEST_ACTOR, owner, "other")
    first = upload(key, 2000)
    assert first.status_code == 200 and first.json()["bytes"] == 2000

    refused = upload(key, 1500)
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert error["code"] == "storage_limit_exceeded" and error["param"] == "file"
    assert error["message"] == (
        "this key's files would hold 3,500 bytes with this one, over its limit of 3,000 (it holds 2,000): "
        "delete files it no longer needs (DELETE /v1/files/{id})"
    )
    assert StoredFile.objects.count() == 1  # nothing of the refused upload is kept
    assert upload(other, 1500).status_code == 200  # another key's room is its own

    file_id = first.json()["id"]
    deleted = Client().delete(f"/v1/files/{file_id}", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert deleted.status_code == 200 and not storage.path_of(file_id).exists()
    assert upload(key, 1500).status_code == 200

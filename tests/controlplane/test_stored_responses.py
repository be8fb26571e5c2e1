"""controlplane/stored_responses/: a response is stored once for its key (a second store of its id is a 409,
so no key overwrites another's), its input items are listed as OpenAI lists them (order, limit, after), and a
response past FLOTILLA_RESPONSES_KEEP_S is gone for reads at once and deleted by the hourly task."""

import datetime
import json
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.apikeys import actions
from controlplane.audit.records import Actor
from controlplane.stored_responses.models import StoredResponse
from controlplane.stored_responses.tasks import expire_responses
from tests.controlplane.factories import make_user

pytestmark = pytest.mark.django_db


def keyed() -> tuple[Client, str]:
    owner = make_user("ada")
    _, secret = actions.create_key(Actor.person(owner), owner, "chat")
    return Client(headers={"Authorization": f"Bearer {secret}"}), secret


def store(client: Client, response_id: str, items: int = 3) -> Any:
    body = {
        "response": {"id": response_id, "object": "response", "output": []},
        "input_items": [{"type": "message", "role": "user", "content": f"turn {n}"} for n in range(items)],
        "conversation": [],
    }
    return client.post(f"/v1/responses/{response_id}/store", json.dumps(body), content_type="application/json")


def test_a_response_is_stored_once_and_its_input_items_listed_as_openai_lists_them() -> None:
    client, _ = keyed()
    assert store(client, "resp_a").status_code == 200
    again = store(client, "resp_a")
    assert again.status_code == 409 and "stored already" in again.json()["error"]["message"]
    assert store(client, "resp_other").status_code == 200  # another id: fine

    newest_first = client.get("/v1/responses/resp_a/input_items").json()
    assert [item["content"] for item in newest_first["data"]] == ["turn 2", "turn 1", "turn 0"]
    assert all(item["id"].startswith("msg_") for item in newest_first["data"])
    page = client.get("/v1/responses/resp_a/input_items", {"order": "asc", "limit": 1}).json()
    assert ([i["content"] for i in page["data"]], page["has_more"]) == (["turn 0"], True)
    rest = client.get("/v1/responses/resp_a/input_items", {"order": "asc", "after": page["last_id"]}).json()
    assert [i["content"] for i in rest["data"]] == ["turn 1", "turn 2"]
    assert client.get("/v1/responses/resp_a/input_items", {"limit": 0}).status_code == 400
    mismatched = client.post(
        "/v1/responses/resp_b/store",
        json.dumps({"response": {"id": "resp_c"}, "input_items": [], "conversation": []}),
        content_type="application/json",
    )
    assert mismatched.status_code == 400


def test_a_response_past_its_keeping_time_is_gone_and_then_deleted() -> None:
    client, _ = keyed()
    store(client, "resp_old")
    store(client, "resp_new")
    StoredResponse.objects.filter(pk="resp_old").update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    assert client.get("/v1/responses/resp_old").status_code == 404
    assert client.get("/v1/responses/resp_new").json()["id"] == "resp_new"
    assert expire_responses() == 1
    assert list(StoredResponse.objects.values_list("pk", flat=True)) == ["resp_new"]


def test_without_a_working_key_nothing_is_stored_or_read() -> None:
    assert Client().get("/v1/responses/resp_a").status_code == 401
    unknown = Client(headers={"Authorization": "Bearer sk-flt-unknown"})
    assert store(unknown, "resp_a").status_code == 401
    assert StoredResponse.objects.count() == 0

"""frontend_gateway/control_plane_proxy.py: /v1/files and /v1/batches are the control plane's; a gateway
without one says how to give it one, and one whose control plane is down says so with a 503 naming it
(tests/distributed/test_batch_api.py runs the real pass-through, and the 503 of a killed control plane)."""

import msgspec
import pytest

from engines.echo import EchoFullEngine
from frontend_gateway.access.api_keys import KeyTable
from frontend_gateway.control_plane_proxy import ControlPlaneProxy, handles
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TextModel
from runtime.fleet_contract.api_keys import new_key
from tests.frontend_gateway.asgi import Client, call
from tests.frontend_gateway.asgi import scope as asgi_scope
from tests.frontend_gateway.test_api_keys import SECRET, published, record
from tests.servers import free_port


def error_of(sent: list[dict[str, object]]) -> tuple[int, dict[str, object]]:
    status = sent[0]["status"]
    assert isinstance(status, int)
    return status, msgspec.json.decode(sent[1]["body"])["error"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "passed_on"),
    [
        ("/v1/files", True),
        ("/v1/files/file-1/content", True),
        ("/v1/batches/batch_1/cancel", True),
        ("/v1/responses/resp_1", True),
        ("/v1/responses/resp_1/input_items", True),
        ("/v1/responses", False),
        ("/v1/filesystem", False),
        ("/v1/batch", False),
        ("/files", False),
    ],
)
def test_only_the_file_batch_and_stored_response_paths_are_passed_on(path: str, passed_on: bool) -> None:
    assert handles(path) is passed_on


async def test_without_a_control_plane_the_batch_api_is_a_404_saying_how_to_get_one() -> None:
    client = await call(GatewayApp(ModelRegistry()), "/v1/batches", {"input_file_id": "file-1"})
    status, error = error_of(client.sent)
    assert status == 404
    assert "--control-plane URL (FLOTILLA_CONTROL_PLANE)" in str(error["message"])


async def test_a_control_plane_that_does_not_answer_is_a_503_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = ControlPlaneProxy(url)
    try:
        client = await call(GatewayApp(ModelRegistry(), control_plane=proxy), "/v1/batches", {"input_file_id": "f"})
    finally:
        await proxy.aclose()
    status, error = error_of(client.sent)
    assert (status, error["code"]) == (503, "control_plane_unavailable")
    assert f"it does not answer at {url} (ConnectError" in str(error["message"])


async def responses_call(app: GatewayApp, key: str, body: dict[str, object]) -> Client:
    client = Client(msgspec.json.encode(body))
    scope = {**asgi_scope("/v1/responses"), "headers": [(b"content-type", b"application/json"), *bearer(key)]}
    await app(scope, client.receive, client.send)
    return client


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


async def test_a_response_whose_control_plane_is_down_is_answered_unstored_and_a_continuation_is_a_503() -> None:
    """Storing is on the answer's path but never fails it: the answer says ``store: false``; a request that
    needs a stored conversation cannot be answered without it, and says why."""
    table = KeyTable(SECRET)
    key = new_key()
    table.apply(published(key, record()))
    registry = ModelRegistry()
    registry.add(TextModel("echo", EchoFullEngine(0.0)))
    proxy = ControlPlaneProxy(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    app = GatewayApp(registry, api_keys=table, control_plane=proxy)
    try:
        answered = await responses_call(app, key, {"model": "echo", "input": "hi"})
        continued = await responses_call(app, key, {"model": "echo", "input": "hi", "previous_response_id": "resp_1"})
    finally:
        await proxy.aclose()
    body = msgspec.json.decode(answered.content)
    assert (answered.status, body["store"], body["output"][0]["content"][0]["text"]) == (200, False, "hi")
    status, error = error_of(continued.sent)
    assert (status, error["code"]) == (503, "control_plane_unavailable")
    assert "previous_response_id needs the stored responses" in str(error["message"])

"""What the live-update tests share: the channel layer on a real Redis, logged-in sockets, and rows."""

from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.apps import apps
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.deployments import upkeep
from controlplane.deployments.models import Instance, Pipeline
from controlplane.live.layer import channel_layers
from controlplane.live.publisher import Publisher
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, make_user
from tests.infra import RedisServer

ORIGIN = (b"origin", b"http://localhost")


@pytest.fixture
def live_layer(redis_server: RedisServer, settings: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[Publisher]:
    """The Redis channel layer on the test's own Redis, as FLOTILLA_REDIS_URL makes it; yields the
    process's publisher, flushed at the end so that no notice of this test reaches the next one."""
    monkeypatch.setenv("FLOTILLA_REDIS_URL", redis_server.url)
    settings.CHANNEL_LAYERS = channel_layers()  # type: ignore[attr-defined]  # resets Channels' layers
    publisher: Publisher = apps.get_app_config("live").publisher  # type: ignore[attr-defined]
    yield publisher
    publisher.flush(5.0)


def session_cookie(username: str, role: Role) -> bytes:
    """The session cookie of a new person with ``role``, logged in (sync: call it in a thread)."""
    user = make_user(username, role)
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


def communicator(path: str, cookie: bytes | None, origin: tuple[bytes, bytes] = ORIGIN) -> WebsocketCommunicator:
    from controlplane.asgi import application

    headers = [origin] + ([(b"cookie", cookie)] if cookie else [])
    return WebsocketCommunicator(application, path, headers=headers)


@dataclass
class TwoPipelines:
    a: Pipeline
    b: Pipeline
    a_instance: Instance
    b_instance: Instance


def two_placed_pipelines() -> TwoPipelines:
    """Pipelines "alpha" and "beta", one CPU replica each, placed on node gpu-a (sync)."""
    make_node("gpu-a")
    a, b = deploy("alpha"), deploy("beta")
    upkeep.place_pending_instances(TEST_ACTOR)
    return TwoPipelines(a, b, a.instances.get(), b.instances.get())


def element(html: str, element_id: str) -> str | None:
    """The HTML of the element ``element_id`` in ``html`` (its tags and text, attributes as parsed), or None."""
    finder = _ElementFinder(element_id)
    finder.feed(html)
    finder.close()
    return "".join(finder.parts) if finder.found else None


class _ElementFinder(HTMLParser):
    _VOID = frozenset({"br", "hr", "img", "input", "meta", "link", "col", "wbr", "source"})

    def __init__(self, element_id: str) -> None:
        super().__init__(convert_charrefs=True)
        self.element_id = element_id
        self.depth = 0  # > 0 inside the element
        self.found = False
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.depth == 0 and not self.found and dict(attrs).get("id") == self.element_id:
            self.found = True
            self.depth = 1
        elif self.depth > 0 and tag not in self._VOID:
            self.depth += 1
        if self.depth > 0:
            self.parts.append(self.get_starttag_text() or "")

    def handle_endtag(self, tag: str) -> None:
        if self.depth > 0:
            self.parts.append(f"</{tag}>")
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth > 0:
            self.parts.append(data)


CATCH_UP_S = 10.0  # generous on a busy machine; the wait ends as soon as the message arrives


async def caught_up(socket: WebsocketCommunicator) -> str:
    """The socket's first message: what its page shows, as it is when the socket joined its groups
    (``LiveConsumer.catch_up``). Tests read it first so that the messages after it are the changes."""
    return await socket.receive_from(timeout=CATCH_UP_S)


async def connected(path: str, role: Role = Role.OPERATOR, username: str = "alice") -> WebsocketCommunicator:
    """A socket on ``path`` for a logged-in person with ``role``, accepted and past its catch-up message."""
    cookie = await database_sync_to_async(session_cookie)(username, role)
    socket = communicator(path, cookie)
    accepted, _ = await socket.connect(timeout=CATCH_UP_S)
    assert accepted
    await caught_up(socket)
    return socket

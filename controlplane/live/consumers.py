"""The dashboard's websockets: push-only, for people who are logged in.

``/ws/fleet/`` (overview, nodes, models, pipelines) joins the ``fleet.<topic>`` groups, all of them or
those its ``?topics=`` names; ``/ws/pipelines/<pk>/`` joins ``pipeline.<pk>`` once the pipeline is found;
``/ws/instances/<pk>/`` joins its instance's pipeline's group and keeps what is about its instance.
Each socket receives only the groups it joined (controlplane/live/groups.py). A change notice makes the
socket render the row's partial, at most once per ``RENDER_WINDOW_S`` per element
(controlplane/live/debounce.py), with renders shared between the sockets of the process
(controlplane/live/rendering.py); HTML the bridge rendered is forwarded as it is.

Close codes: 4400 an unknown topic, 4401 not logged in, 4403 a role too low for what the socket hears,
4404 no such pipeline or instance (htmx's ws extension does not reconnect after these); 1011 when the channel layer
cannot be reached at connection (it does reconnect, with backoff).

A socket outlives the request that opened it, so it is authorised again as it goes on: every
``REAUTHORISE_S``, before a push when its last check is older than that, and before it rejoins its groups.
Its session is read again as Django reads it for a page (a logout or a password change ends it: 4401);
a person deactivated, or demoted below what the socket's groups need (the audit topic needs the audit
log's role), is closed with 4403. Read-only people watch like everyone else: the socket changes nothing, and a
message sent to it gets a short explanation (as an HTML comment, which htmx ignores) and no action. What it
pushes has the controls of the person's role: none for people who may not act (a demotion counts from the
socket's next check).
"""

import asyncio
import contextlib
import logging
from importlib import import_module
from types import SimpleNamespace
from typing import Any, get_args
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user

from controlplane.accounts.models import Role, User
from controlplane.dashboard.access import ACT_ROLE, AUDIT_ROLE
from controlplane.deployments.models import Instance, Pipeline
from controlplane.live.debounce import PendingRenders
from controlplane.live.groups import (
    AUDIT_TOPIC,
    FLEET_LIST,
    FLEET_TOPICS,
    Changed,
    Html,
    Kind,
    changed,
    fleet_group,
    pipeline_group,
)
from controlplane.live.publisher import describe, layer_address
from controlplane.live.rendering import SharedRenders

log = logging.getLogger(__name__)

BAD_REQUEST = 4400
NOT_LOGGED_IN = 4401
FORBIDDEN = 4403
NOT_FOUND = 4404
SERVER_ERROR = 1011
#: Changes of one element within this many seconds of its last render are rendered together.
RENDER_WINDOW_S = 0.25
#: Sockets join their groups again this often, well within the layer's group expiry
#: (controlplane/live/layer.py), so that a page left open for days keeps hearing.
GROUP_REFRESH_S = 600.0
#: A socket checks this often that its person may still hear what it hears (see above).
REAUTHORISE_S = 10.0
PUSH_ONLY = "<!-- this socket only sends updates; changes go through the page's buttons and forms -->"
_KINDS = frozenset(get_args(Kind))


class LiveConsumer(AsyncWebsocketConsumer):
    """A push-only socket for a logged-in person; ``groups_to_join`` says what it hears."""

    def __init__(self, *, renders: SharedRenders, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.renders = renders
        self.pending: PendingRenders[tuple[Kind, int]] = PendingRenders(RENDER_WINDOW_S)
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._authorised_at = 0.0
        self._closed = False
        self.can_act = False  # whether pushes carry the controls: the person's role, checked again as it goes

    async def groups_to_join(self) -> list[str] | None:
        """The groups this socket joins; None when it was closed instead (with its code)."""
        raise NotImplementedError

    def needed_role(self) -> Role:
        """The role that the groups this socket joined need (read-only: any person)."""
        return Role.READ_ONLY

    def catch_up(self) -> list[tuple[Kind, int]]:
        """What the socket renders once joined: the page's live sections as they are now, so that a change
        made between the page's render and the join, or while the socket was away, is not missed."""
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            # Accepted first, so that the browser sees the code (a refused handshake reads as 1006).
            await self.accept()
            await self.close(code=NOT_LOGGED_IN, reason="log in to watch the dashboard")
            return
        groups = await self.groups_to_join()
        if groups is None:
            return
        try:
            for group in groups:
                await self.channel_layer.group_add(group, self.channel_name)
        except Exception as exc:  # Redis's errors, OSError, timeouts
            log.warning(
                "live updates: cannot reach the channel layer at %s (%s)",
                layer_address(self.channel_layer),
                describe(exc),
            )
            await self.accept()
            await self.close(code=SERVER_ERROR, reason="live updates are unavailable; retrying")
            return
        self.groups = groups  # left again on disconnect
        self.can_act = isinstance(user, User) and user.has_role(ACT_ROLE)
        await self.accept()
        now = asyncio.get_running_loop().time()
        self._authorised_at = now
        for key in self.catch_up():
            self.pending.add(key, now)
        self._changed.set()
        self._tasks = [
            asyncio.create_task(self._render_forever()),
            asyncio.create_task(self._rejoin_forever()),
            asyncio.create_task(self._reauthorise_forever()),
        ]

    async def disconnect(self, code: int) -> None:
        for task in self._tasks:
            task.cancel()
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            # A send that raced the browser's leaving is no news; anything else is a bug to see.
            if isinstance(result, Exception):
                log.warning("live updates: a socket's task ended with %s", describe(result))

    async def dispatch(self, message: dict[str, Any]) -> None:
        # Channels closes stale database connections before every handler (a thread hop per message);
        # our handlers touch the database only through database_sync_to_async, which does it itself.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        await self.send(text_data=PUSH_ONLY)

    # -- messages from the channel layer ---------------------------------------------------------------

    async def live_changed(self, message: Changed) -> None:
        kind, row_id = message.get("kind"), message.get("id")
        if kind not in _KINDS or not isinstance(row_id, int):
            log.warning("live updates: a change notice of nothing known: %r", message)
            return
        self.pending.add((kind, row_id), asyncio.get_running_loop().time())
        self._changed.set()

    async def live_html(self, message: Html) -> None:
        if await self._may_push():
            await self.send(text_data=message["html"])

    # -- the socket's tasks ----------------------------------------------------------------------------

    async def _render_forever(self) -> None:
        """Render what is due, when it is due, until the socket closes."""
        loop = asyncio.get_running_loop()
        while True:
            due = self.pending.next_due()
            if due is None or due > loop.time():
                self._changed.clear()
                timeout = None if due is None else due - loop.time()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout)
                continue
            wanted = self.pending.take_due(loop.time())
            try:
                html = await self.renders.render(wanted, can_act=self.can_act)
            except Exception:
                log.exception("live updates: rendering %d change(s) failed", len(wanted))
                continue
            if html and await self._may_push():
                await self.send(text_data=html)

    async def _rejoin_forever(self) -> None:
        while True:
            await asyncio.sleep(GROUP_REFRESH_S)
            if not await self._authorised():
                return
            try:
                for group in self.groups:
                    await self.channel_layer.group_add(group, self.channel_name)
            except Exception as exc:
                log.warning("live updates: could not renew this socket's groups (%s)", describe(exc))

    async def _reauthorise_forever(self) -> None:
        while True:
            await asyncio.sleep(REAUTHORISE_S)
            if not await self._authorised():
                return

    # -- authorisation, again ---------------------------------------------------------------------------

    async def _may_push(self) -> bool:
        """Whether to send a push: not after closing, and only with a check no older than REAUTHORISE_S."""
        if self._closed:
            return False
        if asyncio.get_running_loop().time() - self._authorised_at < REAUTHORISE_S:
            return True
        return await self._authorised()

    async def _authorised(self) -> bool:
        """Check the person again; close the socket (4401, 4403) and return False when they may no longer watch."""
        if self._closed:
            return False
        refusal = await database_sync_to_async(self._refusal)()
        if refusal is None:
            self._authorised_at = asyncio.get_running_loop().time()
            return True
        self._closed = True
        code, reason = refusal
        log.info("live updates: closing a socket of %s: %s", self.scope.get("user"), reason)
        await self.close(code=code, reason=reason)
        return False

    def _refusal(self) -> tuple[int, str] | None:
        """Why this socket's person may no longer watch (a close code and reason), or None."""
        person_id = getattr(self.scope.get("user"), "pk", None)
        if not User.objects.filter(pk=person_id, is_active=True).exists():
            return FORBIDDEN, "your account has been deactivated"
        session_key = getattr(self.scope.get("session"), "session_key", None)
        # The session as it is now, read as a page's request reads it: gone (logout), or its password hash
        # no longer the person's (a password change), or the person inactive, and it is no one's.
        session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user = get_user(SimpleNamespace(session=session))  # type: ignore[arg-type]
        if not isinstance(user, User) or user.pk != person_id:
            return NOT_LOGGED_IN, "your session has ended; log in again"
        needed = self.needed_role()
        if not user.has_role(needed):
            return FORBIDDEN, f"this page's updates need the {needed.label} role"
        self.scope["user"] = user
        self.can_act = user.has_role(ACT_ROLE)
        return None


class FleetConsumer(LiveConsumer):
    """``/ws/fleet/``: nodes, pipelines' rows, downloads and audit entries; ``/ws/fleet/?topics=nodes,audit``:
    only those (a page that shows no downloads need not hear of them)."""

    async def groups_to_join(self) -> list[str] | None:
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        wanted = [topic.strip() for text in query.get("topics", []) for topic in text.split(",") if topic.strip()]
        unknown = sorted(set(wanted) - set(FLEET_TOPICS))
        if unknown:
            await self.accept()
            reason = f"topics: {', '.join(unknown)} unknown; choose from {', '.join(FLEET_TOPICS)}"
            await self.close(code=BAD_REQUEST, reason=reason)
            return None
        topics = [topic for topic in FLEET_TOPICS if not wanted or topic in wanted]
        if AUDIT_TOPIC in topics and not self._may_read_audit():
            if AUDIT_TOPIC in wanted:
                await self.accept()
                reason = f"topics: audit needs the {AUDIT_ROLE.label} role, as the audit log does"
                await self.close(code=FORBIDDEN, reason=reason)
                return None
            topics.remove(AUDIT_TOPIC)  # all topics by default: all that this person may read
        self.topics = topics
        return [fleet_group(topic) for topic in topics]

    def catch_up(self) -> list[tuple[Kind, int]]:
        # The lists of the topics joined; audit entries are news, not state (the page shows the latest).
        lists: dict[str, Kind] = {
            "nodes": "nodes",
            "pipelines": "pipelines",
            "downloads": "downloads",
            "models": "models",
        }
        return [(lists[topic], FLEET_LIST) for topic in self.topics if topic in lists]

    def needed_role(self) -> Role:
        return AUDIT_ROLE if AUDIT_TOPIC in self.topics else Role.READ_ONLY

    def _may_read_audit(self) -> bool:
        user = self.scope.get("user")
        return isinstance(user, User) and user.has_role(AUDIT_ROLE)


class PipelineConsumer(LiveConsumer):
    """``/ws/pipelines/<pk>/``: one pipeline's row, instances and their load."""

    async def groups_to_join(self) -> list[str] | None:
        pipeline_id = int(self.scope["url_route"]["kwargs"]["pk"])
        if not await database_sync_to_async(Pipeline.objects.filter(pk=pipeline_id).exists)():
            await self.accept()
            await self.close(code=NOT_FOUND, reason=f"there is no pipeline {pipeline_id}")
            return None
        self.pipeline_id = pipeline_id
        return [pipeline_group(pipeline_id)]

    def catch_up(self) -> list[tuple[Kind, int]]:
        return [("pipeline", self.pipeline_id), ("instances", self.pipeline_id)]


class InstanceConsumer(LiveConsumer):
    """``/ws/instances/<pk>/``: one instance's page. It joins its pipeline's group, and of what that group hears
    keeps only its instance: a change of the instance (or of its pipeline's list of instances, which a stop
    or a new row changes) renders the page's state, placement, timeline and restarts again, and of the load
    figures only the instance's are forwarded (others would have no element on the page)."""

    async def groups_to_join(self) -> list[str] | None:
        instance_id = int(self.scope["url_route"]["kwargs"]["pk"])
        pipeline_id = await database_sync_to_async(_pipeline_of)(instance_id)
        if pipeline_id is None:
            await self.accept()
            await self.close(code=NOT_FOUND, reason=f"there is no instance {instance_id}")
            return None
        self.instance_id = instance_id
        return [pipeline_group(pipeline_id)]

    def catch_up(self) -> list[tuple[Kind, int]]:
        return [("instance_detail", self.instance_id)]

    async def live_changed(self, message: Changed) -> None:
        kind, row_id = message.get("kind"), message.get("id")
        if kind == "instances" or (kind == "instance" and row_id == self.instance_id):
            await super().live_changed(changed("instance_detail", self.instance_id))

    async def live_html(self, message: Html) -> None:
        if message.get("instance") == self.instance_id:
            await super().live_html(message)


def _pipeline_of(instance_id: int) -> int | None:
    return Instance.objects.filter(pk=instance_id).values_list("pipeline_id", flat=True).first()

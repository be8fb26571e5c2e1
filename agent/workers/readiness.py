"""A worker is ready when the gateway can route to it: its instance and its model are registered in etcd.

That is the honest signal: a log line says the process got somewhere, a registration says that
gateways now see it. A worker registers ``flotilla/instances/<ns>/<comp>/<ep>/<id>`` (an InstanceEntry
carrying its hostname, pid and the labels the agent gave it) and then
``flotilla/models/<ns>/<comp>/<ep>/<id>`` (a ModelEntry); ``RegistrationWatch`` watches both prefixes
and matches a worker process by hostname, pid and labels. The pid tells one incarnation from the next:
a crashed worker's keys live on until its lease expires, and must not make its restart look ready.
"""

import asyncio
import logging
import socket
from collections.abc import Mapping

import msgspec

from runtime.cluster.discovery import INSTANCES_PREFIX, MODELS_PREFIX, Discovery, WatchEvent
from runtime.endpoint import InstanceEntry

log = logging.getLogger(__name__)


class _ModelOwner(msgspec.Struct):
    """The part of a ModelEntry that readiness needs (the card is not decoded)."""

    instance_id: int


_instance_decoder = msgspec.json.Decoder(InstanceEntry)
_model_decoder = msgspec.json.Decoder(_ModelOwner)


class RegistrationWatch:
    """What this host's workers have registered in etcd, kept current by two watches until ``close()``."""

    def __init__(self, discovery: Discovery, *, hostname: str | None = None) -> None:
        self._discovery = discovery
        self._hostname = hostname or socket.gethostname()
        self._instances: dict[str, InstanceEntry] = {}
        self._models: dict[str, int] = {}  # key -> instance id
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start watching (each watch re-lists after an etcd outage, so nothing is missed)."""
        self._tasks = [
            asyncio.create_task(self._watch(INSTANCES_PREFIX), name="watch worker instances"),
            asyncio.create_task(self._watch(MODELS_PREFIX), name="watch worker models"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _watch(self, prefix: str) -> None:
        async for event in self._discovery.watch_prefix(prefix):
            self._apply(prefix, event)
            async with self._changed:
                self._changed.notify_all()

    def _apply(self, prefix: str, event: WatchEvent) -> None:
        if event.value is None:
            self._instances.pop(event.key, None)
            self._models.pop(event.key, None)
            return
        try:
            if prefix == INSTANCES_PREFIX:
                entry = _instance_decoder.decode(event.value)
                if entry.hostname == self._hostname:
                    self._instances[event.key] = entry
            else:
                self._models[event.key] = _model_decoder.decode(event.value).instance_id
        except msgspec.DecodeError as exc:
            log.debug("ignoring %s: %s", event.key, exc)

    def find(self, pid: int, labels: Mapping[str, str]) -> int | None:
        """The endpoint instance id of this host's worker ``pid`` carrying ``labels``, once its model is
        registered too; None until then."""
        for entry in self._instances.values():
            if (
                entry.pid == pid
                and all(entry.labels.get(key) == value for key, value in labels.items())
                and entry.instance_id in self._models.values()
            ):
                return entry.instance_id
        return None

    async def wait_registered(self, pid: int, labels: Mapping[str, str]) -> int:
        """Wait until worker ``pid`` with ``labels`` is registered (instance and model); its endpoint instance id."""
        async with self._changed:
            while (found := self.find(pid, labels)) is None:
                await self._changed.wait()
            return found

"""Service discovery in etcd: who serves what, kept alive by one lease per process.

A process registers its keys (``flotilla/instances/...``, ``flotilla/models/...``) under its lease.
A clean exit revokes the lease, so its keys vanish at once; a crash stops the refreshes, so they vanish
when the lease expires. Readers list a prefix and watch it.

Both sides survive an etcd restart, even one that lost its data: the keepalive task grants a new lease
and puts the keys again, and a broken watch re-lists its prefix and reports what changed meanwhile.
"""

import asyncio
import logging
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import aetcd

from runtime.backoff import Backoff
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.server_wait import ServerWait
from runtime.errors import ConfigError, DiscoveryUnavailable
from runtime.rate_limited_log import RateLimitedLog
from runtime.settings import etcd_endpoints, parse_etcd_endpoint
from runtime.settings import lease_ttl as configured_lease_ttl

log = logging.getLogger(__name__)

INSTANCES_PREFIX = "flotilla/instances/"
MODELS_PREFIX = "flotilla/models/"
# Unary calls give up after this, so a hung etcd cannot stall the keepalive task for longer.
RPC_TIMEOUT = 5
# Retries wait 0.1 s, doubled after each failure up to 2 s (etcd restarts in about a second).
BACKOFF_MIN, BACKOFF_MAX = 0.1, 2.0
_CHANNEL_OPTIONS = {
    # gRPC waits up to two minutes between reconnection attempts by default; an etcd restart takes a second.
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": int(BACKOFF_MAX * 1000),
    # Pings notice an etcd that vanished without closing the connection (a frozen host, a dropped
    # network), which would otherwise leave a watch waiting forever. etcd refuses pings under 5 s apart.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.http2.ping_timeout_ms": 5_000,
}


def instance_key(address: EndpointAddress, instance_id: int) -> str:
    """``flotilla/instances/{ns}/{comp}/{ep}/{id:x}``: where an instance of an endpoint announces itself."""
    return f"{INSTANCES_PREFIX}{address.path}/{instance_id:x}"


def model_key(address: EndpointAddress, instance_id: int) -> str:
    """``flotilla/models/{ns}/{comp}/{ep}/{id:x}``: the model an instance of an endpoint serves."""
    return f"{MODELS_PREFIX}{address.path}/{instance_id:x}"


def adapter_model_key(address: EndpointAddress, instance_id: int, adapter: str) -> str:
    """``flotilla/models/{ns}/{comp}/{ep}/{id:x}/lora/{adapter}``: a LoRA adapter an instance serves beside its
    base model (runtime/lora.py), under the models' prefix so that gateways pool it as a model of its own."""
    return f"{model_key(address, instance_id)}/{ADAPTER_KEY_PART}/{adapter}"


#: The part of a model key between the instance and an adapter's name.
ADAPTER_KEY_PART = "lora"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A key under a watched prefix was put (``value`` is its new value) or deleted (``value`` is None)."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None = None


def _lease_gone(exc: Exception) -> bool:
    # etcd answers NOT_FOUND "requested lease not found"; aetcd keeps only the message.
    return "lease not found" in str(exc)


class Discovery:
    """One etcd client and one lease for this process. Create with ``await Discovery.connect()``."""

    def __init__(self, client: Any, endpoint: str, lease_id: int, ttl: int) -> None:
        self._client = client
        self._endpoint = endpoint
        self._lease_id = lease_id
        # A replacement lease while its keys are being put under it (see _renew_lease), else None.
        self._renewing: int | None = None
        self._ttl = ttl
        self._keys: dict[str, bytes] = {}
        # Held while the lease is refreshed or replaced, and around puts, so that no key is put under
        # a lease that is being replaced (it would vanish with it).
        self._lock = asyncio.Lock()
        self._closed = False
        self._bad_keys = RateLimitedLog(log, period_s=60.0)
        #: Whether etcd answered the last lease refresh (for /health).
        self.connected = True
        self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-lease-keepalive")

    @classmethod
    async def connect(
        cls, endpoints: list[str] | None = None, *, lease_ttl: float | None = None, wait: float | None = None
    ) -> "Discovery":
        """Connect to the first etcd endpoint that answers and grant this process's lease.

        ``endpoints`` default to ``$ETCD_ENDPOINTS`` (comma-separated), ``lease_ttl`` to
        ``$FLOTILLA_LEASE_TTL`` (seconds, rounded up: etcd counts whole seconds). While no endpoint
        answers, they are tried again with backoff, with a warning within a second that names them and
        how to start etcd, and a reminder every few seconds (runtime/cluster/server_wait.py).
        Raises ConfigError for a malformed endpoint or TTL, DiscoveryUnavailable if none answered
        within ``wait`` seconds (None: wait for ever; 0: one round of attempts).
        """
        if endpoints is None:
            endpoints = etcd_endpoints()
        targets = [parse_etcd_endpoint(endpoint) for endpoint in endpoints if endpoint.strip()]
        if not targets:
            raise ConfigError("no etcd endpoint given (set ETCD_ENDPOINTS)")
        if lease_ttl is None:
            lease_ttl = configured_lease_ttl()
        elif lease_ttl < 1:
            raise ConfigError(f"lease TTL {lease_ttl} is below the minimum 1 s")
        address = ", ".join(f"http://{host}:{port}" for host, port in targets)
        waiting = ServerWait("etcd", address, variable="ETCD_ENDPOINTS", error=DiscoveryUnavailable)
        if wait == 0:
            discovery = await cls._try_each(targets, math.ceil(lease_ttl), waiting)
            if discovery is None:
                raise DiscoveryUnavailable(waiting.message())
            return discovery
        return await waiting.wait(cls._keep_trying(targets, math.ceil(lease_ttl), waiting), limit=wait)

    @classmethod
    async def _keep_trying(cls, targets: list[tuple[str, int]], ttl: int, waiting: ServerWait) -> "Discovery":
        """Try every endpoint in turn, with backoff between rounds, until one grants a lease."""
        backoff = Backoff(BACKOFF_MIN, BACKOFF_MAX)
        while True:
            discovery = await cls._try_each(targets, ttl, waiting)
            if discovery is not None:
                return discovery
            await asyncio.sleep(backoff.next())

    @classmethod
    async def _try_each(cls, targets: list[tuple[str, int]], ttl: int, waiting: ServerWait) -> "Discovery | None":
        """One round: the first endpoint that grants a lease, or None (the failures are noted in ``waiting``)."""
        failures = []
        for host, port in targets:
            client = aetcd.Client(host=host, port=port, timeout=RPC_TIMEOUT, options=_CHANNEL_OPTIONS)
            try:
                lease = await client.lease(ttl)
            except aetcd.ClientError as exc:
                # gRPC's message ends with the cause ("...: Connection refused"): that is what helps.
                reason = str(exc).rpartition(": ")[2] or str(exc)
                failures.append(reason if len(targets) == 1 else f"{host}:{port}: {reason}")
                await client.close()
                continue
            except BaseException:
                await client.close()
                raise
            # etcd may grant more than asked (its minimum TTL): refresh by what it granted.
            log.debug("etcd at %s:%d granted lease %x (ttl %d s)", host, port, lease.id, lease.ttl)
            return cls(client, f"{host}:{port}", lease.id, lease.ttl)
        waiting.last_failure = "; ".join(failures)
        return None

    async def __aenter__(self) -> "Discovery":
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _unavailable(self, exc: Exception) -> DiscoveryUnavailable:
        return DiscoveryUnavailable(
            f"cannot reach etcd at {self._endpoint}: {exc}; start it with `make services` or set ETCD_ENDPOINTS"
        )

    async def register(self, key: str, value: bytes) -> None:
        """Put ``key`` under this process's lease; it is put again whenever the lease is replaced.

        Raises DiscoveryUnavailable if etcd cannot be reached (the key is then not registered).
        """
        async with self._lock:
            try:
                try:
                    await self._client.put(key.encode(), value, lease=self._lease_id)
                except aetcd.ClientError as exc:
                    if not _lease_gone(exc):
                        raise
                    # The keepalive task has not noticed yet that the lease is gone: replace it now.
                    await self._renew_lease()
                    await self._client.put(key.encode(), value, lease=self._lease_id)
            except aetcd.ClientError as exc:
                raise self._unavailable(exc) from exc
            self._keys[key] = value

    async def deregister(self, key: str) -> None:
        """Delete ``key`` and forget it. Raises DiscoveryUnavailable if etcd cannot be reached."""
        async with self._lock:
            # Forget it first: even if the delete fails, a lease renewal must not bring it back.
            self._keys.pop(key, None)
            try:
                await self._client.delete(key.encode())
            except aetcd.ClientError as exc:
                raise self._unavailable(exc) from exc

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` with its value. Raises DiscoveryUnavailable if etcd cannot be reached."""
        try:
            keys, _ = await self._list(prefix)
        except aetcd.ClientError as exc:
            raise self._unavailable(exc) from exc
        return keys

    async def _list(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """The keys under ``prefix`` and the store revision they were read at."""
        response = await self._client.get_prefix(prefix.encode())
        keys = {key: bytes(kv.value) for kv in response.kvs if (key := self._key_text(kv.key)) is not None}
        revision: int = response.header.revision
        return keys, revision

    def _key_text(self, raw: bytes) -> str | None:
        """``raw`` as text; None (logged, at most once a minute) for a key that is not UTF-8: no Flotilla
        process writes one, and a reader must skip it rather than stop (and stop every later change)."""
        try:
            return bytes(raw).decode()
        except UnicodeDecodeError:
            self._bad_keys.warning(f"etcd: skipped the key {bytes(raw)[:120]!r}: it is not UTF-8")
            return None

    async def watch_prefix(
        self, prefix: str, known: dict[str, bytes] | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Yield the keys under ``prefix`` as puts (a snapshot), then every change, until ``close()``.

        Never raises for etcd outages: a broken watch is re-established with backoff, the prefix is
        listed again, and the differences are yielded (deletes for keys that vanished, puts for new or
        changed ones) before watching resumes from that listing's revision. ``known`` (key -> value)
        is what the caller already has: the first snapshot is then only what differs from it.
        """
        known = dict(known or {})
        backoff = Backoff(BACKOFF_MIN, BACKOFF_MAX)
        failing = False
        while not self._closed:
            try:
                current, revision = await self._list(prefix)
                # Watching from the revision after the listing leaves neither a gap nor a repeat.
                watch = await self._client.watch_prefix(prefix.encode(), start_revision=revision + 1)
            except aetcd.ClientError as exc:
                # Warn once per outage, not at every retry.
                level = logging.DEBUG if failing else logging.WARNING
                log.log(level, "cannot watch %r in etcd at %s (%s); retrying", prefix, self._endpoint, exc)
                failing = True
                await asyncio.sleep(backoff.next())
                continue
            if failing:
                log.info("watching %r in etcd at %s again", prefix, self._endpoint)
                failing = False
            backoff.reset()
            for key in known.keys() - current.keys():
                yield WatchEvent("delete", key)
            for key, value in current.items():
                if known.get(key) != value:
                    yield WatchEvent("put", key, value)
            known = current
            try:
                async for event in watch:
                    changed = self._key_text(event.kv.key)
                    if changed is None:
                        continue
                    if event.kind == "PUT":
                        known[changed] = bytes(event.kv.value)
                        yield WatchEvent("put", changed, known[changed])
                    else:
                        known.pop(changed, None)
                        yield WatchEvent("delete", changed)
            except aetcd.ClientError as exc:
                log.warning("watch of %r in etcd at %s broke (%s); listing it again", prefix, self._endpoint, exc)
                failing = True
            finally:
                # After close() the client has already dropped every watch (and its watcher).
                if not self._closed:
                    await watch.cancel()
            if not self._closed:
                await asyncio.sleep(backoff.next())

    async def _renew_lease(self) -> None:
        """Grant a new lease and put every registered key under it. The caller holds ``_lock``."""
        lease = await self._client.lease(self._ttl)
        # Known to close() meanwhile: a close that cancels the puts revokes this lease too, or the keys
        # already put under it would outlive the process by a TTL.
        self._renewing = lease.id
        for key, value in self._keys.items():
            await self._client.put(key.encode(), value, lease=lease.id)
        # Switch only once every key is under the new lease: if a put failed, the next round starts over
        # (the half-used new lease expires on its own).
        self._lease_id = lease.id
        self._renewing = None
        log.info("granted etcd lease %x and registered %d keys again", lease.id, len(self._keys))

    async def _keep_alive(self) -> None:
        """Refresh the lease every ttl/3 until cancelled; replace it (and re-put the keys) if etcd lost it."""
        backoff = Backoff(BACKOFF_MIN, BACKOFF_MAX)
        failing = False
        while True:
            await asyncio.sleep(backoff.next() if failing else self._ttl / 3)
            try:
                async with self._lock:
                    reply = await self._client.refresh_lease(self._lease_id)
                    if reply is None:
                        raise aetcd.ClientError("the lease keepalive stream closed without an answer")
                    if reply.TTL <= 0:
                        log.warning(
                            "etcd lease %x is gone (expired, or etcd lost its data); replacing it", self._lease_id
                        )
                        await self._renew_lease()
            except aetcd.ClientError as exc:
                # Warn once per outage, not at every retry.
                log.log(logging.DEBUG if failing else logging.WARNING, "cannot refresh etcd lease: %s; retrying", exc)
                failing = True
                self.connected = False
                continue
            except Exception:
                log.exception("unexpected error refreshing etcd lease; retrying")
                failing = True
                self.connected = False
                continue
            self.connected = True
            if failing:
                log.info("etcd at %s answers again; lease %x is live", self._endpoint, self._lease_id)
                failing = False
                backoff.reset()

    async def close(self) -> None:
        """Revoke the lease (every registered key vanishes at once), stop the keepalive, close the client."""
        if self._closed:
            return
        self._closed = True
        self._keepalive.cancel()
        # wait() neither raises the task's CancelledError nor swallows a cancellation of close() itself.
        await asyncio.wait([self._keepalive])
        for lease_id in (self._lease_id, self._renewing):
            if lease_id is None:
                continue
            try:
                await self._client.revoke_lease(lease_id)
            except aetcd.ClientError as exc:
                log.warning("could not revoke etcd lease %x (%s); its keys expire in %d s", lease_id, exc, self._ttl)
        await self._client.close()

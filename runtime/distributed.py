"""The distributed runtime: one process's connections to etcd and NATS, and what it serves on them.

A worker gets a ``DistributedRuntime`` (``await DistributedRuntime.connect()`` or the ``@worker``
decorator), names endpoints with ``runtime.namespace("ns").component("backend").endpoint("generate")``
and serves them (runtime/endpoint.py). The gateway side calls instances through ``client()`` and
watches what workers register through ``discovery``. ``close()`` deregisters at once and drains NATS.
"""

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS

from runtime.cluster.addressing import EndpointAddress, new_instance_id
from runtime.cluster.discovery import Discovery
from runtime.cluster.nats_connection import close_nats, connect_nats
from runtime.cluster.object_store import fetch_tokenizer
from runtime.endpoint import Endpoint, Namespace, drain_grace_seconds, register_model
from runtime.errors import BackgroundTaskFailed, Fenced
from runtime.fleet_contract.fences import watch_own_fence
from runtime.fleet_contract.liveness import claim_while_asked
from runtime.fleet_contract.worker_keys import WorkerKey, take_from_environment
from runtime.loop_lag import watch_loop_lag
from runtime.rate_limited_log import RateLimitedLog
from runtime.request_plane import EndpointServer, RequestClient
from runtime.settings import (
    stream_gone_after_seconds,
    stream_heartbeat_seconds,
    stream_progress_deadline_seconds,
    stream_silence_seconds,
)
from runtime.supervision import Supervisor, TaskFactory

log = logging.getLogger(__name__)

# The worker API in one import: `from runtime.distributed import DistributedRuntime, register_model, worker`.
__all__ = ["DistributedRuntime", "Endpoint", "Namespace", "register_model", "worker"]


class DistributedRuntime:
    """Owns the NATS connection, the etcd lease and everything served through them."""

    def __init__(
        self, nc: NATS, discovery: Discovery, *, heartbeat_interval: float, worker_key: WorkerKey | None = None
    ) -> None:
        """``worker_key`` is the one the agent gave this worker (runtime/fleet_contract/worker_keys.py): with it,
        only fences signed under it stop the worker, and the worker signs its liveness with it."""
        self.nc = nc
        self.discovery = discovery
        self.instance_id = new_instance_id()
        self.worker_key = worker_key
        #: Fences put for this worker that it refused to obey (``refused_fences.count``: how many).
        self.refused_fences = RateLimitedLog(log, period_s=60.0)
        self.heartbeat_interval = heartbeat_interval
        self._servers: list[EndpointServer] = []
        self._supervisor = Supervisor(on_fatal=self.shutdown)
        self._client: RequestClient | None = None
        self._client_lock = asyncio.Lock()
        self._shutdown = asyncio.Event()
        self._fenced: str | None = None  # why the control plane fenced this worker, once it has
        #: How long the client's streams wait for an output (None: FLOTILLA_STREAM_PROGRESS_DEADLINE_S);
        #: read when the client starts.
        self.progress_deadline: float | None = None

    @classmethod
    async def connect(
        cls,
        *,
        nats_url: str | None = None,
        etcd_endpoints: list[str] | None = None,
        lease_ttl: float | None = None,
        wait: float | None = None,
    ) -> "DistributedRuntime":
        """Connect to NATS (``NATS_SERVER``) and etcd (``ETCD_ENDPOINTS``), waiting for them if need be.

        Both are tried at once, so that a missing etcd is reported even while NATS is missing too; each
        warns within a second which server does not answer and how to start it, and again every few
        seconds, until it connects. Raises ConfigError for a malformed setting, RequestPlaneUnavailable /
        DiscoveryUnavailable if a server did not answer within ``wait`` seconds (None: wait for ever).

        The worker key the agent set in ``FLOTILLA_WORKER_KEY`` is taken out of the environment here, so that
        no process this one starts inherits it.
        """
        heartbeat = stream_heartbeat_seconds()
        worker_key = take_from_environment()
        name = f"flotilla-{socket.gethostname()}-{os.getpid()}"
        connecting_nats = asyncio.create_task(connect_nats(nats_url, name=name, wait=wait), name="connect NATS")
        connecting_etcd = asyncio.create_task(
            Discovery.connect(etcd_endpoints, lease_ttl=lease_ttl, wait=wait), name="connect etcd"
        )
        both = (connecting_nats, connecting_etcd)
        try:
            nc, discovery = await asyncio.gather(*both)
        except BaseException:
            # One failed, or we were cancelled: stop the other and let go of what did connect.
            for task in both:
                task.cancel()
            await asyncio.wait(both)
            if not connecting_nats.cancelled() and connecting_nats.exception() is None:
                await connecting_nats.result().close()
            if not connecting_etcd.cancelled() and connecting_etcd.exception() is None:
                await connecting_etcd.result().close()
            raise
        runtime = cls(nc, discovery, heartbeat_interval=heartbeat, worker_key=worker_key)
        runtime.own(watch_loop_lag, name="event loop lag", restart=True)
        return runtime

    def namespace(self, name: str) -> "Namespace":
        return Namespace(self, name)

    def endpoint(self, address: EndpointAddress) -> "Endpoint":
        return Endpoint(self, address)

    async def client(self) -> RequestClient:
        """The request client for calling instances, started once on first use.

        Concurrent first callers wait for the one start-up rather than getting an unstarted client.
        """
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._client is None:
                silence = stream_silence_seconds()
                client = RequestClient(
                    self.nc,
                    silence_timeout=silence,
                    gone_after=stream_gone_after_seconds(),
                    progress_deadline=(
                        stream_progress_deadline_seconds() if self.progress_deadline is None else self.progress_deadline
                    ),
                )
                await client.start()
                self._client = client  # published only once started
        return self._client

    def shutdown(self) -> None:
        """Ask everything waiting on ``wait_for_shutdown`` to finish (safe from signal handlers)."""
        self._shutdown.set()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()

    def own(self, work: asyncio.Task[None] | TaskFactory, *, name: str = "", restart: bool = False) -> None:
        """Keep a background task, supervised, until ``close()`` cancels it.

        ``work`` is a running task, or a coroutine factory that starts one now. If the task ends with an
        exception, its traceback is logged; then with ``restart`` (a factory only) a fresh coroutine is
        started after a backoff, and without it the runtime shuts down with ``failure`` recorded, so
        that the process exits non-zero. Raises ValueError for ``restart`` with a task.
        """
        if isinstance(work, asyncio.Task):
            if restart:
                raise ValueError("a running task cannot be restarted: pass its coroutine factory")
            self._supervisor.own_task(work)
        else:
            self._supervisor.own(work, name=name or getattr(work, "__qualname__", "background task"), restart=restart)

    @property
    def failure(self) -> str | None:
        """Why an owned task's failure shut the runtime down, or None."""
        return self._supervisor.failure

    def raise_if_failed(self) -> None:
        """Raise Fenced if the control plane fenced this worker, BackgroundTaskFailed if an owned task's
        failure shut the runtime down (call it once closed)."""
        if self._fenced is not None:
            raise Fenced(f"fenced by the control plane: {self._fenced}")
        if self._supervisor.failure is not None:
            raise BackgroundTaskFailed(self._supervisor.failure)

    async def drain(self, grace: float) -> None:
        """Refuse new requests and deregister at once, give those in flight up to ``grace`` s, cut the rest.

        A cut request's ingress migrates it to another instance at once (runtime/request_plane/).
        """
        for server in self._servers:
            await server.stop_taking_requests()
        with contextlib.suppress(Exception):
            await self.discovery.close()
        await asyncio.gather(*(server.drain(grace) for server in self._servers))

    async def close(self) -> None:
        """Deregister at once (revoke the lease), stop serving, drain NATS."""
        self._shutdown.set()
        with contextlib.suppress(Exception):
            await self.discovery.close()
        for server in self._servers:
            await server.close()
        await self._supervisor.close()
        if self._client is not None:
            await self._client.close()
        await close_nats(self.nc)

    async def fetch_tokenizer(self, digest: str) -> str:
        """The tokenizer JSON named ``digest`` from the object store. Raises ModelError if absent."""
        return await fetch_tokenizer(self.nc, digest)

    def _add_server(self, server: EndpointServer) -> None:
        if not self._servers:  # a worker, not only a client: the control plane may fence it
            self.own(
                lambda: watch_own_fence(
                    self.discovery, self.instance_id, self.worker_key, self._on_fenced, self.refused_fences
                ),
                name="fence watch",
            )
            if (key := self.worker_key) is not None:  # the agent's: the control plane may spare it when silent
                self.own(lambda: claim_while_asked(self.discovery, self.instance_id, key), name="liveness claims")
        self._servers.append(server)

    def _on_fenced(self, reason: str) -> None:
        log.error("worker %x fenced by the control plane (%s): deregistering and exiting", self.instance_id, reason)
        self._fenced = reason
        self.shutdown()


def worker(main: Callable[[DistributedRuntime], Coroutine[Any, Any, None]]) -> Callable[[], Coroutine[Any, Any, None]]:
    """Decorator for a worker's entry point: connects the runtime, drains on SIGINT/SIGTERM, closes it.

    Raises BackgroundTaskFailed once closed if an owned task's failure stopped the worker.

    >>> @worker
    ... async def main(runtime: DistributedRuntime) -> None: ...
    >>> uvloop.run(main())
    """

    async def run() -> None:
        runtime = await DistributedRuntime.connect()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, runtime.shutdown)
        try:
            task = asyncio.create_task(main(runtime))
            stop = asyncio.create_task(runtime.wait_for_shutdown())
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            for pending in (task, stop):
                pending.cancel()
            await asyncio.gather(task, stop, return_exceptions=True)
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        finally:
            await runtime.drain(drain_grace_seconds())
            await runtime.close()
        runtime.raise_if_failed()

    return run

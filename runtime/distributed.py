"""The distributed runtime: one process's connections to etcd and NATS, and what it serves on them.

A worker gets a ``DistributedRuntime`` (``await DistributedRuntime.connect()`` or the ``@worker``
decorator), names endpoints with ``runtime.namespace("ns").component("backend").endpoint("generate")``
and serves them (runtime/endpoint.py). The gateway side calls instances through ``client()`` and
watches what workers register through ``discovery``. ``close()`` deregisters at once and drains NATS.
"""

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS

from runtime.addressing import EndpointAddress, new_instance_id
from runtime.config import env_float, env_str
from runtime.discovery import Discovery
from runtime.endpoint import Endpoint, Namespace, register_model
from runtime.nats_connection import connect_nats
from runtime.object_store import fetch_tokenizer
from runtime.request_plane import EndpointServer, RequestClient

# The worker API in one import: `from runtime.distributed import DistributedRuntime, register_model, worker`.
__all__ = ["DistributedRuntime", "Endpoint", "Namespace", "register_model", "worker"]


class DistributedRuntime:
    """Owns the NATS connection, the etcd lease and everything served through them."""

    def __init__(self, nc: NATS, discovery: Discovery, *, heartbeat_interval: float) -> None:
        self.nc = nc
        self.discovery = discovery
        self.instance_id = new_instance_id()
        self.heartbeat_interval = heartbeat_interval
        self._servers: list[EndpointServer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._client: RequestClient | None = None
        self._client_lock = asyncio.Lock()
        self._shutdown = asyncio.Event()

    @classmethod
    async def connect(
        cls, *, nats_url: str | None = None, etcd_endpoints: list[str] | None = None, lease_ttl: float | None = None
    ) -> "DistributedRuntime":
        """Connect to NATS (``NATS_SERVER``) and etcd (``ETCD_ENDPOINTS``).

        Raises RequestPlaneUnavailable / DiscoveryUnavailable with what to do when one is down.
        """
        url = nats_url or env_str("NATS_SERVER", "nats://127.0.0.1:4222") or ""
        heartbeat = env_float("FLOTILLA_STREAM_HEARTBEAT_S", 1.0, minimum=0.05)
        nc = await connect_nats(url, name=f"flotilla-{socket.gethostname()}-{os.getpid()}")
        try:
            discovery = await Discovery.connect(etcd_endpoints, lease_ttl=lease_ttl)
        except BaseException:
            await nc.close()
            raise
        return cls(nc, discovery, heartbeat_interval=heartbeat)

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
                silence = env_float("FLOTILLA_STREAM_SILENCE_S", 5.0, minimum=0.1)
                client = RequestClient(self.nc, silence_timeout=silence)
                await client.start()
                self._client = client  # published only once started
        return self._client

    def shutdown(self) -> None:
        """Ask everything waiting on ``wait_for_shutdown`` to finish (safe from signal handlers)."""
        self._shutdown.set()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()

    def own(self, task: asyncio.Task[None]) -> None:
        """Keep a background task, to be cancelled on close."""
        self._tasks.append(task)

    async def close(self) -> None:
        """Deregister at once (revoke the lease), stop serving, drain NATS."""
        self._shutdown.set()
        with contextlib.suppress(Exception):
            await self.discovery.close()
        for server in self._servers:
            await server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
        with contextlib.suppress(Exception):
            await self.nc.drain()

    async def fetch_tokenizer(self, digest: str) -> str:
        """The tokenizer JSON named ``digest`` from the object store. Raises ModelError if absent."""
        return await fetch_tokenizer(self.nc, digest)

    def _add_server(self, server: EndpointServer) -> None:
        self._servers.append(server)


def worker(main: Callable[[DistributedRuntime], Coroutine[Any, Any, None]]) -> Callable[[], Coroutine[Any, Any, None]]:
    """Decorator for a worker's entry point: connects the runtime, stops on SIGINT/SIGTERM, closes it.

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
            await runtime.close()

    return run

"""Service discovery against a real etcd: leases, watches, and surviving etcd restarts."""

import asyncio
import os
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path

import pytest

from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import (
    INSTANCES_PREFIX,
    MODELS_PREFIX,
    Discovery,
    WatchEvent,
    instance_key,
    model_key,
)
from runtime.errors import ConfigError, DiscoveryUnavailable
from tests.distributed.cluster import etcd_put
from tests.infra import EtcdServer
from tests.servers import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
ADDRESS = EndpointAddress("test", "backend", "generate")
PREFIX = "flotilla/test/"

# A worker that registers with a 2 s lease, says so, and waits to be killed.
WORKER = """
import asyncio, sys
from runtime.cluster.discovery import Discovery

async def main():
    discovery = await Discovery.connect([sys.argv[1]], lease_ttl=2)
    await discovery.register(sys.argv[2], b"alive")
    print("registered", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def wait_until(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> float:
    """Poll ``condition`` until it holds and return the seconds it took; fail after ``within`` seconds.

    An unreachable etcd counts as "not yet": these tests poll across etcd restarts.
    """
    start = time.monotonic()
    while time.monotonic() - start < within:
        try:
            if await condition():
                return time.monotonic() - start
        except DiscoveryUnavailable:
            pass
        await asyncio.sleep(0.05)
    pytest.fail(f"{what} did not happen within {within} s")


async def next_event(events: AsyncGenerator[WatchEvent, None], within: float = 10.0) -> WatchEvent:
    return await asyncio.wait_for(anext(events), within)


def test_keys_name_the_endpoint_and_the_instance_in_hex() -> None:
    assert instance_key(ADDRESS, 0xABC) == "flotilla/instances/test/backend/generate/abc"
    assert model_key(ADDRESS, 0xABC) == "flotilla/models/test/backend/generate/abc"
    assert instance_key(ADDRESS, 1).startswith(INSTANCES_PREFIX)
    assert model_key(ADDRESS, 1).startswith(MODELS_PREFIX)


async def test_registered_keys_are_visible_and_a_clean_close_removes_them_at_once(etcd_server: EtcdServer) -> None:
    key = instance_key(ADDRESS, 0xABC)
    async with await Discovery.connect([etcd_server.endpoint]) as reader:
        async with await Discovery.connect([etcd_server.endpoint]) as writer:
            await writer.register(key, b"hello")
            assert await reader.get_prefix(INSTANCES_PREFIX) == {key: b"hello"}
        # No waiting: close() revoked the lease, which deleted the key with it.
        assert await reader.get_prefix(INSTANCES_PREFIX) == {}


async def test_a_deregistered_key_is_deleted_at_once(etcd_server: EtcdServer) -> None:
    async with await Discovery.connect([etcd_server.endpoint]) as discovery:
        await discovery.register(PREFIX + "a", b"1")
        await discovery.register(PREFIX + "b", b"2")
        await discovery.deregister(PREFIX + "a")
        assert await discovery.get_prefix(PREFIX) == {PREFIX + "b": b"2"}


async def test_a_process_that_dies_without_closing_disappears_within_the_ttl(etcd_server: EtcdServer) -> None:
    key = instance_key(ADDRESS, 0xDEAD)
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WORKER,
        etcd_server.endpoint,
        key,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with await Discovery.connect([etcd_server.endpoint]) as reader:
        assert worker.stdout and worker.stderr
        try:
            line = await asyncio.wait_for(worker.stdout.readline(), 30)
            assert line == b"registered\n", (await worker.stderr.read()).decode()
            assert key in await reader.get_prefix(INSTANCES_PREFIX)
        finally:
            worker.kill()
            await worker.wait()
        # The lease outlives the process by up to its TTL; etcd checks expiries every 0.5 s.
        assert key in await reader.get_prefix(INSTANCES_PREFIX)
        elapsed = await wait_until(lambda: _lacks(reader, key), 2 + 1.5, "the dead worker's key expiring")
        assert elapsed < 2 + 1.5


async def _lacks(discovery: Discovery, key: str) -> bool:
    return key not in await discovery.get_prefix(INSTANCES_PREFIX)


async def test_watch_yields_the_snapshot_then_puts_and_deletes(etcd_server: EtcdServer) -> None:
    async with await Discovery.connect([etcd_server.endpoint]) as discovery:
        await discovery.register(PREFIX + "a", b"1")
        await discovery.register(PREFIX + "b", b"2")
        events = discovery.watch_prefix(PREFIX)
        snapshot = {await next_event(events), await next_event(events)}
        assert snapshot == {WatchEvent("put", PREFIX + "a", b"1"), WatchEvent("put", PREFIX + "b", b"2")}

        await discovery.register("flotilla/elsewhere", b"not watched")
        await discovery.register(PREFIX + "c", b"3")
        assert await next_event(events) == WatchEvent("put", PREFIX + "c", b"3")
        await discovery.register(PREFIX + "a", b"changed")
        assert await next_event(events) == WatchEvent("put", PREFIX + "a", b"changed")
        await discovery.deregister(PREFIX + "b")
        assert await next_event(events) == WatchEvent("delete", PREFIX + "b")
        await events.aclose()


async def test_a_key_that_is_not_utf8_is_skipped_by_listings_and_watches_and_the_others_come_through(
    etcd_server: EtcdServer,
) -> None:
    async with await Discovery.connect([etcd_server.endpoint]) as discovery:
        etcd_put(etcd_server, PREFIX.encode() + b"\xff-listed", b"junk")
        await discovery.register(PREFIX + "a", b"1")
        assert await discovery.get_prefix(PREFIX) == {PREFIX + "a": b"1"}
        events = discovery.watch_prefix(PREFIX)
        assert await next_event(events) == WatchEvent("put", PREFIX + "a", b"1")
        etcd_put(etcd_server, PREFIX.encode() + b"\xfe-watched", b"junk")
        await discovery.register(PREFIX + "b", b"2")
        assert await next_event(events) == WatchEvent("put", PREFIX + "b", b"2")
        await events.aclose()


async def test_after_an_etcd_restart_with_its_data_wiped_the_registered_keys_come_back_by_themselves(
    etcd_server: EtcdServer,
) -> None:
    keys = {instance_key(ADDRESS, 1): b"one", model_key(ADDRESS, 1): b"card"}
    discovery = await Discovery.connect([etcd_server.endpoint], lease_ttl=2)
    for key, value in keys.items():
        await discovery.register(key, value)

    await asyncio.to_thread(etcd_server.restart, wipe=True)
    async with await Discovery.connect([etcd_server.endpoint]) as reader:
        await wait_until(lambda: _has(reader, keys), 10, "the keys being registered again")
        # They are under the new lease: closing revokes it and they vanish at once.
        await discovery.close()
        assert await reader.get_prefix("flotilla/") == {}


async def _has(discovery: Discovery, keys: dict[str, bytes]) -> bool:
    return await discovery.get_prefix("flotilla/") == keys


async def test_the_watch_reports_a_key_that_vanished_while_etcd_was_down_as_a_delete_and_resumes(
    etcd_server: EtcdServer,
) -> None:
    async with await Discovery.connect([etcd_server.endpoint]) as watcher:
        writer = await Discovery.connect([etcd_server.endpoint])
        await writer.register(PREFIX + "gone", b"1")
        events = watcher.watch_prefix(PREFIX)
        assert await next_event(events) == WatchEvent("put", PREFIX + "gone", b"1")

        # The writer exits while etcd is down (so its lease cannot be revoked), and etcd comes back empty.
        await asyncio.to_thread(etcd_server.stop)
        await writer.close()
        await asyncio.to_thread(etcd_server.restart, wipe=True)

        assert await next_event(events) == WatchEvent("delete", PREFIX + "gone")
        await watcher.register(PREFIX + "new", b"2")
        assert await next_event(events) == WatchEvent("put", PREFIX + "new", b"2")
        await events.aclose()


async def test_a_closed_port_without_waiting_raises_discovery_unavailable_with_a_helpful_message() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(DiscoveryUnavailable, match="make services") as raised:
        await Discovery.connect([endpoint], wait=0)
    assert time.monotonic() - start < 2
    assert endpoint in str(raised.value)
    assert "ETCD_ENDPOINTS" in str(raised.value)


async def test_connect_waits_for_an_etcd_that_starts_later(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd")  # its port chosen, the server not started yet
    connecting = asyncio.create_task(Discovery.connect([etcd.endpoint]))
    try:
        await asyncio.to_thread(etcd.start)
        async with await asyncio.wait_for(connecting, 30) as discovery:
            await discovery.register(PREFIX + "late", b"1")
            assert await discovery.get_prefix(PREFIX) == {PREFIX + "late": b"1"}
    finally:
        connecting.cancel()
        etcd.stop()


async def test_endpoints_and_ttl_come_from_the_environment(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_ENDPOINTS", f"http://127.0.0.1:{free_port()},{etcd_server.endpoint}")
    monkeypatch.setenv("FLOTILLA_LEASE_TTL", "3")
    async with await Discovery.connect() as discovery:
        await discovery.register(PREFIX + "a", b"1")
        assert await discovery.get_prefix(PREFIX) == {PREFIX + "a": b"1"}


@pytest.mark.parametrize("endpoint", ["https://127.0.0.1:2379", "http://127.0.0.1:port", "http://:2379", "ftp://x"])
async def test_a_malformed_endpoint_is_a_config_error(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="ETCD_ENDPOINTS"):
        await Discovery.connect([endpoint], wait=0)

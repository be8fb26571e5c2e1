"""The ingress (``out=dyn``) stops with a non-zero exit code when a background task it needs fails."""

import asyncio
import logging
from typing import Any

import pytest

from launcher.options import RunOptions
from launcher.run import run_ingress
from runtime.distributed import DistributedRuntime
from tests.infra import EtcdServer, NatsServer
from tests.servers import free_port


class Broken(Exception):
    pass


async def fail() -> None:
    await asyncio.sleep(0)
    raise Broken("the publisher fell over")


async def test_a_failed_background_task_stops_the_ingress_with_exit_code_1(
    etcd_server: EtcdServer,
    nats_server: NatsServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("NATS_SERVER", nats_server.url)
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    connect = DistributedRuntime.connect

    async def connect_with_a_failing_task(**kwargs: Any) -> DistributedRuntime:
        runtime = await connect(**kwargs)
        runtime.own(asyncio.create_task(fail(), name="load metrics"))
        return runtime

    monkeypatch.setattr(DistributedRuntime, "connect", connect_with_a_failing_task)
    options = RunOptions(input="http", output="dyn", http_port=free_port())
    assert await asyncio.wait_for(run_ingress(options), timeout=30) == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any(r.exc_info is not None and r.exc_info[0] is Broken for r in errors)
    assert any("the ingress stopped because background task 'load metrics' failed" in r.getMessage() for r in errors)

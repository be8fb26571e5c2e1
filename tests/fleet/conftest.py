"""One fleet per test module (starting it takes seconds): the servers and the processes of tests/fleet/stack.py."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet.stack import FleetStack
from tests.infra import EtcdServer, NatsServer, RedisServer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[FleetStack]:
    directory = tmp_path_factory.mktemp("fleet")
    servers = (RedisServer(directory / "redis"), EtcdServer(directory / "etcd"), NatsServer(directory / "nats"))
    for server in servers:
        server.start()
    stack = FleetStack(directory, *servers, smollm2)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        for server in servers:
            server.stop()

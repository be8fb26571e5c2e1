"""Fixtures of the distributed tests: a cluster on this test's own etcd and NATS."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.cluster import Cluster
from tests.infra import EtcdServer, NatsServer


@pytest.fixture
def cluster(etcd_server: EtcdServer, nats_server: NatsServer, tmp_path: Path) -> Iterator[Cluster]:
    deployment = Cluster(etcd_server, nats_server, tmp_path)
    yield deployment
    deployment.stop()

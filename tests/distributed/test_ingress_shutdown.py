"""The ingress stops cleanly on SIGTERM: exit 0, after closing its etcd lease and draining NATS."""

import signal

from tests.distributed.cluster import Cluster
from tests.servers import stop_process


def test_sigterm_stops_the_ingress_with_exit_0_after_it_closed_its_connections(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    code = stop_process(ingress.process, signal.SIGTERM, timeout=20)
    assert code == 0, ingress.log()
    # uvicorn's own signal handling re-raised SIGTERM after shutdown, so the process died of it
    # (code -15) before the ingress could close its etcd lease and drain NATS.
    assert "the ingress closed its etcd and NATS connections" in ingress.log()
    assert "Traceback" not in ingress.log()

"""An ingress's /health says whether it reaches NATS and etcd and how many instances each model has;
/live stays the liveness probe, 200 whatever the fleet's state."""

import httpx

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.servers import Server

MODEL = "alpha"


def health(ingress: Server) -> tuple[int, dict[str, object]]:
    reply = httpx.get(ingress.base_url + "/health", timeout=5)
    return reply.status_code, reply.json()


def live(ingress: Server) -> int:
    return httpx.get(ingress.base_url + "/live", timeout=5).status_code


def test_health_counts_each_models_instances_and_names_the_connection_that_is_lost(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    assert health(ingress) == (503, {"status": "no models", "models": [], "nats": True, "etcd": True, "instances": {}})
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    wait_until(lambda: health(ingress)[1]["instances"] == {MODEL: 2}, 15, "the instances were not counted")
    assert health(ingress) == (
        200,
        {"status": "healthy", "models": [MODEL], "nats": True, "etcd": True, "instances": {MODEL: 2}},
    )

    # etcd away: the models known are still served, so the ingress stays in its load balancer, saying why.
    cluster.etcd.stop()
    wait_until(lambda: health(ingress)[1]["etcd"] is False, 20, "etcd's loss was not reported")
    status, body = health(ingress)
    assert (status, body["status"]) == (200, "etcd unreachable")
    assert served_models(ingress) == [MODEL]

    # NATS away: nothing can be served.
    cluster.nats.stop()
    wait_until(lambda: health(ingress)[0] == 503, 20, "NATS's loss was not reported")
    assert health(ingress)[1]["status"] == "NATS unreachable"
    assert live(ingress) == 200

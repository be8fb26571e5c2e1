"""A fenced worker deregisters and exits, and the gateway stops routing to it (runtime/fleet_contract/fences.py)."""

import asyncio

import httpx
import pytest

from runtime.errors import DiscoveryUnavailable
from runtime.fleet_contract import fences as fencing
from runtime.fleet_contract.fences import fence_key, put_fences
from tests.distributed.cluster import Cluster, etcd_leases, served_models, wait_until
from tests.servers import free_port

MODEL = "fence-me"


def test_a_fenced_worker_exits_with_the_reason_and_its_neighbour_keeps_serving(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    fenced = cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    spared = cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    reason = "node gpu-a stopped heartbeating at 12:00:00"

    asyncio.run(put_fences([cluster.etcd.endpoint], [int(fenced.instance_id, 16)], reason))

    assert fenced.process.wait(timeout=15) == 1
    assert f"fenced by the control plane: {reason}" in fenced.log()
    assert spared.process.poll() is None  # a fence stops its own worker only
    registered = etcd_leases(cluster.etcd, "flotilla/instances/")
    assert not any(key.endswith(fenced.instance_id) for key in registered)
    assert any(key.endswith(spared.instance_id) for key in registered)
    assert fence_key(int(fenced.instance_id, 16)) in etcd_leases(cluster.etcd, "flotilla/fences/")
    for _ in range(4):  # every request now goes to the worker left
        answer = ingress_chat(ingress.base_url)
        assert answer.headers["x-flotilla-instance"] == spared.instance_id


def ingress_chat(base_url: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return response


def test_fencing_with_no_etcd_answering_says_so() -> None:
    with pytest.raises(DiscoveryUnavailable, match="cannot reach etcd to fence workers"):
        asyncio.run(put_fences([f"http://127.0.0.1:{free_port()}"], [0xABC], "gone"))


def test_fencing_nothing_contacts_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    clients: list[object] = []
    monkeypatch.setattr(fencing.aetcd, "Client", lambda **kwargs: clients.append(kwargs))
    asyncio.run(put_fences(["http://127.0.0.1:1"], [], "gone"))
    assert clients == []  # no etcd client was even made

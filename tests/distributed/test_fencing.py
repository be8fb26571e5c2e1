"""A fenced worker deregisters and exits, and the gateway stops routing to it; a worker the agent gave a key
obeys only fences the control plane signed for it, and signs its liveness (runtime/fleet_contract/fences.py,
runtime/fleet_contract/liveness.py)."""

import asyncio
import time

import httpx
import pytest

from runtime.errors import DiscoveryUnavailable
from runtime.fleet_contract import fences as fencing
from runtime.fleet_contract.fences import FenceTarget, fence_key, fence_value, put_fences
from runtime.fleet_contract.liveness import BadClaim, asked_key, check_claim, liveness_key
from runtime.fleet_contract.signing import agent_signing_key
from runtime.fleet_contract.worker_keys import WORKER_KEY_VARIABLE, encode, worker_key
from tests.distributed.cluster import Cluster, Worker, etcd_leases, etcd_put, etcd_values, served_models, wait_until
from tests.servers import free_port

MODEL = "fence-me"
#: The task-signing key of the node the workers pretend to run on (the agent's, from its token).
NODE_KEY = agent_signing_key("flt_node-a-token", "node-a")
ON_ANOTHER_NODE = agent_signing_key("flt_node-b-token", "node-b")


def start_keyed_worker(cluster: Cluster, instance_id: int) -> Worker:
    """A worker as node-a's agent starts it for control-plane instance ``instance_id``: with its key."""
    key = encode(worker_key(NODE_KEY, instance_id))
    args = (f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    return cluster.start_worker(*args, env={WORKER_KEY_VARIABLE: key})


def worker_id(worker: Worker) -> int:
    return int(worker.instance_id, 16)


def test_a_fenced_worker_exits_with_the_reason_and_its_neighbour_keeps_serving(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    fenced = start_keyed_worker(cluster, 7)
    spared = start_keyed_worker(cluster, 8)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    reason = "node gpu-a stopped heartbeating at 12:00:00"

    asyncio.run(put_fences([cluster.etcd.endpoint], [FenceTarget(7, worker_id(fenced))], reason, [NODE_KEY]))

    assert fenced.process.wait(timeout=15) == 1
    assert f"fenced by the control plane: {reason}" in fenced.log()
    assert spared.process.poll() is None  # a fence stops its own worker only
    registered = etcd_leases(cluster.etcd, "flotilla/instances/")
    assert not any(key.endswith(fenced.instance_id) for key in registered)
    assert any(key.endswith(spared.instance_id) for key in registered)
    assert fence_key(worker_id(fenced)) in etcd_leases(cluster.etcd, "flotilla/fences/")
    for _ in range(4):  # every request now goes to the worker left
        answer = ingress_chat(ingress.base_url)
        assert answer.headers["x-flotilla-instance"] == spared.instance_id


def test_a_worker_ignores_fences_the_control_plane_did_not_sign_for_it_and_obeys_the_one_it_did(
    cluster: Cluster,
) -> None:
    """What another worker with write access to etcd could put at this worker's fence key."""
    worker = start_keyed_worker(cluster, 7)
    own = fence_key(worker_id(worker))
    forged = [
        b"forged: unsigned, as fences were",
        fence_value(FenceTarget(8, worker_id(worker)), "forged: signed for instance 8", [NODE_KEY]),
        fence_value(FenceTarget(7, worker_id(worker)), "forged: instance 7 on node-b", [ON_ANOTHER_NODE]),
        # The control plane's own fence of an earlier worker of instance 7, put back at this worker's key.
        fence_value(FenceTarget(7, 0xEA211E5), "forged: a replay", [NODE_KEY]),
    ]
    for value in forged:
        etcd_put(cluster.etcd, own, value)
    genuine = "node node-a stopped heartbeating"

    asyncio.run(put_fences([cluster.etcd.endpoint], [FenceTarget(7, worker_id(worker))], genuine, [NODE_KEY]))

    # A worker obeys the first fence it obeys at all, and sees the puts in order: had it taken a forged one,
    # it would have left with that one's reason.
    assert worker.process.wait(timeout=15) == 1
    assert f"fenced by the control plane: {genuine}" in worker.log()
    assert "fenced by the control plane: forged" not in worker.log()
    assert f"ignored a fence of worker {worker.instance_id} that is not the control plane's" in worker.log()


def test_a_worker_started_by_hand_has_no_key_and_obeys_any_fence(cluster: Cluster) -> None:
    worker = cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)

    etcd_put(cluster.etcd, fence_key(worker_id(worker)), "stop, whoever you are")

    assert worker.process.wait(timeout=15) == 1
    assert "fenced by the control plane: stop, whoever you are" in worker.log()


def test_a_worker_asked_signs_its_liveness_which_holds_for_its_instance_only(cluster: Cluster) -> None:
    worker = start_keyed_worker(cluster, 7)
    claim = liveness_key(worker_id(worker))
    assert etcd_values(cluster.etcd, "flotilla/liveness/") == {}  # nobody asked: no etcd write every few seconds

    etcd_put(cluster.etcd, asked_key(worker_id(worker)), "prove that you are alive")  # as the reconciler asks

    wait_until(lambda: claim in etcd_values(cluster.etcd, "flotilla/liveness/"), 15, "no liveness claim")
    value = etcd_values(cluster.etcd, "flotilla/liveness/")[claim].encode()

    def check(instance_id: int, worker: int, now: float) -> None:
        keys = [worker_key(NODE_KEY, instance_id).key]
        check_claim(value, instance_id=instance_id, worker_id=worker, keys=keys, now=now)

    check(7, worker_id(worker), time.time())  # the control plane believes it
    with pytest.raises(BadClaim, match="does not verify"):
        check(8, worker_id(worker), time.time())  # another instance's claim is no use to it
    with pytest.raises(BadClaim, match="signed for worker"):
        check(7, 0xEA211E5, time.time())  # nor to an earlier or later worker of the same instance
    with pytest.raises(BadClaim, match="outside the 60 s window"):
        check(7, worker_id(worker), time.time() + 3600)  # a copy kept for later
    assert etcd_leases(cluster.etcd, "flotilla/liveness/")[claim] != 0  # under the worker's lease

    worker.stop()
    assert claim not in etcd_values(cluster.etcd, "flotilla/liveness/")  # gone with the worker


def ingress_chat(base_url: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return response


def test_fencing_with_no_etcd_answering_says_so() -> None:
    with pytest.raises(DiscoveryUnavailable, match="cannot reach etcd to fence workers"):
        asyncio.run(put_fences([f"http://127.0.0.1:{free_port()}"], [FenceTarget(1, 0xABC)], "gone", [NODE_KEY]))


def test_fencing_nothing_contacts_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    clients: list[object] = []
    monkeypatch.setattr(fencing.aetcd, "Client", lambda **kwargs: clients.append(kwargs))
    asyncio.run(put_fences(["http://127.0.0.1:1"], [], "gone", [NODE_KEY]))
    assert clients == []  # no etcd client was even made

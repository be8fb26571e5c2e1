"""A worker killed outright costs its streams a short pause, not the silence timeout."""

import signal

import httpx
import pytest

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.streaming import MODEL, start_ingress, stream_chat, while_streaming

# serial: the gaps a migration leaves in a stream are measured against the silence timeout.
pytestmark = pytest.mark.serial


def test_a_killed_workers_streams_migrate_long_before_the_silence_timeout(cluster: Cluster) -> None:
    ingress = start_ingress(cluster, "--migration-limit", "3", silence_s=5)
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    undisturbed = stream_chat(ingress.base_url)

    result, victim = while_streaming(cluster, ingress.base_url, lambda worker: worker.kill())
    assert victim.process.returncode == -signal.SIGKILL
    assert not result.errors
    assert result.text == undisturbed.text
    assert result.usage == undisturbed.usage
    assert "is gone (its NATS connection closed)" in ingress.log()
    # The ingress notices the closed connection within a probe (~0.4 s): far below the 5 s silence.
    assert result.longest_gap < 2.5


def test_a_frozen_workers_streams_migrate_within_ten_seconds_at_the_default_silence_timeout(cluster: Cluster) -> None:
    # SIGSTOP: the worker's NATS connection stays open and nobody answers on it, as with a hung process
    # or a host that stopped scheduling it. Its probe used to get six silence timeouts (35 s in all).
    ingress = start_ingress(cluster, "--migration-limit", "3", silence_s=5)
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    undisturbed = stream_chat(ingress.base_url)

    result, victim = while_streaming(
        cluster, ingress.base_url, lambda worker: worker.process.send_signal(signal.SIGSTOP)
    )
    try:
        assert not result.errors
        assert result.text == undisturbed.text
        assert 5 <= result.longest_gap < 10  # the 5 s silence, then half of it for the confirming probe
    finally:
        victim.process.send_signal(signal.SIGCONT)


def test_a_killed_worker_gets_no_new_request_once_its_streams_are_cut_long_before_its_lease_expires(
    cluster: Cluster,
) -> None:
    cluster.lease_ttl = 60  # etcd keeps the dead worker registered throughout the test
    ingress = start_ingress(cluster, "--migration-limit", "3", silence_s=5)
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")

    result, victim = while_streaming(cluster, ingress.base_url, lambda worker: worker.kill())
    assert not result.errors
    assert "is gone (its NATS connection closed)" in ingress.log()
    survivors = set()
    for _ in range(6):  # round-robin would send every other one to the dead worker
        reply = httpx.post(
            ingress.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            timeout=30,
        )
        assert reply.status_code == 200
        survivors.add(reply.headers["x-flotilla-instance"])
    assert victim.instance_id not in survivors
    assert "did not take request" not in ingress.log()  # none was even tried on the dead worker
    health = httpx.get(ingress.base_url + "/health", timeout=5).json()
    assert health["instances"] == {MODEL: 2}  # still registered: its lease has not expired

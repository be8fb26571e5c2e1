"""A worker killed outright costs its streams a short pause, not the silence timeout."""

import signal

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.streaming import MODEL, start_ingress, stream_chat, while_streaming


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

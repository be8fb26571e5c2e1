"""An ingress killed outright leaves no request generating on its workers for long.

Real processes: a mocker worker in real time (a request of 8,000 tokens takes ~50 s) and an ingress,
both on real etcd and NATS; the ingress is SIGKILLed with streams in flight. Nothing tells the worker
(no Stop), so only its ack deadline (FLOTILLA_STREAM_ACK_DEADLINE_S, 1 s here) ends those requests;
the worker's own load reports show when.
"""

import signal
import threading
from pathlib import Path

import httpx

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.kv_pool import MODEL, NatsListener, mocker_settings

STREAMS = 6
MAX_TOKENS = 8_000  # the mocker's context is 8,192 tokens


def stream_completion(base_url: str, number: int, started: threading.Semaphore) -> None:
    """Read a long streamed completion until the ingress dies under it."""
    body = {"model": MODEL, "prompt": [1000 + number, 7, 8, 9], "max_tokens": MAX_TOKENS, "stream": True}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            if response.status_code != 200:
                return  # the test fails on the stream that did not start
            next(lines)
            started.release()
            for _ in lines:
                pass
    except httpx.TransportError:
        pass  # the ingress was killed: what the test is about


def test_a_killed_ingress_leaves_its_streams_generating_on_the_worker_only_until_the_ack_deadline(
    cluster: Cluster, tmp_path: Path
) -> None:
    engine = mocker_settings(tmp_path, speedup_ratio=1, block_size=16, num_gpu_blocks=STREAMS * 600)
    with NatsListener(cluster.nats.url) as listener:
        ingress = cluster.start_ingress()
        worker = cluster.start_worker(
            f"dyn://{MODEL}", *engine, "--model-name", MODEL, env={"FLOTILLA_STREAM_ACK_DEADLINE_S": "1"}
        )
        wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
        started = threading.Semaphore(0)
        readers = [
            threading.Thread(target=stream_completion, args=(ingress.base_url, number, started), daemon=True)
            for number in range(STREAMS)
        ]
        for reader in readers:
            reader.start()
        for _ in range(STREAMS):
            assert started.acquire(timeout=30), "a stream did not start"
        listener.wait_for(
            lambda seen: any(load.active_requests == STREAMS for load in seen.loads), 10, "the streams are not running"
        )

        ingress.process.send_signal(signal.SIGKILL)
        ingress.process.wait()
        reports_before = len(listener.loads)
        # Without the deadline they would run for most of a minute; with it, they stop about a second after the
        # kill, and the worker's next load reports (one a second) say so.
        listener.wait_for(
            lambda seen: any(load.active_requests == 0 for load in seen.loads[reports_before:]),
            15,
            "the worker still runs the killed ingress's requests",
        )
        for reader in readers:
            reader.join(timeout=10)
    assert f"stopped {STREAMS} stream(s)" in worker.log() or "whose client sent no ack for 1 s" in worker.log()

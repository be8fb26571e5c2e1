"""What happens when workers die, clients leave, NATS restarts, or garbage reaches a worker."""

import asyncio
import json
import threading

import httpx
import msgspec
import nats

from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import instance_key, model_key
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from runtime.request_plane import ERROR, TOO_LARGE, Envelope, Frame
from tests.distributed.cluster import Cluster, Worker, etcd_leases, served_models, wait_until
from tests.distributed.load_watch import LoadWatcher

MODEL = "alpha"
# About 60 tokens once templated: at 40 ms a token the echo takes ~2.4 s, time enough to kill a worker.
PROMPT = " ".join(f"w{i}" for i in range(20))


def stream_chat(
    base_url: str, on_first_chunk: "threading.Event | None" = None
) -> tuple[str, dict[str, object], list[str]]:
    """Stream a chat completion; return (text, usage, error messages seen in the stream)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, errors = [], {}, []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"]["message"])
            elif event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and (content := event["choices"][0]["delta"].get("content")):
                text.append(content)
                if on_first_chunk is not None and len(text) == 5:
                    on_first_chunk.set()
    return "".join(text), usage, errors


def serving_worker(cluster: Cluster, base_url: str) -> Worker:
    """The worker that answers the next request (round-robin: ask once, the next one is the other)."""
    first = httpx.post(
        base_url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    ).headers["x-flotilla-instance"]
    return next(worker for worker in cluster.workers if worker.instance_id != first)


def kill_mid_stream(cluster: Cluster, base_url: str) -> tuple[str, dict[str, object], list[str]]:
    victim = serving_worker(cluster, base_url)
    started = threading.Event()

    def kill_once_started() -> None:
        started.wait(30)
        victim.kill()

    killer = threading.Thread(target=kill_once_started)
    killer.start()
    result = stream_chat(base_url, on_first_chunk=started)
    killer.join()
    assert victim.process.returncode is not None
    return result


def test_a_worker_killed_mid_stream_is_migrated_and_the_stream_is_unbroken(cluster: Cluster) -> None:
    ingress = cluster.start_ingress("--migration-limit", "3")
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    undisturbed, usage, errors = stream_chat(ingress.base_url)
    assert not errors

    text, migrated_usage, errors = kill_mid_stream(cluster, ingress.base_url)
    assert not errors
    assert text == undisturbed
    assert migrated_usage == usage
    assert "migrating request" in ingress.log()


def test_without_migration_a_killed_worker_gives_a_clean_error(cluster: Cluster) -> None:
    ingress = cluster.start_ingress("--migration-limit", "0")
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    text, _, errors = kill_mid_stream(cluster, ingress.base_url)
    assert text  # what arrived before the worker died
    assert len(errors) == 1
    assert "stopped mid-stream" in errors[0]
    assert "migration limit (0)" in errors[0]


def test_a_client_that_disconnects_stops_the_work_on_the_worker(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=300)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    with LoadWatcher(cluster.nats.url, f"flotilla.{MODEL}.backend.load_metrics") as load:
        # ~60 tokens at 300 ms each would keep the worker busy for ~18 s: leave after the first few.
        with httpx.stream("POST", ingress.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            # The worker reports its active requests every second: the stream counts while it is open.
            load.wait_for(
                lambda load: load.last(worker.instance_id) == 1,
                5,
                "the stream never counted as active",
            )
        # Back to 0 within a few reports of the disconnect, long before the ~18 s echo would end.
        load.wait_for(lambda load: load.last(worker.instance_id) == 0, 6, "the worker kept generating")


def test_after_a_nats_restart_service_resumes(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=10).status_code == 200

    cluster.nats.stop()
    during = httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=10)
    assert during.status_code == 503
    assert "NATS" in during.json()["error"]["message"]

    cluster.nats.start()
    wait_until(
        lambda: httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=10).status_code == 200,
        15,
        "service did not resume after NATS came back",
    )


def test_garbage_sent_to_a_worker_is_rejected_and_it_keeps_serving(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    # A small limit, so that an envelope that is otherwise fine is refused for its size alone.
    worker = cluster.start_worker(
        f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, env={"FLOTILLA_MAX_REQUEST_BYTES": "4096"}
    )
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    subject = f"flotilla.{MODEL}.backend.generate.{worker.instance_id}"

    # A well-formed request whose prompt makes it larger than the limit.
    request = PreprocessedRequest(
        request_id="big",
        model=MODEL,
        token_ids=[7] * 5000,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=1),
    )
    oversized = msgspec.msgpack.encode(Envelope("big", msgspec.Raw(msgspec.msgpack.encode(request))))

    async def send_garbage() -> list[bytes]:
        connection = await nats.connect(cluster.nats.url)
        answers = []
        for payload in (
            b"\x00\xff not msgpack",
            msgspec.msgpack.encode(["id", "reply", b"not a request"]),
            oversized,
        ):
            reply = await connection.request(subject, payload, timeout=5)
            answers.append(reply.data)
        await connection.close()
        return answers

    answers = asyncio.run(send_garbage())
    assert b"malformed request envelope" in answers[0]
    refusal = msgspec.msgpack.decode(answers[2], type=Frame)
    assert (refusal.kind, refusal.code) == (ERROR, TOO_LARGE)
    assert refusal.error == f"request of {len(oversized)} bytes is over the limit of 4096"
    assert worker.process.poll() is None
    assert "rejected a malformed request" in worker.log()
    assert f"rejected a {len(oversized)}-byte request" in worker.log()
    reply = httpx.post(
        ingress.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "still there?"}]},
        timeout=10,
    )
    assert reply.status_code == 200


def test_after_etcd_loses_its_data_workers_re_register_by_themselves(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    address, instance_id = EndpointAddress.parse(f"dyn://{MODEL}"), int(worker.instance_id, 16)
    keys = {instance_key(address, instance_id), model_key(address, instance_id)}
    assert keys <= etcd_leases(cluster.etcd, "flotilla/").keys()

    cluster.etcd.restart(wipe=True)
    # Nothing counts until the worker has written its keys again: the ingress may simply have kept
    # serving what it knew.
    wait_until(
        lambda: keys <= etcd_leases(cluster.etcd, "flotilla/").keys(),
        20,
        "the worker did not register again after etcd came back empty",
    )
    leases = etcd_leases(cluster.etcd, "flotilla/")
    assert all(leases[key] != 0 for key in keys), "the new registration is not leased"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    def served_by_the_worker() -> bool:
        reply = httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=10)
        return reply.status_code == 200 and reply.headers["x-flotilla-instance"] == worker.instance_id

    # The ingress may have seen the model go with the wiped data; it comes back with the new keys.
    wait_until(served_by_the_worker, 10, "the ingress did not serve the re-registered worker")
    # The new registration is leased like the first, and the ingress watches the new etcd: a worker
    # killed now still disappears.
    worker.kill()
    wait_until(lambda: served_models(ingress) == [], cluster.lease_ttl + 5, "the re-registered worker stayed listed")

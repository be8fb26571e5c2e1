"""vLLM workers in a fleet: routed by vLLM's own KV events, and deployed by the control plane.

* Two `flotilla run in=dyn://llm out=vllm` workers on real etcd and NATS behind an ingress in
  ``--router-mode kv``. Each worker caches a prefix sent through a second, round-robin ingress, which
  the KV ingress never hears of: only the blocks vLLM's ZMQ publisher reports (renamed by the worker,
  published on NATS) tell it where the prefixes are. Which worker answered is the ingress's
  ``x-flotilla-instance`` header; that its cache was hit is vLLM's own count of cached prompt tokens.
* `flotilla up` on a node with a simulated GPU (vLLM's CPU build runs beside it): a vLLM pipeline made
  through the REST API is placed, started by the agent, becomes ready and answers a chat through the gateway.

Two vLLM engines fit in this machine's memory with a 1 GiB KV cache each, but each takes a minute or more
to start on two shared cores: the timeouts are generous.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.kv.blocks import sequence_block_hashes
from tests.distributed.cluster import Cluster, Worker
from tests.distributed.kv_pool import (
    MODEL,
    Completion,
    NatsListener,
    fresh_prefix,
    registered_block_size,
    send,
    unique_tokens,
    wait_for_every_worker,
)
from tests.engines.vllm_model import BLOCK_SIZE, ENGINE_ARGS, ENGINE_SETTINGS, KV_CACHE_ENV, VLLM_MARKS
from tests.infra import EtcdServer, NatsServer
from tests.launcher.test_stack import Up, stop_stack
from tests.servers import free_port

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]

#: A prefix of 8 full vLLM blocks (256 tokens); each request adds a 5-token tail of its own.
PREFIX_BLOCKS = 8
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK_SIZE
#: Seconds a vLLM worker may take to start and register (a minute or more here, two at once slower).
START_S = 400


@pytest.fixture
def cluster(etcd_server: EtcdServer, nats_server: NatsServer, tmp_path: Path) -> Iterator[Cluster]:
    deployment = Cluster(etcd_server, nats_server, tmp_path)
    yield deployment
    deployment.stop()


def start_vllm_workers(cluster: Cluster, model_folder: Path, count: int) -> list[Worker]:
    """``count`` vLLM workers, started at once."""
    return cluster.start_workers(
        count,
        f"dyn://{MODEL}",
        "out=vllm",
        str(model_folder),
        "--model-name",
        MODEL,
        "--extra-engine-args",
        ENGINE_ARGS,
        env=KV_CACHE_ENV,
        timeout=START_S,
    )


def test_a_prompt_sharing_a_prefix_goes_to_the_vllm_worker_whose_kv_events_said_it_cached_it(
    cluster: Cluster, vllm_model_folder: Path
) -> None:
    workers = start_vllm_workers(cluster, vllm_model_folder, 2)
    assert registered_block_size(cluster.etcd) == BLOCK_SIZE
    kv_ingress = cluster.start_ingress("--router-mode", "kv")
    round_robin = cluster.start_ingress()
    wait_for_every_worker(kv_ingress, workers)
    wait_for_every_worker(round_robin, workers)

    with NatsListener(cluster.nats.url) as listener:
        # Round robin alternates: a prefix of its own lands on each worker within a few tries.
        holders: dict[str, list[int]] = {}
        for _ in range(6):
            prefix = fresh_prefix(PREFIX_BLOCKS, BLOCK_SIZE)
            first = send(round_robin, [*prefix, *unique_tokens(5)])
            assert first.cached_tokens == 0, "a fresh prefix was already cached"
            # The worker renamed vLLM's blocks as the router names them; the KV ingress heard the same message.
            listener.wait_for_stored(first.instance, sequence_block_hashes(prefix, BLOCK_SIZE), timeout=60)
            holders.setdefault(first.instance, prefix)
            if len(holders) == len(workers):
                break
    assert set(holders) == {worker.instance_id for worker in workers}

    # The KV ingress routed neither prefix: only the events tell it where each is. Each prefix in turn, in an
    # order round robin would not follow, lands on its holder, and vLLM finds its 8 blocks there.
    first_holder, second_holder = holders
    for holder in [first_holder, first_holder, second_holder, second_holder, first_holder, second_holder]:
        assert send(kv_ingress, [*holders[holder], *unique_tokens(5)]) == Completion(holder, PREFIX_TOKENS)


def test_a_vllm_pipeline_deployed_through_the_control_plane_answers_a_chat(
    tmp_path: Path, vllm_model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The catalog takes a folder on a node only under the allowed roots.
    monkeypatch.setenv("FLOTILLA_LOCAL_MODEL_ROOTS", str(vllm_model_folder))
    # vLLM runs only on GPU nodes as far as the control plane knows: the local node gets a simulated one.
    stack = Up(tmp_path / "data", tmp_path / "up.log", "--no-pipeline", "--gpus", "1x24GiB")
    try:
        stack.wait_until_up()
        # The KV cache's size is given outright: on CPU, vLLM reads --gpu-memory-utilization (the share of the
        # simulated GPU the control plane placed it by) as a share of the machine's memory.
        engine_args: dict[str, Any] = {**ENGINE_SETTINGS, "kv_cache_memory_bytes": 2**30}
        with stack.admin() as api:
            model = {"name": "smol-safetensors", "source_kind": "folder", "source": str(vllm_model_folder)}
            created = api.post("models/", json={**model, "engine": "vllm"})
            assert created.status_code == 201, created.text
            group = {"replicas": 1, "gpus_per_replica": 1, "engine_args": engine_args}
            deployed = api.post("pipelines/", json={"name": "smol", "model": model["name"], "groups": [group]})
            assert deployed.status_code == 201, deployed.text
            assert deployed.json()["groups"][0]["engine"] == "vllm"
            ready = wait_for_ready_instance(api, stack, START_S)
        assert (ready["pipeline_name"], ready["node"]) == ("smol", "local")
        wait_for_gateway_model(stack, "smol", START_S)
        reply = httpx.post(
            f"{stack.gateway}/v1/chat/completions",
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0,
                "max_tokens": 10,
            },
            headers=stack.api_key_header(),
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        assert reply.json()["usage"]["completion_tokens"] > 0
    finally:
        stop_stack(stack)


def wait_for_ready_instance(api: httpx.Client, stack: Up, timeout_s: float) -> dict[str, Any]:
    """The first ready instance, once there is one; AssertionError with the instances and the stack's output
    after ``timeout_s`` or once one has failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        instances = api.get("instances/").json()["results"]
        ready = [instance for instance in instances if instance["state"] == "ready"]
        if ready:
            return dict(ready[0])
        failed = [instance for instance in instances if instance["state"] == "failed"]
        assert not failed and time.monotonic() < deadline, f"{instances}\n{stack.output()[-3000:]}"
        time.sleep(1)  # the instance's state lives in another process: no event to await


def wait_for_gateway_model(stack: Up, name: str, timeout_s: float) -> None:
    """Wait until the gateway lists ``name`` in /v1/models. The control plane hears that an instance is ready
    from its agent, the gateway from its own etcd watch (and then builds the model's pool): a moment apart,
    during which the gateway answers 503 "its replicas are starting", as a client that honours Retry-After
    would wait out."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = httpx.get(f"{stack.gateway}/v1/models", headers=stack.api_key_header(), timeout=10)
        if listed.status_code == 200 and name in [model["id"] for model in listed.json()["data"]]:
            return
        assert time.monotonic() < deadline, f"{listed.status_code} {listed.text}\n{stack.output()[-3000:]}"
        time.sleep(0.5)  # the gateway is another process: no event to await


def test_a_prompt_prefilled_by_one_vllm_worker_is_decoded_by_another_from_its_kv_and_says_the_same(
    cluster: Cluster, vllm_model_folder: Path, tmp_path: Path
) -> None:
    # vLLM's ExampleConnector (shared files) is the connector its CPU build runs: the prefill worker stores the
    # prompt's KV, the decode worker loads it. The decode worker caches no prefix of its own, so a prompt it
    # has answered before is not found there: only the connector can give it the KV.
    store = tmp_path / "kv-store"
    decode_metrics = free_port()

    def worker_args(role: str, kv_role: str, *flags: str, **settings: object) -> tuple[str, ...]:
        connector = {"kv_connector": "ExampleConnector", "kv_role": kv_role}
        connector["kv_connector_extra_config"] = {"shared_storage_path": str(store)}  # type: ignore[assignment]
        engine = json.dumps({**ENGINE_SETTINGS, **settings, "kv_transfer_config": connector})
        return ("out=vllm", str(vllm_model_folder), "--model-name", MODEL, "--disagg-role", role,
                "--extra-engine-args", engine, *flags)  # fmt: skip

    def loaded_through_the_connector() -> float:
        """The decode worker's prompt tokens that vLLM's connector gave it, from its own /metrics."""
        text = httpx.get(f"http://127.0.0.1:{decode_metrics}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:external_prefix_cache_hits_total"
        )

    prefill, decode = cluster.start_each(  # at once: their starts overlap
        [
            (f"dyn://{MODEL}.prefill.generate", worker_args("prefill", "kv_producer")),
            (
                f"dyn://{MODEL}.decode.generate",
                worker_args(
                    "decode", "kv_consumer", "--metrics-port", str(decode_metrics), enable_prefix_caching=False
                ),
            ),
        ],
        env=KV_CACHE_ENV,
        timeout=START_S,
    )
    ingress = cluster.start_ingress()
    body = {"model": MODEL, "prompt": "The history of the lighthouse begins in ancient Egypt, where " * 6}
    body |= {"max_tokens": 24, "temperature": 0}
    url = ingress.base_url + "/v1/completions"

    def answered(headers: dict[str, str]) -> httpx.Response | None:
        reply = httpx.post(url, json=body, headers=headers, timeout=120)
        return reply if reply.status_code == 200 else None

    deadline = time.monotonic() + 60
    while (alone := answered({"x-flotilla-disagg": "local"})) is None and time.monotonic() < deadline:
        time.sleep(0.5)  # the ingress takes the model in: nothing to await from here
    assert alone is not None, ingress.log()[-3000:]
    assert "x-flotilla-prefill-instance" not in alone.headers and "External Cache Hit" not in decode.log()
    handed = answered({"x-flotilla-disagg": "remote"})
    assert handed is not None
    assert handed.headers["x-flotilla-prefill-instance"] == prefill.instance_id
    assert handed.headers["x-flotilla-instance"] == decode.instance_id
    assert "External Cache Hit" in decode.log()  # vLLM's connector loaded what the prefill worker stored
    # ...the prompt's whole blocks, less at most the one holding its last token: not a match of nothing (which
    # that line says too, for a prompt under a block) and not a prompt computed again with the same text.
    loaded = loaded_through_the_connector()
    assert loaded > 0 and loaded >= handed.json()["usage"]["prompt_tokens"] - 2 * BLOCK_SIZE, loaded
    assert any(store.iterdir())
    assert handed.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]

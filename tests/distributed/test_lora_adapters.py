"""LoRA adapters end to end: real ``flotilla run in=dyn://llm out=mocker --lora ... --lora-file ...`` workers
behind a real ingress, over real etcd and NATS.

An adapter loaded at start (``--lora``) or later (written into the ``--lora-file``) is listed by ``/v1/models``
with its base model as ``parent`` and answers requests; that the worker ran them with the adapter shows in its
KV events, which carry the adapter's ``lora_id`` (runtime/lora.py) and its blocks' hashes chained from the
adapter's root hash. An adapter removed from the file leaves ``/v1/models`` and its name becomes a 404; a
malformed file changes nothing. With KV routing, an adapter's repeated prompt goes to the worker holding that
adapter's blocks.
"""

import json
from pathlib import Path

import httpx

from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored
from runtime.lora import lora_id, lora_root_hash
from tests.distributed.cluster import Cluster, Worker, wait_until
from tests.distributed.kv_pool import MODEL, NatsListener, mocker_settings, prefix_tokens
from tests.servers import Server

BLOCK = 16
SETTINGS = {"speedup_ratio": 1000, "block_size": BLOCK, "num_gpu_blocks": 512, "lora_load_time": 0.01}


def models(ingress: Server) -> dict[str, dict[str, object]]:
    reply = httpx.get(ingress.base_url + "/v1/models", timeout=10)
    assert reply.status_code == 200, reply.text
    return {model["id"]: model for model in reply.json()["data"]}


def instances(ingress: Server) -> dict[str, int]:
    """Each served model's instance count, as the ingress's /health says."""
    counts: dict[str, int] = httpx.get(ingress.base_url + "/health", timeout=10).json()["instances"]
    return counts


def completion(ingress: Server, model: str, tokens: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": tokens, "max_tokens": 2}
    return httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=60)


def adapter_folder(directory: Path, name: str) -> Path:
    folder = directory / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    return folder


def write_adapters(path: Path, generation: int, **adapters: Path) -> None:
    """Write the --lora-file atomically, as the node agent does."""
    body = {"adapters": [{"name": name, "path": str(folder)} for name, folder in adapters.items()]}
    body["generation"] = generation  # type: ignore[assignment]
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps(body))
    staged.replace(path)


def adapter_blocks(listener: NatsListener, worker: Worker, adapter: str) -> list[int]:
    """The blocks ``worker`` said it stored with ``adapter``."""
    instance = int(worker.instance_id, 16)
    return [
        block_hash
        for batch in listener.batches
        if batch.instance_id == instance
        for event in batch.events
        if isinstance(event, BlockStored) and event.lora_id == lora_id(adapter)
        for block_hash in event.block_hashes
    ]


def test_adapters_come_and_go_with_the_lora_file_without_a_restart(cluster: Cluster, tmp_path: Path) -> None:
    sql, chat = adapter_folder(tmp_path, "sql"), adapter_folder(tmp_path, "chat")
    lora_file = tmp_path / "adapters.json"
    prompt = prefix_tokens(3, BLOCK)
    with NatsListener(cluster.nats.url) as listener:
        ingress = cluster.start_ingress()
        worker = cluster.start_worker(
            f"dyn://{MODEL}", *mocker_settings(tmp_path, **SETTINGS), "--model-name", MODEL,
            "--lora", f"sql={sql}", "--lora-file", str(lora_file),
        )  # fmt: skip
        wait_until(lambda: set(models(ingress)) == {MODEL, "sql"}, 30, "the adapter given by --lora did not appear")
        assert models(ingress)["sql"]["parent"] == MODEL
        assert "parent" not in models(ingress)[MODEL]

        reply = completion(ingress, "sql", prompt)
        assert reply.status_code == 200, reply.text
        # The worker ran it with the adapter: its blocks are the adapter's, announced with its lora_id.
        expected = sequence_block_hashes(prompt, BLOCK, lora_root_hash(lora_id("sql")))
        listener.wait_for(
            lambda seen: adapter_blocks(seen, worker, "sql")[:3] == expected, 10, "no block stored with the adapter"
        )
        # The base model's request of the same tokens shares none of the adapter's blocks.
        base = completion(ingress, MODEL, prompt)
        assert base.status_code == 200, base.text
        assert base.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        write_adapters(lora_file, 1, chat=chat)
        wait_until(lambda: "chat" in models(ingress), 30, "the adapter written into the --lora-file did not appear")
        assert models(ingress)["chat"]["parent"] == MODEL
        assert completion(ingress, "chat", prompt).status_code == 200

        lora_file.write_text('{"adapters": [{"name": "chat"}]}')  # no path: malformed
        wait_until(lambda: "not an adapter set" in worker.log(), 30, "the malformed file was not reported")
        assert set(models(ingress)) == {MODEL, "sql", "chat"}
        assert completion(ingress, "chat", prompt).status_code == 200

        write_adapters(lora_file, 2)
        wait_until(lambda: "chat" not in models(ingress), 30, "the adapter removed from the file stayed")
        gone = completion(ingress, "chat", prompt)
        assert gone.status_code == 404, gone.text
        assert set(models(ingress)) == {MODEL, "sql"}  # --lora's stays
        assert worker.process.poll() is None


def test_a_repeated_adapter_prompt_goes_to_the_worker_holding_its_blocks(cluster: Cluster, tmp_path: Path) -> None:
    sql = adapter_folder(tmp_path, "sql")
    prompt = prefix_tokens(4, BLOCK, start=3000)
    with NatsListener(cluster.nats.url) as listener:
        ingress = cluster.start_ingress("--router-mode", "kv")
        args = (*mocker_settings(tmp_path, **SETTINGS), "--model-name", MODEL, "--lora", f"sql={sql}")
        workers = cluster.start_each([(f"dyn://{MODEL}", args)] * 2)
        wait_until(lambda: set(models(ingress)) == {MODEL, "sql"}, 30, "the adapter did not appear")
        wait_until(lambda: instances(ingress).get("sql") == 2, 30, "the adapter's pool did not take both workers")
        first = completion(ingress, "sql", prompt)
        assert first.status_code == 200, first.text
        holder = first.headers["x-flotilla-instance"]
        [worker] = [worker for worker in workers if worker.instance_id == holder]
        expected = sequence_block_hashes(prompt, BLOCK, lora_root_hash(lora_id("sql")))
        listener.wait_for(
            lambda seen: adapter_blocks(seen, worker, "sql")[:4] == expected, 10, "the adapter's blocks were not stored"
        )
        for _ in range(6):
            again = completion(ingress, "sql", prompt)
            assert again.status_code == 200, again.text
            assert again.headers["x-flotilla-instance"] == holder
            # All but the last block: one token is computed.
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK


def test_the_adapters_of_a_worker_that_dies_vanish_with_its_lease(cluster: Cluster, tmp_path: Path) -> None:
    sql = adapter_folder(tmp_path, "sql")
    ingress = cluster.start_ingress()
    worker = cluster.start_worker(
        f"dyn://{MODEL}", *mocker_settings(tmp_path, **SETTINGS), "--model-name", MODEL, "--lora", f"sql={sql}"
    )
    wait_until(lambda: set(models(ingress)) == {MODEL, "sql"}, 30, "the adapter did not appear")
    worker.kill()
    # The lease (2 s here) expires: the base model's entry and the adapter's go together.
    wait_until(lambda: models(ingress) == {}, 30, "the dead worker's adapter stayed listed")
    gone = completion(ingress, "sql", prefix_tokens(1, BLOCK))
    assert gone.status_code == 404, gone.text

"""KV cache tiers end to end: mocker workers with a host-memory tier behind a KV-routing ingress, real etcd and NATS.

A worker whose device cache is too small for the prompts it served keeps them in host memory: it publishes the
copies (``BlockStored`` with medium ``cpu``) and the device's evictions on NATS, the ingress's index keeps the
two tiers apart, and a prompt that comes back goes to the worker holding it in host memory (credited
``--kv-host-hit-weight``, 0.75 by default), whose answer says its blocks were brought back, not computed
(``cached_tokens``). What the worker published is heard by a ``NatsListener``, as the ingress hears it.
"""

from pathlib import Path

import pytest

from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockRemoved, BlockStored, KvEventBatch
from tests.distributed.cluster import Cluster
from tests.distributed.kv_pool import (
    NatsListener,
    mocker_settings,
    prefix_tokens,
    send,
    start_workers,
    unique_tokens,
    wait_for_every_worker,
)
from tests.infra import NatsServer

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
DOCUMENT_BLOCKS = 10
# A device of 16 blocks holds one 10-block document at a time; the host tier holds 256 blocks, every one.
SETTINGS = {"speedup_ratio": 10, "block_size": BLOCK, "num_gpu_blocks": 16, "num_host_blocks": 256,
            "kv_bytes_per_token": 1000}  # fmt: skip


def document(number: int) -> list[int]:
    return prefix_tokens(DOCUMENT_BLOCKS, BLOCK, start=1000 + number * 1000)


def published(batches: list[KvEventBatch], instance: str, kind: type, medium: str | None) -> set[int]:
    """The block hashes ``instance`` said it stored (``kind`` BlockStored) or evicted on tier ``medium``."""
    return {
        block_hash
        for batch in batches
        if batch.instance_id == int(instance, 16)
        for event in batch.events
        if isinstance(event, kind) and event.medium == medium  # type: ignore[attr-defined]
        for block_hash in event.block_hashes  # type: ignore[attr-defined]
    }


def test_a_prompt_evicted_from_a_workers_device_but_kept_in_its_host_memory_goes_back_to_it(
    cluster: Cluster, nats_server: NatsServer, tmp_path: Path
) -> None:
    ingress = cluster.start_ingress("--router-mode", "kv")
    engine = mocker_settings(tmp_path, **SETTINGS)
    with NatsListener(nats_server.url) as listener:
        (keeper,) = start_workers(cluster, 1, *engine)
        wait_for_every_worker(ingress, [keeper])
        documents = [document(number) for number in range(4)]
        for tokens in documents:
            assert send(ingress, [*tokens, *unique_tokens(5)]).instance == keeper.instance_id
        first_blocks = {sequence_block_hashes(tokens, BLOCK)[0] for tokens in documents[:2]}
        every_block = {block for tokens in documents for block in sequence_block_hashes(tokens, BLOCK)}

        def evicted_and_offloaded(seen: NatsListener) -> bool:
            on_host = published(seen.batches, keeper.instance_id, BlockStored, "cpu")
            gone = published(seen.batches, keeper.instance_id, BlockRemoved, None)
            return every_block <= on_host and first_blocks <= gone

        listener.wait_for(evicted_and_offloaded, 15, "the worker never said its documents went to host memory")
        # A second worker, idle and holding nothing: only the host tier draws the documents back to the first.
        (bare,) = start_workers(cluster, 1, *engine)
        wait_for_every_worker(ingress, [keeper, bare])
        for tokens in documents[:2]:
            again = send(ingress, [*tokens, *unique_tokens(5)])
            assert again.instance == keeper.instance_id
            assert again.cached_tokens == DOCUMENT_BLOCKS * BLOCK  # brought back from host memory, not computed

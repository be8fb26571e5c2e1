"""A KV-routed pool whose instances serve two namespaces: the router hears the caches of both.

Two real ``out=mocker`` workers serve model ``llm``, one under ``dyn://llm``, one under
``dyn://other``; the ingress pools them by model name. A prefix cached on the second worker must draw
the requests that share it there: the router learns it from the events published on that worker's own
component (before, it listened only to the first instance's component and routed the second blind).
"""

from pathlib import Path

import pytest

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.kv_pool import MODEL, Completion, fresh_prefix, mocker_settings, send, unique_tokens

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
PREFIX_BLOCKS = 8


def test_a_prefix_cached_on_an_instance_of_another_namespace_draws_its_requests_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    engine = mocker_settings(tmp_path, speedup_ratio=2, block_size=BLOCK, num_gpu_blocks=4096)
    ingress = cluster.start_ingress("--router-mode", "kv")
    cluster.start_worker(f"dyn://{MODEL}", *engine, "--model-name", MODEL)
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    elsewhere = cluster.start_worker("dyn://other", *engine, "--model-name", MODEL)
    # Fresh prefixes until one lands on the other namespace's worker (ties between idle workers are random).
    prefix: list[int] = []

    def cached_elsewhere() -> bool:
        nonlocal prefix
        prefix = fresh_prefix(PREFIX_BLOCKS, BLOCK)
        return send(ingress, [*prefix, *unique_tokens(5)]).instance == elsewhere.instance_id

    wait_until(cached_elsewhere, 60, "no request reached the worker of the other namespace")
    # Once the router has heard the worker's stored blocks, every request sharing the prefix goes there
    # and finds them (blind, each would go either way: 8 in a row by chance is 1 in 256).
    wait_until(
        lambda: send(ingress, [*prefix, *unique_tokens(5)]) == Completion(elsewhere.instance_id, PREFIX_BLOCKS * BLOCK),
        30,
        "the router never learned the other namespace's cache",
    )
    for _ in range(8):
        assert send(ingress, [*prefix, *unique_tokens(5)]) == Completion(elsewhere.instance_id, PREFIX_BLOCKS * BLOCK)

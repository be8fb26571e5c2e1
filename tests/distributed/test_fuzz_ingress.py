"""Fuzzing the ingress: what one process answers must not turn into a 5xx once the request crosses the
network to a worker (an integer beyond 64 bits, say, cannot be encoded for it)."""

import httpx
import pytest

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.frontend_gateway.fuzz import CHAT, COMPLETIONS, check_answer, fire, request_bodies


@pytest.mark.parametrize("output", ["echo_core", "echo_full"])
async def test_the_ingress_survives_the_fuzzer(cluster: Cluster, output: str) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://fuzz", f"out={output}", "--model-name", "fuzz", "--context-length", "256")
    wait_until(lambda: served_models(ingress) == ["fuzz"], 15, "the model did not appear")

    for seed, route in enumerate([CHAT, COMPLETIONS]):
        answers = await fire(ingress.base_url, route, request_bodies(route, "fuzz", seed=seed, count=300))
        for answer in answers:
            check_answer(answer)
        assert {answer.status for answer in answers} >= {200, 400}

    body = {"model": "fuzz", "messages": [{"role": "user", "content": "still here?"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=ingress.base_url, timeout=30) as client:
        assert (await client.post(CHAT, json=body)).status_code == 200
    assert "Traceback" not in ingress.log()

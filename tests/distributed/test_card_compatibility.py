"""Instances pooled under one model name must share its card; one that differs is refused from routing."""

import re

import httpx

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.servers import Server


def refused(ingress: Server, model: str, reason: str) -> float:
    """The ingress's refused-instances counter for ``model`` and ``reason`` (0 before any refusal)."""
    text = httpx.get(ingress.base_url + "/metrics", timeout=5).text
    pattern = rf'^flotilla_frontend_refused_instances_total{{model="{model}",reason="{reason}"}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_an_instance_with_another_context_length_gets_no_request_and_is_counted(cluster: Cluster) -> None:
    ingress = cluster.start_ingress("--router-mode", "round-robin")
    first = cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "same", "--context-length", "256")
    wait_until(lambda: served_models(ingress) == ["same"], 15, "the model did not appear")
    second = cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "same", "--context-length", "512")
    wait_until(lambda: refused(ingress, "same", "context_length") == 1, 15, "the second instance was not refused")

    body = {"model": "same", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    served_by = {
        httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=30).headers["x-flotilla-instance"]
        for _ in range(8)
    }
    assert served_by == {first.instance_id}
    assert f"instance {second.instance_id} of model 'same' is refused" in ingress.log()
    assert "context_length (256 vs 512)" in ingress.log()
    assert refused(ingress, "same", "context_length") == 1
